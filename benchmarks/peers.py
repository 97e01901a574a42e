"""Benchmark (e), peers: paramupdates against what users would pick instead, side by side.

    python -m benchmarks --only peers       or   python benchmarks/peers.py [--repeats 15] [--steps 16] [--quick]

Every comparison builds its sides from the same weights (each side its own model), first checks
that they compute the same thing, then times them in one process with ``timing.interleaved``
(variants interleaved, the order rotating, ratios paired round by round: median, range over the
rounds, and the ratio of the minima). One CPU thread and the process's CPU time by default.

The check (before the timing, outside it): every side is called ``CHECK_CALLS`` times (the
"alone" pairs, whose model does not move, with the same deterministic perturbation of the model
before each call) and the tensors each side is responsible for (the model's weights and
statistics, the averaged copy) must be bitwise those of the reference (``torch.equal`` on the
bits; integers equal). Every pair below computes the same formula on both sides, so bitwise is
the bar; the one exception is stated: ``AveragedModel`` averages the integer
``num_batches_tracked`` in float, so its copy's integer buffers are not compared.

The pairs (model ``mlp``: 50 x ``Linear(64, 64)`` [+ ``BatchNorm1d(64)``], batch 32, mean-squared
error; model ``heads``: 128 parallel ``Linear(16, 16)``, summed, batch 32):

* ``pu.ema`` alone (the commit of a ``pu.Stepper`` whose optimizer step does nothing) vs timm's
  ``ModelEmaV3.update`` and ``torch.optim.swa_utils.AveragedModel.update_parameters``
  (``get_ema_multi_avg_fn``, ``use_buffers=True``), on ``mlp`` with batch norm (300 floating
  tensors, 50 counters); and over a whole SGD step on ``mlp`` without batch norm
  (``pu.attach`` + ``pu.ema`` vs the loop + the peer's update);
* ``Adam`` + ``pu.weight_decay`` through ``pu.attach`` vs ``AdamW``, a whole step on ``mlp``
  without batch norm: with the default ``exclude`` (biases not decayed; against AdamW with a
  no-decay group; pu's own foreach pass) and with ``exclude=None`` (against one AdamW group; pu
  lets Adam's kernel decay);
* ``pu.constrain(w, pu.max_norm(0.5))`` on every weight of ``heads`` vs the hand-written loop
  ``n = w.norm(dim=1, keepdim=True); w.mul_(n.clamp(max=c) / (n + eps))``: the rule alone (as
  the ``pu.ema`` alone) and over a whole SGD step (``pu.attach``);
* the whole recipe on ``mlp`` (``pu.convert``'s batch norm, decoupled weight decay, max-norm on
  every weight, an EMA) through ``pu.attach`` with ``Adam`` vs the best hand-written version of
  the same math (``torch.nn.BatchNorm1d``, ``AdamW`` with a no-decay group, the norm loop after
  ``opt.step()``, an EMA by ``torch._foreach_lerp_`` and ``torch._foreach_copy_``), and vs the
  same with timm's ``ModelEmaV3`` as the EMA; apportioned: always the decay, one part added at a
  time (+ batch norms, + max-norm, + EMA; a part that is off is absent on both sides: no batch
  norm layers, no norm loop, no EMA), then all;
* ``pu.attach`` with nothing declared and no batch norm (``mlp``, SGD) vs the bare loop.

Goals (docs/design.md, performance contract): ``pu.ema`` no slower than either peer; a rule never
slower than the per-tensor loop; the whole recipe no slower than the best hand-written code;
``pu.attach`` with nothing declared within 1 % of the bare loop. Adam + ``pu.weight_decay`` vs
AdamW and the apportioned parts have no goal of their own (they show where the time goes).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

if __package__ in (None, ""):  # python benchmarks/peers.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import paramupdates as pu
from benchmarks import timing
from benchmarks.rules import NoStep
from benchmarks.timing import interleaved, ms, ratios

WIDTH, LAYERS, BATCH = 64, 50, 32
HEADS, HEAD_WIDTH = 128, 16
LR, ADAM_LR, WD, MAX, DECAY = 0.01, 1e-3, 0.05, 0.5, 0.999
EPS = pu.rules.constraints.EPSILON  # 1e-7, Keras' epsilon: the max_norm formula's
CHECK_CALLS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = "(e) peers"

Run = Callable[[], None]


# --- the models and the hand-written pieces -------------------------------------------------------------
def mlp(bn: bool, seed: int = 0) -> nn.Sequential:
    """50 x ``Linear(64, 64)`` (each followed by ``BatchNorm1d(64)`` if ``bn``); same weights for a seed."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if bn:
            layers.append(nn.BatchNorm1d(WIDTH))
    return nn.Sequential(*layers)


class Heads(nn.Module):
    """128 parallel ``Linear(16, 16)`` on the same input, summed: many small weights."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.heads = nn.ModuleList(nn.Linear(HEAD_WIDTH, HEAD_WIDTH) for _ in range(HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([h(x) for h in self.heads]).sum(0)


def batch(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch ``(x, y)`` of 32 rows."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, width, generator=g)


def weights(model: nn.Module) -> list[torch.Tensor]:
    """The 2-D parameters (the ``Linear`` weights): what is decayed and max-normed."""
    return [p for p in model.parameters() if p.ndim == 2]


def train(model: nn.Module, opt: torch.optim.Optimizer, then: Run | None = None) -> Run:
    """One training step ``zero_grad; mse(model(x), y).backward(); opt.step()``, then ``then()``."""
    x, y = batch(HEAD_WIDTH if isinstance(model, Heads) else WIDTH)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
        if then is not None:
            then()

    return run


def norm_loop(ws: list[torch.Tensor]) -> Run:
    """The hand-written max-norm: ``n = w.norm(dim=1, keepdim=True); w.mul_(n.clamp(max=c) / (n + eps))``."""

    def run() -> None:
        with torch.no_grad():
            for w in ws:
                n = w.norm(dim=1, keepdim=True)
                w.mul_(n.clamp(max=MAX) / (n + EPS))

    return run


def foreach_ema(model: nn.Module) -> tuple[nn.Module, Run]:
    """The hand-written EMA: a deep copy; ``torch._foreach_lerp_`` of its floating tensors towards the
    model's (weight ``1 - decay``), ``torch._foreach_copy_`` of the others (``num_batches_tracked``)."""
    avg = copy.deepcopy(model).eval().requires_grad_(False)
    pairs = list(zip(avg.state_dict().values(), model.state_dict().values()))
    af, mf = [a for a, m in pairs if a.is_floating_point()], [m for a, m in pairs if a.is_floating_point()]
    ai, mi = [a for a, m in pairs if not a.is_floating_point()], [m for a, m in pairs if not a.is_floating_point()]

    def run() -> None:
        with torch.no_grad():
            torch._foreach_lerp_(af, mf, 1 - DECAY)
            if ai:
                torch._foreach_copy_(ai, mi)

    return avg, run


def no_decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """AdamW's param groups for decoupled decay on the weights only (what ``pu.weight_decay``'s default
    ``exclude`` gives): ``[{weights, weight_decay=WD}, {the rest, weight_decay=0}]``."""
    ws = weights(model)
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [{"params": ws, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]


def chain(*runs: Run | None) -> Run:
    """Call each of ``runs`` in turn (``None`` skipped)."""
    todo = [r for r in runs if r is not None]

    def run() -> None:
        for r in todo:
            r()

    return run


def import_timm() -> tuple[Any, str | None]:
    """``(timm, None)``, or ``(None, why)`` where it cannot be imported.

    Where only torchvision's compiled ops fail to load (a CUDA torchvision beside the CPU torch),
    ``tests/frameworks.py``'s ``python_only_torchvision`` lets its Python parts import, as the tests
    do (timm's EMA uses none of those ops).
    """
    try:
        path = os.path.join(ROOT, "tests", "frameworks.py")
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("_pu_bench_frameworks", path)
            mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            spec.loader.exec_module(mod)  # type: ignore[union-attr]
            mod.python_only_torchvision()
        return importlib.import_module("timm.utils"), None
    except Exception as e:  # noqa: BLE001 - any failure to import: those sides are skipped, with the reason
        return None, f"timm does not import ({type(e).__name__}: {e}); pip install -e '.[timm]'"


# --- a comparison: its sides, its check, its rows -------------------------------------------------------
@dataclass
class Side:
    """One way of doing it: ``run`` (one call: a step or an update) and ``state`` (the tensors that must
    agree with the reference's after the same calls); ``perturb(k)`` moves the model before the k-th
    checked call where ``run`` alone would not (the "alone" pairs)."""

    run: Run
    state: Callable[[], list[torch.Tensor]]
    perturb: Callable[[int], None] | None = None


@dataclass
class Pair:
    """Sides timed together; ``rows``: ``(variant, reference, goal)``; ``close``: undo what pu attached."""

    title: str
    sides: dict[str, Side]
    rows: list[tuple[str, str, float | None]]
    close: list[Callable[[], Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # variant -> why it did not run


def tensors_of(*modules: nn.Module) -> Callable[[], list[torch.Tensor]]:
    """Every tensor of the modules' ``state_dict``, in order (read when called)."""
    return lambda: [t for m in modules for t in m.state_dict().values()]


def floats_of(*modules: nn.Module) -> Callable[[], list[torch.Tensor]]:
    """The floating tensors of the modules' ``state_dict``, in order (read when called)."""
    return lambda: [t for m in modules for t in m.state_dict().values() if t.is_floating_point()]


def perturb_of(model: nn.Module, ws_only: bool = False) -> Callable[[int], None]:
    """Move ``model`` deterministically before the k-th checked call: its floating tensors (only the
    2-D weights if ``ws_only``) ``t <- t * 1.5 + 0.01 * (k + 1)``, in place (no step is open)."""
    ts = weights(model) if ws_only else [t for t in model.state_dict().values() if t.is_floating_point()]

    def move(k: int) -> None:
        with torch.no_grad():
            for t in ts:
                t.mul_(1.5).add_(0.01 * (k + 1))

    return move


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width (floats compared bit for bit: -0.0 != 0.0, NaN == the same NaN)."""
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check(pair: Pair, reference: str) -> str:
    """Call every side ``CHECK_CALLS`` times and require its state bitwise the reference's; say so."""
    for k in range(CHECK_CALLS):
        for side in pair.sides.values():
            if side.perturb is not None:
                side.perturb(k)
            side.run()
    want = pair.sides[reference].state()
    for name, side in pair.sides.items():
        got = side.state()
        if len(got) != len(want):
            raise RuntimeError(f"{pair.title}: {name} has {len(got)} tensors to compare, {reference} {len(want)}")
        for i, (a, b) in enumerate(zip(got, want)):
            if a.dtype != b.dtype or not torch.equal(_bits(a), _bits(b)):
                diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
                raise RuntimeError(
                    f"{pair.title}: {name} is not bitwise {reference} after {CHECK_CALLS} calls "
                    f"(tensor {i} of {len(want)}, {tuple(a.shape)}: max |diff| {diff}); the ratio would compare "
                    "different math"
                )
    return f"checked: bitwise the same state after {CHECK_CALLS} calls"


def measure(pair: Pair, repeats: int, steps: int) -> list[dict]:
    """Check, time and turn ``pair`` into rows of the benchmark table."""
    try:
        # the first reference that ran (timm's side is skipped where timm is not installed)
        note = check(pair, next(ref for _, ref, _ in pair.rows if ref in pair.sides))
        times = interleaved({n: s.run for n, s in pair.sides.items()}, repeats=repeats, steps=steps)
    finally:
        for close in pair.close:
            close()
        pu.rules.base.clear()  # the rules declared on this pair's models
    out = []
    for variant, ref, goal in pair.rows:
        row = {"bench": f"{BENCH}: {pair.title}", "variant": f"{variant} / {ref}", "goal": goal}
        if variant in pair.skipped or ref in pair.skipped:
            row["skip"] = pair.skipped.get(variant) or pair.skipped[ref]
        else:
            r = ratios(times, variant, ref)
            row["ratio"] = r
            row["note"] = f"ratio of minima {r.of_min:.3f}; {ms(r.s)} vs {ms(r.base_s)} ms; {note}"
        out.append(row)
    return out


# --- the pairs --------------------------------------------------------------------------------------------
def _pu_alone(model: nn.Module, declare: Callable[[nn.Module], Any]) -> tuple[Any, Run]:
    """Declare on ``model`` and return ``(what declare returned, one pu.Stepper commit)``; the optimizer's
    step does nothing (``benchmarks.rules.NoStep``), so a commit is the declared rules and pu's machinery."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    got = declare(model)
    stepper = pu.Stepper(model, NoStep(model.parameters(), lr=LR))

    def run() -> None:
        with stepper:
            pass

    return got, run


def _ema_side(kind: str, alone: bool, timm: Any = None) -> tuple[Side, Callable[[], Any] | None]:
    """One side of the EMA pairs on a model of its own: ``kind`` "pu.ema", "timm ModelEmaV3" or
    "AveragedModel"; the update alone (``mlp`` with batch norm, the model moved before each checked
    call) or after an SGD step (``mlp`` without). Returns the side and what undoes a ``pu.attach``."""
    m = mlp(alone)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    detach = None
    if kind == "pu.ema":
        if alone:
            avg, update = _pu_alone(m, lambda mm: pu.ema(mm, DECAY))
        else:
            avg, update, detach = pu.ema(m, DECAY), None, pu.attach(m, opt).detach
    elif kind == "timm ModelEmaV3":
        ema = timm.ModelEmaV3(m, decay=DECAY)
        avg, update = ema.module, lambda: ema.update(m)
    else:
        swa = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
        swa.update_parameters(m)  # its first update copies; pu's copy starts as the model: align
        avg, update = swa.module, lambda: swa.update_parameters(m)
    if alone:  # the copies' floating tensors (AveragedModel averages the integer counters in float)
        return Side(update, floats_of(avg), perturb_of(m)), detach
    return Side(train(m, opt, update), floats_of(m, avg)), detach


def ema_pair(alone: bool) -> Pair:
    """``pu.ema`` vs timm's ``ModelEmaV3`` and ``AveragedModel``: the update alone (``mlp`` with batch
    norm), or over a whole SGD step (``mlp`` without, ``pu.attach``)."""
    timm, why = import_timm()
    what = (
        f"alone, {LAYERS} x (Linear({WIDTH}) + BN1d)"
        if alone
        else f"in an SGD step, {LAYERS} x Linear({WIDTH}), batch {BATCH}"
    )
    rows = [("pu.ema", "timm ModelEmaV3", 1.0), ("pu.ema", "AveragedModel", 1.0)]
    pair = Pair(f"EMA update {what}", {}, rows)
    for kind in ("pu.ema", "timm ModelEmaV3", "AveragedModel"):
        if kind == "timm ModelEmaV3" and timm is None:
            pair.skipped[kind] = why or ""
            continue
        pair.sides[kind], detach = _ema_side(kind, alone, timm)
        if detach is not None:
            pair.close.append(detach)
    return pair


def decay_pair(exclude_1d: bool) -> Pair:
    """``Adam`` + ``pu.weight_decay`` (``pu.attach``) vs ``AdamW``, a whole step on ``mlp`` without batch
    norm; ``exclude_1d``: pu's default exclude vs AdamW with a no-decay group, else every parameter."""
    m_pu, m_t = mlp(False), mlp(False)
    opt = torch.optim.Adam(m_pu.parameters(), lr=ADAM_LR)
    if exclude_1d:
        pu.weight_decay(m_pu, WD)
        ref, adamw = "AdamW, no-decay group", torch.optim.AdamW(no_decay_groups(m_t), lr=ADAM_LR)
    else:
        pu.weight_decay(m_pu, WD, exclude=None)
        ref, adamw = "AdamW", torch.optim.AdamW(m_t.parameters(), lr=ADAM_LR, weight_decay=WD)
    att = pu.attach(m_pu, opt)
    what = "biases excluded (pu's foreach pass)" if exclude_1d else "exclude=None (Adam's own kernel)"
    sides = {
        "Adam + pu.weight_decay": Side(train(m_pu, opt), tensors_of(m_pu)),
        ref: Side(train(m_t, adamw), tensors_of(m_t)),
    }
    title = f"decoupled decay, {what}, {LAYERS} x Linear({WIDTH}), batch {BATCH}"
    return Pair(title, sides, [("Adam + pu.weight_decay", ref, None)], [att.detach])


def max_norm_pair(alone: bool) -> Pair:
    """``pu.constrain(w, pu.max_norm(0.5))`` on every weight of ``heads`` vs the hand-written loop: the
    rule alone (weights moved before each checked call), or over a whole SGD step (``pu.attach``)."""
    m_pu, m_t = Heads(), Heads()
    what = "the rule alone" if alone else f"in an SGD step, batch {BATCH}"
    pair = Pair(f"max_norm on {HEADS} x Linear({HEAD_WIDTH}) weights, {what}", {}, [("pu.constrain", "loop", 1.0)])

    def declare(m: nn.Module) -> None:
        pu.constrain(weights(m), pu.max_norm(MAX))

    if alone:
        _, run = _pu_alone(m_pu, declare)
        loop = norm_loop(weights(m_t))
    else:
        declare(m_pu)
        opt = torch.optim.SGD(m_pu.parameters(), lr=LR)
        pair.close.append(pu.attach(m_pu, opt).detach)
        run = train(m_pu, opt)
        loop = train(m_t, torch.optim.SGD(m_t.parameters(), lr=LR), norm_loop(weights(m_t)))
    moved = (lambda m: perturb_of(m, ws_only=True)) if alone else (lambda m: None)
    pair.sides["pu.constrain"] = Side(run, tensors_of(m_pu), moved(m_pu))
    pair.sides["loop"] = Side(loop, tensors_of(m_t), moved(m_t))
    return pair


def _pu_recipe(bn: bool, max_norm: bool, ema: bool) -> tuple[Side, Callable[[], Any]]:
    """The recipe through pu: ``pu.convert``'s batch norm, ``Adam`` + ``pu.weight_decay``, max-norm on every
    weight, ``pu.ema``, all committed by ``pu.attach``; the side and the attachment's ``detach``."""
    m = mlp(bn)
    if bn:
        m = pu.convert(m)
    opt = torch.optim.Adam(m.parameters(), lr=ADAM_LR)
    pu.weight_decay(m, WD)
    if max_norm:
        pu.constrain(weights(m), pu.max_norm(MAX))
    mods = (m, pu.ema(m, DECAY)) if ema else (m,)
    att = pu.attach(m, opt)
    return Side(train(m, opt), tensors_of(*mods)), att.detach


def _hand_recipe(bn: bool, max_norm: bool, ema: bool, timm: Any = None) -> Side:
    """The best hand-written recipe: ``torch.nn.BatchNorm1d``, ``AdamW`` with a no-decay group, the norm
    loop after ``opt.step()``, the foreach EMA (or, with ``timm``, its ``ModelEmaV3``)."""
    m = mlp(bn)
    opt = torch.optim.AdamW(no_decay_groups(m), lr=ADAM_LR)
    mods: tuple[nn.Module, ...] = (m,)
    lerp: Run | None = None
    if ema and timm is not None:
        e = timm.ModelEmaV3(m, decay=DECAY)
        mods, lerp = (m, e.module), lambda: e.update(m)
    elif ema:
        avg, lerp = foreach_ema(m)
        mods = (m, avg)
    return Side(train(m, opt, chain(norm_loop(weights(m)) if max_norm else None, lerp)), tensors_of(*mods))


PARTS = (
    ("decay alone", False, False, False),
    ("decay + batch norms", True, False, False),
    ("decay + max-norm", False, True, False),
    ("decay + EMA", False, False, True),
    ("all: batch norms, decay, max-norm, EMA", True, True, True),
)
"""The recipe apportioned: ``(name, batch norms, max-norm, EMA)``; always the decay, one part at a time."""


def recipe_pair(part: str, bn: bool, max_norm: bool, ema: bool) -> Pair:
    """The recipe (its parts ``bn``, ``max_norm``, ``ema``) through pu vs hand-written; for the whole recipe
    also vs the hand-written one with timm's ``ModelEmaV3`` as its EMA."""
    whole = bn and max_norm and ema
    side, detach = _pu_recipe(bn, max_norm, ema)
    sides = {"pu.attach": side, "hand-written": _hand_recipe(bn, max_norm, ema)}
    rows: list[tuple[str, str, float | None]] = [("pu.attach", "hand-written", 1.0 if whole else None)]
    pair = Pair(f"recipe, {part}, {LAYERS} x Linear({WIDTH}){' + BN1d' if bn else ''}, batch {BATCH}", sides, rows)
    pair.close.append(detach)
    if whole:
        timm, why = import_timm()
        pair.rows.append(("pu.attach", "hand-written, timm EMA", None))
        if timm is None:
            pair.skipped["hand-written, timm EMA"] = why or ""
        else:
            sides["hand-written, timm EMA"] = _hand_recipe(bn, max_norm, ema, timm)
    return pair


def attach_pair() -> Pair:
    """``pu.attach`` with nothing declared and no batch norm (``mlp``, SGD) vs the bare loop."""
    m_pu, m_t = mlp(False), mlp(False)
    opt = torch.optim.SGD(m_pu.parameters(), lr=LR)
    att = pu.attach(m_pu, opt)
    sides = {
        "pu.attach": Side(train(m_pu, opt), tensors_of(m_pu)),
        "bare loop": Side(train(m_t, torch.optim.SGD(m_t.parameters(), lr=LR)), tensors_of(m_t)),
    }
    title = f"nothing declared, {LAYERS} x Linear({WIDTH}), SGD, batch {BATCH}"
    return Pair(title, sides, [("pu.attach", "bare loop", 1.01)], [att.detach])


PAIRS: tuple[Callable[[], Pair], ...] = (
    lambda: ema_pair(alone=True),
    lambda: ema_pair(alone=False),
    lambda: decay_pair(exclude_1d=True),
    lambda: decay_pair(exclude_1d=False),
    lambda: max_norm_pair(alone=True),
    lambda: max_norm_pair(alone=False),
    *(lambda p=p: recipe_pair(*p) for p in PARTS),
    attach_pair,
)
"""Every comparison, in table order; each is built when it runs (one pair's models alive at a time)."""


def rows(device: torch.device, *, repeats: int = 15, steps: int = 16) -> list[dict]:
    """The rows of every pair for ``python -m benchmarks`` (CPU only: these compare host-side overhead)."""
    if device.type != "cpu":
        why = f"CPU only (on {device} these launch-bound steps compare the same host overhead, plus sync)"
        return [{"bench": f"{BENCH}: every pair", "variant": "pu / its peer", "goal": None, "skip": why}]
    out: list[dict] = []
    for make in PAIRS:
        out.extend(measure(make(), repeats, steps))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/peers.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15, help="paired repeats (default 15)")
    ap.add_argument("--steps", type=int, default=16, help="calls per variant per repeat (default 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--wall", action="store_true", help="wall clock instead of process CPU time")
    ap.add_argument("--quick", action="store_true", help="tiny settings: checks that everything runs, not numbers")
    args = ap.parse_args(argv)
    from benchmarks.run import commit, machine, table

    torch.set_num_threads(args.threads)
    timing.use_device(torch.device("cpu"))
    timing.use_wall_clock(args.wall)
    reps, steps = (2, 1) if args.quick else (args.repeats, args.steps)
    print(f"paramupdates peers at commit {commit()}: {machine(torch.device('cpu'))}", flush=True)
    got = rows(torch.device("cpu"), repeats=reps, steps=steps)
    print(
        f"\nratios pu / its peer, {timing.clock_name()}: median and range over {reps} paired repeats of {steps} calls\n"
    )
    print(table(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
