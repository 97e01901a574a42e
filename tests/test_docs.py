"""The docs' code and claims, run: the README's first snippet, the converter recipe of
docs/frameworks.md, and the README's ``Adam + pu.weight_decay == AdamW`` with the ``exclude`` it needs."""

import copy
import pathlib
import re

import torch
from torch import nn

import paramupdates as pu
from test_no_sync import Syncs

from conftest import assert_same, snapshot

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)


def test_the_readmes_first_snippet_runs():
    ns: dict = {}
    exec(compile(_python_blocks("README.md")[0], "README.md", "exec"), ns)  # noqa: S102 - our own README
    assert list(dict.fromkeys(ns["s"].schedule().phases())) == [
        "before_grad",
        "grad",
        "after_grad",
        "auxiliary",
        "after_step",
    ]
    assert int(ns["model"][1].num_batches_tracked) == 1  # once under pu.checkpoint, not twice


class NormAct(nn.BatchNorm2d):
    """A batch norm with a forward of its own (as timm's BatchNormAct2d)."""

    def __init__(self, c):
        super().__init__(c)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(super().forward(x))


def test_the_converter_recipe_of_frameworks_md_registers_and_converts():
    """Earlier, the text said to register with pu.nn.convert_module(module, SafeClass), which
    registers nothing: the recipe is pu.nn.register_converter(cls, fn)."""
    (block,) = [b for b in _python_blocks("docs/frameworks.md") if "register_converter" in b]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), NormAct(3))
    ref = copy.deepcopy(model)
    ns = {"pu": pu, "NormAct": NormAct, "model": model}
    exec(compile(block, "docs/frameworks.md", "exec"), ns)  # noqa: S102 - our own docs
    converted = ns["model"][1]
    assert type(converted) is ns["SafeNormAct"] and isinstance(converted, pu.nn.BatchNorm2d)
    x = torch.randn(4, 1, 6, 6)
    with pu.step(ns["model"]):
        y = ns["model"](x)
    assert torch.equal(y, ref(x))  # the activation kept, the statistics updated once
    assert_same(snapshot(ref), snapshot(ns["model"]))


def _train(opt_of, declare=None):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    opt = opt_of(m)
    if declare is not None:
        declare(m)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        with pu.step(m, opt):
            m(torch.randn(8, 4, generator=g)).square().mean().backward()
        opt.zero_grad()
    pu.testing.reset()
    return snapshot(m)


def test_adam_plus_weight_decay_is_adamw_with_exclude_none_and_the_no_decay_recipe_by_default():
    """The README's claim, as stated there: bitwise AdamW with exclude=None; the default exclude (1-D
    tensors skipped, which AdamW decays) is AdamW with biases and norm scales in a weight_decay=0 group."""
    adamw = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1))
    ours = _train(lambda m: torch.optim.Adam(m.parameters(), lr=0.01), lambda m: pu.weight_decay(m, 0.1, exclude=None))
    assert_same(adamw, ours)

    def no_decay_groups(m):
        decay = [p for p in m.parameters() if p.ndim > 1]
        rest = [p for p in m.parameters() if p.ndim <= 1]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.01, weight_decay=0.1)

    default = _train(lambda m: torch.optim.Adam(m.parameters(), lr=0.01), lambda m: pu.weight_decay(m, 0.1))
    assert_same(_train(no_decay_groups), default)
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(adamw, default) if torch.is_tensor(a[1]))


def _pages() -> list[str]:
    return ["README.md", "CHANGELOG.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_a_five_minute_read():
    """What, why, the two commands, the model in brief and where to look next; the rest is in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    blocks = re.findall(r"```bash\n(.*?)```", "\n".join(lines), flags=re.S)
    assert any("paramupdates-demo" in b for b in blocks) and any("python -m pytest" in b for b in blocks)


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """A page moved or a heading renamed breaks no link: each relative target exists, and an
    anchor into a Markdown page names one of its headings."""
    broken = []
    for page in _pages():
        text = re.sub(r"```.*?```|`[^`\n]*`", "", (ROOT / page).read_text(), flags=re.S)  # links, not code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / page).parent / path if path else ROOT / page
            if not file.exists():
                broken.append(f"{page}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page}: {target} (no such heading)")
    assert broken == []


def test_every_python_block_of_the_readme_and_docs_is_python():
    """Blocks that need a framework or data are not run here (the first README block and the
    converter recipe are, above; each framework's recipe is its test file's subject), but each
    must at least be valid Python."""
    bad = []
    for page in _pages():
        for i, block in enumerate(_python_blocks(page)):
            try:
                compile(block, f"{page} block {i}", "exec")
            except SyntaxError as e:
                bad.append(f"{page} block {i}: {e}")
    assert bad == []


def test_the_readmes_ema_is_useful_after_a_short_run():
    """The README's first block declares its EMA as users will copy it; on the demo's digits
    (Adam, batch 64) its copy must be about as good as the model after one epoch (23 steps).
    A copy without warmup (decay 0.999) is still mostly the initial weights there: 10 %."""
    from paramupdates.demo import DigitsNet, load_digits, logits_of

    (call,) = re.findall(r"^averaged = (pu\.ema\(model, .*?\))", _python_blocks("README.md")[0], flags=re.M)
    x_train, y_train, x_test, y_test = load_digits(0)
    torch.manual_seed(0)
    model = pu.convert(DigitsNet())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    averaged = eval(call, {"pu": pu, "model": model})  # noqa: S307 - our own README's call
    order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(0))
    for i in range(0, len(y_train), 64):
        idx = order[i : i + 64]
        with pu.step(model, opt):
            nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
        opt.zero_grad()
    with torch.no_grad():
        model_acc, copy_acc = (
            float((logits_of(m, x_test).argmax(1) == y_test).float().mean()) for m in (model, averaged)
        )
    pu.testing.reset()
    assert model_acc > 0.7 and copy_acc > model_acc - 0.1, (model_acc, copy_acc)


def test_the_schedules_of_guarantees_md_count_applied_updates_only():
    """The two learning-rate recipes of docs/guarantees.md ("Skipped steps"), run over batches of which
    one has a NaN (its step skipped on the device, fused AdamW): each schedule has advanced once per
    applied update, and the second never read a tensor on the host."""
    blocks = [b for b in _python_blocks("docs/guarantees.md") if "att.applied" in b]
    assert len(blocks) == 2
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(6)]
    batches[2][0][0, 0] = float("nan")
    for i, block in enumerate(blocks):
        pu.testing.reset()
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        ns = {
            "torch": torch,
            "pu": pu,
            "model": model,
            "opt": torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
            "loss_fn": nn.functional.mse_loss,
            "batches": batches,
            "warmup": 4,
            "base_lr": 1e-2,
        }
        with Syncs() as counter:
            exec(compile(block, "docs/guarantees.md", "exec"), ns)  # noqa: S102 - our own docs
        with Syncs() as made:  # (torch's optimizer checks a tensor learning rate when it is made)
            torch.optim.AdamW(nn.Linear(1, 1).parameters(), lr=torch.tensor(1e-2), fused=True)
        assert counter.calls == (["__bool__"] * 6 if i == 0 else made.calls), counter.calls  # (the first: the `if`)
        att = ns["att"]
        assert (att.steps, att.skipped_steps) == (5, 1)
        lr = ns["opt"].param_groups[0]["lr"]
        if i == 0:
            assert ns["scheduler"].last_epoch == 5 and lr == 1e-2 * min(1.0, 6 / 4)
        else:
            assert int(ns["applied"]) == 5 and torch.equal(lr, 1e-2 * torch.clamp(torch.tensor(6) / 4, max=1.0))
