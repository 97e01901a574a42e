"""``pu.weight_decay``: decoupled weight decay, phase ``before_grad``.

Math, for every covered parameter ``p`` that the optimizer updates in this
step (it is in one of the optimizer's param groups and has a gradient)::

    p <- p * (1 - lr_g * rate_p)     scale_by_lr=True  (lr_g: p's param group lr, read at commit)
    p <- p * (1 - rate_p)            scale_by_lr=False

``rate_p`` is ``p.weight_decay`` for a ``pu.Parameter`` that sets one, else the
rule's ``rate``. It is applied in phase ``before_grad``, i.e. before
``optimizer.step()``, which is exactly where ``torch.optim.AdamW`` decays
(``param.mul_(1 - lr * weight_decay)`` before the Adam update): so
``Adam(weight_decay=0)`` + ``pu.weight_decay(model, w, exclude=None)`` is ``AdamW(weight_decay=w)``.
Parameters without a gradient are skipped, as every ``torch.optim`` optimizer
skips them.

Two ways to carry it out, chosen per param group at each commit (the schedule shows the rule in
``before_grad`` either way):

* **the optimizer's own kernel**, where the optimizer has the same update built in: ``AdamW``, and
  ``Adam``, ``NAdam``, ``RAdam`` through their ``decoupled_weight_decay`` (every optimizer whose
  param groups carry ``decoupled_weight_decay``). For a group whose parameters with a gradient are
  all covered, at one rate, with ``scale_by_lr=True``, and whose tensors nothing later in phase
  ``before_grad`` writes (a ``before_grad`` rule declared after this one, an update issued with that
  phase: they must see the decayed values), the commit sets the group's ``weight_decay`` (and ``decoupled_weight_decay``)
  for this one ``optimizer.step()`` and restores the optimizer's own settings after it (after an
  exception too). The decay then runs in the optimizer's pass over memory, in its kernel
  (``foreach``, ``fused``, any dtype): bitwise that optimizer with ``weight_decay`` set, e.g.
  ``Adam(fused=True)`` + ``pu.weight_decay`` == ``AdamW(fused=True)`` in bfloat16 too;
* **a separate pass** for everything else (SGD, whose ``weight_decay`` is coupled L2, another
  update; groups mixing covered and uncovered parameters or rates; ``scale_by_lr=False``):
  :func:`_multi_tensor_weight_decay`, one ``torch._foreach_mul_`` per device and dtype
  (``foreach=False``: :func:`_single_tensor_weight_decay`, ``p.mul_(f)`` tensor by tensor, bitwise
  the same: ``tests/test_rule_paths.py``).

A param group that decays by itself (its own ``weight_decay`` is not 0) and a ``pu.weight_decay``
over some of its parameters would decay them twice: the commit refuses it before anything is
written, naming the parameters and the fix.

Under a step's device-side verdict ``ok`` (``on_nonfinite="skip"`` decided on the device, rule 7)
each factor is ``where(ok, 1 - lr * rate, 1)``: a skipped step multiplies by 1 (bitwise the same
tensor), an applied one by the same factor as ever; the optimizer's own kernel skips its decay
with the rest of its update (``found_inf``).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .. import sharding
from ..errors import UpdateError, listed
from ..ops import flag_on
from ..origin import call_site
from ..parameter import Parameter
from ..phases import BEFORE_GRAD
from .base import register
from .common import (
    Referents,
    adopt_known,
    aliases,
    check_declared,
    named_tensors,
    no_subclass,
    plain_if,
    refuse_inside_step,
)
from .declared import DeclaredRule

if TYPE_CHECKING:
    from .base import CommitContext

Exclude = Callable[[str, torch.Tensor], bool]
_grad_of = torch._C.TensorBase.grad.__get__  # the C getter, mapped without a Python-level loop
_NUMBER = (int, float)  # a learning rate that is a number (else a tensor)
_PLAIN = contextlib.nullcontext()  # (reusable: plain tensors need no DisableTorchFunctionSubclass)


# --- the math ---------------------------------------------------------------------------------------------
def _single_tensor_weight_decay(params: list[torch.Tensor], factors: list[float]) -> None:
    """``p <- p * f`` for each parameter and its factor ``f = 1 - lr * rate``, one at a time."""
    for p, f in zip(params, factors):
        p.mul_(f)


def _multi_tensor_weight_decay(groups: list[tuple[list[torch.Tensor], Any]]) -> None:
    """The same, one ``torch._foreach_mul_`` per group (one device and dtype; factors per tensor, or one
    0-dim tensor for the whole group)."""
    for params, factors in groups:
        torch._foreach_mul_(params, factors)


class Factors:
    """The factors ``1 - lr_g * rate`` of one foreach group (one device and dtype), made at each commit
    from the learning rates the param groups have then, with no Python work per tensor.

    A learning rate changes every step under a schedule: it is not part of the plan. The group's
    tensors take their factors from a few *combinations* ``(param group, rate)``.

    * On CPU the factors are 0-dim tensors, in float32 (float64 for float64 tensors): one for the whole
      group where it has one combination (``torch._foreach_mul_(ts, f)``), else views into one buffer,
      one per tensor; refilled in place when a learning rate changed (one ``fill_`` for one combination).
      They are 2-3x faster than Python scalars there (no scalar wrapped per tensor), the products of
      ``Tensor.mul_(scalar)`` bitwise, and right for bfloat16/float16 too, where
      ``torch._foreach_mul_(ts, scalar)`` on CPU rounds the scalar to the tensors' dtype first
      (``1 - 1e-3`` becomes 1.0 in bfloat16) while ``Tensor.mul_`` computes in float32.
    * Elsewhere a list of Python floats, made again when a learning rate changed.
    * A tensor learning rate (``capturable``; a scheduler fills it in place) is read on the device at
      every commit, never on the host: ``1 - lr * rate`` per combination.
    """

    __slots__ = ("combos", "of", "members", "device", "cpu", "dtype", "buf", "index", "values", "lrs")

    def __init__(self, dev: torch.device, dt: torch.dtype, combos: list[tuple[int, float]], of: list[int]) -> None:
        self.combos = combos  # (param group index, rate), in first-seen order
        self.of = of  # the combination of each tensor of the group
        self.members = [[j for j, c in enumerate(of) if c == k] for k in range(len(combos))]
        self.device = dev
        self.cpu = dev.type == "cpu"
        self.dtype = torch.float64 if dt == torch.float64 else torch.float32
        self.buf: torch.Tensor | None = None
        self.index = torch.tensor(of, dtype=torch.long) if len(combos) > 1 else None
        self.values: Any = []  # a list, one per tensor, or one 0-dim tensor (CPU, one combination)
        self.lrs: tuple[Any, ...] | None = None

    def _lrs(self, groups: list[dict], scale_by_lr: bool) -> tuple[Any, ...]:
        return tuple([groups[gi]["lr"] if scale_by_lr else 1.0 for gi, _ in self.combos])

    def gated(self, ts: list[Any], groups: list[dict], scale_by_lr: bool, ok: torch.Tensor) -> list[tuple[list, Any]]:
        """Under a device verdict ``ok``: ``[(tensors, where(ok, f, 1))]``, one pair per combination (one
        ``torch._foreach_mul_`` with a 0-dim factor each: the fused path on accelerators). The factor is made
        on the group's device in the dtype the kernel computes it in (float64 for float64 tensors, else
        float32; a tensor learning rate's own), so ``p * where(ok, f, 1)`` is ``p * f`` bitwise where ``ok``,
        and ``p`` itself where not."""
        dev = self.device
        ok = flag_on(ok, dev)
        ws = []
        for lr, (_, rate) in zip(self._lrs(groups, scale_by_lr), self.combos):
            f = 1.0 - lr * rate
            if not isinstance(f, torch.Tensor):
                f = torch.full((), f, dtype=self.dtype, device=dev)
            elif f.device != dev:  # (a tensor learning rate kept on another device)
                f = f.to(dev, non_blocking=True)
            ws.append(torch.where(ok, f, 1.0))
        if len(ws) == 1:
            return [(ts, ws[0])]
        return [([ts[j] for j in m], w) for m, w in zip(self.members, ws)]

    def get(self, groups: list[dict], scale_by_lr: bool) -> Any:
        """The factors of the group's tensors, in order (or one 0-dim tensor for all), for this commit: those of the last commit while
        every learning rate is the number it was then (one comparison for one combination)."""
        kept = self.lrs
        if kept is not None and len(kept) == 1:  # (one combination, the common case: no pass over them)
            lr = groups[self.combos[0][0]]["lr"] if scale_by_lr else 1.0
            if isinstance(lr, _NUMBER) and lr == kept[0]:
                return self.values
        lrs = self._lrs(groups, scale_by_lr)
        numbers = all(isinstance(lr, _NUMBER) for lr in lrs)
        if numbers and lrs == kept:
            return self.values
        per = [1.0 - lr * rate for lr, (_, rate) in zip(lrs, self.combos)]
        if not numbers:  # tensor learning rates: on the device, at every commit (never kept)
            self.lrs = None
            return [per[c] for c in self.of]
        if not self.cpu:
            self.values = [per[c] for c in self.of]
        elif self.buf is None and self.index is None:
            # one combination: one 0-dim factor for the whole group (torch._foreach_mul_'s Tensor overload,
            # ~12 % faster than one view per tensor on CPU; the same value: the same products)
            self.buf = self.values = torch.tensor(per[0], dtype=self.dtype)
        elif self.buf is None:
            self.buf = torch.tensor([per[c] for c in self.of], dtype=self.dtype)
            self.values = list(self.buf.unbind())  # views: refilled in place below
        elif self.index is None:
            self.buf.fill_(per[0])
        else:
            self.buf.copy_(torch.tensor(per, dtype=self.dtype)[self.index])
        self.lrs = lrs
        return self.values


def skip_1d(name: str, tensor: torch.Tensor) -> bool:
    """The default ``exclude``: tensors with at most one dimension (biases, norm scales, scalars)."""
    return tensor.ndim <= 1


class WeightDecay(DeclaredRule):
    """Decoupled weight decay (see the module docstring for the math and the two paths)."""

    phase = BEFORE_GRAD
    kind = "weight_decay"
    infallible = True  # foreach mul by validated factors on floating tensors; the group settings restored
    per_optimizer_update = True

    def __init__(
        self,
        named: list[tuple[str, torch.Tensor, float]],
        scale_by_lr: bool,
        origin: str,
        foreach: bool = True,
        root: nn.Module | None = None,
    ) -> None:
        super().__init__(origin)
        self.foreach = foreach
        self.rates = [r for _, _, r in named]
        self.scale_by_lr = scale_by_lr
        # declared on a module: follows its parameters by name (e.g. into fully_shard's DTensors)
        self.hold([(n, t) for n, t, _ in named], root)
        self._lent: list[tuple[dict, dict]] = []  # param groups whose settings this commit set, and theirs
        self._seen: Any = None  # the optimizer of the last full check, until the RuleSet keeps it (bound)

    def same_kind(self) -> Any:
        return "weight_decay"  # two decays of one tensor are never meant

    def settings(self) -> Any:
        return (self.scale_by_lr, self.foreach, tuple(self.rates))

    def settings_on(self, ids: set[int]) -> Any:
        rates = [r for t, r in zip(self._tensors.current(), self.rates) if t is not None and id(t) in ids]
        return (self.scale_by_lr, self.foreach, tuple(rates))

    def describe(self) -> str:
        return "pu.weight_decay"

    def drop(self, ids: set[int]) -> bool:
        return not self.keep_except(ids)

    def keep_positions(self, keep: list[int]) -> None:
        super().keep_positions(keep)
        self.rates = [self.rates[i] for i in keep]

    # --- the plan -------------------------------------------------------------------------------------
    def plan_key(self, ctx: CommitContext, live: list[Any]) -> Any:
        """The optimizer and the layout of its groups (which parameters, by identity, their lr, own
        decay, ``decoupled_weight_decay``), and which parameters have a gradient: where a group may
        decay in its optimizer's kernel, every parameter of the optimizer (a group decays there only
        while each of its stepped parameters is covered, and a parameter that gets its first gradient
        later changes that); otherwise the covered ones."""
        opt = ctx.optimizer
        if opt is None:
            return None
        groups = opt.param_groups
        params = list(itertools.chain.from_iterable([g["params"] for g in groups]))
        layout = self._layout(groups)
        return (
            Referents([opt]),  # (not a weakref.ref: a traced commit compares keys, and dynamo cannot compare those)
            Referents(params),  # weakly, by identity: no id() of a parameter that died can match
            layout,
            self._grad_key(params if layout[3] else [t for t in live if t is not None]),
        )

    def same_plan(self, ctx: CommitContext, live: list[Any]) -> bool:
        """:meth:`plan_key` compared with the last one piece by piece, cheapest first, without making
        it: per group, then one identity pass over the optimizer's parameters and one over the
        gradients (both mapped in C: no Python work per tensor)."""
        if self._key is None:
            return False
        key, opt = self._key[0], ctx.optimizer
        if key is None or opt is None:
            return key is None and opt is None
        opt_ref, refs, layout, grad_key = key
        if not opt_ref.same([opt]):
            return False
        groups = opt.param_groups
        if self._layout(groups) != layout:
            return False
        params = list(itertools.chain.from_iterable([g["params"] for g in groups]))
        if not layout[3] and self._tied:
            live = [t for t in live if t is not None]  # (a tied name's gap, as plan_key left it out)
        return refs.same(params) and self._grad_key(params if layout[3] else live) == grad_key

    def _layout(self, groups: list[dict]) -> tuple:
        """``(group sizes, lrs, own decays, whether a group can decay in its kernel)``, per group; the
        last (``[3]``) decides whose gradients the plan key covers (every optimizer parameter's, or
        the covered ones')."""
        sizes, numbers, decays, kernel = [], [], [], False
        for g in groups:  # (one pass: this runs at every commit)
            sizes.append(len(g["params"]))
            numbers.append(isinstance(g["lr"], _NUMBER))  # (not the value)
            decays.append((g.get("weight_decay", 0), g.get("decoupled_weight_decay")))
            kernel = kernel or "decoupled_weight_decay" in g
        scaled = self.scale_by_lr
        return (tuple(sizes), tuple(numbers) if scaled else (), tuple(decays), scaled and kernel)

    def _grad_key(self, ts: list[torch.Tensor]) -> tuple[bool, ...] | bool:
        """Which of ``ts`` have a gradient (``True``: all of them; one pass in C in that case)."""
        with no_subclass() if self._sub else _PLAIN:
            if all(map(operator.is_not, map(_grad_of, ts), itertools.repeat(None))):
                return True
            return tuple([g is not None for g in map(_grad_of, ts)])

    # --- the kept plan (RuleSet) ----------------------------------------------------------------------
    def check(self, ctx: CommitContext) -> None:
        super().check(ctx)
        self._seen = weakref.ref(ctx.optimizer) if ctx.optimizer is not None else None

    def bound(self) -> Any:
        """What the ``RuleSet`` keeps of this full check: the foreach lists (:meth:`bind`), the optimizer
        and its parameters in group order, as the check saw them (strongly, where the ``RuleSet`` holds the
        rules' tensors anyway; the rule holds them only by weak reference, in its plan key)."""
        seen, self._seen = self._seen, None
        opt = seen() if seen is not None else None
        if opt is None:
            return (self._args, None, None)
        # (the optimizer by weak reference: the RuleSet is a value of a weak dict keyed by it)
        return (self._args, seen, list(itertools.chain.from_iterable([g["params"] for g in opt.param_groups])))

    def revalidate(self, ctx: CommitContext, held: list[torch.Tensor], bound: Any = None) -> bool:
        """:meth:`same_plan` against what the ``RuleSet`` kept (:meth:`bound`): the optimizer and its
        parameters compared by identity with the objects held (one pass in C, no weak reference called per
        parameter), then the layout of its groups and the gradients, as :meth:`plan_key` has them."""
        args, seen, params = bound if bound is not None else (None, None, None)
        if seen is None or params is None or torch.compiler.is_compiling():
            return super().revalidate(ctx, held, args)
        opt = ctx.optimizer
        if self._key is None or self._key[0] is None or opt is None or seen() is not opt:
            return False
        _opt, _refs, layout, grad_key = self._key[0]
        groups = opt.param_groups
        if self._layout(groups) != layout:  # (the group sizes: the chain below has params' length)
            return False
        now = groups[0]["params"] if len(groups) == 1 else itertools.chain.from_iterable([g["params"] for g in groups])
        if not all(map(operator.is_, now, params)):
            return False
        live = params if layout[3] else [t for t in held if t is not None] if self._tied else held
        if self._grad_key(live) != grad_key:
            return False
        self._live, self._args = held, args
        if self.plan[2]:
            self.ready(ctx)  # (refuses a double decay: the plan's names of it)
        return True

    def restore(self, saved: Any) -> None:
        super().restore(saved)
        self._seen = None

    def make_plan(self, ctx: CommitContext, live: list[Any]) -> Any:
        """``(separate, lent, double)``: the separate pass (per device and dtype: indices and factors),
        the groups the optimizer decays itself (group index, rate, the indices it covers), and the
        names of covered parameters their group decays already (refused at each commit)."""
        opt = ctx.optimizer
        if opt is None:  # pragma: no cover - Commit._take_rules drops per-update rules without optimizer
            return ([], [], [])
        groups = opt.param_groups
        group_of = _group_of(opt)
        covered: dict[int, list[int]] = {}  # group -> positions of covered parameters with a gradient
        double: list[str] = []
        with plain_if(self._sub):
            grads = [t if t is None else _grad_of(t) for t in live]
        for i, (t, name, rate, grad) in enumerate(zip(live, self.names, self.rates, grads)):
            if t is None or grad is None or rate == 0.0:
                continue
            gi = group_of.get(id(t))
            if gi is None:
                continue  # not updated by this optimizer
            if groups[gi].get("weight_decay", 0):
                double.append(name)
            covered.setdefault(gi, []).append(i)
        lent = []
        separate_idx: list[int] = []
        for gi, idx in covered.items():
            if self._kernel_can_decay(groups[gi], [live[i] for i in idx], {self.rates[i] for i in idx}):
                lent.append((gi, self.rates[idx[0]], idx))
            else:
                separate_idx.extend(idx)
        separate_idx.sort()
        return (self._separate_plan(groups, group_of, live, separate_idx), lent, double)

    def _kernel_can_decay(self, g: dict, ts: list[torch.Tensor], rates: set[float]) -> bool:
        """Whether group ``g``'s optimizer can carry out this decay itself: it has decoupled decay
        built in, decays no parameter of its own, and this rule covers every parameter of the group
        that has a gradient, at one rate, scaled by the learning rate."""
        if not self.scale_by_lr or "decoupled_weight_decay" not in g or g.get("weight_decay", 0) or len(rates) != 1:
            return False
        with plain_if(self._sub):
            stepped = [p for p in g["params"] if _grad_of(p) is not None]
        return len(stepped) == len(ts) and all(map(lambda a, b: a is b, sorted(stepped, key=id), sorted(ts, key=id)))

    def _separate_plan(self, groups: list[dict], group_of: dict[int, int], live: list[Any], idx: list[int]) -> Any:
        """``(positions, their param groups, foreach groups)`` of the separate pass over ``idx``: per
        device and dtype, the positions and their :class:`Factors` (``1 - lr * rate``, ``1 - rate``
        unless ``scale_by_lr``, made at each commit from the learning rates then)."""
        gis = [group_of[id(live[i])] for i in idx]
        foreach_groups = []
        if idx:
            grouped = _group_tensors_by_device_and_dtype([[live[i] for i in idx]], with_indices=True)
            for (dev, dt), (_, js) in grouped.items():
                combos: dict[tuple[int, float], int] = {}
                of = [combos.setdefault((gis[j], self.rates[idx[j]]), len(combos)) for j in js]
                foreach_groups.append(([idx[j] for j in js], Factors(dev, dt, list(combos), of)))
        return (idx, gis, foreach_groups)

    def _factors(self, groups: list[dict], idx: list[int], gis: list[int]) -> list[Any]:
        """``1 - lr * rate`` per position (the reference path: one tensor at a time)."""
        return [1.0 - (groups[gi]["lr"] if self.scale_by_lr else 1.0) * self.rates[i] for i, gi in zip(idx, gis)]

    # --- the commit -----------------------------------------------------------------------------------
    def ready(self, ctx: CommitContext) -> None:
        """Refuse, at every commit, the parameters whose param group decays them already (a group's own
        ``weight_decay`` set since the plan was made is in the plan key)."""
        double = self.plan[2] if self.plan is not None else []
        if double:
            self._live = []
            opt = type(ctx.optimizer).__name__
            raise UpdateError(
                f"pu.weight_decay declared at {self.origin} covers {listed(list(map(repr, double)))}, which "
                f"{opt}(weight_decay=...) decays already (its param group's own weight_decay is not 0): the "
                f"parameters would be decayed twice. Set weight_decay=0 in that param group of {opt} (keep "
                "pu.weight_decay), or exclude them from pu.weight_decay. Nothing of this step was written."
            )

    def tensors(self) -> list[torch.Tensor]:
        """During a commit, what its separate pass writes (the optimizer's kernel writes the rest);
        between commits, what the last one decayed (every covered tensor before the first)."""
        if self.plan is None:
            return self._tensors.live()
        if self._live:
            return [self._live[i] for i in self.plan[0][0]]
        return self.decayed()

    def decayed(self) -> list[torch.Tensor]:
        """The tensors the last commit decayed, by either path."""
        (idx, _gis, _groups), lent, _double = self.plan
        positions = list(idx)
        for _gi, _r, covered in lent:
            positions.extend(covered)
        live = self._tensors.current()
        return [live[i] for i in sorted(positions) if live[i] is not None]

    def rows(self, index: Any) -> list[Any]:
        if self.plan is None:
            return super().rows(index)
        saved, self._live = self._live, []
        try:
            return super().rows(index)  # (tensors() between commits: what the last one decayed)
        finally:
            self._live = saved

    def bind(self, ctx: CommitContext, live: list[Any]) -> Any:
        """The separate pass's foreach lists: ``[(tensors, Factors)]`` per device and dtype, of plain
        aliases (``common.aliases``; foreach path of plain tensors). ``None`` (:meth:`run` makes the
        lists each commit): a DTensor's local shard is looked up at each commit, and a traced commit
        takes the tensors themselves, which dynamo guards already (an alias would be one more)."""
        if self.plan is None or not self.foreach or sharding.any_sharded(live) or torch.compiler.is_compiling():
            return None
        return [(aliases(ts), f) for ts, f in _foreach_lists(live, self.plan[0][2])]

    gates = True  # the factors are where(ok, f, 1) under a device verdict (module docstring)

    def run(self, ctx: CommitContext, live: list[Any], args: Any) -> None:
        (idx, gis, foreach_groups), lent, _double = self.plan
        groups = ctx.optimizer.param_groups
        if args is not None and not lent and not torch.compiler.is_compiling():
            _multi_tensor_weight_decay(self._foreach_groups(args, groups, ctx.ok))  # (plain aliases)
            return
        touched = ctx.written_before_grad_after(self) if lent else set()  # must see the decayed values
        fallback: list[int] = []
        for gi, rate, covered in lent:
            if touched and any(id(live[i]) in touched for i in covered):
                fallback.extend(covered)  # the decay must come before those updates: a separate pass
                continue
            g = groups[gi]
            self._lent.append((g, {k: g[k] for k in ("weight_decay", "decoupled_weight_decay")}))
            g["weight_decay"], g["decoupled_weight_decay"] = rate, True
        # elementwise: a DTensor (FSDP2) decays its local shard, with no communication
        ts = sharding.locals_of(live)
        with plain_if(self._sub):
            if fallback:
                idx, gis, foreach_groups = self._separate_plan(
                    groups, _group_of(ctx.optimizer), live, sorted(set(idx) | set(fallback))
                )
            if not self.foreach:  # the reference path: one tensor at a time
                params = [ts[i] for i in idx]
                factors = self._factors(groups, idx, gis)
                if ctx.ok is not None:
                    factors = [_gated(f, ctx.ok, p) for p, f in zip(params, factors)]
                _single_tensor_weight_decay(params, factors)
            else:
                _multi_tensor_weight_decay(self._foreach_groups(_foreach_lists(ts, foreach_groups), groups, ctx.ok))

    def _foreach_groups(self, lists: list[tuple[list, Factors]], groups: list[dict], ok: Any) -> list[tuple[list, Any]]:
        """``[(tensors, factors)]`` for :func:`_multi_tensor_weight_decay`; under a device verdict the
        factors are ``where(ok, f, 1)`` (:meth:`Factors.gated`)."""
        if ok is None:
            out = []
            for ts, f in lists:
                out.append((ts, f.get(groups, self.scale_by_lr)))
            return out
        return [pair for ts, f in lists for pair in f.gated(ts, groups, self.scale_by_lr, ok)]

    def optimizer_done(self) -> None:
        """The optimizer's step is over (or failed): its param groups get their own settings back."""
        lent, self._lent = self._lent, []
        for g, own in lent:
            g.update(own)


def _gated(f: Any, ok: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``where(ok, f, 1)`` for one tensor ``p`` of the reference path, as :meth:`Factors.gated` makes it."""
    if not isinstance(f, torch.Tensor):
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        f = torch.full((), f, dtype=dtype, device=p.device)
    return torch.where(flag_on(ok, f.device), f, 1.0)


def _foreach_lists(ts: list[Any], foreach_groups: list[tuple[list[int], Factors]]) -> list[tuple[list[Any], Factors]]:
    """The separate pass's ``[(tensors, Factors)]`` per device and dtype, from the plan's positions."""
    return [([ts[i] for i in js], fs) for js, fs in foreach_groups]


def _group_of(opt: torch.optim.Optimizer) -> dict[int, int]:
    group_of: dict[int, int] = {}
    for gi, g in enumerate(opt.param_groups):
        for q in g["params"]:
            group_of.setdefault(id(q), gi)
    return group_of


def weight_decay(
    params: nn.Module | Any,
    rate: float,
    *,
    exclude: Exclude | None = skip_1d,
    scale_by_lr: bool = True,
    foreach: bool | None = None,
) -> WeightDecay:
    """Declare decoupled weight decay on ``params``; phase ``before_grad``.

    ``p <- p * (1 - lr * rate)`` (``scale_by_lr=True``, ``lr`` of ``p``'s param
    group, read at each commit, so schedulers apply) or ``p <- p * (1 - rate)``,
    before ``optimizer.step()``, once per optimizer update, for the parameters
    the optimizer updates in that step (in its param groups, with a gradient).

    Args:
        params: a module (its parameters, by qualified name), a tensor, or an
            iterable of tensors or ``(name, tensor)`` pairs (``model.named_parameters()``).
        rate: the decay rate (AdamW's ``weight_decay``), ``>= 0``.
        exclude: ``(qualified_name, tensor) -> bool``; ``True`` skips the tensor.
            The default skips tensors with ``ndim <= 1`` (biases, norm scales);
            ``None`` excludes nothing.
        scale_by_lr: multiply the rate by the learning rate (decoupled decay as
            in AdamW); ``False`` decays by ``rate`` alone.
        foreach: ``None``/``True``: one ``torch._foreach_mul_`` per device and dtype;
            ``False``: the per-tensor reference path (same result, bitwise).

    A ``pu.Parameter(weight_decay=r)`` uses ``r`` instead of ``rate``, and its
    explicit rate also overrides ``exclude`` (``weight_decay=0.0`` exempts it).
    Where the optimizer has decoupled decay built in (``AdamW``; ``Adam``, ``NAdam``, ``RAdam``)
    its own kernel carries the decay out for the groups this rule covers whole (see the module
    docstring); a param group that decays by itself (``weight_decay`` not 0) and this rule on its
    parameters is refused at commit (double decay). Returns the rule (``.remove()`` undeclares it).
    """
    origin = call_site(2)
    if exclude is ...:  # the contract writes the default as "..."
        exclude = skip_1d
    rate = float(rate)
    if not rate >= 0.0:
        raise ValueError(f"pu.weight_decay at {origin}: rate must be >= 0, got {rate}")
    if exclude is not None and not callable(exclude):
        raise TypeError(f"pu.weight_decay at {origin}: exclude must be a callable (name, tensor) -> bool or None")
    named = named_tensors(params, "pu.weight_decay")
    root = params if isinstance(params, nn.Module) else None
    refuse_inside_step("pu.weight_decay", origin, [t for _, t in named])
    check_declared(named, root, "pu.weight_decay", origin)
    rule = WeightDecay(_chosen(named, rate, exclude, origin), bool(scale_by_lr), origin, foreach is not False, root)
    adopt_known(rule, root)
    register(rule)
    return rule


def _chosen(
    named: list[tuple[str, torch.Tensor]], rate: float, exclude: Exclude | None, origin: Any
) -> list[tuple[str, torch.Tensor, float]]:
    """``(name, tensor, its rate)`` of the tensors ``pu.weight_decay`` decays: a ``pu.Parameter``'s own
    rate first (it overrides ``exclude``), the floating tensors ``exclude`` keeps at ``rate``."""
    chosen: list[tuple[str, torch.Tensor, float]] = []
    for name, t in named:
        own = t.weight_decay if isinstance(t, Parameter) else None
        if own is None and exclude is not None and exclude(name, t):
            continue
        r = float(own) if own is not None else rate
        if not r >= 0.0:
            raise ValueError(f"pu.weight_decay at {origin}: {name!r} has weight_decay={own}; it must be >= 0")
        if not (t.is_floating_point() or t.is_complex()):
            if own is not None:
                raise UpdateError(
                    f"pu.weight_decay at {origin}: {name!r} is {t.dtype}, not floating point, but asks for "
                    f"weight_decay={own}. Decay applies to floating tensors: give it weight_decay=None (or 0.0)."
                )
            continue
        chosen.append((name, t, r))
    return chosen
