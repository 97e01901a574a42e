"""Closures (``optimizer.step(closure)``): the commit begins after the closure's first call, when this
step's gradients exist; and ``attach``'s wrapper of ``optimizer.step`` is what LR schedulers expect.

``docs/design.md``, "Closures" and "attach wraps optimizer.step".
"""

import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import assert_same, snapshot


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batches(n=5):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 4, generator=g) for _ in range(n)]


def _train(m, opt, mode, batches):
    att = pu.attach(m, opt) if mode == "attach" else None
    stepper = pu.Stepper(m, opt) if mode == "stepper" else None
    for x in batches:

        def closure(x=x):
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            return loss

        if mode == "step":
            with pu.step(m, opt, closure=closure):
                pass
        elif mode == "stepper":
            with stepper.step(closure):
                pass
        else:
            opt.step(closure)
    if att is not None:
        att.detach()
    return snapshot(m)


@pytest.mark.parametrize("mode", ["step", "stepper", "attach"])
def test_adam_plus_weight_decay_with_a_closure_is_adamw_bitwise(mode):
    """The decay sees this step's gradients (which parameters have one) and comes before the Adam update,
    as in AdamW: also on the first step, when no gradient existed before the closure ran."""
    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    want = _train(ref, ref_opt, "plain", _batches())
    m = _net()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    pu.weight_decay(m, 0.1, exclude=None)
    assert_same(want, _train(m, opt, mode, _batches()))


@pytest.mark.parametrize("mode", ["step", "attach"])
def test_sgd_with_a_closure_decays_before_the_update(mode):
    def reference():
        ref = _net()
        for x in _batches():
            for p in ref.parameters():
                p.grad = None
            ref(x).square().mean().backward()
            with torch.no_grad():
                for p in ref.parameters():
                    if p.ndim > 1:
                        p.mul_(1 - 0.1 * 0.05)
                    p.add_(p.grad, alpha=-0.1)
        return snapshot(ref)

    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pu.weight_decay(m, 0.05)
    assert_same(reference(), _train(m, opt, mode, _batches()))


def test_lbfgs_decays_once_per_step_after_the_first_closure_call():
    """LBFGS calls the closure several times per step; the decay runs once, after the first call."""

    def run(with_pu):
        m = _net()
        opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4)
        if with_pu:
            pu.weight_decay(m, 0.1, scale_by_lr=False)
            pu.attach(m, opt)
        calls = []
        for x in _batches(3):
            first = [True]

            def closure(x=x, first=first):
                opt.zero_grad()
                loss = m(x).square().mean()
                loss.backward()
                calls.append(1)
                if not with_pu and first[0]:  # the hand-written equivalent
                    first[0] = False
                    with torch.no_grad():
                        for p in m.parameters():
                            if p.ndim > 1:
                                p.mul_(1 - 0.1)
                return loss

            opt.step(closure)
        pu.testing.reset()
        return snapshot(m), len(calls)

    (want, n_ref), (got, n) = run(False), run(True)
    assert n == n_ref > 3  # the closure really ran several times per step
    assert_same(want, got)


class CountingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        pu.assign_add(self.calls, 1)
        return self.lin(x)


def test_updates_issued_in_the_closure_join_the_step_and_later_calls_read_them():
    m = CountingNet()
    opt = torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=3)
    seen = []

    def closure():
        opt.zero_grad()
        loss = m(torch.ones(2, 4)).sum()
        seen.append(int(m.calls))  # read-your-writes inside the step
        loss.backward()
        return loss

    with pu.step(m, opt, closure=closure) as s:
        pass
    assert seen == list(range(1, len(seen) + 1)) and len(seen) > 1
    assert int(m.calls) == len(seen)
    assert [r.op for r in s.schedule() if r.target == "calls"] == ["assign_add"] * len(seen)


def test_skip_under_a_closure_drops_the_whole_step():
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = snapshot(m)

    def closure():
        opt.zero_grad()
        loss = m(torch.randn(2, 4)).sum()
        loss.backward()
        pu.assign(m[0].weight, float("nan"), phase="after_grad")
        return loss

    with pu.step(m, opt, closure=closure, on_nonfinite="skip") as s:
        pass
    assert s.skipped and s.skipped_steps == 1
    assert_same(before, snapshot(m))
    assert m[0].weight.grad is not None  # the gradients are back after the step


def test_an_optimizer_that_ignores_the_closure_is_an_error_and_nothing_is_committed():
    class Ignores(torch.optim.SGD):
        def step(self, closure=None):
            return super().step()

    m = CountingNet()
    opt = Ignores(m.parameters(), lr=0.1)
    with pytest.raises(pu.UpdateError, match="without calling the closure"):
        with pu.step(m, opt, closure=lambda: None):
            m(torch.ones(1, 4)).sum().backward()
    assert int(m.calls) == 0


@pytest.mark.parametrize("order", ["scheduler first", "attach first"])
def test_lr_scheduler_before_or_after_attach(order):
    """torch.optim.lr_scheduler wraps ``opt.step.__func__``: attach's wrapper is a bound method."""

    def run(attach):
        m = _net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        pu.weight_decay(m, 0.1)
        att = pu.attach(m, opt) if attach and order == "attach first" else None
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if attach and order == "scheduler first":
            att = pu.attach(m, opt)
        lrs = []
        for x in _batches(3):
            opt.zero_grad()
            m(x).square().mean().backward()
            if not attach:  # the hand-written decoupled decay
                with torch.no_grad():
                    for p in m.parameters():
                        if p.ndim > 1:
                            p.mul_(1 - opt.param_groups[0]["lr"] * 0.1)
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        if att is not None:
            att.detach()
        opt.step()  # (after detach: the plain step)
        pu.testing.reset()
        return snapshot(m), lrs

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        (want, lrs_ref), (got, lrs) = run(False), run(True)
    assert lrs == lrs_ref == [0.05, 0.025, 0.0125]
    assert_same(want, got)
