"""The benchmark table: ``python -m benchmarks`` or ``python benchmarks/run.py``.

Every ratio is measured side by side in this one process (variants
interleaved, several repeats): the median and the range over repeats.

1. step overhead: ResNet-20 step through ``pu.step`` / ``pu.attach`` vs hand-written eager;
2. rules: ``benchmarks/rules.py`` (weight decay + max_norm + EMA vs a loop and raw foreach);
3. memory: peak extra CPU memory of a step vs the bytes the step updates;
4. checkpointed model: pu batch norm under ``pu.checkpoint`` vs torch's under torch checkpoint.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time

if __package__ in (None, ""):  # python benchmarks/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import paramupdates  # noqa: F401  (fail early if not installed)


def _rules_rows(repeats: int) -> list[dict]:
    """Rows from ``benchmarks/rules.py`` (the rules issue's benchmark), or a placeholder row.

    Uses its ``rows()`` if it has one; else its ``bench(real_opt, rounds, iters)``
    (medians per variant: pu with atomic=True/False, a per-parameter loop, bare
    foreach); else runs its ``main()`` (which prints its own table).
    """
    title = "rules: wd + max_norm + EMA"
    try:
        mod = importlib.import_module("benchmarks.rules")
    except ModuleNotFoundError as exc:
        if exc.name != "benchmarks.rules":
            raise
        return [{"bench": title, "variant": "-", "skip": "benchmarks/rules.py is not in this build (issue 3)"}]
    if hasattr(mod, "rows"):
        return list(mod.rows())
    if hasattr(mod, "bench"):
        from paramupdates.rules import base

        out = []
        size = getattr(mod, "SIZE", "")
        for real_opt, part in ((False, "rules only"), (True, "with SGD step")):
            med = mod.bench(real_opt, max(3, repeats), 5)
            base._RULES.clear()  # the rules declared on the benchmark's models
            pu_t = med["pu (atomic=True)"]
            out.append(
                {
                    "bench": f"{title} ({size}, {part})",
                    "variant": "loop / pu",
                    "value": med["loop"] / pu_t,
                    "goal": 3.0,
                    "higher_is_better": True,
                    "note": f"{pu_t * 1e3:.2f} vs {med['loop'] * 1e3:.2f} ms (wall clock; medians only)",
                }
            )
            out.append(
                {
                    "bench": f"{title} ({size}, {part})",
                    "variant": "pu / bare foreach",
                    "value": pu_t / med["foreach"],
                    "goal": 1.10,
                    "note": f"{pu_t * 1e3:.2f} vs {med['foreach'] * 1e3:.2f} ms",
                }
            )
        return out
    argv = sys.argv
    sys.argv = [mod.__file__]
    try:
        mod.main()
    finally:
        sys.argv = argv
    return [{"bench": title, "variant": "-", "skip": "see the table benchmarks/rules.py printed above"}]


def _fmt(row: dict) -> tuple[str, str, str, str, str, str]:
    if "skip" in row:
        return row["bench"], row["variant"], "n/a", "", "", row["skip"]
    goal = row.get("goal")
    if "ratio" in row:
        r = row["ratio"]
        med, spread = r.median, r.spread()
        better = row.get("higher_is_better", False)
    else:
        med = row["value"]
        lo, hi = row.get("lo", med), row.get("hi", med)
        spread = f"{lo:.3f}-{hi:.3f}" if "lo" in row else ""
        better = row.get("higher_is_better", False)
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


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--repeats", type=int, default=15, help="timed repeats of the step benchmark (default 15; fewer for the others)"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier on a shared machine)"
    )
    ap.add_argument("--wall", action="store_true", help="time wall clock instead of process CPU time")
    ap.add_argument("--only", choices=["step", "rules", "memory", "checkpoint"], action="append")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from . import checkpointed, memory, step_overhead, timing

    timing.use_wall_clock(args.wall)

    only = set(args.only or ["step", "rules", "memory", "checkpoint"])
    rows: list[dict] = []
    t0 = time.perf_counter()
    if "step" in only:
        rows += step_overhead.run(repeats=args.repeats)
    if "rules" in only:
        rows += _rules_rows(max(3, args.repeats // 2))
    if "memory" in only:
        rows += memory.run()
    if "checkpoint" in only:
        rows += checkpointed.run(repeats=max(3, args.repeats // 3))
    print(f"\nparamupdates benchmarks: {machine()}")
    clock = "wall-clock" if args.wall else "CPU"
    print(
        f"ratios of {clock} time: paramupdates / reference, median and range over paired repeats ({args.repeats} for the step benchmark)\n"
    )
    print(table(rows))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        from benchmarks.run import main as _main

        raise SystemExit(_main())
    raise SystemExit(main())
