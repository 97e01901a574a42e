"""Rule 5: an unphased update of a trainable target is an error naming target and call site."""

import inspect

import pytest
import torch
from torch import nn

import paramupdates as pu


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(2, 2))
        self.gain = pu.Parameter(torch.ones(2), trainable=True)


def test_unphased_update_of_trainable_plain_parameter():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = m.block[0].weight.detach().clone()
    with pytest.raises(pu.AmbiguousOrderError) as ei:
        with pu.step(m, opt):
            line = inspect.currentframe().f_lineno + 1
            pu.assign_add(m.block[0].weight, 1.0)
    msg = str(ei.value)
    assert "'block.0.weight'" in msg
    assert f"test_ambiguous.py:{line}" in msg
    assert "phase='before_grad'" in msg and "phase='after_grad'" in msg
    assert torch.equal(m.block[0].weight, before)


def test_unphased_method_on_trainable_pu_parameter():
    m = Net()
    with pytest.raises(pu.AmbiguousOrderError) as ei:
        with pu.step(m):
            line = inspect.currentframe().f_lineno + 1
            m.gain.assign(torch.zeros(2))
    assert "'gain'" in str(ei.value) and f"test_ambiguous.py:{line}" in str(ei.value)
    assert isinstance(ei.value, pu.UpdateError)  # one except clause catches all update errors


def test_phased_update_of_trainable_is_fine_and_non_trainable_needs_no_phase():
    m = Net()
    m.block[0].bias.requires_grad_(False)
    with pu.step(m):
        pu.assign_add(m.block[0].weight, 1.0, phase="after_grad")
        pu.assign_add(m.block[0].bias, 1.0)  # frozen: no ambiguity


def test_parameter_outside_the_optimizer_is_not_trainable_for_that_step():
    m = Net()
    opt = torch.optim.SGD([m.gain], lr=0.1)  # block is not optimized
    with pu.step(m, opt):
        pu.assign_add(m.block[0].weight, 1.0)
