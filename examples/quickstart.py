"""Quickstart: custom updates inside an unchanged training loop.

A linear model keeps an auxiliary running mean of its outputs (like batch
norm's statistics) and a step counter, both updated through paramupdates,
while the optimizer trains the weights. Run: python examples/quickstart.py
"""

import torch
from torch import nn

import paramupdates as pu


class Tracked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.running = pu.Parameter(torch.zeros(2), auxiliary=True)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with pu.when(self.training):
            self.running.assign(0.9 * self.running + 0.1 * y.detach().mean(0))
            pu.assign_add(self.seen, x.shape[0])
        return y


def main() -> None:
    torch.manual_seed(0)
    model = Tracked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    att = pu.attach(model, opt)  # commits inside opt.step()
    x, target = torch.randn(64, 4), torch.randn(64, 2)
    for _ in range(20):
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(att.schedule())
    print(f"loss {loss.item():.4f}  samples seen {int(model.seen)}  running mean {model.running.data.tolist()}")


if __name__ == "__main__":
    main()
