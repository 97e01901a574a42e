"""Rule 7: validation before any write; errors and exceptions leave state bitwise unchanged."""

import inspect

import pytest
import torch

import paramupdates as pu
from paramupdates.rules.base import Rule, register

from conftest import assert_same, snapshot
from models import Counter


def _trained(steps=2):
    m = Counter()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    for _ in range(steps):
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
        opt.zero_grad()
    return m, opt


@pytest.mark.parametrize("bad,match", [
    (lambda m: pu.assign(m.acc, torch.zeros(3)), "shape"),
    (lambda m: pu.assign(m.count, torch.tensor(1.5)), "losing its kind"),
    (lambda m: pu.assign(m.count, 1.5), "float value"),
    (lambda m: pu.assign(m.acc, torch.zeros(2, device="meta")), "device"),
    (lambda m: pu.assign_key(m.acc, 5, 1.0), "key"),
    (lambda m: pu.assign(m.acc, "zero"), "not a tensor"),
])
def test_bad_input_raises_and_changes_nothing(bad, match):
    m, opt = _trained()
    before = snapshot(m, opt)
    with pytest.raises(pu.UpdateError, match=match) as ei:
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
            bad(m)
    msg = str(ei.value)
    assert "'acc'" in msg or "'count'" in msg
    assert f"test_atomic.py:{bad.__code__.co_firstlineno}" in msg  # the call site of the bad update
    assert_same(before, snapshot(m, opt))


def test_nonfinite_raises_names_target_and_changes_nothing():
    m, opt = _trained()
    before = snapshot(m, opt)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
            line = inspect.currentframe().f_lineno + 1
            pu.assign(m.acc, torch.tensor([1.0, float("inf")]))
    assert "'acc'" in str(ei.value) and f"test_atomic.py:{line}" in str(ei.value)
    assert "on_nonfinite='skip'" in str(ei.value)
    assert_same(before, snapshot(m, opt))


def test_on_nonfinite_skip_drops_whole_step_and_counts():
    m, opt = _trained()
    before = snapshot(m, opt)
    stepper = pu.Stepper(m, opt, on_nonfinite="skip")
    with stepper:
        m(torch.randn(4, 3)).sum().backward()
        pu.assign(m.acc, torch.tensor([float("nan"), 0.0]))
    assert stepper.skipped and stepper.skipped_steps == 1 and stepper.steps == 0
    assert_same(before, snapshot(m, opt))  # optimizer did not step either
    opt.zero_grad()
    with stepper:
        m(torch.randn(4, 3)).sum().backward()
    assert not stepper.skipped and stepper.steps == 1
    assert stepper.state_dict()["skipped_steps"] == 1


def test_exception_in_block_discards():
    m, opt = _trained()
    before = snapshot(m, opt)
    with pytest.raises(KeyError):
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
            raise KeyError("user bug")
    assert_same(before, snapshot(m, opt))
    assert int(m.count) == 2 and m._buffers["acc"] is m.acc


class Boom(torch.optim.SGD):
    fail = True

    def step(self, closure=None):
        super().step(closure)  # writes every parameter, then fails
        if self.fail:
            raise RuntimeError("optimizer failed")


def test_exception_inside_optimizer_rolls_back_everything():
    m = Counter()
    opt = Boom(m.parameters(), lr=0.1, momentum=0.9)
    opt.fail = False
    with pu.step(m, opt):
        m(torch.randn(4, 3)).sum().backward()
    opt.zero_grad()
    opt.fail = True
    before = snapshot(m, opt)
    with pytest.raises(RuntimeError, match="optimizer failed"):
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
            pu.assign_add(m.lin.bias, 1.0, phase="before_grad")
    assert_same(before, snapshot(m, opt))


def test_first_step_exception_removes_created_optimizer_state():
    m = Counter()
    opt = Boom(m.parameters(), lr=0.1, momentum=0.9)
    before = snapshot(m, opt)
    with pytest.raises(RuntimeError):
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
    assert len(opt.state) == 0
    assert_same(before, snapshot(m, opt))


class Failing(Rule):
    phase = "after_step"
    kind = "failing"

    def __init__(self, t):
        super().__init__("test")
        self.t = t
        self.calls = 0

    def tensors(self):
        return [self.t]

    def apply(self, ctx):
        self.calls += 1
        self.t.add_(1.0)
        raise ValueError("rule failed")

    def save(self):
        return self.calls

    def restore(self, saved):
        self.calls = saved


def test_exception_inside_rule_rolls_back_and_next_step_works():
    m, opt = _trained()
    rule = register(Failing(m.acc))
    before = snapshot(m, opt)
    with pytest.raises(ValueError, match="rule failed"):
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
    assert_same(before, snapshot(m, opt))
    assert rule.calls == 0
    from paramupdates.rules.base import unregister

    unregister(rule)
    opt.zero_grad()
    with pu.step(m, opt):
        m(torch.randn(4, 3)).sum().backward()
    assert int(m.count) == 3


def test_nested_steps_are_an_error():
    m = Counter()
    with pytest.raises(pu.UpdateError, match="do not nest"):
        with pu.step(m):
            with pu.step(m):
                pass


def test_target_not_in_model_is_an_error():
    m = Counter()
    stray = torch.zeros(2)
    with pytest.raises(pu.UpdateError, match="not a parameter or buffer of the model"):
        with pu.step(m):
            pu.assign(stray, torch.ones(2))
    assert torch.equal(stray, torch.zeros(2))


def test_update_during_backward_is_an_error():
    m = Counter()
    x = torch.randn(2, 3, requires_grad=True)

    def hook(grad):
        pu.assign_add(m.count, 1)
        return grad

    with pytest.raises(pu.UpdateError, match="during backward"):
        with pu.step(m):
            y = m.lin(x)
            y.register_hook(hook)
            y.sum().backward()
    assert int(m.count) == 0


@pytest.mark.filterwarnings("ignore:pu.weight_decay")
def test_failing_user_callable_constraint_rolls_back_everything():
    """A user constraint runs after the optimizer: its failure restores parameters, optimizer state, EMA."""
    m, opt = _trained()
    pu.weight_decay(m, 0.1)
    averaged = pu.ema(m, 0.9)
    calls = []

    def bad(w):
        calls.append(1)
        if len(calls) == 2:
            raise FloatingPointError("user constraint failed")
        return w * 0.5

    pu.constrain(m.lin.weight, bad)
    with pu.step(m, opt):  # first step: fine
        m(torch.randn(4, 3)).sum().backward()
    opt.zero_grad()
    before = snapshot(m, opt, averaged)
    with pytest.raises(pu.UpdateError, match="user constraint failed") as ei:
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
    assert "'lin.weight'" in str(ei.value) and "test_atomic.py" in str(ei.value)
    assert_same(before, snapshot(m, opt, averaged))
    from paramupdates.rules.ema import rule_of

    assert rule_of(averaged).updates == 1


@pytest.mark.filterwarnings("ignore:pu.weight_decay")
def test_no_snapshot_after_the_last_fallible_stage(monkeypatch):
    """Built-in rules are infallible: after the optimizer step nothing more is copied."""
    from paramupdates import transaction

    copied = []
    real = transaction._clone_all
    monkeypatch.setattr(transaction, "_clone_all", lambda ts: copied.extend(map(id, ts)) or real(ts))
    m, opt = _trained()
    pu.weight_decay(m, 0.1)
    pu.constrain(m.lin.weight, pu.max_norm(0.5))
    averaged = pu.ema(m, 0.9)
    copied.clear()
    with pu.step(m, opt):
        m(torch.randn(4, 3)).sum().backward()
    assert id(m.lin.weight) in copied  # decayed before the (fallible) optimizer step
    assert not set(map(id, averaged.state_dict(keep_vars=True).values())) & set(copied)
    assert id(m.acc) not in copied  # auxiliary writes come after the last fallible stage


def test_fallible_rule_after_ema_restores_the_average():
    m, opt = _trained()
    averaged = pu.ema(m, 0.5)
    register(Failing(m.acc))  # after_step, declared after the EMA: not infallible
    before = snapshot(m, opt, averaged)
    with pytest.raises(ValueError, match="rule failed"):
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
    assert_same(before, snapshot(m, opt, averaged))


def test_atomic_false_takes_no_snapshot(monkeypatch):
    from paramupdates import transaction

    copied = []
    monkeypatch.setattr(transaction, "_clone_all", lambda ts: copied.append(ts) or list(ts))
    m = Counter()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pu.weight_decay(m, 0.1)
    with pu.step(m, opt, atomic=False):
        m(torch.randn(4, 3)).sum().backward()
    assert copied == []
