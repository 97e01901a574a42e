"""Benchmark (b): the cost of a training step through paramupdates, ResNet-20.

What is measured: the time of one training step of a ResNet-20 (21 batch-norm layers, SGD with momentum, batch 32 of 3x32x32)
trained by hand in eager PyTorch (``torch.nn.BatchNorm2d`` writes its running
statistics in place in forward; ``loss.backward(); opt.step()``) against the
same model with update-safe batch norm whose 63 statistics updates per step
go through a ``pu.step`` transaction (recorded, validated, snapshotted,
committed with foreach kernels; default settings: no rollback copy) or through
``pu.attach`` (an unchanged loop); also ``pu.step(on_nonfinite="skip")`` (the opt-in
finiteness check, one host sync per step with this SGD), for its cost. Same weights, same
data. The skip before and after issue 39, side by side, with ``SGD(fused=True)`` (an
optimizer that takes the verdict in its kernel, ``found_inf``): the synced skip (the same
optimizer made to look like one without ``found_inf``: one read per step, as every skip
was) and the skip decided on the device (no read), each against the eager fused step, and
the device skip against ``pu.step``'s default commit with the same optimizer (the goal:
the default commit plus one fused check). On CPU each row also shows where the difference lies (forward, backward,
commit against ``opt.step()``; not on an accelerator, where reading a clock
mid-step would need a synchronization that changes the step).
Goal: <= 1.03x for ``pu.step`` and ``pu.attach`` (docs/design.md, performance contract).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer

import paramupdates as pu

from .models import count_bn, pu_batchnorm, resnet
from .timing import interleaved, ms, now, ratios

CPU = torch.device("cpu")


def _data(batch: int = 32, device: torch.device = CPU) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return x.to(device), y.to(device)


def _opt(model: nn.Module, fused: bool = False) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=fused)


class Parts:
    """Seconds of each part of a step (forward, backward, optimizer step or commit), per call (CPU only)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []

    def median(self) -> tuple[float, float, float]:
        return tuple(statistics.median(z) for z in zip(*self.samples))  # type: ignore[return-value]


def _no_clock() -> float:
    return 0.0  # no parts collected: no clock reading inside the step


Loss = Callable[..., torch.Tensor]


def eager_step(model: nn.Module, opt: Optimizer, x, y, parts: Parts | None = None, loss_fn: Loss = F.cross_entropy):
    """The hand-written step ``zero_grad; loss_fn(model(x), y).backward(); opt.step()`` (``parts``: its
    forward, backward and optimizer step timed)."""
    clock = now if parts is not None else _no_clock

    def run() -> None:
        t0 = clock()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        if parts is not None:
            parts.samples.append((t1 - t0, t2 - t1, clock() - t2))

    return run


def pu_step(
    model: nn.Module, opt: Optimizer, x, y, parts: Parts | None = None, loss_fn: Loss = F.cross_entropy, **kw: Any
) -> Callable[[], None]:
    """The same step in a ``pu.Stepper`` (``forward``: the model's compiled forward, if any; ``parts``:
    the commit timed in place of ``opt.step()``, opening the step with the forward; ``**kw``: the
    stepper's options)."""
    fwd = kw.pop("forward", None)
    fwd = model if fwd is None else fwd
    stepper = pu.Stepper(model, opt, **kw)
    clock = now if parts is not None else _no_clock

    def run() -> None:
        t0 = clock()
        with stepper:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(fwd(x), y)
            t1 = clock()
            loss.backward()
            t2 = clock()
        if parts is not None:
            parts.samples.append((t1 - t0, t2 - t1, clock() - t2))

    return run


def _delta(mine: tuple[float, float, float], base: tuple[float, float, float]) -> str:
    f, b, c = (1e3 * (m - e) for m, e in zip(mine, base))
    return f"; vs eager: forward {f:+.1f}, backward {b:+.1f}, commit vs opt.step() {c:+.1f} ms"


def build(
    bn: type[nn.Module], device: torch.device = CPU, fused: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = resnet(bn).to(device)
    return model, _opt(model, fused)


SKIP_SYNCED = "pu.step(on_nonfinite='skip') synced, as before (fused SGD)"
SKIP_DEVICE = "pu.step(on_nonfinite='skip') on the device (fused SGD)"


def _skip_variants(bn: type[nn.Module], device: torch.device, x, y) -> dict[str, Callable[[], None]]:
    """The skip before and after, side by side: the eager fused step, ``pu.step``'s default commit, the
    synced skip (``_step_supports_amp_scaling`` hidden: the commit reads its check on the host, as every
    skip did before) and the skip decided on the device, all with ``SGD(fused=True)``."""
    m_e, o_e = build(nn.BatchNorm2d, device, fused=True)
    m_d, o_d = build(bn, device, fused=True)
    m_s, o_s = build(bn, device, fused=True)
    o_s._step_supports_amp_scaling = False  # type: ignore[attr-defined]
    m_v, o_v = build(bn, device, fused=True)
    return {
        "eager (fused SGD)": eager_step(m_e, o_e, x, y),
        "pu.step (fused SGD)": pu_step(m_d, o_d, x, y),
        SKIP_SYNCED: pu_step(m_s, o_s, x, y, on_nonfinite="skip"),
        SKIP_DEVICE: pu_step(m_v, o_v, x, y, on_nonfinite="skip"),
    }


def run(device: torch.device = CPU, repeats: int = 9, steps: int = 2) -> list[dict]:
    """Rows of the table (ratios vs the hand-written eager step)."""
    bn, _ = pu_batchnorm()
    x, y = _data(device=device)
    m_eager, o_eager = build(nn.BatchNorm2d, device)
    m_step, o_step = build(bn, device)
    m_fast, o_fast = build(bn, device)
    m_att, o_att = build(bn, device)
    att = pu.attach(m_att, o_att)
    on_cpu = device.type == "cpu"
    parts = {"eager": Parts(), "pu.step": Parts(), "pu.attach": Parts()} if on_cpu else {}
    variants = {
        "eager": eager_step(m_eager, o_eager, x, y, parts.get("eager")),
        "pu.step": pu_step(m_step, o_step, x, y, parts.get("pu.step")),
        "pu.attach": eager_step(m_att, o_att, x, y, parts.get("pu.attach")),
        "pu.step(on_nonfinite='skip')": pu_step(m_fast, o_fast, x, y, on_nonfinite="skip"),
        **_skip_variants(bn, device, x, y),
    }
    try:
        times = interleaved(variants, repeats=repeats, steps=steps)
    finally:
        att.detach()
    n_bn = count_bn(m_step)
    base = parts["eager"].median() if on_cpu else None
    rows = []
    for name, goal, ref in (
        ("pu.step", 1.03, "eager"),
        ("pu.attach", 1.03, "eager"),
        ("pu.step(on_nonfinite='skip')", None, "eager"),
        ("pu.step (fused SGD)", 1.03, "eager (fused SGD)"),
        (SKIP_SYNCED, None, "eager (fused SGD)"),
        (SKIP_DEVICE, None, "eager (fused SGD)"),
        (SKIP_DEVICE, None, "pu.step (fused SGD)"),
    ):
        r = ratios(times, name, ref)
        rows.append(
            {
                "bench": f"(b) ResNet-20 ({n_bn} BN), batch 32, SGD",
                "variant": f"{name} / {ref}",
                "ratio": r,
                "goal": goal,
                "note": f"ratio of minima {r.of_min:.3f}; {ms(r.s)} vs {ms(r.base_s)} ms/step"
                + (_delta(parts[name].median(), base) if name in parts and base is not None and ref == "eager" else ""),
            }
        )
    return rows
