"""Rule 7: an exception in the block or in the optimizer leaves state bitwise unchanged.

The bad-input catalogue (every validation error and its message) is in
test_bad_input.py; random fault points (rules, optimizer, validation, user
code, under pu.step and pu.attach) are in test_faults.py.
"""


import pytest
import torch

import paramupdates as pu
from paramupdates.rules.base import Rule, register

from conftest import assert_same, snapshot
from models import Counter
from models import trained_counter as _trained


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
