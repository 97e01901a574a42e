"""Rule 12 ("accounted for"): an ``optimizer.step()`` that updates tensors a declared rule covers, with no
``pu.step`` / ``pu.attach`` commit applying the rule, warns once per rule, naming the rule, its declaration
site, the tensors, the call and the fix; nothing is warned where the rules run, and nothing is registered
(no global optimizer hook) in a program that declares no rule."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import paramupdates as pu
from misuse_helpers import line_of


def _loop(model: nn.Module, opt: torch.optim.Optimizer, n: int = 3) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()  # MARK: the bare step


def test_a_forgotten_attach_warns_once_per_rule_naming_it_and_the_fix():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pu.weight_decay(m, 0.1)  # MARK: the decay
    pu.constrain(m[1], pu.max_norm(1.0))  # MARK: the constraint
    with pytest.warns(pu.AccountingWarning) as record:
        _loop(m, opt)
    msgs = [str(w.message) for w in record]
    assert len(msgs) == 2  # once per rule, not once per step
    decay, con = msgs
    here = "tests/test_unapplied_rules.py"
    assert decay.startswith(f"pu.weight_decay declared at {here}:{line_of('MARK: the decay')} did not run")
    assert con.startswith(f"pu.constrain(max_norm) declared at {here}:{line_of('MARK: the constraint')} did not run")
    assert f"SGD.step() at {here}:{line_of('MARK: the bare step')}" in decay
    # (qualified names in the model: a rule declared on a layer of a model paramupdates knows follows its place)
    assert "'0.weight', '1.weight'" in decay and "'1.weight', '1.bias'" in con
    assert "pu.attach(model, optimizer)" in decay and "pu.step(model, optimizer)" in decay
    assert all(w.filename.endswith("test_unapplied_rules.py") for w in record)  # (the user's line)


def test_a_step_opened_without_its_optimizer_then_a_bare_optimizer_step_warns():
    m = nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    avg = pu.ema(m, 0.9)
    with pu.step(m):  # (no optimizer: the rules of the gradient update do not run here)
        m(torch.randn(4, 3)).sum().backward()
    with pytest.warns(pu.AccountingWarning, match=r"pu.ema declared at .* did not run: SGD.step\(\)"):
        opt.step()
    assert pu.rules.ema.rule_of(avg).updates == 0


def test_a_rule_of_another_model_sharing_the_optimizer_warns_where_the_attached_model_does_not_hold_it():
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    pu.attach(a, opt)
    pu.constrain(b, pu.max_norm(0.5))  # b's rule: a's attachment does not apply it
    opt.zero_grad()
    (a(torch.randn(4, 3)).sum() + b(torch.randn(4, 3)).sum()).backward()
    with pytest.warns(pu.AccountingWarning, match="another model's, which does not hold them"):
        opt.step()


def test_nothing_is_warned_where_the_rules_run_or_the_optimizer_steps_nothing_they_cover():
    m = nn.Linear(3, 2)
    other = nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    pu.weight_decay(m, 0.1)
    pu.constrain(m, pu.max_norm(1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
        att = pu.attach(m, opt)
        _loop(m, opt)
        _loop(other, other_opt)  # an optimizer of tensors no rule covers
        att.detach()
        opt.zero_grad()
        opt.step()  # no gradient: the optimizer updates nothing
    assert att.steps == 3


def test_a_program_without_rules_registers_no_global_optimizer_hook():
    """The check costs nothing where no rule is declared: torch's global optimizer hooks stay empty until
    the first declaration (a fresh process: the suite's other tests declared rules)."""
    code = textwrap.dedent(
        """
        import torch
        from torch.optim import optimizer as o
        import paramupdates as pu
        m = torch.nn.Linear(2, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        att = pu.attach(m, opt)
        m(torch.ones(1, 2)).sum().backward(); opt.step()
        assert not o._global_optimizer_post_hooks and not o._global_optimizer_pre_hooks, "registered"
        pu.weight_decay(m, 0.1)
        assert len(o._global_optimizer_post_hooks) == 1 and len(o._global_optimizer_pre_hooks) == 1
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


class Lookahead(torch.optim.Optimizer):
    """The common Lookahead recipe (Zhang et al. 2019): a real optimizer wrapping a base one, whose step
    steps the base (fast weights) and every ``k`` steps pulls the weights towards slow copies."""

    def __init__(self, base: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        self._base_optimizer = base
        self.k, self.alpha, self._n = k, alpha, 0
        super().__init__(base.param_groups, {"k": k, "alpha": alpha})  # (the base's groups, shared)
        self._slow = [p.detach().clone() for g in base.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        self._n += 1
        if self._n % self.k == 0:
            params = [p for g in self.param_groups for p in g["params"]]
            for p, slow in zip(params, self._slow):
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)
        return loss


def _clamp(w: torch.Tensor) -> torch.Tensor:
    return w.clamp(-0.2, 0.2)


def _wrapped_run(make_opt, how: str, n: int = 5):
    """``n`` steps of a model under ``pu.constrain`` and ``pu.ema`` with the optimizer ``make_opt`` builds,
    beside plain PyTorch with the rules applied by hand after each ``optimizer.step()``; both results."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    m.load_state_dict(ref.state_dict())
    ref_opt, opt = make_opt(ref), make_opt(m)
    avg = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    avg.update_parameters(ref)  # (its first update copies; pu.ema starts from the copy at declaration)
    pu.constrain(m[0].weight, _clamp)
    ours = pu.ema(m, 0.9)
    att = pu.attach(m, opt) if how == "pu.attach" else None
    xs = [torch.randn(6, 3) for _ in range(n)]
    for x in xs:
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        with torch.no_grad():
            ref[0].weight.copy_(_clamp(ref[0].weight))
        avg.update_parameters(ref)
        opt.zero_grad()
        if att is not None:
            m(x).square().mean().backward()
            opt.step()
        else:
            with pu.step(m, opt):
                m(x).square().mean().backward()
    if att is not None:
        att.detach()
    return (ref.state_dict(), avg.module.state_dict()), (m.state_dict(), ours.state_dict())


def _assert_same_bits(theirs, ours):
    for a, b in zip(theirs, ours):
        assert list(a) == list(b)
        for k in a:
            assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k


@pytest.mark.parametrize("how", ["pu.attach", "pu.step"])
def test_an_optimizer_stepped_inside_the_step_of_the_one_a_commit_runs_is_part_of_it(how):
    """A wrapper (a Lookahead here, holding its base as ._base_optimizer) steps the optimizer it wraps inside
    its own step: that inner step is part of the owned one, so nothing is warned (filterwarnings = error),
    and the rules ran once per step: bitwise plain PyTorch with the constraint and the EMA applied by hand."""
    theirs, ours = _wrapped_run(lambda model: Lookahead(torch.optim.SGD(model.parameters(), lr=0.1)), how)
    _assert_same_bits(theirs, ours)


def test_a_forgotten_attach_of_a_wrapping_optimizer_still_warns():
    m = nn.Linear(3, 2)
    opt = Lookahead(torch.optim.SGD(m.parameters(), lr=0.1))
    pu.constrain(m.weight, _clamp)
    with pytest.warns(pu.AccountingWarning, match=r"pu.constrain\(_clamp\) declared at .* did not run: SGD.step\(\)"):
        _loop(m, opt)


@pytest.fixture
def one_rank_gloo():
    """A 1-process gloo group on 127.0.0.1 for the test, destroyed after it."""
    import datetime
    import socket

    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable, or a group is already initialized")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo",
        rank=0,
        world_size=1,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (torch.jit.script in ZeroRedundancyOptimizer's import)
@pytest.mark.parametrize("how", ["pu.attach", "pu.step"])
def test_zero_redundancy_optimizers_local_step_is_part_of_the_owned_one(one_rank_gloo, how):
    """torch's ZeroRedundancyOptimizer steps its local optimizer (.optim) inside its own step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def make(model):
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)

    theirs, ours = _wrapped_run(make, how)
    _assert_same_bits(theirs, ours)


@pytest.mark.parametrize("use", ["step", "attach"])
def test_torchs_dcp_resume_recipe_warns_nothing_and_resumes_like_the_uninterrupted_run(use, tmp_path):
    """torch's recipe for resuming with ``torch.distributed.checkpoint``: fresh model and optimizer,
    ``get_state_dict(model, opt)`` (on a fresh optimizer it makes the state by one ``optimizer.step()`` with
    zero gradients and a zero learning rate), ``dcp.load``, ``set_state_dict``. That step is no optimizer
    update: nothing is warned (before, two AccountingWarnings named pu.constrain and pu.ema as left out of a
    step), an attachment commits nothing in it (before, its EMA counted an update there), and the resumed
    run equals the uninterrupted one bitwise. A zero-lr ``optimizer.step()`` of the user's own, outside any
    commit, still warns."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from conftest import assert_same, snapshot

    def setup():
        pu.testing.reset()
        torch.manual_seed(0)
        net = pu.convert(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1)))
        opt = torch.optim.AdamW(net.parameters(), lr=0.1)
        pu.constrain(net[0].weight, pu.max_norm(1.0))
        avg = pu.ema(net, 0.9, warmup=10)
        att = pu.attach(net, opt) if use == "attach" else None
        return net, opt, avg, att

    def train(net, opt, xs):
        for x in xs:
            with pu.step(net, opt) if use == "step" else contextlib.nullcontext():
                net(x).square().mean().backward()
            if use == "attach":
                opt.step()
            opt.zero_grad()

    def stateful(avg, att):
        return {"ema": pu.rules.ema.rule_of(avg)} if att is None else {"pu": att}

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 3, generator=g) for _ in range(5)]
    net, opt, avg, att = setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error", pu.AccountingWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # (one process)
        train(net, opt, xs[:3])
        msd, osd = get_state_dict(net, opt)
        dcp.save({"model": msd, "optim": osd, **stateful(avg, att)}, checkpoint_id=tmp_path / "ckpt")
        train(net, opt, xs[3:])  # the uninterrupted run
        net2, opt2, avg2, att2 = setup()
        msd, osd = get_state_dict(net2, opt2)  # a fresh optimizer: its state made by a zero-lr step
        assert pu.rules.ema.rule_of(avg2).updates == 0 and (att2 is None or att2.steps == 0)
        st = {"model": msd, "optim": osd, **stateful(avg2, att2)}
        dcp.load(st, checkpoint_id=tmp_path / "ckpt")
        set_state_dict(net2, opt2, model_state_dict=st["model"], optim_state_dict=st["optim"])
        assert pu.rules.ema.rule_of(avg2).updates == 3
        train(net2, opt2, xs[3:])
    assert_same(snapshot(net, avg), snapshot(net2, avg2))
    moments = [
        [(f"{i}.{k}", v) for i, st in o.state_dict()["state"].items() for k, v in st.items()] for o in (opt, opt2)
    ]
    assert_same(*moments)
    if att2 is not None:
        att2.detach()
    for group in opt2.param_groups:
        group["lr"] = 0.0
    net2(xs[0]).square().mean().backward()
    with pytest.warns(pu.AccountingWarning) as caught:
        opt2.step()  # (a step of the loop, lr 0 or not, outside any commit: the rules are left out)
    assert sorted(str(w.message).split(" declared")[0] for w in caught) == ["pu.constrain(max_norm)", "pu.ema"]
