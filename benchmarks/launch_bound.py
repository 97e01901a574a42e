"""Benchmark (a): a launch-bound model, eager and compiled.

What is measured: the time of one training step of 50 x (``Linear(16, 16)`` +
``BatchNorm1d(16)``), batch 8, mean-squared error, ``torch.optim.SGD(lr=0.01)``.
Every kernel is tiny, so the step time is per-op overhead (host dispatch on
CPU, launches on a GPU): the case where what paramupdates adds per recorded
update shows most. Three variants, same weights, same data:

* ``torch`` (the reference, plain PyTorch): ``torch.nn.BatchNorm1d``, which writes its running
  statistics in place in forward, and the hand-written loop
  ``opt.zero_grad(); loss.backward(); opt.step()``;
* ``pu.step``: ``pu.nn.BatchNorm1d`` (its three statistics per layer go through
  ``pu.assign``: 150 recorded updates per step) in a ``pu.Stepper`` at default
  settings (no finiteness check, so no host sync; no rollback copy);
* ``pu.attach``: the same loop as ``torch``, with ``pu.attach(model, opt)``.

Compiled: the same three with ``torch.compile(model, fullgraph=True)`` on both
sides, the same backend (``inductor`` unless ``--backend``); backward and the
optimizer step (or the commit) stay outside the compiled region, as a user
writes it (docs/compile.md). Compiling happens before the timing (each compiled
variant runs its first steps first), and the wall time those first steps took
is reported as the compile cost (inductor keeps an on-disk cache: a rerun on
the same machine compiles much faster than the first run). The note says so
if dynamo compiled any graph while the steps were timed.

Goals (performance contract, docs/design.md): pu / torch <= 1.25 eager,
<= 1.10 compiled, for ``pu.step`` and ``pu.attach``.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

import paramupdates as pu

from .timing import Ratio, interleaved, ms, ratios

LAYERS, WIDTH, BATCH = 50, 16, 8
TITLE = f"(a) launch-bound: {LAYERS} x (Linear({WIDTH}) + BN1d), batch {BATCH}, SGD"


def build(bn: type[nn.Module], device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model with batch-norm class ``bn`` (the same weights for any ``bn``) and its SGD."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), bn(WIDTH)]
    model = nn.Sequential(*layers).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def data(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g).to(device), torch.randn(BATCH, WIDTH, generator=g).to(device)


def variants(device: torch.device, compiled: bool, backend: str) -> tuple[dict, list]:
    """``{name: step function}`` for torch (the reference), pu.step and pu.attach, and the attachments to detach."""
    x, y = data(device)

    def fwd(model: nn.Module) -> nn.Module:
        return torch.compile(model, backend=backend, fullgraph=True) if compiled else model

    m_e, o_e = build(nn.BatchNorm1d, device)
    m_s, o_s = build(pu.nn.BatchNorm1d, device)
    m_a, o_a = build(pu.nn.BatchNorm1d, device)
    f_e, f_s, f_a = fwd(m_e), fwd(m_s), fwd(m_a)
    stepper = pu.Stepper(m_s, o_s)
    att = pu.attach(m_a, o_a)

    def plain() -> None:
        o_e.zero_grad(set_to_none=True)
        F.mse_loss(f_e(x), y).backward()
        o_e.step()

    def pu_step() -> None:
        with stepper:
            o_s.zero_grad(set_to_none=True)
            F.mse_loss(f_s(x), y).backward()

    def pu_attach() -> None:
        o_a.zero_grad(set_to_none=True)
        F.mse_loss(f_a(x), y).backward()
        o_a.step()

    return {"torch": plain, "pu.step": pu_step, "pu.attach": pu_attach}, [att]


def _graphs() -> int:
    """Graphs dynamo has compiled so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _row(part: str, name: str, r: Ratio, goal: float, note: str) -> dict:
    per_update = (r.s - r.base_s) / (3 * LAYERS)
    return {
        "bench": f"{TITLE}, {part}",
        "variant": f"{name} / torch",
        "ratio": r,
        "goal": goal,
        "note": f"ratio of minima {r.of_min:.3f}; {ms(r.s)} vs {ms(r.base_s)} ms/step "
        f"({per_update * 1e6:+.1f} us per recorded update){note}",
    }


def run(
    device: torch.device, *, repeats: int = 15, steps: int = 16, compiled: bool = False, backend: str = "inductor"
) -> list[dict]:
    """Rows of the table: pu.step and pu.attach over plain torch, eager or (``compiled``) both compiled."""
    fns, atts = variants(device, compiled, backend)
    note = ""
    try:
        if compiled:
            took = {}
            for name, fn in fns.items():  # compile (and any recompilation of the first steps) before timing
                t0 = time.perf_counter()
                for _ in range(3):
                    fn()
                took[name] = time.perf_counter() - t0
            note = "; compiling (first 3 steps, wall): " + ", ".join(f"{n} {s:.1f} s" for n, s in took.items())
            graphs = _graphs()
        times = interleaved(fns, repeats=repeats, steps=steps)
        if compiled and _graphs() != graphs:
            note += f"; RECOMPILED while timed: {_graphs() - graphs} more graph(s)"
    finally:
        for a in atts:
            a.detach()
    part = f"both torch.compile({backend})" if compiled else "eager"
    goal = 1.10 if compiled else 1.25
    return [_row(part, name, ratios(times, name, "torch"), goal, note) for name in ("pu.step", "pu.attach")]
