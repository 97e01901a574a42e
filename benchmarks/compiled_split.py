"""Where the compiled launch-bound step's extra time goes: forward, backward, commit, and dynamo's guards.

    python benchmarks/compiled_split.py [--steps 300] [--backend inductor]

The model of benchmark (a) (``benchmarks/launch_bound.py``: 50 x (Linear(16) +
BatchNorm1d), batch 8, SGD), ``torch.compile``d on both sides: plain PyTorch
(``torch.nn.BatchNorm1d``, ``opt.step()``) and ``pu.nn.BatchNorm1d`` in a
``pu.Stepper``. The two step functions run interleaved, ``--steps`` times each;
for each part of the step the minimum and the median of the process CPU time
(one thread) are printed, and pu's extra over plain:

* forward: the compiled call (dynamo's guards, the graph, AOTAutograd's runtime
  wrappers, the replay of the recording's side effects); for pu it includes
  opening the step (``Stepper.__enter__``);
* backward: ``loss.backward()``;
* step / commit: ``opt.step()``, or the commit (``Stepper.__exit__``), which
  calls ``opt.step()`` among its phases.

Then the guards alone: the cache entry's ``guard_manager.check`` on the frame's
locals, timed for each variant (private dynamo API: prints ``n/a`` if this
PyTorch has none). The recording reads the journal's and the index's state
while dynamo traces, and dynamo guards every attribute it read.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # python benchmarks/compiled_split.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import paramupdates as pu
from benchmarks import timing
from benchmarks.launch_bound import build, data
from benchmarks.step_overhead import Parts, eager_step, pu_step

PARTS = ("forward", "backward", "step / commit")


def _variants(backend: str) -> dict:
    """``{name: (step function, its parts, the model, its input, where its guards hold)}``."""
    cpu = torch.device("cpu")
    x, y = data(cpu)
    m_t, o_t = build(nn.BatchNorm1d, cpu)
    m_p, o_p = build(pu.nn.BatchNorm1d, cpu)
    c_t = torch.compile(m_t, backend=backend, fullgraph=True)
    c_p = torch.compile(m_p, backend=backend, fullgraph=True)
    p_t, p_p = Parts(), Parts()
    plain = eager_step(c_t, o_t, x, y, p_t, F.mse_loss)
    stepped = pu_step(m_p, o_p, x, y, p_p, F.mse_loss, forward=c_p)
    inside = pu.Stepper(m_p, o_p)  # (the guards of pu's graph hold inside a step)
    return {
        "torch": (plain, p_t.samples, m_t, x, contextlib.nullcontext()),
        "pu.step": (stepped, p_p.samples, m_p, x, inside),
    }


def guard_check_us(model: nn.Module, x: torch.Tensor, reps: int = 2000) -> float | None:
    """Microseconds per ``guard_manager.check`` of ``model``'s compiled forward (None: no such API)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.external_utils import wrap_inline

        entries = _debug_get_cache_entry_list(wrap_inline(lambda: None).__code__)
        frame = {"fn": model, "args": (x,), "kwargs": {}}
        mine = [e for e in entries if e.guard_manager.check(frame)]
        if not mine:
            return None
        check = mine[0].guard_manager.check
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                check(frame)
            best = min(best, (time.perf_counter() - t0) / reps)
        return best * 1e6
    except Exception:  # noqa: BLE001 - private API: any change means "not available here"
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    timing.use_wall_clock(False)  # process CPU time
    variants = _variants(args.backend)
    for fn, samples, *_ in variants.values():  # compile, then forget the first steps
        for _ in range(3):
            fn()
        samples.clear()
    for _ in range(args.steps):
        for fn, *_ in variants.values():
            fn()
    print(
        f"compiled launch-bound step ({args.backend}), torch {torch.__version__}, {args.steps} steps each, "
        "interleaved, CPU time of this process, us"
    )
    print(f"{'part':<16}{'torch min':>11}{'pu min':>9}{'extra':>8}{'torch med':>11}{'pu med':>9}{'extra':>8}")
    cols = {name: list(zip(*v[1])) for name, v in variants.items()}
    for i, part in enumerate(PARTS):
        a, b = cols["torch"][i], cols["pu.step"][i]
        mins = (min(a) * 1e6, min(b) * 1e6)
        meds = (statistics.median(a) * 1e6, statistics.median(b) * 1e6)
        print(
            f"{part:<16}{mins[0]:11.0f}{mins[1]:9.0f}{mins[1] - mins[0]:+8.0f}"
            f"{meds[0]:11.0f}{meds[1]:9.0f}{meds[1] - meds[0]:+8.0f}"
        )
    totals = {name: [sum(r) for r in v[1]] for name, v in variants.items()}
    t, p = min(totals["torch"]), min(totals["pu.step"])
    print(f"{'whole step':<16}{t * 1e6:11.0f}{p * 1e6:9.0f}{(p - t) * 1e6:+8.0f}   ratio of minima {p / t:.3f}")
    for name, (_f, _s, model, x, inside) in variants.items():
        with inside:
            us = guard_check_us(model, x)
        print(f"guard check, {name:<8}: " + ("n/a (no guard_manager API here)" if us is None else f"{us:.1f} us"))


if __name__ == "__main__":
    main()
