"""Rules, the EMA copy and ``pu.Parameter`` follow parameters replaced under their names
(``load_state_dict(assign=True)``, ``to_empty()``, a re-creating ``model.to()``); a rule that cannot follow raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

import paramupdates as pu
from misuse_helpers import Mixed
from misuse_helpers import line_of as _line_of

from conftest import assert_same, bits, snapshot


def _declare(m):
    pu.weight_decay(m.net, 0.1)
    pu.constrain(m.net.lin, pu.max_norm(0.5))
    return pu.ema(m, 0.9)


def _train_steps(m, avg, n=2, dtype=torch.float32):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.manual_seed(5)
    for _ in range(n):
        opt.zero_grad()
        with pu.step(m, opt) as s:
            m(torch.randn(8, 4, dtype=dtype)).square().sum().backward()
    m.last_schedule = str(s.schedule())
    return snapshot(m, avg)


def _other_state():
    torch.manual_seed(9)
    return {k: v.clone() for k, v in Mixed().state_dict().items()}


def test_rules_follow_parameters_replaced_by_load_state_dict_assign():
    sd = _other_state()
    torch.manual_seed(0)
    ref = Mixed()
    ref_avg = _declare(ref)
    ref.load_state_dict(sd)  # in place: the reference
    torch.manual_seed(0)
    m = Mixed()
    avg = _declare(m)
    pu.Stepper(m)  # the model is known now: a rule on a bare tensor follows it by name too
    pu.constrain(m.net.bn.weight, pu.clamp(-0.5, 0.5))
    pu.constrain(ref.net.bn.weight, pu.clamp(-0.5, 0.5))
    old = m.net.lin.weight
    m.load_state_dict(sd, assign=True)
    assert m.net.lin.weight is not old and type(m.scale) is pu.Parameter and m.scale.auxiliary
    assert_same(_train_steps(ref, ref_avg), _train_steps(m, avg))
    rows = m.last_schedule
    for kind in ("weight_decay", "constrain:max_norm", "constrain:clamp", "ema"):
        assert kind in rows, kind


def test_meta_init_then_to_empty_keeps_rules_the_ema_and_pu_parameters():
    sd = _other_state()
    ref = Mixed()
    ref.load_state_dict(sd)
    ref_avg = _declare(ref)
    with torch.device("meta"):
        m = Mixed()
    avg = _declare(m)  # declared on the meta model: the copy is on meta too
    m.to_empty(device="cpu")
    m.load_state_dict(sd)
    assert_same(_train_steps(ref, ref_avg), _train_steps(m, avg))  # the copy started as a copy of sd
    assert type(m.scale) is pu.Parameter and m.scale.auxiliary and not any(t.is_meta for t in avg.state_dict().values())


def test_a_rule_on_a_bare_meta_tensor_is_refused_at_declaration():
    with torch.device("meta"):
        m = Mixed()
    with pytest.raises(
        pu.UpdateError,
        match=r"pu.constrain at tests/test_replaced_parameters.py:\d+: '0' is a meta tensor .* on the module",
    ):
        pu.constrain(m.net.lin.weight, pu.max_norm(1.0))


def test_model_to_that_recreates_parameters_keeps_rules_and_the_ema_follows():
    torch.manual_seed(0)
    ref = Mixed().double()
    ref_avg = _declare(ref)
    torch.manual_seed(0)
    m = Mixed()
    avg = _declare(m)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        m.to(torch.float64)  # new parameter objects
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert_same(_train_steps(ref, ref_avg, dtype=torch.float64), _train_steps(m, avg, dtype=torch.float64))
    assert avg.net.lin.weight.dtype == torch.float64 and type(m.scale) is pu.Parameter


def test_the_ema_copy_follows_the_model_cast_between_steps():
    torch.manual_seed(0)
    m = Mixed()
    avg = _declare(m)
    _train_steps(m, avg, n=1)
    m.double()
    a0 = avg.net.lin.weight.detach().clone().double()
    _train_steps(m, avg, n=1, dtype=torch.float64)
    assert avg.net.lin.weight.dtype == torch.float64
    # the anchor, torch.optim.swa_utils' EMA: lerp with the weight 1 - decay, as the rule computes it
    # (torch.lerp(a0, w, 0.1) rounds differently: 1 - 0.9 is not 0.1, and it agreed only on some CPUs)
    expect = [a0]
    get_ema_multi_avg_fn(0.9)(expect, [m.net.lin.weight.detach()], None)
    assert torch.equal(bits(avg.net.lin.weight), bits(expect[0]))


def test_a_rule_that_cannot_follow_raises_at_the_next_commit():
    torch.manual_seed(0)
    m = Mixed()
    m.extra = nn.Linear(2, 2)
    pu.weight_decay(m, 0.1, exclude=None)  # MARK: on the model
    head = pu.constrain(m.extra, pu.max_norm(1.0))
    _train_steps(m, None, n=1)
    del m.extra  # a layer removed
    before = snapshot(m)
    with pytest.raises(pu.UpdateError) as ei:
        _train_steps(m, None, n=1)
    msg = str(ei.value)
    assert "pu.constrain(max_norm) declared at tests/test_replaced_parameters.py:" in msg or (
        f"pu.weight_decay declared at tests/test_replaced_parameters.py:{_line_of('MARK: on the model')}" in msg
        and "'extra.weight'" in msg
    )
    assert "Nothing of this step was written" in msg and ".remove()" in msg
    assert_same(before, snapshot(m))
    head.remove()
    with pytest.raises(pu.UpdateError, match=r"'extra.weight', 'extra.bias', which Mixed no longer has"):
        _train_steps(m, None, n=1)
