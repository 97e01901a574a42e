"""Validated commit (rule 7): an exception in the block leaves state bitwise unchanged; with
``copy_for_rollback=True`` so does one raised in the optimizer or a rule during the commit.

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
        with pu.step(m, opt, copy_for_rollback=True):
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


def test_failing_user_callable_constraint_rolls_back_everything():
    """A user constraint runs after the optimizer: its failure restores parameters, optimizer state, EMA."""
    m, opt = _trained(weight_decay=0.0)
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
        with pu.step(m, opt, copy_for_rollback=True):
            m(torch.randn(4, 3)).sum().backward()
    assert "'lin.weight'" in str(ei.value) and "test_atomic.py" in str(ei.value)
    assert_same(before, snapshot(m, opt, averaged))
    from paramupdates.rules.ema import rule_of

    assert rule_of(averaged).updates == 1


def test_no_snapshot_after_the_last_fallible_stage(monkeypatch):
    """Built-in rules are infallible: after the optimizer step nothing more is copied."""
    from paramupdates.commit import rollback

    copied = []
    real = rollback.copies_of
    monkeypatch.setattr(rollback, "copies_of", lambda pool, ts: copied.extend(map(id, ts)) or real(pool, ts))
    m, opt = _trained(weight_decay=0.0)
    pu.weight_decay(m, 0.1)
    pu.constrain(m.lin.weight, pu.max_norm(0.5))
    averaged = pu.ema(m, 0.9)
    copied.clear()
    with pu.step(m, opt, copy_for_rollback=True):
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
        with pu.step(m, opt, copy_for_rollback=True):
            m(torch.randn(4, 3)).sum().backward()
    assert_same(before, snapshot(m, opt, averaged))


def test_the_default_commit_takes_no_copy(monkeypatch):
    from paramupdates.commit import rollback

    copied = []
    monkeypatch.setattr(rollback, "copies_of", lambda pool, ts: copied.append(ts) or [])
    m = Counter()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pu.weight_decay(m, 0.1)
    with pu.step(m, opt):
        m(torch.randn(4, 3)).sum().backward()
    assert copied == []


def _failing_step(m, opt, stepper):
    opt.fail = True
    with pytest.raises(RuntimeError, match="optimizer failed"):
        with stepper:
            m(torch.randn(4, 3)).sum().backward()
            pu.assign_add(m.lin.bias, 1.0, phase="before_grad")
    opt.fail = False


def test_rollback_copies_reuse_kept_cpu_buffers_and_still_restore_bitwise():
    """CPU rollback copies live in buffers kept between commits (no fresh allocation per step)."""
    from paramupdates.commit import rollback

    m = Counter()
    opt = Boom(m.parameters(), lr=0.1, momentum=0.9)
    opt.fail = False
    pu.weight_decay(m, 0.1)
    s = pu.Stepper(m, opt, copy_for_rollback=True)
    seen = []
    real = rollback.copies_of
    transaction_copies = lambda pool, ts: seen.append(out := real(pool, ts)) or out  # noqa: E731
    mp = pytest.MonkeyPatch()
    mp.setattr(rollback, "copies_of", transaction_copies)
    try:
        for _ in range(3):
            with s:
                m(torch.randn(4, 3)).sum().backward()
            opt.zero_grad()
        first, last = seen[-4:-2], seen[-2:]  # two protects per commit: decayed weight, then the rest
        for a, b in zip(first, last):
            assert [id(c) for _, cs in a for c in cs] == [id(c) for _, cs in b for c in cs]
        before = snapshot(m, opt)
        _failing_step(m, opt, s)  # the kept buffers hold this step's copies: restored from them
        assert_same(before, snapshot(m, opt))
        # a moved model (new storage, new dtype) gets new copies, and rollback is still exact
        m.double()
        opt.state.clear()
        with s:
            m(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
        opt.zero_grad()
        before = snapshot(m, opt)
        n = len(seen)
        opt.fail = True
        with pytest.raises(RuntimeError, match="optimizer failed"):
            with s:
                m(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
        opt.fail = False
        assert all(
            c.dtype == torch.float64 for copies in seen[n:] for _, cs in copies for c in cs if c.is_floating_point()
        )
        assert_same(before, snapshot(m, opt))
    finally:
        mp.undo()


def test_kept_rollback_copies_follow_a_reshaped_view_of_the_same_storage():
    """Same tensor, same data_ptr, new size (p.data = p.data[:1]): a new copy of the new size."""
    from paramupdates.commit.rollback import SnapshotPool

    pool = SnapshotPool()
    t = torch.arange(6.0)
    assert pool.claim("commit 1")
    ((ts, cs),) = pool.copies([t])
    pool.end_commit("commit 1")
    t.data = t.data[:2]
    assert pool.claim("commit 2")
    assert not pool.claim("a commit nested in commit 2")  # it takes fresh copies instead
    ((ts2, cs2),) = pool.copies([t])
    assert cs2[0].shape == (2,) and torch.equal(cs2[0], torch.tensor([0.0, 1.0]))
    pool.end_commit("commit 2")
    assert len(pool._plans) == 1  # the plan of the old size was dropped with its buffer
