"""Benchmark 1: the cost of a training step through paramupdates.

A ResNet-20 (21 batch-norm layers, SGD with momentum, batch 32 of 3x32x32)
trained by hand in eager PyTorch (``torch.nn.BatchNorm2d`` writes its running
statistics in place in forward; ``loss.backward(); opt.step()``) against the
same model with update-safe batch norm whose 63 statistics updates per step
go through a ``pu.step`` transaction (recorded, validated, snapshotted,
committed with foreach kernels) or through ``pu.attach`` (an unchanged loop).
Same weights, same data; goal <= 1.03x (DESIGN.md, performance contract).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import paramupdates as pu

from .models import count_bn, pu_batchnorm, resnet
from .timing import interleaved, ratios


def _data(batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def eager_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return run


def pu_step(model: nn.Module, opt: torch.optim.Optimizer, x, y, **kw) -> Callable[[], None]:
    stepper = pu.Stepper(model, opt, **kw)

    def run() -> None:
        with stepper:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()

    return run


def build(bn: type[nn.Module]) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = resnet(bn)
    return model, _opt(model)


def run(repeats: int = 9, steps: int = 2) -> list[dict]:
    """Rows of the table (ratios vs the hand-written eager step)."""
    bn, _ = pu_batchnorm()
    x, y = _data()
    m_eager, o_eager = build(nn.BatchNorm2d)
    m_step, o_step = build(bn)
    m_fast, o_fast = build(bn)
    m_att, o_att = build(bn)
    att = pu.attach(m_att, o_att)
    variants = {
        "eager": eager_step(m_eager, o_eager, x, y),
        "pu.step": pu_step(m_step, o_step, x, y),
        "pu.attach": eager_step(m_att, o_att, x, y),
        "pu.step(atomic=False, check_finite=False)": pu_step(m_fast, o_fast, x, y, atomic=False, check_finite=False),
    }
    try:
        times = interleaved(variants, repeats=repeats, steps=steps)
    finally:
        att.detach()
    n_bn = count_bn(m_step)
    rows = []
    for name, goal in (
        ("pu.step", 1.03),
        ("pu.attach", 1.03),
        ("pu.step(atomic=False, check_finite=False)", None),
    ):
        r = ratios(times, name, "eager")
        rows.append(
            {
                "bench": f"step overhead (ResNet-20, {n_bn} BN)",
                "variant": f"{name} / eager",
                "ratio": r,
                "goal": goal,
                "note": f"ratio of minima {r.of_min:.3f}; {r.s * 1e3:.1f} vs {r.base_s * 1e3:.1f} ms/step",
            }
        )
    return rows
