"""The opt-in finiteness check (validated commit, rule 7): ``on_nonfinite="skip"`` / ``"raise"``
checks the pending values and the gradients the optimizer will use, in one batched check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramupdates as pu
from misuse_helpers import BNNet
from misuse_helpers import rules_model as _rules_model

from conftest import assert_same, snapshot


def test_a_parameter_replaced_inside_its_group_list_is_checked():
    """The check reads the optimizer's param groups as they are at this commit: a parameter replaced
    in place in an existing group list (same list, same length) is the one whose gradient is checked."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pu.step(model, opt, on_nonfinite="skip") as s:
        model(torch.randn(4, 3)).sum().backward()
    assert s.steps == 1
    new_w = nn.Parameter(torch.ones(2, 3))
    model.weight = new_w
    opt.param_groups[0]["params"][0] = new_w  # the same list object, the same length
    opt.zero_grad()
    with pu.step(model, opt, on_nonfinite="skip") as s:
        model(torch.randn(4, 3)).sum().backward()
        new_w.grad[0, 0] = float("nan")
    assert s.skipped and s.skipped_steps == 1
    assert torch.equal(new_w.detach(), torch.ones(2, 3))  # SGD did not write NaN into it


class Queue(nn.Module):
    """A buffer that starts empty (a queue, a codebook filled later), beside 2-D state."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("queue", torch.zeros(0, 3))
        self.register_buffer("gram", torch.zeros(3, 3))

    def forward(self, x):
        pu.assign(self.queue, self.queue * 2)  # an empty pending value
        pu.assign_key(self.gram, (slice(0, 0),), torch.ones(0, 3))  # an empty slice
        pu.assign_add(self.gram, x.detach().T @ x.detach())
        return self.lin(x)


@pytest.mark.parametrize("on_nonfinite", [None, "raise", "skip"])
def test_empty_pending_values_commit(on_nonfinite):
    """Zero-size pending values beside values that are not 1-D: valid input, committed like the rest."""
    torch.manual_seed(0)
    model, ref = Queue(), Queue()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    options = {} if on_nonfinite is None else {"on_nonfinite": on_nonfinite}
    with pu.step(model, opt, **options):
        model(x).sum().backward()
    with torch.no_grad():
        ref.gram += x.T @ x
    assert_same(snapshot(ref.gram, ref.queue), snapshot(model.gram, model.queue))


def _nan_grad_step(m, how, opt, att=None, **options):
    """One training step whose lin.weight gradient has a NaN."""
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = m(x).square().sum()
        loss.backward()
        m.lin.weight.grad[0, 0] = float("nan")
        return loss

    if how == "step":
        with pu.step(m, opt, **options) as s:
            closure()
        return s
    if how == "closure":
        s = pu.Stepper(m, opt, closure=closure, **options)
        with s:
            pass
        return s
    closure()
    opt.step()
    return att


@pytest.mark.parametrize("how", ["step", "closure", "attach"])
def test_nonfinite_gradient_skips_the_whole_step(how):
    m, opt, avg = _rules_model()
    att = pu.attach(m, opt, on_nonfinite="skip") if how == "attach" else None
    before = snapshot(m, opt, avg)
    owner = _nan_grad_step(m, how, opt, att, **({} if how == "attach" else {"on_nonfinite": "skip"}))
    assert_same(before, snapshot(m, opt, avg))  # no optimizer step, no statistics, no rule, no EMA
    assert owner.skipped_steps == 1 and owner.steps == 0 and owner.skipped
    assert torch.isnan(m.lin.weight.grad[0, 0])  # the gradients are put back, as they were


@pytest.mark.parametrize("how", ["step", "closure", "attach"])
def test_nonfinite_gradient_raises_naming_the_parameter(how):
    m, opt, avg = _rules_model()
    att = pu.attach(m, opt, on_nonfinite="raise") if how == "attach" else None
    before = snapshot(m, opt, avg)
    with pytest.raises(pu.UpdateError) as ei:
        _nan_grad_step(m, how, opt, att, on_nonfinite="raise")
    msg = str(ei.value)
    assert "non-finite gradient of 'lin.weight'" in msg and "'lin.bias'" not in msg
    assert "on_nonfinite='skip'" in msg and "Nothing was written" in msg
    assert ("pu.attach(BNNet)" if how == "attach" else "pu.step at tests/test_nonfinite.py:") in msg
    assert_same(before, snapshot(m, opt, avg))


def test_nonfinite_sparse_gradient_is_checked_too():
    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 3, sparse=True)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    m = Emb()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = snapshot(m)
    with pytest.raises(pu.UpdateError, match="non-finite gradient of 'emb.weight'"):
        with pu.step(m, opt, on_nonfinite="raise"):
            pu.assign_add(m.calls, 1)
            (m.emb(torch.tensor([1, 2])).sum() * float("nan")).backward()
    assert_same(before, snapshot(m))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_gradients_that_require_grad_are_checked_without_a_write():
    """create_graph=True: the gradients are in a graph that may be differentiated again (an optimizer
    computing Hessian-vector products): the check must not write them (no version bump)."""
    m = BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pu.step(m, opt):
        m(torch.randn(8, 4)).square().sum().backward(create_graph=True)
        versions = [p.grad._version for p in m.parameters()]
        grads = [p.grad for p in m.parameters()]
    assert [g._version for g in grads] == versions
    m.zero_grad(set_to_none=True)  # (breaks the parameter-gradient cycle create_graph makes)


@pytest.mark.parametrize("options", [{}, {"on_nonfinite": None}], ids=["default", "off"])
def test_by_default_a_nonfinite_gradient_reaches_the_optimizer(options):
    """No check unless asked (rule 7): what plain PyTorch does, with no host sync."""
    m, opt, _ = _rules_model()
    _nan_grad_step(m, "step", opt, **options)
    assert torch.isnan(m.lin.weight).any()


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_the_check_reads_an_expanded_gradient_and_writes_nothing(on_nonfinite):
    """An ``expand()``-ed gradient (stride 0; every torch optimizer accepts one): the opt-in check
    reads it (GradScaler's kernel would write it back, and raise on the overlapping memory)."""
    torch.manual_seed(0)
    ref, m = nn.Linear(3, 2), nn.Linear(3, 2)
    m.load_state_dict(ref.state_dict())
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for net in (ref, m):
        net.weight.grad = torch.tensor(0.5).expand(2, 3)
        net.bias.grad = torch.ones(2)
    ref_opt.step()
    with pu.step(m, opt, on_nonfinite=on_nonfinite) as s:
        pass
    assert s.steps == 1 and not s.skipped
    assert_same(snapshot(ref), snapshot(m))
    assert m.weight.grad.stride() == (0, 0)


@pytest.mark.parametrize("fused", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("how", ["step", "attach"])
def test_applied_and_skipped_count_are_tensors_read_without_a_wait(how, fused):
    """``applied`` (whether the last step was applied) is a 0-dim bool tensor and ``skipped_count`` a 0-dim
    int64 tensor: with a fused optimizer the verdict taken on the device, read with no host sync; otherwise
    tensors of what the host decided. They agree with ``steps`` / ``skipped_steps`` (ints: reading those
    after device verdicts waits, once) and ``skipped``. Before any step nothing was applied."""
    from test_no_sync import Syncs

    torch.manual_seed(0)
    m = BNNet()
    opt = torch.optim.Adam(m.parameters(), lr=0.1, fused=fused)
    stepper = pu.Stepper(m, opt, on_nonfinite="skip")
    owner = pu.attach(m, opt, on_nonfinite="skip") if how == "attach" else stepper
    assert not bool(owner.applied) and int(owner.skipped_count) == 0 and not owner.skipped
    seen = []
    for bad in (False, True, True, False):
        opt.zero_grad()
        if how == "attach":
            m(torch.randn(8, 4)).square().sum().backward()
            if bad:
                m.lin.weight.grad[0, 0] = float("inf")
            opt.step()
        else:
            with stepper:
                m(torch.randn(8, 4)).square().sum().backward()
                if bad:
                    m.lin.weight.grad[0, 0] = float("inf")
        with Syncs() as counter:
            applied, skipped = owner.applied, owner.skipped_count
        assert counter.calls == []
        assert applied.shape == () and applied.dtype == torch.bool
        assert skipped.shape == () and skipped.dtype == torch.int64
        seen.append((bool(applied), int(skipped), owner.skipped))
    assert seen == [(True, 0, False), (False, 1, True), (False, 2, True), (True, 2, False)]
    assert (owner.steps, owner.skipped_steps) == (2, 2)
    assert owner.state_dict()["steps"] == 2 and owner.state_dict()["skipped_steps"] == 2
