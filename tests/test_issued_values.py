"""The value an issued update commits (rule 12, "accounted for": committed "with the value it had when issued").

* An update keeps its operands as they were when it was issued, on every commit path: the
  single-phase copy and the fold (a trainable target updated after the gradient update, a target
  written by a rule before its phase, a target updated in two phases). A scratch tensor the user
  writes after issuing, or a view of a parameter the optimizer steps in the same commit, changes
  nothing.
* An update of a trainable parameter issued under ``torch.no_grad()`` leaves it trainable, as an
  in-place write under ``no_grad`` does in plain PyTorch (later reads pass the gradient straight through).
* An update issued under ``torch.inference_mode()`` leaves a normal tensor pending: the step's next
  training forward trains as plain PyTorch does.

Each test compares with plain eager PyTorch running the same formula, bitwise.
"""

import copy

import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import assert_same, bits, snapshot

LR = 0.1


def _pair():
    """A ``nn.Linear(3, 2)`` with a buffer, and a plain copy of it, with an SGD each."""
    m = nn.Linear(3, 2)
    m.register_buffer("acc", torch.zeros(2))
    ref = copy.deepcopy(m)
    return m, torch.optim.SGD(m.parameters(), lr=LR), ref, torch.optim.SGD(ref.parameters(), lr=LR)


def _backward(m, x):
    m(x).square().mean().backward()


# --- operands as issued ----------------------------------------------------------------------------------
def _after_grad_assign(m, s):
    """A trainable target updated after the gradient update (the fold over the optimizer's result)."""
    pu.assign(m.bias, s, phase="after_grad")


def _after_grad_assign_key(m, s):
    """``assign_key`` with a tensor key and a tensor value (both reused after issuing: returned)."""
    key, value = torch.tensor([1]), s[:1].unsqueeze(1).expand(1, 3).clone()
    pu.assign_key(m.weight, key, value, phase="after_grad")
    return key, value


def _three_phases(m, s):
    """A buffer updated in three phases (the fold, where the copy of ``assign`` is reused)."""
    pu.assign(m.acc, s, phase="before_grad")
    pu.assign_add(m.acc, s, phase="after_grad")
    pu.assign_sub(m.acc, s * 0.5)  # (phase None on a buffer: auxiliary)


# what plain PyTorch does for each, with v the scratch's value when issued: (before opt.step(), after it)
_PLAIN = {
    _after_grad_assign: (None, lambda ref, v: ref.bias.copy_(v)),
    _after_grad_assign_key: (None, lambda ref, v: ref.weight.__setitem__(torch.tensor([1]), v[:1].unsqueeze(1))),
    _three_phases: (lambda ref, v: ref.acc.copy_(v), lambda ref, v: ref.acc.add_(v).sub_(v * 0.5)),
}


@pytest.mark.parametrize("issue", list(_PLAIN), ids=lambda f: f.__name__.strip("_"))
def test_a_scratch_tensor_written_after_issuing_changes_nothing(issue):
    m, opt, ref, ref_opt = _pair()
    x = torch.randn(4, 3)
    scratch = torch.randn(2)
    v = scratch.clone()  # its value when issued
    with pu.step(m, opt):
        _backward(m, x)
        reused = issue(m, scratch) or ()
        scratch.mul_(3.0)  # the user reuses the scratch tensor (and a key and value tensor)
        for t in reused:
            t.zero_()
    _backward(ref, x)
    before, after = _PLAIN[issue]
    with torch.no_grad():
        if before is not None:
            before(ref, v)
        ref_opt.step()
        after(ref, v)
    assert_same(snapshot(ref), snapshot(m))


def test_a_delta_reused_after_issuing_folds_over_the_decayed_weight():
    """``before_grad`` on a parameter a rule writes first (weight decay): the update folds over the
    decayed value, with the delta as issued."""
    m, opt, ref, ref_opt = _pair()
    pu.weight_decay(m, 0.01)  # m.weight only (biases are excluded by default)
    x = torch.randn(4, 3)
    delta = torch.randn(2, 3)
    v = delta.clone()
    with pu.step(m, opt):
        _backward(m, x)
        pu.assign_add(m.weight, delta, phase="before_grad")
        delta.zero_()
    _backward(ref, x)
    with torch.no_grad():
        ref.weight.mul_(1 - LR * 0.01)
        ref.weight.add_(v)
    ref_opt.step()
    assert_same(snapshot(ref), snapshot(m))


@pytest.mark.parametrize("target", ["bias", "acc"])
def test_a_view_of_a_parameter_the_optimizer_steps_is_read_when_issued(target):
    """``assign(t, weight[:, 0])`` commits the column the step read, not the one the optimizer wrote
    into ``weight`` before ``t``'s phase (``bias``: trainable, after_grad; ``acc``: two phases)."""
    m, opt, ref, ref_opt = _pair()
    x = torch.randn(4, 3)
    with pu.step(m, opt):
        _backward(m, x)
        if target == "acc":
            pu.assign_add(m.acc, 1.0, phase="before_grad")
        pu.assign(getattr(m, target), m.weight[:, 0], phase="after_grad")
        assert torch.equal(pu.read(getattr(m, target)), m.weight[:, 0])
    _backward(ref, x)
    with torch.no_grad():
        column = ref.weight[:, 0].clone()
        ref_opt.step()
        if target == "acc":
            ref.acc.add_(1.0)
        getattr(ref, target).copy_(column)
    assert_same(snapshot(ref), snapshot(m))


def test_a_condition_tensor_written_after_issuing_changes_nothing():
    """``pu.when(flag)`` reads ``flag`` when the block is entered: the fold's ``where`` too."""
    m, opt, ref, ref_opt = _pair()
    x = torch.randn(4, 3)
    flag = torch.tensor(True)
    with pu.step(m, opt):
        _backward(m, x)
        with pu.when(flag):
            pu.assign(m.bias, torch.zeros(2), phase="after_grad")
        flag.fill_(False)  # a flag tensor reused for the next decision
    _backward(ref, x)
    ref_opt.step()
    with torch.no_grad():
        ref.bias.copy_(torch.where(torch.tensor(True), torch.zeros(2), ref.bias))
    assert_same(snapshot(ref), snapshot(m))


# --- updates of a trainable parameter under no_grad --------------------------------------------------------
class _Renormed(nn.Module):
    """A weight renormalised before use: ``how`` is ``"pu.Parameter"``, ``"nn.Parameter+pu.read"`` (an
    ``nn.Parameter`` read through ``pu.read``) or ``"plain"`` (plain PyTorch's reference)."""

    def __init__(self, how: str, w: torch.Tensor):
        super().__init__()
        self.how = how
        self.w = pu.Parameter(w.clone()) if how == "pu.Parameter" else nn.Parameter(w.clone())

    def forward(self, x):
        w = pu.read(self.w) if self.how == "nn.Parameter+pu.read" else self.w
        return (x @ w.t()).tanh()


def _renorm_pu(m, flag):
    """The renormalise-before-use idiom, under a tensor condition, and a second update after it."""
    with torch.no_grad():
        with pu.when(flag):
            pu.assign(m.w, pu.read(m.w) / pu.read(m.w).norm(), phase="before_grad")
        pu.assign(m.w, pu.read(m.w).clamp(-0.5, 0.5), phase="before_grad")  # (reads the first)


def _renorm_plain(ref, flag):
    """The same, as plain PyTorch writes it: in place under ``no_grad`` (the leaf stays trainable)."""
    with torch.no_grad():
        ref.w.copy_(torch.where(flag, ref.w / ref.w.norm(), ref.w))
        ref.w.clamp_(-0.5, 0.5)


@pytest.mark.parametrize("how", ["pu.Parameter", "nn.Parameter+pu.read"])
def test_an_update_under_no_grad_keeps_the_parameter_trainable(how):
    w = torch.randn(2, 3)
    m, ref = _Renormed(how, w), _Renormed("plain", w)
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for flag in (True, False, True):
        x = torch.randn(4, 3)
        with pu.step(m, opt):
            _renorm_pu(m, torch.tensor(flag))
            m(x).square().mean().backward()
        _renorm_plain(ref, torch.tensor(flag))
        ref(x).square().mean().backward()
        ref_opt.step()
        assert m.w.grad is not None, "the parameter got no gradient"
        assert torch.equal(bits(m.w.grad), bits(ref.w.grad))
        assert torch.equal(bits(pu.read(m.w)), bits(ref.w))
        opt.zero_grad()
        ref_opt.zero_grad()


# --- updates under inference_mode --------------------------------------------------------------------------
class _Scaled(nn.Module):
    """A linear layer whose output is multiplied by a buffer refreshed in train mode (the product
    saves the buffer for backward), through ``pu.assign``; ``plain``: in place, as plain PyTorch does."""

    def __init__(self, plain: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.plain = plain

    def forward(self, x):
        y = self.lin(x)
        # saves the value the rollout left pending (plain PyTorch: a clone, as it writes in place below)
        out = y * (self.scale.clone() if self.plain else self.scale)
        if self.training:
            new = 0.9 * self.scale + 0.1 * y.detach().abs().mean(0)
            if self.plain:
                with torch.no_grad():
                    self.scale.copy_(new)
            else:
                pu.assign(self.scale, new)
        return out


def _net():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), _Scaled(True), nn.Linear(4, 1))


def test_updates_under_inference_mode_leave_normal_tensors_pending():
    """Rollouts under ``inference_mode`` in train mode (one: the batch norm's row fast path; two: the
    second takes the general path), then a training forward, backward and ``opt.step()``. The
    training forward saves for backward what the rollouts left pending: the buffer of ``_Scaled``
    (``pu.assign``), and the running statistics where the batch norm is frozen (eval)."""
    ref = _net()
    net = pu.convert(copy.deepcopy(ref))
    net[3].plain = False
    assert isinstance(net[1], pu.nn.BatchNorm1d)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    pu.attach(net, opt)
    for n_rollouts, frozen in ((1, True), (2, True), (1, False)):
        rollouts, x = [torch.randn(5, 3) for _ in range(n_rollouts)], torch.randn(5, 3)
        for model, o in ((ref, ref_opt), (net, opt)):
            model.train()
            with torch.inference_mode():
                for r in rollouts:
                    model(r)
            model[1].train(not frozen)
            model(x).square().mean().backward()
            o.step()
            o.zero_grad()
        assert_same(snapshot(ref), snapshot(net))
