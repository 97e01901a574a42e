"""Benchmark 1: the cost of a training step through paramupdates.

A ResNet-20 (21 batch-norm layers, SGD with momentum, batch 32 of 3x32x32)
trained by hand in eager PyTorch (``torch.nn.BatchNorm2d`` writes its running
statistics in place in forward; ``loss.backward(); opt.step()``) against the
same model with update-safe batch norm whose 63 statistics updates per step
go through a ``pu.step`` transaction (recorded, validated, snapshotted,
committed with foreach kernels) or through ``pu.attach`` (an unchanged loop).
Same weights, same data; goal <= 1.03x (docs/design.md, performance contract).
"""

from __future__ import annotations

import statistics
import time
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


class Parts:
    """CPU seconds of each part of a step (forward, backward, optimizer step or commit), per call."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []

    def median(self) -> tuple[float, float, float]:
        return tuple(statistics.median(z) for z in zip(*self.samples))  # type: ignore[return-value]


def eager_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, parts: Parts | None = None
) -> Callable[[], None]:
    clock = time.process_time

    def run() -> None:
        t0 = clock()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        if parts is not None:
            parts.samples.append((t1 - t0, t2 - t1, clock() - t2))

    return run


def pu_step(model: nn.Module, opt: torch.optim.Optimizer, x, y, parts: Parts | None = None, **kw) -> Callable[[], None]:
    stepper = pu.Stepper(model, opt, **kw)
    clock = time.process_time

    def run() -> None:
        t0 = clock()
        with stepper:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            t1 = clock()
            loss.backward()
            t2 = clock()
        if parts is not None:
            parts.samples.append((t1 - t0, t2 - t1, clock() - t2))

    return run


def _delta(mine: tuple[float, float, float], base: tuple[float, float, float]) -> str:
    f, b, c = (1e3 * (m - e) for m, e in zip(mine, base))
    return f"; vs eager: forward {f:+.1f}, backward {b:+.1f}, commit vs opt.step() {c:+.1f} ms"


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
    parts = {"eager": Parts(), "pu.step": Parts(), "pu.attach": Parts()}
    variants = {
        "eager": eager_step(m_eager, o_eager, x, y, parts["eager"]),
        "pu.step": pu_step(m_step, o_step, x, y, parts["pu.step"]),
        "pu.attach": eager_step(m_att, o_att, x, y, parts["pu.attach"]),
        "pu.step(atomic=False, check_finite=False)": pu_step(m_fast, o_fast, x, y, atomic=False, check_finite=False),
    }
    try:
        times = interleaved(variants, repeats=repeats, steps=steps)
    finally:
        att.detach()
    n_bn = count_bn(m_step)
    base = parts["eager"].median()
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
                "note": f"ratio of minima {r.of_min:.3f}; {r.s * 1e3:.1f} vs {r.base_s * 1e3:.1f} ms/step"
                + (_delta(parts[name].median(), base) if name in parts else ""),
            }
        )
    return rows
