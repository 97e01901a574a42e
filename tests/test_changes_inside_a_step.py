"""A model's tensors change between steps, not inside one: converting, loading or assigning tensors with
pending updates raises (at the call, or at the commit), and pending values never leak into the model."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import paramupdates as pu
from misuse_helpers import BNNet, Mixed
from misuse_helpers import committed as _committed
from misuse_helpers import line_of as _line_of

from conftest import assert_same, snapshot


def _as(state, dtype):
    return [(k, v.to(dtype) if v.is_floating_point() else v) for k, v in state]


@pytest.mark.parametrize("ending", ["exception", "commit"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_converting_the_model_inside_a_step_keeps_stored_values(ending, dtype):
    m = Mixed()
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1)
    before = _committed(m)
    with pytest.raises((pu.UpdateError, KeyError)) as ei:
        with pu.step(m, opt):
            m(torch.randn(8, 4)).square().sum().backward()
            m.to(dtype)  # MARK: converts the model while its updates are pending
            if ending == "exception":
                raise KeyError("user code fails")
    if ending == "commit":
        msg = str(ei.value)
        assert ei.type is pu.UpdateError and "Nothing of the step was written" in msg
        for name in ("'net.bn.running_mean'", "'net.bn.running_var'", "'scale'", "'frozen'"):
            assert name in msg, name
        assert "between steps" in msg
    # the conversion, applied to the stored values; nothing of the step (statistics, counters, pu.Parameter)
    assert_same(_as(before, dtype), _committed(m))
    assert m.scale.dtype == dtype and type(m.scale) is pu.Parameter
    # and the next step is an ordinary one
    opt.zero_grad()
    with pu.step(m, opt):
        m(torch.randn(8, 4).to(dtype)).square().sum().backward()
    assert int(m.net.calls) == 1 and torch.equal(m.scale, torch.full((4,), 0.5, dtype=dtype))


def test_converting_a_pu_parameter_between_steps_keeps_its_updates():
    m = Mixed()
    with pu.step(m):
        m.scale.assign_add(1.0)
    m.double()  # between steps: fine
    with pu.step(m):
        m.scale.assign_add(1.0)
    assert m.scale.dtype == torch.float64 and torch.equal(m.scale, torch.full((4,), 3.0, dtype=torch.float64))


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("use", ["step", "attach"])
def test_load_state_dict_of_tensors_with_pending_updates_raises_before_loading(use, assign):
    m = Mixed()
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1)
    other = Mixed()
    with torch.no_grad():
        for t in other.state_dict().values():
            t.add_(7)
    sd = other.state_dict()
    before = _committed(m)
    att = pu.attach(m, opt) if use == "attach" else None
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m, opt) if use == "step" else contextlib.nullcontext():
            m(torch.randn(8, 4))
            m.load_state_dict(sd, assign=assign)  # MARK: load inside the step
    msg = str(ei.value)
    assert (
        f"Mixed.load_state_dict() at tests/test_changes_inside_a_step.py:{_line_of('MARK: load inside the step')}"
        in msg
    )
    assert "'net.calls'" in msg and "Nothing was loaded" in msg
    assert ("flush()" in msg and "discard()" in msg) if use == "attach" else "between steps" in msg.lower()
    if att is not None:
        att.discard()
    assert_same(before, _committed(m))  # nothing loaded, nothing of the step written
    m.load_state_dict(sd, assign=assign)  # between steps: loads
    assert_same(list(sd.items()), _committed(m))


def test_loading_tensors_without_pending_updates_inside_a_step_loads():
    m = Mixed()
    src, other = BNNet(), BNNet()
    with pu.step(m):
        m(torch.randn(8, 4))  # pending: statistics, counters, scale, frozen
        m.net.lin.load_state_dict(src.lin.state_dict())  # no pending update of these: loads
        other.load_state_dict(src.state_dict())  # another model: loads
    assert torch.equal(m.net.lin.weight, src.lin.weight) and int(m.net.calls) == 1
    assert_same(snapshot(other), snapshot(src))


def test_assigning_a_buffer_with_pending_updates_raises_at_the_call():
    m = Mixed()
    before = _committed(m)
    with pytest.raises(
        pu.UpdateError,
        match=r"assigning the buffer 'net.calls' \(BNNet.calls = ...\) at tests/test_changes_inside_a_step.py:\d+",
    ):
        with pu.step(m):
            m(torch.randn(8, 4))
            m.net.calls = torch.zeros((), dtype=torch.long)
    with pytest.raises(pu.UpdateError, match=r"assigning the parameter 'frozen'"):
        with pu.step(m):
            m(torch.randn(8, 4))
            m.frozen = nn.Parameter(torch.zeros(4), requires_grad=False)
    assert_same(before, _committed(m))
