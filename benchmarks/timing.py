"""Side-by-side timing: variants interleaved in one process, several repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

CLOCK: Callable[[], float] = time.process_time


def use_wall_clock(wall: bool) -> None:
    """Time with ``time.perf_counter`` (wall) instead of ``time.process_time`` (CPU time of this process)."""
    global CLOCK
    CLOCK = time.perf_counter if wall else time.process_time


def interleaved(
    variants: dict[str, Callable[[], None]], *, repeats: int, steps: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Seconds per call of each variant, one sample per repeat.

    The clock is the process's CPU time by default: on a machine shared with
    other jobs, wall time mostly measures the wait for a core (run with one
    intra-op thread, so CPU time is the step's own work).

    Every repeat times ``steps`` calls of each variant in turn, rotating the
    order from repeat to repeat, so that drift of a shared machine hits every
    variant alike. Ratios are taken repeat by repeat (see :func:`ratios`).
    """
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            variants[name]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = variants[name]
            t0 = CLOCK()
            for _ in range(steps):
                fn()
            out[name].append((CLOCK() - t0) / steps)
    return out


@dataclass
class Ratio:
    median: float
    lo: float
    hi: float
    base_s: float  # median seconds per call of the baseline
    s: float  # median seconds per call of the variant
    of_min: float  # min(variant) / min(baseline): the best case of each, least touched by load

    def spread(self) -> str:
        return f"{self.lo:.3f}-{self.hi:.3f}"


def ratios(times: dict[str, list[float]], variant: str, baseline: str) -> Ratio:
    """Median and range of ``variant / baseline`` over repeats (paired by repeat)."""
    rs = [a / b for a, b in zip(times[variant], times[baseline])]
    return Ratio(
        statistics.median(rs),
        min(rs),
        max(rs),
        statistics.median(times[baseline]),
        statistics.median(times[variant]),
        min(times[variant]) / min(times[baseline]),
    )
