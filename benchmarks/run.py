"""The benchmark table: ``python -m benchmarks`` or ``python benchmarks/run.py``.

Every time ratio is measured side by side in this one process (variants
interleaved, the order rotating, several paired repeats): the median and the
range over the repeats, and the ratio of the minima. Memory (c) runs each
variant in its own fresh process. The benchmarks, and what each compares:

(a) ``launch``:   50 x (Linear(16) + BatchNorm1d), batch 8, SGD: ``pu.step`` and
                  ``pu.attach`` vs plain PyTorch, eager (goal <= 1.25x);
    ``compiled``: the same, ``torch.compile`` of the model on both sides (goal
                  <= 1.10x; not in the default set: compiling takes ~20 s with
                  inductor's cache warm, minutes cold; ``--all`` or ``--only compiled``);
(b) ``step``:     ResNet-20, ``pu.step`` and ``pu.attach`` vs hand-written eager (goal <= 1.03x);
(c) ``peak``:     peak memory (RSS; on CUDA max_memory_allocated) of a 16.8 M-parameter
                  MLP with Adam, each variant in a fresh process: pu default vs plain
                  (goal <= 1.02x), and ``copy_for_rollback=True`` (its cost);
(d) ``rules``:    ``benchmarks/rules.py``: weight decay + max_norm + EMA over 300
                  tensors at default settings vs bare foreach (goals <= 1.15x tiny,
                  <= 1.10x small and large), rules alone and with an SGD step;
    ``alloc``:    extra peak memory of a ResNet-20 step, exactly, from the allocator,
                  over the bytes the step leaves pending (goal <= 1);
    ``checkpoint``: ResNet-20 with every block checkpointed, pu vs torch (no goal);
    ``compiled_commit``: ``benchmarks/compiled_commit.py``: ``torch.compile(opt.step)`` on an
                  attached optimizer with the rules of (d), vs the same math hand-written in one
                  compiled function and vs eager foreach (``--all`` or ``--only compiled_commit``:
                  compiling a 300-tensor step takes minutes on CPU);
(e) ``peers``:    ``benchmarks/peers.py``: pu against what users would pick instead, each
                  checked bitwise first: ``pu.ema`` vs timm's ``ModelEmaV3`` and
                  ``AveragedModel``, ``Adam + pu.weight_decay`` vs ``AdamW``, ``pu.constrain(max_norm)``
                  vs a norm loop, the whole recipe (apportioned) vs the best hand-written, and
                  ``pu.attach`` with nothing declared vs the bare loop (``--all`` or ``--only peers``;
                  CPU only).

``--device cuda`` runs the same benchmarks on the GPU (wall clock after a
synchronize); it stops with a message if CUDA is not available.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

if __package__ in (None, ""):  # python benchmarks/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import paramupdates  # noqa: F401  (fail early if not installed)

# table order; "compiled" runs last (compiling is slow) but is printed after (a) eager
ORDER = ("launch", "compiled", "step", "peak", "rules", "compiled_commit", "peers", "alloc", "checkpoint")
DEFAULT = ("launch", "step", "peak", "rules", "alloc", "checkpoint")
RUN_ORDER = ("launch", "step", "rules", "peers", "alloc", "checkpoint", "peak", "compiled", "compiled_commit")


def _fmt(row: dict) -> tuple[str, str, str, str, str, str]:
    goal = row.get("goal")
    better = row.get("higher_is_better", False)
    if "skip" in row:
        g = "" if goal is None else f"{'>=' if better else '<='} {goal:g} (not run)"
        return row["bench"], row["variant"], "n/a", "", g, row["skip"]
    if "ratio" in row:
        r = row["ratio"]
        med, spread = r.median, r.spread()
    else:
        med = row["value"]
        spread = f"{row['lo']:.3f}-{row['hi']:.3f}" if "lo" in row else ""
    if goal is None:
        g = ""
    else:
        ok = med >= goal if better else med <= goal
        g = f"{'>=' if better else '<='} {goal:g} {'yes' if ok else 'NO'}"
        r = row.get("ratio")
        if r is not None and (r.lo <= goal <= r.hi):
            g += " (noisy: the range spans the goal)"
    return row["bench"], row["variant"], f"{med:.3f}", spread, g, row.get("note", "")


def table(rows: list[dict]) -> str:
    head = ("benchmark", "variant", "median", "range", "goal met", "note")
    cells = [head] + [_fmt(r) for r in rows]
    lines = ["| " + " | ".join(c) + " |" for c in cells]
    lines.insert(1, "|" + "|".join("---" for _ in head) + "|")
    return "\n".join(lines)


def machine(device: torch.device) -> str:
    where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible"
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} ({where})"
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    return (
        f"{where}{load}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"Python {platform.python_version()}"
    )


def commit() -> str:
    """The repository's commit (``+`` if the tree has changes), or ``?``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "?"
    if head.returncode != 0:
        return "?"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def _compiled_placeholder() -> list[dict]:
    from .launch_bound import TITLE

    why = "not in the default set (compiling: ~20 s, minutes cold): --all or --only compiled"
    return [
        {"bench": f"{TITLE}, both torch.compile", "variant": f"{v} / torch", "goal": 1.10, "skip": why}
        for v in ("pu.step", "pu.attach")
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[0],
        epilog="benchmarks: " + ", ".join(ORDER),
    )
    ap.add_argument("--repeats", type=int, default=15, help="paired repeats of the time benchmarks (default 15)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier on a shared machine)"
    )
    ap.add_argument("--wall", action="store_true", help="time wall clock instead of process CPU time (CPU)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: the same benchmarks on that device")
    ap.add_argument("--only", choices=ORDER, action="append", help="run only these (repeatable)")
    ap.add_argument("--all", action="store_true", help="the default set plus the compiled benchmarks and the peers (e)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of 'compiled' (default inductor)")
    ap.add_argument("--quick", action="store_true", help="tiny settings: checks that everything runs, not numbers")
    args = ap.parse_args(argv)

    from . import checkpointed, compiled_commit, launch_bound, memory, peak_memory, peers, rules, step_overhead, timing

    device = timing.select_device(args.device)
    torch.set_num_threads(args.threads)
    timing.use_device(device)
    timing.use_wall_clock(args.wall)

    only = set(args.only or (ORDER if args.all else DEFAULT))
    q = args.quick
    reps = 2 if q else args.repeats
    jobs = {
        "launch": lambda: launch_bound.run(device, repeats=reps, steps=1 if q else 16),
        "compiled": lambda: launch_bound.run(
            device, repeats=reps, steps=1 if q else 16, compiled=True, backend=args.backend
        ),
        "step": lambda: step_overhead.run(device, repeats=reps, steps=1 if q else 2),
        "peak": lambda: peak_memory.run(
            str(device),
            repeats=1,
            threads=args.threads,
            steps=1 if q else peak_memory.STEPS,
            jobs=3 if q else 2,
            small=q,
        ),
        "rules": lambda: rules.rows(
            device, rounds=reps, iters=1 if q else 10, sizes=("tiny",) if q else ("tiny", "small", "large")
        ),
        "compiled_commit": lambda: compiled_commit.rows(
            device, rounds=reps, iters=1 if q else 10, size="tiny" if q else "small", backend=args.backend
        ),
        "peers": lambda: peers.rows(device, repeats=reps, steps=1 if q else 16),
        "alloc": lambda: memory.run(device, steps=1 if q else memory.STEPS),
        "checkpoint": lambda: checkpointed.run(device, repeats=1 if q else max(3, reps // 3), steps=1 if q else 4),
    }
    print(f"paramupdates benchmarks at commit {commit()}: {machine(device)}", flush=True)
    t0 = time.perf_counter()
    got: dict[str, list[dict]] = {}
    took: dict[str, float] = {}
    for name in RUN_ORDER:
        if name in only:
            t = time.perf_counter()
            got[name] = jobs[name]()
            took[name] = time.perf_counter() - t
            print(f"  {name}: {took[name]:.0f} s", flush=True)
    if "launch" in only and "compiled" not in only:
        got["compiled"] = _compiled_placeholder()
    rows = [r for name in ORDER for r in got.get(name, [])]
    print(
        f"\nratios paramupdates / reference on {device}, {timing.clock_name()}: median and range over "
        f"{reps} paired repeats (memory: own processes / allocator peaks){' [--quick: not numbers]' if q else ''}\n"
    )
    print(table(rows))
    print(f"\n({time.perf_counter() - t0:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()) + ")")
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        from benchmarks.run import main as _main

        raise SystemExit(_main())
    raise SystemExit(main())
