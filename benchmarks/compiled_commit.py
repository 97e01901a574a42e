"""Benchmark: a compiled commit, ``torch.compile(optimizer.step)`` with pu's rules.

    python benchmarks/compiled_commit.py [--size small] [--rounds 11] [--backend inductor]

The rules model of ``benchmarks/rules.py`` (300 tensors; weight decay, ``max_norm(2.0)`` on the
2-D weights, EMA of every parameter) with a real ``SGD(foreach=True)`` step, three ways:

* ``pu compiled``: ``pu.attach(model, opt)`` and ``torch.compile(opt.step)``, PyTorch's recipe
  for a compiled optimizer; the commit's phases are traced with the optimizer's update;
* ``hand compiled``: the same math written by hand (``_foreach_mul_``, ``opt.step()``, the row
  norms, ``_foreach_lerp_``) in one ``torch.compile``d function;
* ``hand eager foreach``: benchmark (d)'s reference (``rules.foreach_variant``: bare
  ``torch._foreach_*`` calls on precomputed lists, the row norms batched), eager;
* ``pu eager``: the same attachment, ``opt.step()`` not compiled (pu's eager commit).

Printed as ratios measured side by side (``timing.interleaved``). Compiling takes a while on CPU
(two compilations of a 300-tensor step), so ``python -m benchmarks`` runs it only with ``--all``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if __package__ in (None, ""):  # python benchmarks/compiled_commit.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import paramupdates as pu
from benchmarks import rules
from benchmarks.timing import interleaved, ms, ratios

TITLE = "compiled commit: torch.compile(opt.step), wd + max_norm + EMA, 300 tensors, SGD"


def pu_compiled(size: str, device: torch.device, backend: str | None):
    model, opt = rules.setup(size, True, device)
    rules.declare(model)
    pu.attach(model, opt)
    return (torch.compile(opt.step, backend=backend) if backend else opt.step), model


def hand(size: str, device: torch.device, backend: str | None):
    model, opt = rules.setup(size, True, device)
    params, weights, avg = rules.tensors(model)
    factor = 1 - rules.LR * rules.WD

    def step():
        with torch.no_grad():
            torch._foreach_mul_(weights, factor)
        opt.step()
        with torch.no_grad():
            ns = [torch.linalg.vector_norm(w, dim=(1,), keepdim=True) for w in weights]
            torch._foreach_mul_(weights, [n.clamp(0, rules.MAX) / (n + rules.EPS) for n in ns])
            torch._foreach_lerp_(avg, params, 1 - rules.DECAY)

    return (torch.compile(step, backend=backend) if backend else step), model


def bench(size: str, rounds: int, iters: int, device: torch.device, backend: str) -> dict[str, list[float]]:
    makers = {
        "pu compiled": lambda: pu_compiled(size, device, backend),
        "hand compiled": lambda: hand(size, device, backend),
        "hand eager foreach": lambda: rules.foreach_variant(size, True, device),
        "pu eager": lambda: pu_compiled(size, device, None),  # (backend None: not compiled)
    }
    variants, models = {}, []
    try:
        for name, make in makers.items():
            run, model = make()
            for _ in range(3):  # compile (and recompile once the optimizer's state exists)
                run()
            variants[name] = run
            models.append(model)
        return interleaved(variants, repeats=rounds, steps=iters)
    finally:
        pu.testing.reset()
        torch._dynamo.reset()


def rows(
    device: torch.device = rules.CPU, rounds: int = 11, iters: int = 10, size: str = "small", backend: str = "inductor"
) -> list[dict]:
    """Rows of ``python -m benchmarks --all``."""
    t = bench(size, rounds, iters, device, backend)
    r = ratios(t, "pu compiled", "hand compiled")
    e = ratios(t, "pu compiled", "hand eager foreach")
    p = ratios(t, "pu eager", "hand eager foreach")
    return [
        {
            "bench": f"{TITLE} ({size}, {backend})",
            "variant": "pu compiled / hand-written compiled",
            "ratio": r,
            "note": f"ratio of minima {r.of_min:.3f}; {ms(r.s)} vs {ms(r.base_s)} ms",
        },
        {
            "bench": f"{TITLE} ({size}, {backend})",
            "variant": "pu compiled / hand-written eager foreach",
            "ratio": e,
            "goal": 1.0,
            "note": f"ratio of minima {e.of_min:.3f}; {ms(e.s)} vs {ms(e.base_s)} ms (aim: pu compiled faster); "
            f"pu eager / hand-written eager foreach {p.median:.3f}",
        },
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", choices=tuple(rules.SIZES))
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for row in rows(rounds=args.rounds, iters=args.iters, size=args.size, backend=args.backend):
        r = row["ratio"]
        print(f"{row['bench']}: {row['variant']} {r.median:.3f} (range {r.spread()}); {row['note']}")


if __name__ == "__main__":
    main()
