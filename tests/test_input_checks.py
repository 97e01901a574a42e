"""Smaller misuses, each with a clear error: values that do not fit their target, complex values, meta
tensors, a ``pu.step`` object entered twice, arguments of the wrong type."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import paramupdates as pu
from misuse_helpers import committed as _committed
from misuse_helpers import line_of as _line_of

from conftest import assert_same


class Typed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("count", torch.zeros(2, dtype=torch.int32))
        self.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
        self.code = pu.Parameter(torch.zeros(2, dtype=torch.int32), auxiliary=True)


def _check(msg, target, marker, *hints):
    assert target in msg, msg
    assert f"tests/test_input_checks.py:{_line_of(marker)}" in msg, msg
    for h in hints:
        assert h in msg, msg


@pytest.mark.parametrize("where", ["step", "eager"])
def test_an_int_that_does_not_fit_the_target(where):
    m = Typed()
    pu.Stepper(m)  # (eager errors name a target of a model paramupdates knows)
    before = _committed(m)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m) if where == "step" else contextlib.nullcontext():
            pu.assign(m.count, 2**40)  # MARK: 2**40 into int32
    _check(str(ei.value), "'count'", "MARK: 2**40 into int32", "does not fit a torch.int32", "torch.int64")
    assert_same(before, _committed(m))


def test_complex_values_and_targets():
    m = Typed()
    pu.Stepper(m)
    with pu.step(m):
        pu.assign_add(m.phase, 1 + 2j)  # a complex number into a complex target
        pu.assign_key(m.phase, 0, 3j)
    assert torch.equal(m.phase, torch.tensor([3j, 1 + 2j], dtype=torch.complex64))
    pu.assign_sub(m.phase, 1j)  # eager too
    assert torch.equal(m.phase, torch.tensor([2j, 1 + 1j], dtype=torch.complex64))
    with pytest.raises(pu.UpdateError) as ei:
        pu.assign(m.lin.bias, 1j)  # MARK: complex into float
    _check(str(ei.value), "'lin.bias'", "MARK: complex into float", "imaginary part", "value.real")
    with pytest.raises(pu.UpdateError) as ei:
        pu.constrain(m.phase, pu.clamp(0.0, 1.0))  # MARK: clamp a complex tensor
    _check(str(ei.value), "'0'", "MARK: clamp a complex tensor", "needs a real dtype", "callable")


def test_a_norm_constraint_on_an_int_tensor():
    m = Typed()
    with pytest.raises(pu.UpdateError) as ei:
        pu.constrain([("code", m.code)], pu.max_norm(1.0))  # MARK: max_norm on int
    _check(str(ei.value), "'code'", "MARK: max_norm on int", "need floating point", "leave this one out")


def test_a_step_on_meta_tensors():
    with torch.device("meta"):
        m = Typed()
    opt = torch.optim.SGD(m.lin.parameters(), lr=0.1)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m, opt):  # MARK: a meta model
            pu.assign_add(m.count, 1)
    _check(str(ei.value), "'code', 'count'", "MARK: a meta model", "meta device", "to_empty", "Nothing was written")


def test_a_pu_step_object_is_one_step():
    m = Typed()
    s = pu.step(m)
    with s:
        pu.assign_add(m.count, 1)
    with pytest.raises(pu.UpdateError) as ei:
        with s:  # MARK: entered again
            pass
    _check(str(ei.value), "Typed", "MARK: entered again", "already used", "pu.Stepper")
    assert torch.equal(m.count, torch.ones(2, dtype=torch.int32))


def test_wrong_argument_types_name_the_call():
    m = Typed()
    opt = torch.optim.SGD(m.lin.parameters(), lr=0.1)
    with pytest.raises(TypeError) as ei:
        pu.step(m, m)  # MARK: pu.step(model, model)
    _check(str(ei.value), "Typed", "MARK: pu.step(model, model)", "torch.optim.Optimizer", "pu.step(model, optimizer)")
    with pytest.raises(TypeError) as ei:
        pu.step(opt, m)  # MARK: swapped
    _check(str(ei.value), "SGD", "MARK: swapped", "torch.nn.Module")
    with pytest.raises(TypeError) as ei:
        pu.attach(m, m)  # MARK: attach(model, model)
    _check(str(ei.value), "Typed", "MARK: attach(model, model)", "torch.optim.Optimizer")


def test_with_stepper_names_the_with_line():
    m = Typed()
    stepper = pu.Stepper(m, on_nonfinite="raise")
    with pytest.raises(pu.UpdateError) as ei:
        with stepper:  # MARK: with stepper
            pu.assign(m.lin.bias, float("nan"), phase="after_grad")
    _check(str(ei.value), "'lin.bias'", "MARK: with stepper", "non-finite")
    assert str(ei.value).startswith(f"pu.step at tests/test_input_checks.py:{_line_of('MARK: with stepper')}:")
    with pytest.raises(pu.UpdateError) as ei:
        with stepper.step():  # MARK: stepper.step()
            pu.assign(m.lin.bias, float("nan"), phase="after_grad")
    assert str(ei.value).startswith(f"pu.step at tests/test_input_checks.py:{_line_of('MARK: stepper.step()')}:")
