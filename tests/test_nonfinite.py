"""The opt-in finiteness check (validated commit, rule 7): ``on_nonfinite="skip"`` / ``"raise"``
checks the pending values and the gradients the optimizer will use, in one batched check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramupdates as pu

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
