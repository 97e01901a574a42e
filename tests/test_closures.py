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
        if attach:
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
            with pytest.warns(pu.AccountingWarning, match="did not run"):
                opt.step()  # (after detach: the plain step, the declared rule left out, and said)
        else:
            opt.step()
        pu.testing.reset()
        return snapshot(m), lrs

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        (want, lrs_ref), (got, lrs) = run(False), run(True)
    assert lrs == lrs_ref == [0.05, 0.025, 0.0125]
    assert_same(want, got)


# --- every driver x SGD (momentum) / Adam / LBFGS, against AdamW or the hand-written decay ---

LR, WD = 0.05, 0.1


def _net17():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))


def _batches17(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _closure(m, opt, x, y):
    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss

    return closure


def _decay_after_first_call(m, closure):
    """The reference for optimizers without decoupled decay: decay ``p *= 1 - lr*wd`` (each parameter
    with a gradient) once, right after the closure's first evaluation, before the optimizer's math."""
    calls = []

    def wrapped():
        loss = closure()
        if not calls:
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p.mul_(1 - LR * WD)
        calls.append(1)
        return loss

    return wrapped


def _state(m, opt):
    """The model and the optimizer state, by position (not by parameter id), bitwise."""
    out = snapshot(m)
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, list | tuple):  # LBFGS: its history of directions and steps
                out += [(f"opt.{i}.{k}.{j}", t.detach().clone() if torch.is_tensor(t) else t) for j, t in enumerate(v)]
            else:
                out.append((f"opt.{i}.{k}", v.detach().clone() if torch.is_tensor(v) else v))
    return out


def _optimizer(kind, params, reference):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    if kind == "adam":
        return (torch.optim.AdamW if reference else torch.optim.Adam)(
            params, lr=LR, weight_decay=WD if reference else 0
        )
    return torch.optim.LBFGS(params, lr=LR, max_iter=3)


def _reference(kind, data):
    m = _net17()
    opt = _optimizer(kind, m.parameters(), reference=True)
    for x, y in data:
        closure = _closure(m, opt, x, y)
        opt.step(closure if kind == "adam" else _decay_after_first_call(m, closure))  # AdamW decays itself
    return _state(m, opt)


@pytest.mark.parametrize("kind", ["sgd", "adam", "lbfgs"])
@pytest.mark.parametrize("driver", ["attach", "pu.step", "Stepper", "Stepper.step"])
def test_weight_decay_with_a_closure_equals_the_reference(kind, driver):
    """Adam + pu.weight_decay == AdamW bitwise with opt.step(closure); SGD and LBFGS: decoupled decay
    right after the closure's first evaluation."""
    data = _batches17()
    expect = _reference(kind, data)
    m = _net17()
    opt = _optimizer(kind, m.parameters(), reference=False)
    pu.weight_decay(m, WD, exclude=None)
    att = pu.attach(m, opt) if driver == "attach" else None
    stepper = pu.Stepper(m, opt) if driver.startswith("Stepper") else None
    for x, y in data:
        closure = _closure(m, opt, x, y)
        if driver == "attach":
            opt.step(closure)
        elif driver == "pu.step":
            with pu.step(m, opt, closure=closure):
                pass
        elif driver == "Stepper":
            pu.Stepper(m, opt, closure=closure).run(lambda: None)
        else:
            with stepper.step(closure):
                pass
    assert_same(expect, _state(m, opt))
    if att is not None:
        assert att.steps == len(data)


# --- optimizer wrappers without hooks ---------------------------------------------------------


class Unhookable:
    """The shape of DeepSpeed's ZeRO optimizers: param_groups and step(), no torch.optim step hooks."""

    def __init__(self, opt):
        self.inner = opt
        self.param_groups = opt.param_groups

    def step(self, closure=None):
        return self.inner.step(closure)


def test_a_wrapper_without_step_hooks_is_refused_with_update_error():
    """Today: AttributeError ('register_step_pre_hook'). Wanted: UpdateError naming the wrapper and the fix."""
    m = _net17()
    wrapper = Unhookable(torch.optim.SGD(m.parameters(), lr=LR))
    before = snapshot(m)
    with pytest.raises(pu.UpdateError, match="Unhookable"):
        pu.attach(m, wrapper)
    assert not pu.routing.attachments()
    assert_same(before, snapshot(m))
