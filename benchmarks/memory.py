"""Benchmark 3: peak extra CPU memory of a step through paramupdates.

The CPU allocator's allocations and frees during one training step are read
from the PyTorch profiler (``profile_memory=True``: one ``[memory]`` event per
allocation or free, with its size); the peak of their running sum is the
step's peak memory above what was live when the step began. The extra peak
of a ``pu.step`` / ``pu.attach`` step over the hand-written eager step is
compared with the bytes of the tensors the step actually updates (parameters,
optimizer state, running statistics): the goal is at most one extra copy
(the commit's rollback snapshot, plus the pending values that replace the
in-place writes). On CPU the rollback copies live in buffers kept between
commits (``paramupdates.rollback``): they are live when the step begins, so
they are added to pu's peaks here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

import paramupdates as pu
from paramupdates.step import commit_caches

from .models import pu_batchnorm
from .step_overhead import _data, build

MARK = "benchmarks.memory.after_backward"


def _mark() -> None:
    with record_function(MARK):
        pass


def step_fns(variant: str, model: nn.Module, opt: torch.optim.Optimizer, x, y) -> tuple[Callable[[], None], Any]:
    """A step that marks the end of backward (what follows is the optimizer step / the commit)."""
    if variant == "pu.step":
        stepper = pu.Stepper(model, opt)

        def run() -> None:
            with stepper:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                _mark()

        return run, stepper
    att = pu.attach(model, opt) if variant == "pu.attach" else None

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        _mark()
        opt.step()

    return run, att


def peak_bytes(fn: Callable[[], None]) -> tuple[int, int]:
    """``(step peak, commit peak)`` of CPU memory while ``fn`` runs.

    Step peak: the peak of the running sum of allocations minus frees over the
    whole step. Commit peak: the same after the end of backward, above the
    level at that moment (what ``opt.step()``, or the commit around it, adds).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    mark = min(e.start_ns() for e in events if e.name() == MARK)
    mem = sorted(
        (e for e in events if e.name() == "[memory]" and e.device_type().name == "CPU"), key=lambda e: e.start_ns()
    )
    cur = peak = 0
    at_mark = None
    commit_peak = 0
    for e in mem:
        if at_mark is None and e.start_ns() >= mark:
            at_mark = cur
        cur += e.nbytes()
        peak = max(peak, cur)
        if at_mark is not None:
            commit_peak = max(commit_peak, cur - at_mark)
    return peak, commit_peak


def updated_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of what one step writes: parameters with gradients, their optimizer state, float buffers."""
    n = 0
    for p in model.parameters():
        if p.grad is not None:
            n += p.numel() * p.element_size()
            n += sum(v.numel() * v.element_size() for v in opt.state.get(p, {}).values() if torch.is_tensor(v))
    n += sum(b.numel() * b.element_size() for b in model.buffers())
    return n


def _measure(variant: str, bn: type[nn.Module], x, y) -> tuple[int, int, int]:
    model, opt = build(bn)
    fn, owner = step_fns(variant, model, opt, x, y)
    try:
        for _ in range(2):
            fn()
        peaks = [peak_bytes(fn) for _ in range(3)]
        kept = (
            commit_caches(owner.index, owner.optimizer)[0].nbytes() if owner is not None else 0
        )  # live before the step begins
    finally:
        if isinstance(owner, pu.Attachment):
            owner.detach()
    return min(p for p, _ in peaks) + kept, min(c for _, c in peaks) + kept, updated_bytes(model, opt)


def run() -> list[dict]:
    bn, _ = pu_batchnorm()
    x, y = _data()
    base, base_commit, upd = _measure("eager", nn.BatchNorm2d, x, y)
    rows = []
    for name in ("pu.step", "pu.attach"):
        peak, commit, _ = _measure(name, bn, x, y)
        rows.append(
            {
                "bench": "memory: extra peak / updated bytes",
                "variant": f"{name} vs eager, whole step",
                "value": (peak - base) / upd,
                "goal": 1.0,
                "note": f"{(peak - base) / 2**20:+.2f} MiB over {base / 2**20:.1f} MiB; updated {upd / 2**20:.2f} MiB",
            }
        )
        rows.append(
            {
                "bench": "memory: extra peak / updated bytes",
                "variant": f"{name} vs eager, commit vs opt.step()",
                "value": (commit - base_commit) / upd,
                "goal": 1.0,
                "note": f"{commit / 2**20:.2f} vs {base_commit / 2**20:.2f} MiB above the level after backward",
            }
        )
    return rows
