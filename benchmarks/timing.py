"""Side-by-side timing: variants interleaved in one process, several paired repeats.

On CPU the clock is the process's CPU time by default (on a machine shared with
other jobs, wall time mostly measures the wait for a core; run with one intra-op
thread, so that CPU time is the step's own work); ``use_wall_clock(True)``
switches to ``time.perf_counter``. On an accelerator (``use_device``) the clock
is always the wall clock, read after the device has finished its queued work
(``torch.cuda.synchronize()``): host CPU time would miss the kernels.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CLOCK: Callable[[], float] = time.process_time
_SYNC: Callable[[], None] | None = None  # the device's synchronize, None on CPU
_WALL = False


def use_wall_clock(wall: bool) -> None:
    """Time with ``time.perf_counter`` (wall) instead of ``time.process_time`` (CPU time of this process)."""
    global CLOCK, _WALL
    _WALL = wall
    CLOCK = time.perf_counter if (wall or _SYNC is not None) else time.process_time


def use_device(device: torch.device) -> None:
    """Time work on ``device``: on an accelerator, synchronize before every clock reading, wall clock."""
    global _SYNC
    _SYNC = None if device.type == "cpu" else sync_of(device)
    use_wall_clock(_WALL)


def sync_of(device: torch.device) -> Callable[[], None]:
    """A function that waits for the work queued on ``device`` (``torch.cuda.synchronize(device)``)."""
    if device.type == "cpu":
        return lambda: None
    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if sync is None:
        raise ValueError(f"no torch.{device.type}.synchronize: cannot time work on {device}")
    return lambda: sync(device)


def clock_name() -> str:
    """What :func:`now` measures, for the table's header."""
    if _SYNC is not None:
        return "wall-clock time (synchronized with the device before each reading)"
    return "wall-clock time" if CLOCK is time.perf_counter else "CPU time of this process"


def now() -> float:
    """The benchmark clock, after the device has finished its queued work."""
    if _SYNC is not None:
        _SYNC()
    return CLOCK()


def select_device(name: str) -> torch.device:
    """``torch.device(name)`` (CPU or CUDA), or a ``SystemExit`` that says why it cannot be used here."""
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise SystemExit(f"--device {name}: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: the benchmarks run on cpu or cuda.")
    if dev.type == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda
        why = (
            f"this torch ({torch.__version__}) is built without CUDA"
            if built is None
            else f"this torch ({torch.__version__}, CUDA {built}) sees no GPU"
        )
        raise SystemExit(f"--device {name}: CUDA is not available ({why}). Run without --device for the CPU.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SystemExit(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible.")
    return dev


def interleaved(
    variants: dict[str, Callable[[], None]], *, repeats: int, steps: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Seconds per call of each variant, one sample per repeat.

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
            t0 = now()
            for _ in range(steps):
                fn()
            out[name].append((now() - t0) / steps)
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


def ms(s: float) -> str:
    """Seconds as milliseconds, 3 significant digits at least."""
    return f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.2f}" if s < 0.1 else f"{s * 1e3:.1f}"
