"""Models and data for the distributed tests (imported by the spawned ranks too)."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import paramupdates as pu
from paramupdates.origin import call_site
from paramupdates.phases import AFTER_GRAD, AFTER_STEP
from paramupdates.rules.base import Rule, register

from conftest import bits

C = 4  # channels
N = 8  # samples per rank and micro-batch
MOMENTUM = 0.1

# DDP without buffer broadcasting in forward: ``forward_sync_buffers=False`` on
# torch >= 2.13 (where ``broadcast_buffers`` is deprecated), else ``broadcast_buffers=False``.
NO_BROADCAST = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else {"broadcast_buffers": False}
)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``module.state_dict()``."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of two state dicts (NaN payloads and -0.0 included)."""
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def batch(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    """Rank ``rank``'s data: a different mean and scale per rank, so that ranks' statistics differ."""
    g = torch.Generator().manual_seed(7919 * step + 101 * rank + micro)
    return torch.randn(N, C, generator=g) * (1.0 + rank) + 2.0 * rank


def stats_update(rm: torch.Tensor, rv: torch.Tensor, x: torch.Tensor, m: float = MOMENTUM):
    """One rank's running-statistics update, as torch.nn.BatchNorm1d defines it (unbiased variance)."""
    return (1 - m) * rm + m * x.mean(0), (1 - m) * rv + m * x.var(0)


class StatsBN(nn.Module):
    """Batch norm over ``(N, C)`` whose running statistics are committed with ``pu.assign(sync=...)``.

    Normalises with the local batch's statistics (like ``nn.BatchNorm1d`` under
    DDP); only the running estimates are synced.
    """

    def __init__(self, c: int = C, momentum: float = MOMENTUM, sync: str | None = "mean") -> None:
        super().__init__()
        self.momentum, self.sync = momentum, sync
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                rm, rv = stats_update(self.running_mean, self.running_var, x, self.momentum)
            pu.assign(self.running_mean, rm, sync=self.sync)
            pu.assign(self.running_var, rv, sync=self.sync)
            pu.assign_add(self.num_batches_tracked, 1, sync=self.sync)
            mean, var = x.mean(0), x.var(0, unbiased=False)
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class Net(nn.Module):
    """Batch norm on the input, then a linear layer: the statistics depend on the data only."""

    def __init__(self, sync: str | None = "mean") -> None:
        super().__init__()
        self.bn = StatsBN(sync=sync)
        self.lin = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.bn(x))


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def reference_stats(steps: int, world: int, micro: int = 1):
    """Single process, all ranks' data: the mean over ranks of each rank's updates, step by step."""
    rm, rv = torch.zeros(C), torch.ones(C)
    for s in range(steps):
        ms, vs = [], []
        for r in range(world):
            a, b = rm, rv
            for k in range(micro):
                a, b = stats_update(a, b, batch(s, r, k))
            ms.append(a)
            vs.append(b)
        rm, rv = sum(ms[1:], ms[0]) / world, sum(vs[1:], vs[0]) / world
    return rm, rv


class MaxNorm(Rule):
    """A declared rule (phase after_grad): rows of ``weight`` scaled to norm at most ``c``."""

    phase = AFTER_GRAD
    kind = "max_norm"

    def __init__(self, p: torch.Tensor, c: float) -> None:
        super().__init__(call_site(2))
        self._p = [p]
        self.c = c

    def tensors(self) -> list[torch.Tensor]:
        return self._p

    def alive(self) -> bool:
        return True

    def apply(self, ctx) -> None:
        for p in self.tensors():
            norm = p.norm(dim=1, keepdim=True).clamp_min(1e-12)
            p.mul_(torch.clamp(self.c / norm, max=1.0))


class Ema(Rule):
    """A declared rule (phase after_step): ``avg <- avg + (1 - decay) * (p - avg)`` after everything else."""

    phase = AFTER_STEP
    kind = "ema"

    def __init__(self, params: list[torch.Tensor], avgs: list[torch.Tensor], decay: float) -> None:
        super().__init__(call_site(2))
        self._p, self._a = list(params), list(avgs)
        self.decay = decay

    def owner_tensors(self) -> list[torch.Tensor]:
        return self._p

    def tensors(self) -> list[torch.Tensor]:
        return self._a

    def alive(self) -> bool:
        return True

    def apply(self, ctx) -> None:
        torch._foreach_lerp_(self.tensors(), self.owner_tensors(), 1 - self.decay)


class RuleNet(Net):
    """Net plus a rank-local (unsynced) buffer, a declared max-norm and an EMA of the weights."""

    def __init__(self) -> None:
        super().__init__(sync="mean")
        self.register_buffer("seen", torch.zeros(()))
        self.ema = nn.Module()
        self.ema.register_buffer("weight", self.lin.weight.detach().clone())
        self.ema.register_buffer("bias", self.lin.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            pu.assign_add(self.seen, x.sum())  # not synced: each rank keeps its own (the control)
        return super().forward(x)

    def declare_rules(self) -> None:
        register(MaxNorm(self.lin.weight, 0.5))
        register(Ema([self.lin.weight, self.lin.bias], [self.ema.weight, self.ema.bias], 0.9))


class Two(nn.Module):
    """Two synced-or-not buffers and a rank-local one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.zeros(2))
        self.register_buffer("b", torch.zeros(2))
        self.register_buffer("local", torch.zeros(2))
