"""Extra peak memory of a training step, exactly, from the allocator (ResNet-20).

What is measured: the peak memory allocated while a ResNet-20 is built and
trained for its first steps (``step_overhead``'s model, SGD with momentum,
batch 32), for the hand-written eager step (``torch.nn.BatchNorm2d``, the
reference) and for ``pu.nn.BatchNorm2d`` under ``pu.step`` and ``pu.attach``
at default settings, and under ``pu.step(copy_for_rollback=True)``. Counting
from before the model exists counts what a commit keeps between steps (the
optimizer's momentum on both sides; pu's rollback copies, which on CPU live in
buffers kept from one commit to the next).

On CPU the peak is the running sum of the allocations and frees the PyTorch
profiler reports (``profile_memory=True``: one ``[memory]`` event per
allocation or free, with its size): exact to the byte, whatever the OS or
malloc do (benchmark (c), ``peak_memory``, measures the whole process's RSS).
On CUDA it is ``torch.cuda.max_memory_allocated``.

The default rows divide pu's extra peak over eager by the bytes of the values
the step leaves pending (the running statistics the batch norms assign);
performance contract: a default step adds the pending values only, no copy of
parameters or optimizer state, so the goal is <= 1 (pending values that
outlive their commit until the cyclic garbage collector frees them count once
per step they survive). The ``copy_for_rollback``
row divides by the bytes the step updates (parameters with gradients, their
momentum, buffers): about 1, the one copy that option states it costs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import paramupdates as pu

from .models import pu_batchnorm
from .step_overhead import CPU, _data, build

STEPS = 3
TITLE = "memory: extra peak of a step (ResNet-20, allocator)"


def step_fn(variant: str, model: nn.Module, opt: torch.optim.Optimizer, x, y) -> tuple[Callable[[], None], object]:
    """One training step as ``variant`` does it, and its stepper or attachment (to detach)."""
    if variant.startswith("pu.step"):
        stepper = pu.Stepper(model, opt, copy_for_rollback="copy_for_rollback" in variant)

        def run() -> None:
            with stepper:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()

        return run, stepper
    att = pu.attach(model, opt) if variant == "pu.attach" else None

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return run, att


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2: the profiler's C++ side prints a line at every start and stop."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak of the memory allocated on ``device`` while ``fn`` runs, above the level when it began.

    On CPU ``fn`` must free only what it allocated: the profiler reports the free of a block
    allocated during an earlier profile with its size, so garbage of an earlier measurement
    collected while ``fn`` runs would count against it (hence ``gc.collect()`` first; the cyclic
    collector stays on while ``fn`` runs, as in a user's process).
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    mem = sorted(
        (e for e in events if e.name() == "[memory]" and e.device_type().name == "CPU"), key=lambda e: e.start_ns()
    )
    cur = peak = 0
    for e in mem:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _measure(variant: str, bn: type[nn.Module], device: torch.device, steps: int) -> tuple[int, int, int]:
    """``(peak, updated bytes, pending bytes)`` of building the model and its first ``steps`` steps."""
    made: list = []

    def build_and_train() -> None:
        x, y = _data(device=device)
        model, opt = build(bn, device)
        fn, owner = step_fn(variant, model, opt, x, y)
        made[:] = [model, opt, owner]
        for _ in range(steps):
            fn()

    try:
        peak = peak_bytes(build_and_train, device)
    finally:
        if made and isinstance(made[2], pu.Attachment):
            made[2].detach()
    model, opt, _ = made
    params = [p for p in model.parameters() if p.grad is not None]
    state = [v for p in params for v in opt.state.get(p, {}).values() if torch.is_tensor(v)]
    buffers = list(model.buffers())
    return peak, _nbytes(params) + _nbytes(state) + _nbytes(buffers), _nbytes(buffers)


def run(device: torch.device = CPU, steps: int = STEPS) -> list[dict]:
    """Rows of the table: pu's extra peak over the eager step's."""
    bn, _ = pu_batchnorm()
    base, upd, pending = _measure("eager", nn.BatchNorm2d, device, steps)
    rows = []
    kib = 2**10
    for name in ("pu.step", "pu.attach", "pu.step(copy_for_rollback=True)"):
        peak, _, _ = _measure(name, bn, device, steps)
        extra = peak - base
        copy = "copy_for_rollback" in name
        rows.append(
            {
                "bench": TITLE,
                "variant": f"{name}: extra / {'updated' if copy else 'pending'} bytes",
                "value": extra / (upd if copy else pending),
                "goal": None if copy else 1.0,
                "note": f"{extra / kib:+.1f} KiB over eager's {base / 2**20:.1f} MiB (model built, {steps} steps); "
                f"the step updates {upd / 2**20:.2f} MiB and leaves {pending / kib:.1f} KiB pending",
            }
        )
    return rows
