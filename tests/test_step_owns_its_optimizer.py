"""A ``pu.step`` owns its optimizer's step: an ``optimizer.step()`` (or ``GradScaler.step``) inside the
block raises before it writes; ``scaler=`` makes the commit call the scaler."""

from __future__ import annotations

import pytest
import torch

import paramupdates as pu
from misuse_helpers import BNNet
from misuse_helpers import line_of as _line_of
from misuse_helpers import rules_model as _rules_model

from conftest import assert_same, snapshot


@pytest.mark.parametrize("attached", [False, True])
def test_optimizer_step_inside_pu_step_raises_before_it_writes(attached):
    m, opt, avg = _rules_model()
    if attached:
        pu.attach(m, opt)  # a pu.step on an attached optimizer owns its step too
    before = snapshot(m, opt, avg)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m, opt):
            m(torch.randn(8, 4)).square().sum().backward()
            opt.step()  # MARK: the usual port of an existing loop
    msg = str(ei.value)
    assert f"Adam.step() at tests/test_step_owns_its_optimizer.py:{_line_of('MARK: the usual')}" in msg
    assert "pu.step at tests/test_step_owns_its_optimizer.py:" in msg and "Remove the optimizer.step() call" in msg
    assert "pu.attach(model, optimizer)" in msg and "scaler=scaler" in msg
    assert_same(before, snapshot(m, opt, avg))  # the optimizer did not write, the step was discarded
    # the optimizer is ours again after the step: the next step commits once
    opt.zero_grad()
    with pu.step(m, opt) as s:
        m(torch.randn(8, 4)).square().sum().backward()
    assert s.steps == 1 and len(opt.state) == 4 and int(opt.state[m.lin.weight]["step"]) == 1
    opt.step()  # outside a step: plain PyTorch (or the attachment's commit)
    assert int(opt.state[m.lin.weight]["step"]) == 2


def test_the_guard_is_one_hook_and_refuses_another_threads_step_too():
    """The guard is one step pre-hook per optimizer, installed at its first pu.step (steps add none), and
    it refuses an optimizer.step() made by another thread while a block records for that optimizer."""
    import threading

    m, opt, avg = _rules_model()
    for _ in range(3):
        with pu.step(m, opt):
            m(torch.randn(8, 4)).square().sum().backward()
        opt.zero_grad()
    assert len(opt._optimizer_step_pre_hooks) == 1
    before = snapshot(m, opt, avg)
    errors = []

    def other_thread():
        try:
            opt.step()
        except pu.UpdateError as e:
            errors.append(str(e))

    with pytest.raises(RuntimeError, match="discard"):
        with pu.step(m, opt):
            m(torch.randn(8, 4)).square().sum().backward()
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
            raise RuntimeError("discard this step")
    assert len(errors) == 1 and "Adam.step()" in errors[0] and "owns that optimizer step" in errors[0]
    assert_same(before, snapshot(m, opt, avg))
    with pytest.warns(pu.AccountingWarning, match="declared at .* did not run"):
        opt.step()  # no step is open: plain PyTorch again (the declared rule left out, and said)
    assert int(opt.state[m.lin.weight]["step"]) == 4


def test_a_stepper_finds_its_guard_again_when_the_hooks_were_cleared():
    """A Stepper looks its guard up once and then only checks it is still registered: pre-hooks
    cleared between steps (a framework resetting the optimizer's hooks) get it installed again, and
    an optimizer.step() in the block is still refused before it writes."""
    m, opt, avg = _rules_model()
    stepper = pu.Stepper(m, opt)
    with stepper:
        m(torch.randn(8, 4)).square().sum().backward()
    opt.zero_grad()
    assert len(opt._optimizer_step_pre_hooks) == 1
    opt._optimizer_step_pre_hooks.clear()
    m(torch.randn(8, 4)).square().sum().backward()
    before = snapshot(m, opt, avg)
    with pytest.raises(pu.UpdateError, match="owns that optimizer step"):
        with stepper:
            opt.step()
    assert_same(before, snapshot(m, opt, avg))
    assert len(opt._optimizer_step_pre_hooks) == 1
    with stepper:  # and the commit's own step goes through
        pass
    assert int(opt.state[m.lin.weight]["step"]) == 2


def test_gradscaler_step_inside_pu_step_raises():
    m, opt, avg = _rules_model()
    scaler = torch.amp.GradScaler("cpu")
    before = snapshot(m, opt, avg)
    with pytest.raises(
        pu.UpdateError, match=r"Adam.step\(\) at tests/test_step_owns_its_optimizer.py:\d+ was called inside"
    ):
        with pu.step(m, opt):
            scaler.scale(m(torch.randn(8, 4)).square().sum()).backward()
            scaler.step(opt)
    assert_same(before, snapshot(m, opt, avg))


def _scaler_run(use, init_scale, steps=3):
    torch.manual_seed(0)
    m = BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    pu.constrain(m.lin.weight, pu.max_norm(1.0))
    avg = pu.ema(m, 0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    torch.manual_seed(1)
    xs = [torch.randn(8, 4) for _ in range(steps)]
    owner = pu.attach(m, opt) if use == "attach" else pu.Stepper(m, opt, scaler=scaler)
    for x in xs:
        opt.zero_grad()
        if use == "attach":
            scaler.scale(m(x).square().sum()).backward()
            scaler.step(opt)
            scaler.update()
        else:
            with owner:
                scaler.scale(m(x).square().sum()).backward()
    pu.testing.reset()
    return m, opt, avg, scaler, owner


def _opt_state(opt):
    return [(f"{i}.{k}", v) for i, st in opt.state_dict()["state"].items() for k, v in st.items()]


def test_gradscaler_through_pu_step_equals_the_attach_loop():
    """``pu.step(model, opt, scaler=scaler)``: the commit calls scaler.step(opt) and scaler.update()."""
    a = _scaler_run("step", 2.0**10)
    b = _scaler_run("attach", 2.0**10)
    assert_same(snapshot(a[0], a[2]), snapshot(b[0], b[2]))
    assert_same(_opt_state(a[1]), _opt_state(b[1]))
    assert a[3].get_scale() == b[3].get_scale() == 2.0**11  # grown once (growth_interval=2, 3 good steps)
    assert a[4].steps == 3 and a[4].skipped_steps == 0


def test_gradscaler_overflow_skips_the_whole_step_and_lowers_the_scale():
    m, opt, avg, scaler, owner = _scaler_run("step", 2.0**127, steps=1)  # the scaled loss overflows
    torch.manual_seed(0)
    fresh = BNNet()
    assert_same(snapshot(m), snapshot(fresh))  # nothing written: no statistics, no optimizer step
    assert_same(snapshot(avg), snapshot(pu.ema(fresh, 0.5)))
    assert owner.skipped_steps == 1 and owner.steps == 0 and not opt.state
    assert scaler.get_scale() == 2.0**126  # backed off, as scaler.update() does after an overflow


def test_scaler_option_is_refused_with_a_closure_and_for_what_is_no_scaler():
    m = BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(TypeError, match="closure= and scaler="):
        pu.Stepper(m, opt, scaler=scaler, closure=lambda: None)
    with pytest.raises(TypeError, match="GradScaler"):
        pu.step(m, opt, scaler=object())
    with pytest.raises(TypeError, match="GradScaler"):
        pu.attach(m, opt, scaler=object())


class _Net(torch.nn.Module):
    def __init__(self, bn):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = bn(4)

    def forward(self, x):
        return self.bn(self.lin(x))


def _overflowing_batches(how):
    """Four batches; the scaler skips the step of the second (``"inf"``: an inf in it, so its batch
    statistics are not finite either, as an fp16 activation overflow makes them) or of the first
    (``"scale"``: a finite batch whose scaled loss overflows the initial scale)."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 4, generator=g) for _ in range(4)]
    if how == "inf":
        xs[1][3, 2] = float("inf")
    return xs, (2.0**127 if how == "scale" else 2.0**10)


def _plain_scaler_loop(xs, init_scale, fused, drop_skipped):
    """The plain GradScaler loop with torch.nn.BatchNorm1d; ``drop_skipped``: a step the scaler skips
    leaves the statistics as they were before it (its statistics dropped with it, as pu.step(scaler=)
    drops them), else they stay as its forward wrote them (plain PyTorch)."""
    torch.manual_seed(0)
    ref = _Net(torch.nn.BatchNorm1d)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, backoff_factor=2.0**-100)
    states = []
    for x in xs:
        opt.zero_grad()
        saved = [b.clone() for b in ref.buffers()]
        scale = scaler.get_scale()
        scaler.scale(ref(x).square().sum()).backward()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale and drop_skipped:  # the scaler skipped this step
            with torch.no_grad():
                for b, v in zip(ref.buffers(), saved):
                    b.copy_(v)
        states.append(snapshot(ref))
    return states


# (fused SGD takes found_inf into its kernel: opt.step() runs, and the attachment reads found_inf. Not
# with "scale": on a skipped first step torch's fused CPU SGD creates its momentum buffer uninitialised
# (torch.empty), so the plain loop's result is not defined there.)
@pytest.mark.parametrize("how, fused", [("inf", False), ("scale", False), ("inf", True)], ids=["inf", "scale", "fused"])
@pytest.mark.parametrize("on_nonfinite", [None, "skip"])
@pytest.mark.parametrize("given", [True, False], ids=["scaler=", "no-scaler="])
def test_gradscaler_under_attach_drops_the_step_it_skips_whole(how, fused, on_nonfinite, given):
    """``pu.attach(model, opt, scaler=scaler)`` with the usual loop (``scaler.step(opt)``,
    ``scaler.update()``): a step the scaler skips is dropped whole, as under ``pu.step(scaler=)``:
    its batch's statistics are never applied, it is counted in ``skipped_steps``, and every other
    step trains as the plain GradScaler loop with torch.nn.BatchNorm1d does, bitwise (parameters and
    statistics after each step). Before, the skipped batch's pending statistics carried over into
    the next step; with ``on_nonfinite="skip"`` and a non-finite batch that next good step was then
    dropped too. The same without ``scaler=`` (the attachment sees the scaler that steps its optimizer,
    from its first step on, a skipped one included): before, a good batch was then silently not trained
    on, or the skipped batch's statistics were committed with the next one's."""
    xs, init_scale = _overflowing_batches(how)
    ref = _plain_scaler_loop(xs, init_scale, fused, drop_skipped=True)
    torch.manual_seed(0)
    m = pu.convert(_Net(torch.nn.BatchNorm1d))
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, backoff_factor=2.0**-100)
    att = pu.attach(m, opt, **({"scaler": scaler} if given else {}), on_nonfinite=on_nonfinite)
    for x, want in zip(xs, ref):
        opt.zero_grad()
        scaler.scale(m(x).square().sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert_same(want, snapshot(m))
    assert att.steps == 3 and att.skipped_steps == 1
    assert not att.pending_schedule().targets()
    att.detach()
    assert "step" not in vars(scaler)  # detach() unwraps scaler.step


class _Seen(torch.nn.Module):
    """A linear layer and a buffer that a bad batch's update makes NaN (a pending value, not a gradient)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x, bad=False):
        pu.assign_add(self.seen, float("nan") if bad else 1.0)
        return self.lin(x)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-sgd"])
@pytest.mark.parametrize("on_nonfinite", ["skip", "raise"])
def test_a_step_dropped_for_a_nonfinite_value_under_pu_step_scaler_ends_the_scalers_iteration(on_nonfinite, fused):
    """``pu.step(scaler=)`` unscales the gradients before it checks the pending values: a step then dropped
    for a NaN pending value (skipped, or raised and caught) still ends the scaler's iteration
    (``scaler.update()``), so the next step unscales its own gradients. The parameters end bitwise where
    the plain GradScaler loop over the good batches ends. Before, the scaler kept the dropped step's
    gradients as unscaled, and the next step stepped with gradients 1024 times too large."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 4, generator=g) for _ in range(4)]
    torch.manual_seed(0)
    m = _Seen()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    stepper = pu.Stepper(m, opt, scaler=scaler, on_nonfinite=on_nonfinite)
    for i, x in enumerate(xs):
        opt.zero_grad()
        try:
            with stepper:
                scaler.scale(m(x, bad=i == 1).square().mean()).backward()
        except pu.UpdateError:
            assert on_nonfinite == "raise" and i == 1
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, fused=fused)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for i, x in enumerate(xs):
        if i != 1:
            ref_opt.zero_grad()
            ref_scaler.scale(ref(x).square().mean()).backward()
            ref_scaler.step(ref_opt)
            ref_scaler.update()
    assert_same(snapshot(ref), snapshot(m.lin))
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert int(m.seen) == 3 and stepper.steps == 3
