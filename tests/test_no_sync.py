"""The default commit never waits on the device (validated commit, rule 7): no ``.item()``, no
``bool(tensor)``, no ``.tolist()`` / ``.cpu()``, no ``torch.cuda.synchronize()`` beyond what the bare
optimizer's own ``step()`` does. Counted on CPU by a ``TorchFunctionMode`` (every such call is a host
sync on an accelerator); ``on_nonfinite=`` opts into one checked sync per step."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import paramupdates as pu

from conftest import assert_same, snapshot

_SYNCS = {
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}


class Syncs(TorchFunctionMode):
    """Counts the calls that make the host wait for the device (and ``torch.cuda.synchronize``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNCS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._synchronize = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *a, **k: self.calls.append("synchronize")
        return super().__enter__()

    def __exit__(self, *exc):
        torch.cuda.synchronize = self._synchronize
        return super().__exit__(*exc)


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), pu.nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    m.register_buffer("seen", torch.zeros((), dtype=torch.long))
    return m


def _declare(m):
    pu.weight_decay(m, 0.1)
    pu.constrain(m[3].weight, pu.max_norm(1.0))
    return pu.ema(m, 0.9, warmup=True)


def _forward(m, x):
    pu.assign_add(m.seen, 1)
    with pu.when(x.sum() > 0):  # a tensor condition: a graph select, no host read
        pu.assign_add(m.seen, 1)
    return m(x).square().mean()


def _lr(schedule):
    """The learning rate: a float, or (``"tensor"``) a tensor that a scheduler fills in place."""
    return torch.tensor(0.1) if schedule == "tensor" else 0.1


def _schedule(opt, schedule, step):
    """A new learning rate between steps, as torch.optim.lr_scheduler sets it (a tensor lr in place)."""
    for g in opt.param_groups:
        if schedule == "tensor":
            g["lr"].fill_(0.1 / (1 + step))
        elif schedule == "float":
            g["lr"] = 0.1 / (1 + step)


def _bare_syncs(opt_cls, schedule=None):
    """What the bare optimizer's step makes (torch's Adam reads its step count with .item() on CPU)."""
    m = _model()
    opt = opt_cls(m.parameters(), lr=_lr(schedule))
    m(torch.randn(6, 4)).square().mean().backward()
    with Syncs() as s:
        opt.step()
    return s.calls


@pytest.mark.parametrize("schedule", [None, "float", "tensor"])
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
@pytest.mark.parametrize("how", ["step", "attach", "accumulate"])
def test_the_default_commit_makes_no_host_sync(how, opt_cls, schedule):
    """Also under a learning-rate schedule: weight decay makes its factors from the learning rate at
    each commit, and reads a tensor learning rate on the device."""
    m = _model()
    _declare(m)
    opt = opt_cls(m.parameters(), lr=_lr(schedule))
    x = torch.randn(6, 4)
    counter = Syncs()
    if how != "step":
        pu.attach(m, opt)
    for step in range(3):  # the first commit plans, the later ones reuse the plans
        _schedule(opt, schedule, step)
        opt.zero_grad()
        if how == "step":
            with pu.step(m, opt):
                _forward(m, x).backward()
                counter.calls.clear()
                counter.__enter__()  # the commit runs at the block's exit, inside the counter
            counter.__exit__(None, None, None)
            continue
        for _ in range(2 if how == "accumulate" else 1):
            _forward(m, x).backward()
        counter.calls.clear()
        with counter:
            opt.step()
    assert counter.calls == _bare_syncs(opt_cls, schedule)
    assert int(m.seen) > 0


def test_the_opt_in_check_syncs_once_and_the_counter_sees_it():
    """The control: the counter sees a sync where there is one (``on_nonfinite="raise"``)."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pu.step(m, opt, on_nonfinite="raise"):
        _forward(m, torch.randn(6, 4)).backward()
        counter = Syncs().__enter__()
    counter.__exit__(None, None, None)
    assert counter.calls.count("__bool__") + counter.calls.count("item") == 1, counter.calls


# --- on_nonfinite="skip" and scaler=: decided on the device where the optimizer takes the verdict --------------
class Net(nn.Module):
    """Batch-norm statistics, a float and an int buffer (the int under a tensor condition), and updates of
    trainable parameters in phases before_grad and after_grad (the slow path of the commit)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.bn = pu.nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("hits", torch.zeros((), dtype=torch.long))

    def forward(self, x, bad=None):
        pu.assign_add(self.seen, float("nan") if bad == "value" else 1.0)
        with pu.when(x.sum() > 0):
            pu.assign_add(self.hits, 1)
        pu.assign_add(self.out.bias, 1e-3, phase="before_grad")
        pu.assign(self.lin.bias, self.lin.bias * 0.5, phase="after_grad")
        return self.out(self.bn(self.lin(x)))


OPTIMIZERS = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.0, fused=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, fused=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01, fused=True),
}
BATCHES = ("grad", None, "value", None, "grad", None)  # a NaN gradient, a NaN pending value, good batches


def _declared(m, foreach):
    pu.weight_decay(m, 0.1, foreach=foreach)
    pu.constrain(m.lin.weight, pu.max_norm(0.5), foreach=foreach)
    pu.constrain(m.out.bias, pu.clamp(-0.05, 0.05), foreach=foreach)
    pu.constrain(m.out.weight, lambda w: w * 0.99)
    return pu.ema(m, 0.9, foreach=foreach)


def _train_skipping(opt_name, how, foreach, dtype, on_device):
    """Train over BATCHES with ``on_nonfinite="skip"``; ``on_device=False``: the same fused optimizer made
    to look like one that takes no ``found_inf`` (the synced skip, as before). Per step: the model and
    the EMA copy, the optimizer state, the host syncs of the commit; then the counters."""
    pu.testing.reset()
    torch.manual_seed(0)
    m = Net().to(dtype)
    with torch.no_grad():  # -0.0 that a skipped step must keep (lerp(a, p, 0) would make them +0.0)
        m.lin.bias[0] = -0.0
        m.out.weight[0, 0] = -0.0
    opt = OPTIMIZERS[opt_name](m.parameters())
    if not on_device:
        opt._step_supports_amp_scaling = False
    avg = _declared(m, foreach)
    owner = pu.attach(m, opt, on_nonfinite="skip") if how == "attach" else pu.Stepper(m, opt, on_nonfinite="skip")
    torch.manual_seed(1)
    steps = []
    for bad in BATCHES:
        x = torch.randn(6, 4, dtype=dtype)
        opt.zero_grad()
        counter = Syncs()
        if how == "attach":
            m(x, bad).float().square().sum().backward()
            if bad == "grad":
                m.lin.weight.grad[0, 0] = float("nan")
            with counter:
                opt.step()
        else:
            with owner:
                m(x, bad).float().square().sum().backward()
                if bad == "grad":
                    m.lin.weight.grad[0, 0] = float("nan")
                counter.__enter__()
            counter.__exit__(None, None, None)
        opt_state = [(k, v.clone()) for st in opt.state.values() for k, v in st.items()]
        steps.append((snapshot(m, avg), opt_state, counter.calls))
    counters = (owner.steps, owner.skipped_steps, int(owner.skipped_count), pu.rules.ema.rule_of(avg).updates)
    return steps, counters


@pytest.mark.parametrize(
    "opt_name, how, foreach, dtype",
    [(o, h, True, torch.float32) for o in OPTIMIZERS for h in ("step", "attach")]
    + [("Adam", h, f, d) for h in ("step", "attach") for f, d in ((False, torch.float32), (True, torch.bfloat16))],
)
def test_a_skip_decided_on_the_device_makes_no_sync_and_equals_the_synced_skip(opt_name, how, foreach, dtype):
    """``on_nonfinite="skip"`` with an optimizer that takes ``found_inf`` in its kernel (torch's fused ones):
    one fused check gives a flag on the device and every phase applies under it (weight decay factor,
    max_norm factor, clamp and a callable selected, batch-norm statistics and issued updates selected,
    the EMA selected, the optimizer's kernel skipping): no host sync in the commit, and every step,
    skipped or not, bitwise the synced skip's (parameters, buffers, EMA copy with its -0.0 entries,
    optimizer state, counters). Torch's fused SGD with momentum is decided on the host until it has its
    momentum buffers (its kernel leaves them uninitialised on a skipped first step)."""
    device, counted_device = _train_skipping(opt_name, how, foreach, dtype, on_device=True)
    synced, counted_synced = _train_skipping(opt_name, how, foreach, dtype, on_device=False)
    host_steps = 2 if opt_name == "SGD" else 0  # (the first step is skipped: no buffers after it)
    for i, ((m_d, o_d, calls_d), (m_s, o_s, calls_s)) in enumerate(zip(device, synced)):
        assert_same(m_s, m_d)
        if i > 0:  # (a fused optimizer's state is made at a skipped first step too, as under GradScaler)
            assert_same(o_s, o_d)
        assert len(calls_s) == 1, calls_s  # the synced skip: one read, good step or not
        assert len(calls_d) == (1 if i < host_steps else 0), (i, calls_d)
    assert counted_device == counted_synced == (3, 3, 3, 3)


def test_a_fused_optimizers_lazy_state_after_a_skipped_first_step_is_its_initial_state():
    """The one difference from the synced skip: torch's fused Adam makes its state (zeros, step 0) at a
    skipped first step, as under GradScaler; the next update is bitwise the same."""
    device, _ = _train_skipping("Adam", "step", True, torch.float32, on_device=True)
    first_state = device[0][1]
    assert first_state and all(not v.any() for _, v in first_state)  # zeros and step 0.0


@pytest.mark.parametrize("why", ["no found_inf", "warmup", "user constraint", "closure", "user rule"])
def test_a_skip_the_device_cannot_take_costs_one_sync(why):
    """Where a writer cannot take a device flag the host decides, with one read per step, good or bad
    (before, a bad step read every tensor to name it even when only skipping): an optimizer without
    ``found_inf`` in its kernel, an EMA warmup (``d_t`` needs ``t`` on the host), a user ``Constraint``
    subclass, a closure, a ``pu.Rule`` of the user's (``gates`` False)."""

    class Halve(pu.rules.constraints.Constraint):
        def apply_(self, ts, plan):
            torch._foreach_mul_(ts, 0.5)

    class Count(pu.Rule):
        phase, kind = "after_step", "count"

        def __init__(self, t):
            super().__init__()
            self.t = t

        def tensors(self):
            return [self.t]

        def apply(self, ctx):
            self.t.add_(1)

    torch.manual_seed(0)
    m = Net()
    if why == "no found_inf":  # (torch's non-fused Adam reads its step count on CPU: SGD reads nothing)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
    else:
        opt = torch.optim.Adam(m.parameters(), lr=0.01, fused=True)
    pu.ema(m, 0.9, warmup=10 if why == "warmup" else None)
    if why == "user constraint":
        pu.constrain(m.out.weight, Halve())
    if why == "user rule":
        Count(m.seen).declare()
    stepper = pu.Stepper(m, opt, on_nonfinite="skip")
    for bad in (None, "value"):
        x = torch.randn(6, 4)
        opt.zero_grad()
        counter = Syncs()
        if why == "closure":

            def closure(x=x, bad=bad, counter=counter):
                loss = m(x, bad).square().sum()
                loss.backward()
                counter.__enter__()
                return loss

            with pu.step(m, opt, on_nonfinite="skip", closure=closure):
                pass
        else:
            with stepper:
                m(x, bad).square().sum().backward()
                counter.__enter__()
        counter.__exit__(None, None, None)
        assert counter.calls == ["__bool__"], (why, bad, counter.calls)


SCALED_OPTIMIZERS = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "Adam(fused)": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "SGD(fused)": lambda ps: torch.optim.SGD(ps, lr=0.01, fused=True),
}


def _scaler_step_syncs(opt_name, how, on_nonfinite=None):
    """The host syncs of each step's ``scaler.step(opt)`` (``how="bare"``: GradScaler's own, no paramupdates;
    ``"attach"``: with ``pu.attach(scaler=)``) or of each ``pu.step(scaler=)`` commit (``"step"``): a good
    batch, one that overflows the scale, a good one."""
    pu.testing.reset()
    torch.manual_seed(0)
    m = Net()
    opt = SCALED_OPTIMIZERS[opt_name](m.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    if how != "bare":
        _declared(m, True)
    owner = None
    if how == "attach":
        owner = pu.attach(m, opt, scaler=scaler, on_nonfinite=on_nonfinite)
    elif how == "step":
        owner = pu.Stepper(m, opt, scaler=scaler, on_nonfinite=on_nonfinite)
    out = []
    for big in (1.0, 2.0**120, 1.0):
        opt.zero_grad()
        counter = Syncs()
        if how == "step":
            with owner:
                scaler.scale(m(torch.randn(6, 4)).square().mean() * big).backward()
                counter.__enter__()
            counter.__exit__(None, None, None)
        else:
            scaler.scale(m(torch.randn(6, 4)).square().mean() * big).backward()
            with counter:
                scaler.step(opt)
            scaler.update()
        out.append(counter.calls)
    return out, owner


@pytest.mark.parametrize("opt_name", list(SCALED_OPTIMIZERS))
@pytest.mark.parametrize("how", ["step", "attach"])
def test_a_scaler_step_syncs_no_more_than_gradscaler_step(opt_name, how):
    """``pu.step(scaler=)`` and ``pu.attach(scaler=)`` with the rules, statistics and updates of the other
    tests make the host syncs that ``scaler.step(opt)`` makes for that optimizer, no more: none for the
    fused ones (the scaler's ``found_inf`` is the step's verdict, on the device), its one read of
    ``found_inf`` (plus the optimizer's own) for the others. Before, the commit read ``found_inf`` itself
    and then ``scaler.step`` read it again. The overflowing step is skipped whole all the same."""
    bare, _ = _scaler_step_syncs(opt_name, "bare")
    mine, owner = _scaler_step_syncs(opt_name, how)
    assert mine == bare, (mine, bare)
    assert owner.steps == 2 and owner.skipped_steps == 1
    assert owner.applied.dtype == torch.bool and bool(owner.applied)


def test_a_scaler_with_on_nonfinite_skip_and_a_fused_optimizer_makes_no_sync():
    """With ``on_nonfinite="skip"`` too the pending values' check joins the scaler's verdict on the device."""
    for how in ("step", "attach"):
        mine, owner = _scaler_step_syncs("Adam(fused)", how, on_nonfinite="skip")
        assert mine == [[], [], []]
        assert owner.steps == 2 and owner.skipped_steps == 1


def test_a_tensor_learning_rate_is_not_read_once_dcp_state_dict_is_imported():
    """``accounting.initialising`` recognises torch.distributed.checkpoint's zero-learning-rate step by its
    function on the stack: with that module imported (by another library, or a test before this one), a
    training step's tensor learning rate is still not read on the host."""
    importlib.import_module("torch.distributed.checkpoint.state_dict")
    m = _model()
    _declare(m)
    opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1))
    pu.attach(m, opt)
    x = torch.randn(6, 4)
    counter = Syncs()
    for _ in range(2):
        opt.zero_grad()
        _forward(m, x).backward()
        counter.calls.clear()
        with counter:
            opt.step()
    assert counter.calls == _bare_syncs(torch.optim.SGD, "tensor")
