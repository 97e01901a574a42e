"""Benchmark (c): peak memory of a 16.8 M-parameter MLP trained with Adam, each variant in a fresh process.

What is measured: the peak memory of a process that builds 16 x (``Linear(1024,
1024)`` + ``BatchNorm1d(1024)``) (16.8 M parameters, 64 MiB in float32), and
trains it for a few steps (batch 64, mean-squared error, ``torch.optim.Adam``,
whose state is two more copies of the parameters). On CPU the peak resident
set size of the process (on Linux ``VmHWM`` from ``/proc/self/status``, the
peak of the child's own memory map: ``getrusage``'s ``ru_maxrss`` is carried
over ``execve`` from the parent that started it; elsewhere ``ru_maxrss``); on
CUDA ``torch.cuda.max_memory_allocated``. Each variant runs in its own fresh
Python process (``python -m benchmarks.peak_memory --child VARIANT``), so that
nothing one variant allocated counts for another; the processes of the
variants are started in turn, repeat after repeat, rotating the order:

* ``torch`` (the reference): ``torch.nn.BatchNorm1d`` and the hand-written loop
  ``opt.zero_grad(); loss.backward(); opt.step()``;
* ``pu.attach``: ``pu.nn.BatchNorm1d`` and the same loop under
  ``pu.attach(model, opt)`` at default settings;
* ``pu.step`` (only with ``--variants all``: the same commit as ``pu.attach``):
  ``pu.nn.BatchNorm1d`` in a ``pu.Stepper`` at default settings;
* ``pu.attach(copy_for_rollback=True)``: the opt-in that copies the parameters
  and the optimizer state before the optimizer's step so that an exception
  there can be rolled back bitwise. Printed so that its cost (about one copy of
  parameters and Adam state, ~190 MiB here) is visible; no goal.

The ratio is pu's peak over torch's peak, whole process (the interpreter and
torch's libraries included, as a user's ``top`` shows it); the note gives the
difference in MiB and the peak above what the process held before building
the model. On Linux the processes run with ``MALLOC_MMAP_THRESHOLD_=131072``
(unless ``--glibc-default``): glibc then serves every block of 128 KiB or more
(each weight, gradient, Adam moment and activation here) from its own mapping
and returns it at free. With glibc's default, a threshold that adapts to the
sizes freed so far, the same program's peak RSS varies by about 2 % from run to
run (heap fragmentation), as much as the goal; with the fixed threshold, by
0.1 %, so one process per variant (``repeats=1``, the default) is enough.
Two processes run at a time (``jobs``): a process's peak RSS is its own.
Goal (performance contract: a default step holds the pending values
only, no copy of parameters or optimizer state): <= 1.02x.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

LAYERS, WIDTH, BATCH, STEPS = 16, 1024, 64, 3
VARIANTS = ("torch", "pu.attach", "pu.step", "pu.attach(copy_for_rollback=True)")
DEFAULT = ("torch", "pu.attach", "pu.attach(copy_for_rollback=True)")
GOALS = {"pu.attach": 1.02, "pu.step": 1.02}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_bytes() -> int:
    """Peak resident set size of this process so far.

    Linux: ``VmHWM`` of ``/proc/self/status``, the high-water mark of this process's own memory
    map. Not ``getrusage().ru_maxrss``: Linux carries that over ``execve`` from the process that
    forked, so a child started by a parent holding 500 MiB reports at least 500 MiB. Elsewhere
    ``ru_maxrss`` (KiB, bytes on macOS).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def child(variant: str, device_name: str, threads: int, steps: int, layers: int = LAYERS, width: int = WIDTH) -> dict:
    """Train the MLP ``steps`` steps as ``variant``; its peak memory and what it ended with."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import paramupdates as pu

    torch.set_num_threads(threads)
    device = torch.device(device_name)
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, width, generator=g).to(device), torch.randn(BATCH, width, generator=g).to(device)

    def peak() -> int:
        return torch.cuda.max_memory_allocated(device) if cuda else _rss_bytes()

    before = torch.cuda.memory_allocated(device) if cuda else _rss_bytes()
    bn = nn.BatchNorm1d if variant == "torch" else pu.nn.BatchNorm1d
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), bn(width)]
    model = nn.Sequential(*mods).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    stepper = pu.Stepper(model, opt) if variant == "pu.step" else None
    if variant.startswith("pu.attach"):
        pu.attach(model, opt, copy_for_rollback=variant.endswith("(copy_for_rollback=True)"))

    t0 = time.perf_counter()
    for _ in range(steps):
        if stepper is not None:
            with stepper:
                opt.zero_grad(set_to_none=True)
                F.mse_loss(model(x), y).backward()
        else:
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
    if cuda:
        torch.cuda.synchronize(device)
    return {
        "variant": variant,
        "peak": peak(),
        "before": before,
        "params": sum(p.numel() for p in model.parameters()),
        "num_batches_tracked": int(model[1].num_batches_tracked),
        "train_s": time.perf_counter() - t0,
    }


def measure(
    variant: str, device: str, threads: int, steps: int, glibc_default: bool = False, small: bool = False
) -> dict:
    """Run :func:`child` for ``variant`` in a fresh interpreter; its result (``small``: a tiny MLP, a smoke test)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if not glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    cmd = [sys.executable, "-m", "benchmarks.peak_memory", "--child", variant, "--device", device]
    cmd += ["--threads", str(threads), "--steps", str(steps)] + (["--layers", "2", "--width", "64"] if small else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["num_batches_tracked"] != steps:
        raise RuntimeError(f"{variant}: num_batches_tracked {out['num_batches_tracked']} after {steps} steps")
    return out


def run(
    device: str = "cpu",
    *,
    repeats: int = 1,
    threads: int = 1,
    steps: int = STEPS,
    jobs: int = 2,
    glibc_default: bool = False,
    variants: tuple[str, ...] = DEFAULT,
    small: bool = False,
) -> list[dict]:
    """Rows of the table: each pu variant's peak over torch's, median and range over paired repeats."""
    assert variants[0] == "torch", "the reference comes first"
    n = len(variants)
    order = [v for r in range(repeats) for v in variants[r % n :] + variants[: r % n]]
    if device.startswith("cuda"):
        jobs = 1  # one process on the GPU at a time
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = list(pool.map(lambda v: measure(v, device, threads, steps, glibc_default, small), order))
    res: dict[str, list[dict]] = {v: [] for v in variants}
    for out in done:  # in start order, so repeat k of each variant pairs with repeat k of torch
        res[out["variant"]].append(out)
    base = res["torch"]
    what = "max_memory_allocated" if device.startswith("cuda") else "peak RSS"
    mib = 2**20
    rows = []
    for v in variants[1:]:
        rs = [a["peak"] / b["peak"] for a, b in zip(res[v], base)]
        peak, ref = statistics.median(a["peak"] for a in res[v]), statistics.median(b["peak"] for b in base)
        above = statistics.median(a["peak"] - a["before"] for a in res[v])
        ref_above = statistics.median(b["peak"] - b["before"] for b in base)
        rows.append(
            {
                "bench": f"(c) peak memory, {base[0]['params'] / 1e6:.3g} M-param MLP + Adam, {what} (own process)",
                "variant": f"{v} / torch",
                "value": statistics.median(rs),
                "lo": min(rs),
                "hi": max(rs),
                "goal": GOALS.get(v),
                "note": f"{peak / mib:.0f} vs {ref / mib:.0f} MiB ({(peak - ref) / mib:+.1f} MiB); "
                f"above the process before the model: {above / mib:.0f} vs {ref_above / mib:.0f} MiB; "
                f"steps: {steps}, processes per variant: {repeats}",
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peak_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", choices=VARIANTS, help="(internal) run one variant in this process, print JSON")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--width", type=int, default=WIDTH)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variants", choices=["default", "all"], default="default", help="all: pu.step too")
    ap.add_argument("--jobs", type=int, default=2, help="processes at a time (CPU; 1 on CUDA)")
    ap.add_argument("--glibc-default", action="store_true", help="keep glibc's adaptive mmap threshold")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.device, a.threads, a.steps, a.layers, a.width)))
        return 0
    from .run import table
    from .timing import select_device

    select_device(a.device)
    rows = run(
        a.device,
        repeats=a.repeats,
        threads=a.threads,
        steps=a.steps,
        jobs=a.jobs,
        glibc_default=a.glibc_default,
        variants=VARIANTS if a.variants == "all" else DEFAULT,
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
