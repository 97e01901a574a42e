"""The traced path counts of issue 40: Python calls into paramupdates on a steady-state step.

    python benchmarks/trace_calls.py [--top 8]      (or python -m benchmarks.trace_calls)

What is counted. Each path runs ``WARMUP`` times untraced (plans built, caches warm), then once
under ``sys.setprofile``. A *call* is a ``"call"`` event (a Python frame entered; a generator
resumed counts too) whose code's file lies in the package's directory (``src/paramupdates``);
C functions, torch's Python and the benchmark's own code are not counted. *files*: the distinct
files among those calls; *transitions*: consecutive calls, in event order, whose files differ
(a call into another file of the package and the call after a return to the caller's file both
count). The paths:

(i)   ``assign``: ``with pu.step(model, opt): pu.assign(model.weight, v, phase="after_grad")`` on a
      ``Linear(4, 4)`` with SGD, gradients set: open (``pu.step(...)`` and ``__enter__``), issue (the
      ``pu.assign`` call), commit (``__exit__``: ``optimizer.step()`` and the write into the weight's
      storage), counted together and per part;
(ii)  ``batch norm forward``: ``bn(x)`` of a ``pu.nn.BatchNorm1d(4)`` in training mode, batch 8,
      inside an open ``pu.step`` over it; and that step's commit (``__exit__``: three statistics);
(iii) ``weight-decay commit``: ``__exit__`` of a ``pu.step`` over a ``Linear(4, 4)`` with
      ``pu.weight_decay(model, 0.1)`` declared, SGD (pu's own foreach pass), gradients set.

The issue's figures (a review's trace, at 6275491) and goals: (i) 159 calls, 23 files, 98
transitions, goal <= 60 calls through <= 10 files; (ii) forward goal <= 10 calls (the review counted
the batch norm's commit: 66 calls, 11 files); (iii) 116 calls, 14 files, goal <= 50 calls.

It also lists the functions over 60 lines in ``src/paramupdates`` (``ast``: ``end_lineno - lineno + 1``
of each ``def``, decorators not counted; a nested ``def`` is counted on its own and inside its
parent), which the lean core must not add to (issue 40: "today 8; no more").
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # python benchmarks/trace_calls.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import paramupdates as pu

PKG = os.path.dirname(os.path.abspath(pu.__file__))
WARMUP = 3
LONG = 60  # lines: the house rule's limit for a function
Event = tuple[str, str]  # (file relative to the package, the function's qualified name)


class Tracer:
    """A ``sys.setprofile`` function that records every Python call into the package, in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(PKG + os.sep):
                self.events.append((os.path.relpath(code.co_filename, PKG), code.co_qualname))


def traced(fn: Callable[[], Any]) -> list[Event]:
    """The package's calls made by ``fn()`` (this thread only)."""
    tracer = Tracer()
    sys.setprofile(tracer)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return tracer.events


@dataclass
class Path:
    """One traced path: its parts ``(name, events)`` in order, and the issue's figure and goal."""

    name: str
    parts: list[tuple[str, list[Event]]]
    before: str
    goal: tuple[int | None, int | None]  # (calls, files): at most

    @property
    def events(self) -> list[Event]:
        return [e for _, evs in self.parts for e in evs]


def calls(events: list[Event]) -> int:
    return len(events)


def files(events: list[Event]) -> int:
    return len({f for f, _ in events})


def transitions(events: list[Event]) -> int:
    """Consecutive calls whose files differ."""
    return sum(a[0] != b[0] for a, b in zip(events, events[1:]))


# --- the paths ------------------------------------------------------------------------------------------
def _linear() -> tuple[nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step_parts(
    model: nn.Module, opt: Any, inside: Callable[[], Any], label: str = "inside"
) -> list[tuple[str, list[Event]]]:
    """Run ``with pu.step(model, opt): inside()`` ``WARMUP`` times untraced, then once traced in three
    parts: open (``pu.step(...)`` and ``__enter__``), ``label`` (``inside()``), commit (``__exit__``)."""
    for _ in range(WARMUP):
        with pu.step(model, opt):
            inside()
    box: dict[str, Any] = {}

    def open_() -> None:
        box["step"] = pu.step(model, opt)
        box["step"].__enter__()

    opened = traced(open_)
    body = traced(inside)
    committed = traced(lambda: box["step"].__exit__(None, None, None))
    return [("open", opened), (label, body), ("commit", committed)]


def assign_path() -> Path:
    """(i) one ``pu.assign(p, v, phase="after_grad")`` inside ``pu.step``: open + issue + commit."""
    model, opt = _linear()
    v = torch.ones(4, 4)
    parts = _step_parts(model, opt, lambda: pu.assign(model.weight, v, phase="after_grad"), "issue")
    if not torch.equal(model.weight, v):
        raise RuntimeError("(i): the assigned value was not committed: the traced path is not the one described")
    return Path("(i) pu.assign in pu.step: open + issue + commit", parts, "159 / 23 / 98", (60, 10))


def batchnorm_paths() -> list[Path]:
    """(ii) a ``pu.nn.BatchNorm1d`` forward inside a step, and that step's commit."""
    torch.manual_seed(0)
    bn = pu.nn.BatchNorm1d(4)
    opt = torch.optim.SGD(bn.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    before = bn.num_batches_tracked.item()
    parts = _step_parts(bn, opt, lambda: bn(x))
    if bn.num_batches_tracked.item() != before + WARMUP + 1:
        raise RuntimeError("(ii): the statistics were not committed: the traced path is not the one described")
    return [
        Path("(ii) batch norm forward in pu.step", [parts[1]], "-", (10, None)),
        Path("(ii) that step's commit (3 statistics)", [parts[2]], "66 / 11 / -", (None, None)),
    ]


def weight_decay_path() -> Path:
    """(iii) a steady-state commit with ``pu.weight_decay`` (SGD: pu's own foreach pass)."""
    model, opt = _linear()
    pu.weight_decay(model, 0.1)
    try:
        before = model.weight.detach().clone()
        parts = _step_parts(model, opt, lambda: None)
    finally:
        pu.rules.base.clear()
    if torch.equal(model.weight, before):
        raise RuntimeError("(iii): the weight was not decayed: the traced path is not the one described")
    return Path("(iii) weight-decay commit", [parts[2]], "116 / 14 / -", (50, None))


def paths() -> list[Path]:
    """Every traced path, in the issue's order."""
    return [assign_path(), *batchnorm_paths(), weight_decay_path()]


# --- functions over 60 lines ------------------------------------------------------------------------------
def long_functions(root: str = PKG, limit: int = LONG) -> list[tuple[str, int, str, int]]:
    """``(file, line, qualified name, lines)`` of every function in ``root`` longer than ``limit`` lines."""
    out = []
    for d, _, names in sorted(os.walk(root)):
        for n in sorted(names):
            if n.endswith(".py"):
                path = os.path.join(d, n)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                out += [(os.path.relpath(path, root), *rest) for rest in _long_defs(tree, limit)]
    return out


def _long_defs(tree: ast.AST, limit: int, prefix: str = "") -> list[tuple[int, str, int]]:
    """``(line, qualified name, lines)`` of the defs under ``tree`` longer than ``limit`` lines."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if not isinstance(node, ast.ClassDef) and size > limit:
                out.append((node.lineno, name, size))
            out += _long_defs(node, limit, f"{name}.")
        else:
            out += _long_defs(node, limit, prefix)
    return out


# --- the report -------------------------------------------------------------------------------------------
def _goal(p: Path) -> str:
    c, f = p.goal
    if c is None:
        return ""
    ok = calls(p.events) <= c and (f is None or files(p.events) <= f)
    return f"<= {c} calls" + (f" through <= {f} files" if f else "") + (" yes" if ok else " NO")


def table(ps: list[Path]) -> str:
    """The counts of every path (and of each part of a path with several) as a markdown table."""
    lines = ["| path | calls | files | transitions | issue 40 (calls / files / transitions) | goal |", "|---" * 6 + "|"]
    for p in ps:
        ev = p.events
        lines.append(f"| {p.name} | {calls(ev)} | {files(ev)} | {transitions(ev)} | {p.before} | {_goal(p)} |")
        if len(p.parts) > 1:
            for part, evs in p.parts:
                lines.append(f"| &nbsp;&nbsp;{part} | {calls(evs)} | {files(evs)} | {transitions(evs)} | | |")
    return "\n".join(lines)


def top(p: Path, n: int) -> str:
    """The ``n`` most called functions of a path, the calls per file, and the calls into ``integrations/``
    (which a plain model should not need, issue 40 item 2)."""
    fns = Counter(f"{f}:{q}" for f, q in p.events).most_common(n)
    per_file = Counter(f for f, _ in p.events).most_common()
    out = [f"{p.name}: top {len(fns)} functions (calls)"]
    out += [f"  {c:3d}  {name}" for name, c in fns]
    out.append("  files: " + ", ".join(f"{f} {c}" for f, c in per_file))
    plugged = Counter(f"{f[len('integrations/') :]}:{q}" for f, q in p.events if f.startswith("integrations/"))
    out.append("  into integrations/: " + (", ".join(f"{n} {c}" for n, c in plugged.items()) or "none"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/trace_calls.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=8, help="functions listed per path (default 8)")
    args = ap.parse_args(argv)
    from benchmarks.run import commit

    print(
        f"paramupdates traced path counts at commit {commit()}, torch {torch.__version__}, Python {sys.version.split()[0]}"
    )
    print(f"(calls into {os.path.relpath(PKG)}, steady state: each path run {WARMUP} times first)\n")
    ps = paths()
    print(table(ps) + "\n")
    for p in ps:
        print(top(p, args.top) + "\n")
    long = long_functions()
    print(f"functions over {LONG} lines in src/paramupdates: {len(long)}")
    for f, line, name, size in sorted(long, key=lambda r: -r[3]):
        print(f"  {size:4d}  {f}:{line} {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
