"""The step options are visible keyword arguments of ``pu.step``, ``pu.Stepper`` and ``pu.attach``
(``help()``, IDEs and ``inspect.signature`` show them), with one default each."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import paramupdates as pu
from paramupdates.options import StepOptions


@pytest.mark.parametrize("fn", [pu.step, pu.Stepper, pu.attach, pu.Attachment], ids=lambda f: f.__name__)
def test_every_option_is_a_keyword_argument_of_the_signature(fn):
    params = inspect.signature(fn).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())  # no **options
    for field in dataclasses.fields(StepOptions):
        assert field.name in params, field.name
        p = params[field.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == field.default, field.name
    assert "check_finite" not in params and "atomic" not in params  # (the shims of an unreleased API: gone)
    assert set(f.name for f in dataclasses.fields(StepOptions)) == {
        "on_nonfinite",
        "copy_for_rollback",
        "scaler",
        "process_group",
        "sync_timeout",
    }


def test_an_unknown_option_is_a_type_error_naming_it():
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for call in (pu.step, pu.Stepper, pu.attach):
        with pytest.raises(TypeError, match="check_finite"):
            call(m, opt, check_finite=True)
