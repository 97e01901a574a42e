"""Rule 8: outside a step, updates apply at once, in place, under no_grad."""

import torch
from torch import nn

import paramupdates as pu


def test_eager_update_is_immediate_and_in_place():
    lin = nn.Linear(2, 2)
    w = lin.weight
    ptr, v = w.data_ptr(), w._version
    pu.assign(w, torch.zeros(2, 2))  # no phase needed: nothing to be ambiguous with
    assert torch.equal(w, torch.zeros(2, 2)) and w.data_ptr() == ptr and w._version > v
    assert w.grad_fn is None and w.is_leaf
    pu.assign_add(w, 1.0)
    pu.assign_sub(w, torch.full((2, 2), 0.5))
    pu.assign_key(w, (0, 1), 7.0)
    assert torch.equal(w, torch.tensor([[0.5, 7.0], [0.5, 0.5]]))


def test_eager_conditions_and_methods():
    p = pu.Parameter(torch.zeros(3), auxiliary=True)
    with pu.when(False):
        p.assign_add(1.0)
    with pu.when(torch.tensor(True)):
        p.assign_add(2.0)
    with pu.when(torch.tensor(False)):
        p.assign_add(4.0)
    assert torch.equal(p.data, torch.full((3,), 2.0))


def test_eager_validation():
    t = torch.zeros(2, dtype=torch.long)
    try:
        pu.assign(t, torch.tensor([0.5, 1.0]))
        raised = False
    except pu.UpdateError:
        raised = True
    assert raised and torch.equal(t, torch.zeros(2, dtype=torch.long))
