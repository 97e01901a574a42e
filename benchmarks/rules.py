"""Declared rules over hundreds of tensors: paramupdates vs a per-parameter loop vs bare foreach.

    .venv/bin/python benchmarks/rules.py [--rounds 15] [--iters 10]

Rules: weight decay (2-D weights, lr-scaled), max_norm(2.0) on the 2-D weights,
EMA(0.999) of every parameter. The model has 300 parameter tensors of mixed
sizes: 50 blocks of Linear(d, 4d), Linear(4d, d), LayerNorm(d), with d cycling
through 2..8 ("tiny", 0.01 M elements: per-tensor overhead only), 8..48
("small", 0.36 M elements) or 32..128 ("large", 3 M elements: memory bound). One CPU thread (the
machine is shared; OpenMP spinning under oversubscription distorts everything).

Four ways of doing the same math, timed side by side (interleaved rounds,
median of the rounds):

* ``pu``: one ``pu.Stepper`` commit (the rules run inside it), with the default
  ``atomic=True`` and with ``atomic=False``;
* ``loop``: a hand-written per-parameter Python loop (the Keras formula per tensor);
* ``foreach``: bare ``torch._foreach_*`` calls on precomputed lists (the
  row norms of max_norm as pu computes them on CPU, since PyTorch has no
  foreach norm along a dim: one ``vector_norm`` over the concatenated small
  weights of each row length, one per large weight);
* ``foreach + checks``: ``foreach`` plus one pass over the storage of the tensors the
  rules touch and one over the decayed weights' gradients: the least that a commit
  which validates before writing (DESIGN validated commit (rule 7)) adds, i.e. the floor of pu / foreach;

Part A isolates the rules: the optimizer's ``step`` does nothing (so the time is
the rules plus what pu adds). Part B adds a real ``SGD(foreach=True)`` step to
every variant. Ratios ``loop / pu`` (goal >= 3) and ``pu / foreach`` (goal <= 1.10).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import paramupdates as pu

EPS = 1e-7
LR, WD, MAX, DECAY = 0.01, 0.05, 2.0, 0.999


SIZES = {"tiny": (2, 4, 6, 8), "small": (8, 16, 32, 48), "large": (32, 64, 96, 128)}
SIZE = "small"


def make_model() -> nn.Module:
    blocks = []
    for i in range(50):
        d = SIZES[SIZE][i % 4]
        blocks += [nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)]
    return nn.Sequential(*blocks)


class NoStep(torch.optim.SGD):
    """An optimizer whose step does nothing: part A times the rules alone."""

    def step(self, closure=None):  # noqa: D102
        return None


def setup(real_opt: bool):
    torch.manual_seed(0)
    model = make_model()
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if not real_opt else torch.randn_like(p) * 1e-3
    opt_cls = torch.optim.SGD if real_opt else NoStep
    opt = opt_cls(model.parameters(), lr=LR, foreach=True)
    return model, opt


def pu_variant(real_opt: bool, atomic: bool):
    model, opt = setup(real_opt)
    weights = [p for p in model.parameters() if p.ndim == 2]
    pu.weight_decay(model, WD)
    pu.constrain(weights, pu.max_norm(MAX))
    pu.ema(model, DECAY)
    stepper = pu.Stepper(model, opt, atomic=atomic)

    def run():
        with stepper:
            pass

    return run, model


_data_ptr = torch._C.TensorBase.data_ptr
_grad_of = torch._C.TensorBase.grad.__get__


def tensors(model: nn.Module) -> tuple[list, list, list]:
    """``(params, the 2-D weights, an average of every param)`` for the hand-written variants."""
    params = list(model.parameters())
    return params, [p for p in params if p.ndim == 2], [p.detach().clone() for p in params]


def loop_variant(real_opt: bool):
    model, opt = setup(real_opt)
    params, weights, avg = tensors(model)

    def run():
        with torch.no_grad():
            for w in weights:
                w.mul_(1 - LR * WD)
            opt.step()
            for w in weights:
                n = w.square().sum(dim=1, keepdim=True).sqrt()
                w.mul_(n.clamp(0, MAX) / (EPS + n))
            for a, p in zip(avg, params):
                a.lerp_(p, 1 - DECAY)

    return run, model


def foreach_variant(real_opt: bool, checked: bool = False):
    model, opt = setup(real_opt)
    params, weights, avg = tensors(model)
    # The row norms as pu computes them on CPU (torch has no foreach norm over a dim): the small
    # weights of one row length concatenated into one vector_norm, the large ones one call each.
    cat_max = pu.rules.constraints.CAT_NUMEL
    batches: dict = {}
    for w in weights:
        batches.setdefault(w.shape[1] if w.numel() <= cat_max else None, []).append(w)
    ordered = [w for b in batches.values() for w in b]
    counts = [w.shape[0] for w in ordered]
    # 0-dim factors, as pu uses on CPU for float32 (2-3x faster than a Python scalar there, same bits)
    factors = list(torch.full((len(weights),), 1 - LR * WD).unbind())

    # checked: plus the least a commit that validates before writing must add: one pass over the
    # storage of every tensor the rules touch (a moved model must fail before any write) and one over
    # which decayed weights have a gradient (weight decay skips the others, as torch.optim does)
    touched = params + avg
    key = tuple(map(_data_ptr, touched))

    def run():
        if checked and (tuple(map(_data_ptr, touched)) != key or any(g is None for g in map(_grad_of, weights))):
            raise RuntimeError("changed")
        with torch.no_grad():
            torch._foreach_mul_(weights, factors)
            opt.step()
            parts = []
            for cols, b in batches.items():
                if cols is None:
                    parts.extend(torch.linalg.vector_norm(w, dim=(1,)) for w in b)
                else:
                    parts.append(torch.linalg.vector_norm(torch.cat(b), dim=(1,)))
            n = torch.cat(parts).view(-1, 1)
            f = n.clamp(0, MAX).div_(n + EPS)
            torch._foreach_mul_(ordered, f.split_with_sizes(counts))
            torch._foreach_lerp_(avg, params, 1 - DECAY)

    return run, model


def bench(real_opt: bool, rounds: int, iters: int) -> dict[str, float]:
    variants = {}
    for name, make in [
        ("pu (atomic=True)", lambda: pu_variant(real_opt, True)),
        ("pu (atomic=False)", lambda: pu_variant(real_opt, False)),
        ("loop", lambda: loop_variant(real_opt)),
        ("foreach", lambda: foreach_variant(real_opt)),
        ("foreach + checks", lambda: foreach_variant(real_opt, checked=True)),
    ]:
        run, model = make()
        run()  # warm up (plans are built on the first commit)
        variants[name] = (run, model)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):  # interleaved, so that load on the machine hits every variant alike
        for name, (run, _m) in variants.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            times[name].append((time.perf_counter() - t0) / iters)
    return {k: statistics.median(v) for k, v in times.items()}


def report(title: str, med: dict[str, float]) -> None:
    print(f"\n{title}")
    for k, v in med.items():
        print(f"  {k:<18} {v * 1e3:8.3f} ms")
    ceiling = med["loop"] / med["foreach"]
    print(
        f"  ceiling: loop / bare foreach = {ceiling:5.2f}x (the most any library built on torch's foreach "
        "kernels reaches here)"
    )
    print(
        f"  floor: (foreach + checks) / foreach = {med['foreach + checks'] / med['foreach']:5.3f}x (the least a commit "
        "that validates before writing adds)"
    )
    for flag in ("True", "False"):
        p = med[f"pu (atomic={flag})"]
        print(
            f"  atomic={flag:<5}: loop / pu = {med['loop'] / p:5.2f}x (goal >= 3)   "
            f"pu / foreach = {p / med['foreach']:5.3f}x (goal <= 1.10)"
        )


def main() -> None:
    global SIZE
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="tiny,small,large")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    for SIZE in args.sizes.split(","):
        ps = list(make_model().parameters())
        print(
            f"\n=== {SIZE}: torch {torch.__version__}, {torch.get_num_threads()} thread(s); {len(ps)} parameter "
            f"tensors, {sum(p.numel() for p in ps) / 1e6:.2f} M elements; {sum(p.ndim == 2 for p in ps)} decayed "
            f"and max-normed, {len(ps)} averaged; median of {args.rounds} rounds x {args.iters} steps"
        )
        report("A. rules only (optimizer step is a no-op)", bench(False, args.rounds, args.iters))
        report("B. with a real SGD(foreach=True) step", bench(True, args.rounds, args.iters))
        pu.rules.base._RULES.clear()
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
