"""Rule 2: nothing is written before commit; saved tensors stay valid."""

import torch
from torch import nn

import paramupdates as pu


class Saver(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.tensor([2.0, 3.0]))
        self.p = pu.Parameter(torch.tensor([5.0, 7.0]), auxiliary=True)

    def forward(self, x):
        y = x * self.w * self.p  # autograd saves w and p for backward
        pu.assign(self.w, torch.zeros(2))
        self.p.assign(torch.zeros(2))
        return y


def test_saved_tensors_stay_valid_and_versions_do_not_move():
    m = Saver()
    w, p = m.w, m.p
    vw, vp = w._version, p._version
    x = torch.ones(2, requires_grad=True)
    with pu.step(m):
        y = m(x)
        y.sum().backward()  # would raise "modified by an inplace operation" if w/p were written
        assert w._version == vw and p._version == vp
        assert torch.equal(x.grad, torch.tensor([10.0, 21.0]))
        assert torch.equal(w, torch.tensor([2.0, 3.0]))
    assert torch.equal(w, torch.zeros(2)) and torch.equal(p.detach(), torch.zeros(2))


def test_plain_torch_inplace_would_fail():
    """The contrast: the same program with in-place writes breaks backward."""
    w = torch.tensor([2.0, 3.0])
    x = torch.ones(2, requires_grad=True)
    y = x * w
    with torch.no_grad():
        w.zero_()
    try:
        y.sum().backward()
        raised = False
    except RuntimeError as e:
        raised = "inplace" in str(e)
    assert raised
