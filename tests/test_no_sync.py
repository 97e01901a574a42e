"""The default commit never waits on the device (validated commit, rule 7): no ``.item()``, no
``bool(tensor)``, no ``.tolist()`` / ``.cpu()``, no ``torch.cuda.synchronize()`` beyond what the bare
optimizer's own ``step()`` does. Counted on CPU by a ``TorchFunctionMode`` (every such call is a host
sync on an accelerator); ``on_nonfinite=`` opts into one checked sync per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import paramupdates as pu

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
