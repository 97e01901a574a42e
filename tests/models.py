"""Small models shared by the tests."""

import torch
from torch import nn

import paramupdates as pu


class Counter(nn.Module):
    """A linear layer with an auxiliary pu.Parameter and a counting buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.scale = pu.Parameter(torch.ones(2), auxiliary=True)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("acc", torch.zeros(2))

    def forward(self, x):
        y = self.lin(x)
        with pu.when(self.training):
            pu.assign_add(self.count, 1)
            pu.assign_add(self.acc, y.detach().mean(0))
            self.scale.assign(self.scale * 0.5 + y.detach().abs().mean(0) * 0.5)
        return y * self.scale


def trained_counter(steps=2, weight_decay=0.01):
    """A Counter and its AdamW after ``steps`` committed steps (optimizer state exists).

    ``weight_decay=0.0`` for a test that declares ``pu.weight_decay`` (decaying in both is refused).
    """
    m = Counter()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=weight_decay)
    for _ in range(steps):
        with pu.step(m, opt):
            m(torch.randn(4, 3)).sum().backward()
        opt.zero_grad()
    return m, opt
