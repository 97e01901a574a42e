"""Rule 7: an exception in the block or in the optimizer leaves state bitwise unchanged.

The bad-input catalogue (every validation error and its message) is in
test_bad_input.py; random fault points (rules, optimizer, validation, user
code, under pu.step and pu.attach) are in test_faults.py.
"""


import pytest
import torch

import paramupdates as pu

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


