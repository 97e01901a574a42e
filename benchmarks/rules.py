"""Benchmark (d): declared rules over hundreds of tensors, paramupdates vs bare foreach (and a loop).

    python benchmarks/rules.py [--rounds 21] [--iters 5] [--sizes tiny,small,large] [--device cuda] [--wall]

What is measured: the time of one commit that applies weight decay (the 2-D
weights, lr-scaled), ``max_norm(2.0)`` on the same weights and ``EMA(0.999)``
of every parameter. The model has 300 parameter tensors of mixed sizes: 50
blocks of Linear(d, 4d), Linear(4d, d), LayerNorm(d), with d cycling through
2..8 ("tiny", 0.01 M elements: per-tensor overhead only), 8..48 ("small",
0.36 M elements) or 32..128 ("large", 3 M elements: memory bound). One CPU
thread by default, process CPU time (the machine is shared; OpenMP spinning
under oversubscription distorts everything); on CUDA, wall clock after a
synchronize.

Five ways of doing the same math, timed side by side (``timing.interleaved``:
variants interleaved, the order rotating, ratios paired round by round; median
and range over the rounds, and the ratio of the minima):

* ``pu (default)``: one ``pu.Stepper`` commit (the rules run inside it) at
  default settings (no copies, no finiteness check: no host sync); ``pu (copy_for_rollback)``:
  the same with ``copy_for_rollback=True``, for its cost; ``pu (on_nonfinite)``: with the
  opt-in finiteness check (``on_nonfinite="skip"``: the pending values and the optimizer's
  gradients, one sync), to be read against ``foreach + checks``;
* ``loop``: a hand-written per-parameter Python loop (the Keras formula per tensor);
* ``foreach`` (the reference): bare ``torch._foreach_*`` calls on precomputed
  lists (on CPU the row norms of max_norm as pu computes them there, since
  PyTorch has no foreach norm along a dim: one ``vector_norm`` over the
  concatenated small weights of each row length, one per large weight; on an
  accelerator one per row length, all weights concatenated);
* ``foreach + plan checks``: ``foreach`` plus what a plan kept between commits must check before it
  is used (``RuleSet`` in ``paramupdates/rules/base.py``), no less: the storage (``data_ptr``) of
  every tensor the rules touch, which decayed weights have a gradient, and the optimizer's
  parameters by identity. The floor of ``pu (default)``: torch has no counter that changes when
  ``.data`` is replaced (``_version`` does not), so one pass in C over those tensors remains;
* ``pu rules, no step`` (diagnostic): the same declared rules, called as pu's commit calls them
  (``RuleSet.check``, then each rule's ``apply`` in its phase around ``optimizer.step()``) but
  without ``pu.step``'s machinery (opening the step and its journal, the commit object, its
  bookkeeping): what the rules themselves cost, to read against ``foreach + plan checks``;
* ``pu (lr schedule)`` / ``foreach (lr schedule)``: the same with a new learning rate every step (what
  ``torch.optim.lr_scheduler`` does), the hand-written variant refilling its decay factors;
* ``foreach + checks``: ``foreach`` plus one pass over the storage of the tensors the
  rules touch, one over the decayed weights' gradients, and the finiteness check of
  every gradient the optimizer will use with ``torch.amp.GradScaler``'s own kernel
  (``torch._amp_foreach_non_finite_check_and_unscale_``, one call, one host sync):
  the least that a commit which checks finiteness before writing (validated commit,
  rule 7, opt in) adds, i.e. the floor of ``pu (on_nonfinite) / foreach``.

Every variant above has a model of its own (allocated one after the other), so a ratio also holds
where each model's tensors lie in memory and, each round, a cold start (the other variants' models
ran in between): measured, the same variant differs by up to 5 % from one model to another. So each
part also runs :func:`bench_same_memory`: ``pu (default)``, ``pu rules, no step``, ``foreach + plan
checks`` and ``foreach`` on one model, the hand-written variants averaging into pu's EMA copy: the
same tensors for every variant, every round warm, i.e. the commits alone (printed as "on one
model"; in ``python -m benchmarks``'s note).

Part A isolates the rules: the optimizer's ``step`` does nothing (so the time is
the rules plus what pu adds). Part B adds a real ``SGD(foreach=True)`` step to
every variant. Goal (performance contract): ``pu (default) / foreach`` <= 1.10
(small, large), <= 1.15 (tiny). ``python -m benchmarks`` shows these ratios
(:func:`rows`); this script alone also prints every variant's time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch
from torch import nn

if __package__ in (None, ""):  # python benchmarks/rules.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import paramupdates as pu
from benchmarks import timing
from benchmarks.timing import interleaved, ms, ratios
from paramupdates.rules.common import Referents, any_none

EPS = 1e-7
LR, WD, MAX, DECAY = 0.01, 0.05, 2.0, 0.999


SIZES = {"tiny": (2, 4, 6, 8), "small": (8, 16, 32, 48), "large": (32, 64, 96, 128)}
GOALS = {"tiny": 1.15, "small": 1.10, "large": 1.10}
CPU = torch.device("cpu")


def make_model(size: str = "small") -> nn.Module:
    blocks = []
    for i in range(50):
        d = SIZES[size][i % 4]
        blocks += [nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)]
    return nn.Sequential(*blocks)


class NoStep(torch.optim.SGD):
    """An optimizer whose step does nothing: part A times the rules alone."""

    def step(self, closure=None):  # noqa: D102
        return None


def setup(size: str, real_opt: bool, device: torch.device):
    torch.manual_seed(0)
    model = make_model(size).to(device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if not real_opt else torch.randn_like(p) * 1e-3
    opt_cls = torch.optim.SGD if real_opt else NoStep
    opt = opt_cls(model.parameters(), lr=LR, foreach=True)
    return model, opt


def schedule(step: int) -> float:
    """The learning rate of step ``step`` under the "lr schedule" variants (a new value every step)."""
    return LR / (1.0 + 1e-3 * step)


def declare(model: nn.Module) -> nn.Module:
    """Declare the rules of this benchmark on ``model``; returns the EMA copy."""
    pu.weight_decay(model, WD)
    pu.constrain([p for p in model.parameters() if p.ndim == 2], pu.max_norm(MAX))
    return pu.ema(model, DECAY)


def pu_variant(
    size: str,
    real_opt: bool,
    device: torch.device,
    copy: bool,
    on_nonfinite: str | None = None,
    sched: bool = False,
    built: tuple | None = None,
):
    """``built``: ``(model, opt)`` with the rules declared already (:func:`bench_same_memory`)."""
    if built is None:
        model, opt = setup(size, real_opt, device)
        declare(model)
    else:
        model, opt = built
    stepper = pu.Stepper(model, opt, copy_for_rollback=copy, on_nonfinite=on_nonfinite)
    steps = iter(range(10**9))
    group = opt.param_groups[0]

    def run():
        if sched:
            group["lr"] = schedule(next(steps))  # what a torch.optim.lr_scheduler does between steps
        with stepper:
            pass

    return run, model


def rules_variant(size: str, real_opt: bool, device: torch.device, built: tuple | None = None):
    """``pu rules, no step``: pu's declared rules, checked and applied as its commit does, without the step."""
    from paramupdates.phases import AFTER_GRAD, AFTER_STEP, BEFORE_GRAD
    from paramupdates.rules.base import CommitContext, RuleSet, rules_for
    from paramupdates.targets import index_of

    if built is None:
        model, opt = setup(size, real_opt, device)
        declare(model)
    else:
        model, opt = built
    index, ruleset = index_of(model), RuleSet()

    def run():
        rules = rules_for(index)
        ctx = CommitContext(opt, index, None, rules)
        ruleset.check(rules, ctx)
        with torch.no_grad():
            for r in rules:
                if r.phase == BEFORE_GRAD:
                    r.apply(ctx)
            opt.step()
            for r in rules:
                r.optimizer_done()
            for phase in (AFTER_GRAD, AFTER_STEP):
                for r in rules:
                    if r.phase == phase:
                        r.apply(ctx)

    return run, model


_data_ptr = torch._C.TensorBase.data_ptr
_grad_of = torch._C.TensorBase.grad.__get__


def tensors(model: nn.Module, copies: bool = True) -> tuple[list, list, list]:
    """``(params, the 2-D weights, an average of every param)`` for the hand-written variants (``copies``
    False: no averages, an empty list)."""
    params = list(model.parameters())
    return params, [p for p in params if p.ndim == 2], [p.detach().clone() for p in params] if copies else []


def loop_variant(size: str, real_opt: bool, device: torch.device):
    model, opt = setup(size, real_opt, device)
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


def foreach_variant(
    size: str,
    real_opt: bool,
    device: torch.device,
    checked: bool = False,
    plan_checked: bool = False,
    sched: bool = False,
    built: tuple | None = None,
):
    """``built``: ``(model, opt, avg)``, the averages being pu's EMA copy of ``model`` (:func:`bench_same_memory`)."""
    if built is None:
        model, opt = setup(size, real_opt, device)
        params, weights, avg = tensors(model)
    else:
        model, opt, avg = built
        params, weights, _ = tensors(model, copies=False)
    # The row norms as pu computes them on CPU (torch has no foreach norm over a dim): the small
    # weights of one row length concatenated into one vector_norm, the large ones one call each.
    # On an accelerator (launch bound) every weight of one row length goes into one call.
    cpu = device.type == "cpu"
    cat_max = pu.rules.constraints.CAT_NUMEL if cpu else float("inf")
    batches: dict = {}
    for w in weights:
        batches.setdefault(w.shape[1] if w.numel() <= cat_max else None, []).append(w)
    ordered = [w for b in batches.values() for w in b]
    counts = [w.shape[0] for w in ordered]
    # 0-dim factors, as pu uses on CPU for float32 (2-3x faster than a Python scalar there, same bits);
    # elsewhere one Python scalar
    buf = torch.full((len(weights),), 1 - LR * WD)
    factors = list(buf.unbind()) if cpu else 1 - LR * WD
    steps = iter(range(10**9))
    group = opt.param_groups[0]

    # checked: plus the least a commit that validates before writing must add: one pass over the
    # storage of every tensor the rules touch (a moved model must fail before any write), one over
    # which decayed weights have a gradient (weight decay skips the others, as torch.optim does), and
    # GradScaler's finiteness check of the optimizer's gradients (scale 1), read back once
    touched = params + avg
    key = tuple(map(_data_ptr, touched))
    one = torch.ones(1, device=device)
    # plan_checked: what a plan kept between commits must check (pu's RuleSet does this), no less: the
    # storage of every tensor the rules touch (model.to(), .data =), which decayed weights have a gradient
    # (decay skips the others, as torch.optim does), and the optimizer's parameters by identity
    members = Referents(params)

    def stale() -> bool:
        """The storage of a touched tensor changed, or a decayed weight has no gradient."""
        return tuple(map(_data_ptr, touched)) != key or any_none(list(map(_grad_of, weights)))

    def run():
        nonlocal factors
        if sched:
            lr = group["lr"] = schedule(next(steps))
            if cpu:
                buf.fill_(1 - lr * WD)
            else:
                factors = 1 - lr * WD
        if plan_checked and (
            stale() or not members.same(list(itertools.chain.from_iterable([g["params"] for g in opt.param_groups])))
        ):
            raise RuntimeError("changed")
        if checked:
            if stale():
                raise RuntimeError("changed")
            found = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(list(map(_grad_of, params)), found, one)
            if found.item():
                raise RuntimeError("non-finite gradient")
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


VARIANTS = (
    "pu (default)",
    "pu (copy_for_rollback)",
    "pu (on_nonfinite)",
    "pu (lr schedule)",
    "loop",
    "foreach",
    "foreach + plan checks",
    "foreach + checks",
    "foreach (lr schedule)",
    "pu rules, no step",
)


def bench(size: str, real_opt: bool, rounds: int, iters: int, device: torch.device = CPU) -> dict[str, list[float]]:
    """Seconds per commit of each variant, one sample per round (``timing.interleaved``)."""
    makers = {
        "pu (default)": lambda: pu_variant(size, real_opt, device, False),
        "pu (copy_for_rollback)": lambda: pu_variant(size, real_opt, device, True),
        "pu (on_nonfinite)": lambda: pu_variant(size, real_opt, device, False, on_nonfinite="skip"),
        "loop": lambda: loop_variant(size, real_opt, device),
        "foreach": lambda: foreach_variant(size, real_opt, device),
        "foreach + checks": lambda: foreach_variant(size, real_opt, device, checked=True),
        "foreach + plan checks": lambda: foreach_variant(size, real_opt, device, plan_checked=True),
        "pu (lr schedule)": lambda: pu_variant(size, real_opt, device, False, sched=True),
        "foreach (lr schedule)": lambda: foreach_variant(size, real_opt, device, sched=True),
        "pu rules, no step": lambda: rules_variant(size, real_opt, device),
    }
    variants, models = {}, []
    try:
        for name in VARIANTS:
            run, model = makers[name]()
            variants[name] = run
            models.append(model)
        # warm-up (plans are built on the first commit), then interleaved rounds: load on the
        # machine hits every variant alike
        return interleaved(variants, repeats=rounds, steps=iters)
    finally:
        pu.rules.base.clear()  # the rules declared on this benchmark's models


SAME_MEMORY = ("pu (default)", "pu rules, no step", "foreach + plan checks", "foreach")


def bench_same_memory(
    size: str, real_opt: bool, rounds: int, iters: int, device: torch.device = CPU
) -> dict[str, list[float]]:
    """:data:`SAME_MEMORY`'s variants all on one model, the hand-written ones averaging into pu's EMA
    copy: the same tensors at the same addresses for every variant, each round warm (one model's
    tensors, touched by every variant in turn). :func:`bench` gives each variant a model of its own,
    so where each model's tensors were allocated, and a cold start of each variant's round (the
    other variants' models in between), go into its ratios too; this measures the commits alone."""
    model, opt = setup(size, real_opt, device)
    avg = list(declare(model).parameters())
    built = (model, opt)
    variants = {
        "pu (default)": pu_variant(size, real_opt, device, False, built=built)[0],
        "pu rules, no step": rules_variant(size, real_opt, device, built=built)[0],
        "foreach + plan checks": foreach_variant(size, real_opt, device, plan_checked=True, built=(*built, avg))[0],
        "foreach": foreach_variant(size, real_opt, device, built=(*built, avg))[0],
    }
    try:
        return interleaved(variants, repeats=rounds, steps=iters)
    finally:
        pu.rules.base.clear()


def same_memory_line(times: dict[str, list[float]]) -> str:
    """What :func:`bench_same_memory` measured, as ratios."""
    return (
        f"pu / foreach {ratios(times, 'pu (default)', 'foreach').median:.3f}, "
        f"(foreach + plan checks) / foreach {ratios(times, 'foreach + plan checks', 'foreach').median:.3f}, "
        f"pu / (foreach + plan checks) {ratios(times, 'pu (default)', 'foreach + plan checks').median:.3f}, "
        f"pu's rules without pu.step / (foreach + plan checks) "
        f"{ratios(times, 'pu rules, no step', 'foreach + plan checks').median:.3f}"
    )


def rows(
    device: torch.device = CPU, rounds: int = 15, iters: int = 5, sizes: tuple[str, ...] = ("tiny", "small", "large")
) -> list[dict]:
    """Rows of ``python -m benchmarks``'s table: pu (default) / bare foreach per size and part."""
    out = []
    for size in sizes:
        n = sum(p.numel() for p in make_model(size).parameters())
        for real_opt, part in ((False, "rules only"), (True, "with SGD step")):
            t = bench(size, real_opt, rounds, iters, device)
            same = bench_same_memory(size, real_opt, rounds, iters, device)
            r = ratios(t, "pu (default)", "foreach")
            med = {k: statistics.median(v) for k, v in t.items()}
            f = med["foreach"]
            out.append(
                {
                    "bench": f"(d) rules: wd + max_norm + EMA, 300 tensors, {size} ({n / 1e6:.2g} M), {part}",
                    "variant": "pu (default) / bare foreach",
                    "ratio": r,
                    "goal": GOALS[size],
                    "note": f"ratio of minima {r.of_min:.3f}; {ms(r.s)} vs {ms(f)} ms; "
                    f"loop {med['loop'] / f:.3f}; "
                    f"pu / (foreach + plan checks) {ratios(t, 'pu (default)', 'foreach + plan checks').median:.3f}, "
                    f"that floor {med['foreach + plan checks'] / f:.3f}; "
                    f"pu's rules without pu.step / that floor "
                    f"{ratios(t, 'pu rules, no step', 'foreach + plan checks').median:.3f}; "
                    f"lr schedule: pu / foreach {ratios(t, 'pu (lr schedule)', 'foreach (lr schedule)').median:.3f}; "
                    f"on_nonfinite='skip' {ratios(t, 'pu (on_nonfinite)', 'foreach').median:.3f} "
                    f"(its floor, foreach + checks: {med['foreach + checks'] / f:.3f}); "
                    f"copy_for_rollback {med['pu (copy_for_rollback)'] / f:.3f}; "
                    f"on one model, the same tensors for every variant: {same_memory_line(same)}",
                }
            )
    return out


def report(title: str, times: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{title}")
    for k, v in med.items():
        print(f"  {k:<24} {v * 1e3:8.3f} ms   (range {min(times[k]) * 1e3:.3f}-{max(times[k]) * 1e3:.3f})")
    ceiling = med["loop"] / med["foreach"]
    print(
        f"  ceiling: loop / bare foreach = {ceiling:5.2f}x (the most any library built on torch's foreach "
        "kernels reaches here)"
    )
    print(
        f"  floor of the opt-in check: (foreach + checks) / foreach = {med['foreach + checks'] / med['foreach']:5.3f}x "
        "(the least a commit that checks finiteness before writing adds, rule 7)"
    )
    print(
        f"  floor of a kept plan: (foreach + plan checks) / foreach = "
        f"{med['foreach + plan checks'] / med['foreach']:5.3f}x (what a plan kept between commits must check)"
    )
    r = ratios(times, "pu (default)", "foreach + plan checks")
    print(
        f"  default           : pu / floor   = {r.median:5.3f}x (range {r.spread()}): what pu adds beyond those checks"
    )
    r = ratios(times, "pu rules, no step", "foreach + plan checks")
    print(
        f"  rules, no step    : pu's rules without pu.step / floor = {r.median:5.3f}x (range {r.spread()}): the rules "
        "themselves; pu (default) adds the step's machinery to them"
    )
    r = ratios(times, "pu (lr schedule)", "foreach (lr schedule)")
    print(f"  lr schedule       : pu / foreach = {r.median:5.3f}x (range {r.spread()}): a new learning rate every step")
    r = ratios(times, "pu (on_nonfinite)", "foreach + checks")
    print(f"  on_nonfinite      : pu / floor   = {r.median:5.3f}x (range {r.spread()}): what pu adds beyond the check")
    for name in ("default", "copy_for_rollback", "on_nonfinite"):
        r = ratios(times, f"pu ({name})", "foreach")
        print(
            f"  {name:<18}: pu / foreach = {r.median:5.3f}x (range {r.spread()}, ratio of minima {r.of_min:5.3f})   "
            f"loop / pu = {med['loop'] / r.s:5.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="tiny,small,large")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--wall", action="store_true", help="wall clock instead of process CPU time (CPU)")
    args = ap.parse_args()
    device = timing.select_device(args.device)
    timing.use_device(device)
    timing.use_wall_clock(args.wall)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    for size in args.sizes.split(","):
        ps = list(make_model(size).parameters())
        print(
            f"\n=== {size}: torch {torch.__version__}, {device}, {torch.get_num_threads()} thread(s), "
            f"{timing.clock_name()}; {len(ps)} parameter tensors, {sum(p.numel() for p in ps) / 1e6:.2f} M elements; "
            f"{sum(p.ndim == 2 for p in ps)} decayed and max-normed, {len(ps)} averaged; "
            f"median of {args.rounds} rounds x {args.iters} steps; goal pu (default) / foreach <= {GOALS[size]}"
        )
        for part, real_opt in (
            ("A. rules only (optimizer step is a no-op)", False),
            ("B. with a real SGD(foreach=True) step", True),
        ):
            report(part, bench(size, real_opt, args.rounds, args.iters, device))
            same = bench_same_memory(size, real_opt, args.rounds, args.iters, device)
            print(f"  on one model (the same tensors for every variant, each round warm): {same_memory_line(same)}")
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
