"""``pu.constrain`` and the constraints of Keras: phase ``after_grad``.

A constraint is a projection ``w -> c(w)`` applied after ``optimizer.step()``
(phase ``after_grad``), once per optimizer update, to every tensor it is
declared on. Several constraints on one tensor apply in declaration order.

Axis convention (``dim``). The norm constraints compute one norm per index
along ``dim``, over all the *other* dims, like ``torch.nn.utils.weight_norm``
(``dim=None``: one norm over the whole tensor). With the default ``dim=0``:

* ``nn.Linear.weight`` (``(out, in)``): one norm per output unit, over its
  incoming weights. That is Keras' default: a ``Dense`` kernel is
  ``(in, out)`` and ``MaxNorm(axis=0)`` reduces over ``in``.
* ``nn.Conv2d.weight`` (``(out, in, kh, kw)``): one norm per filter, over
  ``(in, kh, kw)``: Keras' ``MaxNorm(axis=[0, 1, 2])`` on a ``(kh, kw, in, out)`` kernel.
* a 1-D tensor: one "norm" per element, ``|w_i|``; pass ``dim=None`` for the
  norm of the whole vector (Keras' ``axis=0`` on a bias).

Math (``n`` the L2 norm along the reduced dims, ``eps = 1e-7`` as Keras'
``backend.epsilon()``):

* ``max_norm(v)``:            ``w * clip(n, 0, v) / (eps + n)``
* ``unit_norm()``:            ``w / (eps + n)``
* ``min_max_norm(a, b, r)``:  ``w * (r * clip(n, a, b) + (1 - r) * n) / (eps + n)``
* ``non_neg()``:              ``w * (w >= 0)``  (negative entries become ``+0.0``; Keras gives ``-0.0``)
* ``clamp(a, b)``:            ``clamp(w, a, b)``
* a callable ``f``:           ``f(w)`` (validated: same shape and device, castable dtype)

Each constraint has a readable reference path (``c(w)``, out of place, the
Keras formula: :func:`_single_tensor_constraint`) and a foreach path
(:func:`_multi_tensor_constraint`: plain functions of the constraint's math, planned,
bound and run by the ``Constrain`` rule like every declared rule), in place,
per device, dtype and rank: the norms, then the factors of the whole group in
one pass over the concatenated norms, then one ``torch._foreach_mul_``.
PyTorch has no foreach norm along a dim, so the norms are computed

* on accelerators (launch bound): in one ``segment_reduce`` over a
  ``torch._chunk_cat`` of the group;
* on CPU: small tensors (at most ``CAT_NUMEL`` elements) of one trailing
  shape concatenated into one ``torch.linalg.vector_norm`` call (per-call
  overhead dominates them); large ones (memory bound, where that copy costs
  more than it saves) with one ``vector_norm`` each, the only per-tensor call.
  The row norms are bitwise those of the per-tensor call.

Under a step's device-side verdict ``ok`` (``on_nonfinite="skip"`` decided on the device, rule 7):
a norm constraint multiplies by ``where(ok, factor, 1)``; a clamp (``clamp``, ``non_neg``) and the
reference path (a callable) compute ``c(w)`` out of place and write ``where(ok, c(w), w)``. A skipped
step leaves every tensor bitwise as it was, with no host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .. import sharding
from ..errors import UpdateError
from ..ops import flag_on, select_
from ..origin import call_site
from ..phases import AFTER_GRAD
from .base import register
from .common import (
    adopt_known,
    aliases,
    check_declared,
    named_tensors,
    no_subclass,
    plain_if,
    refuse_inside_step,
    where,
)
from .declared import DeclaredRule

if TYPE_CHECKING:
    from .base import CommitContext

EPSILON = 1e-7  # keras.backend.epsilon()


class Constraint:
    """A projection ``w -> c(w)``: its math. ``c(w)`` is the reference (out of place); a norm constraint
    adds ``factor(n)``, a clamp its bounds, and the foreach path is plain functions of those
    (:func:`_multi_tensor_constraint`), which ``pu.constrain``'s rule plans, binds and runs. A subclass
    of the user's gives its in-place foreach path as ``apply_(ts, plan)``."""

    name = "constraint"
    infallible = True  # the built-in ones; a user callable is not

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def validate(self, name: str, t: torch.Tensor, origin: str) -> None:
        """Raise if the constraint cannot apply to ``t`` (checked at declaration)."""

    def plan(self, ts: list[torch.Tensor], norms: str = "auto") -> Any:
        """The foreach path's plan for ``ts`` (:func:`_plan`: indices into ``ts``, never the tensors)."""
        return _plan(self, ts, norms)

    def apply_(self, ts: list[torch.Tensor], plan: Any) -> None:
        """``t <- c(t)`` in place for ``ts`` (the tensors :meth:`plan` saw): :func:`_multi_tensor_constraint`.
        A constraint of the user's overrides it (its ``plan``: ``ts``' positions per device and dtype)."""
        if not isinstance(self, _Norm | _Clamp):
            raise NotImplementedError(f"{type(self).__name__}.apply_(ts, plan): the in-place foreach path")
        _multi_tensor_constraint(self, ts, plan)

    def __repr__(self) -> str:
        return f"pu.{self.name}()"

    def same_kind(self) -> Any:
        """Constraints of one kind replace each other when declared again on a tensor
        (``max_norm(3)`` then ``max_norm(2)``: the second); different kinds compose."""
        return self.name

    def settings(self) -> Any:
        """Equal for two constraints that compute the same (``max_norm(2)`` twice); ``None``: never."""
        if type(self).__module__ != __name__:
            return None  # a user's subclass: its attributes may be anything
        return (type(self), sorted(vars(self).items()))


class _Norm(Constraint):
    """``w * factor(n)`` with ``n`` the L2 norm over every dim but ``dim``."""

    def __init__(self, dim: int | None) -> None:
        if dim is not None and not isinstance(dim, int):
            raise TypeError(f"pu.{self.name}: dim must be an int or None, not {type(dim).__name__}")
        self.dim = dim

    def factor(self, n: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def factor_(self, n: torch.Tensor, out: torch.Tensor) -> None:
        """``out <- factor(n)``, into a buffer kept between commits (:func:`_norm_keep`); bitwise
        :meth:`factor` (a subclass writes it with ``out=``: the same kernels)."""
        out.copy_(self.factor(n))

    def validate(self, name: str, t: torch.Tensor, origin: str) -> None:
        if not t.is_floating_point():
            raise UpdateError(
                f"pu.{self.name} at {origin}: {name!r} is {t.dtype}; norm constraints need floating point "
                f"(a {'complex' if t.is_complex() else 'non-floating'} tensor has no such norm here). Declare it "
                "on floating tensors only (leave this one out), or use pu.clamp / a callable for it."
            )
        if self.dim is not None and t.ndim > 0 and not -t.ndim <= self.dim < t.ndim:
            raise ValueError(
                f"pu.{self.name} at {origin}: dim={self.dim} is out of range for {name!r} of shape {tuple(t.shape)}"
            )

    def _dims(self, t: torch.Tensor) -> tuple[int, ...] | None:
        if self.dim is None or t.ndim == 0:
            return None
        d = self.dim % t.ndim
        return tuple(i for i in range(t.ndim) if i != d)

    # reference: the Keras formula on one tensor
    def norms(self, w: torch.Tensor) -> torch.Tensor:
        dims = self._dims(w)
        sq = w.square()
        s = sq.sum() if dims is None else (sq.sum(dim=dims, keepdim=True) if dims else sq)
        return s.sqrt()

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.factor(self.norms(w))


def _gate(factors: torch.Tensor, ok: torch.Tensor | None) -> torch.Tensor:
    """``where(ok, factors, 1)`` under a device verdict (a skipped step multiplies by 1: bitwise the same)."""
    return factors if ok is None else torch.where(flag_on(ok, factors.device), factors, 1.0)


CAT_NUMEL = 4096
"""CPU, ``norms="auto"``: tensors of at most this many elements are concatenated for their row norms.
Above it, copying costs more than the ~2 us per call it saves (measured: benchmarks/rules.py,
"tiny"/"small" vs "large")."""

NORMS = ("auto", "segments", "concat", "each")
"""How a norm constraint's foreach path computes its row norms (``pu.constrain(..., norms=)``):

* ``"auto"``: ``"segments"`` on accelerators; on CPU ``"concat"`` for tensors of at most
  :data:`CAT_NUMEL` elements and ``"each"`` above;
* ``"segments"``: one ``segment_reduce`` over a ``torch._chunk_cat`` of the group (launch bound);
* ``"concat"``: small tensors of one trailing shape concatenated into one ``vector_norm`` call;
* ``"each"``: one ``vector_norm`` per tensor (no copy).

Every choice gives the same norms up to rounding (bitwise, between ``"concat"`` and ``"each"``):
it is a speed knob, and what the tests use to check each path on any device."""


def _flat(vs: list[torch.Tensor]) -> torch.Tensor:
    cc = getattr(torch, "_chunk_cat", None)
    if cc is not None:
        return cc(vs, 0, 1).view(-1)
    return torch.cat([v.reshape(-1) for v in vs])  # pragma: no cover - torch without _chunk_cat


class MaxNorm(_Norm):
    name = "max_norm"

    def __init__(self, value: float, dim: int | None = 0) -> None:
        super().__init__(dim)
        self.value = float(value)
        if not self.value >= 0:
            raise ValueError(f"pu.max_norm: value must be >= 0, got {value}")

    def factor(self, n: torch.Tensor) -> torch.Tensor:
        return n.clamp(0.0, self.value).div_(n + EPSILON)

    def factor_(self, n: torch.Tensor, out: torch.Tensor) -> None:
        torch.clamp(n, 0.0, self.value, out=out).div_(n + EPSILON)

    def __repr__(self) -> str:
        return f"pu.max_norm({self.value}, dim={self.dim})"


class UnitNorm(_Norm):
    name = "unit_norm"

    def factor(self, n: torch.Tensor) -> torch.Tensor:
        return (n + EPSILON).reciprocal_()

    def factor_(self, n: torch.Tensor, out: torch.Tensor) -> None:
        torch.add(n, EPSILON, out=out).reciprocal_()

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return w / (EPSILON + self.norms(w))

    def __repr__(self) -> str:
        return f"pu.unit_norm(dim={self.dim})"


class MinMaxNorm(_Norm):
    name = "min_max_norm"

    def __init__(self, min: float, max: float, rate: float = 1.0, dim: int | None = 0) -> None:  # noqa: A002
        super().__init__(dim)
        self.min, self.max, self.rate = float(min), float(max), float(rate)
        if not 0 <= self.min <= self.max:
            raise ValueError(f"pu.min_max_norm: need 0 <= min <= max, got min={min}, max={max}")
        if not 0 <= self.rate <= 1:
            raise ValueError(f"pu.min_max_norm: rate must be in [0, 1], got {rate}")

    def factor(self, n: torch.Tensor) -> torch.Tensor:
        desired = n.clamp(self.min, self.max).mul_(self.rate).add_(n, alpha=1.0 - self.rate)
        return desired.div_(n + EPSILON)

    def __repr__(self) -> str:
        return f"pu.min_max_norm({self.min}, {self.max}, rate={self.rate}, dim={self.dim})"


class _Clamp(Constraint):
    def __init__(self, min: float | None, max: float | None) -> None:  # noqa: A002
        if min is None and max is None:
            raise ValueError("pu.clamp: give min, max or both")
        if min is not None and max is not None and not min <= max:
            raise ValueError(f"pu.clamp: min={min} > max={max}")
        self.min, self.max = min, max

    def validate(self, name: str, t: torch.Tensor, origin: str) -> None:
        if t.is_complex() or t.dtype == torch.bool:
            raise UpdateError(
                f"pu.{self.name} at {origin}: {name!r} is {t.dtype}; pu.{self.name} needs a real dtype (complex "
                "and bool values have no order). Leave it out of the declaration, or constrain it with a callable."
            )
        for v in (self.min, self.max):
            if v is not None and not t.is_floating_point() and float(v) != int(v):
                raise ValueError(f"pu.{self.name} at {origin}: bound {v} is not an integer but {name!r} is {t.dtype}")

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return w.clamp(self.min, self.max)


class NonNeg(_Clamp):
    name = "non_neg"

    def __init__(self) -> None:
        super().__init__(0.0, None)

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return w * (w >= 0).to(w.dtype)  # the Keras formula


class Clamp(_Clamp):
    name = "clamp"

    def __repr__(self) -> str:
        return f"pu.clamp({self.min}, {self.max})"


class CallableConstraint(Constraint):
    """Any ``tensor -> tensor``; runs user code, so the commit snapshots for it."""

    infallible = False

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return self.fn(w)

    def same_kind(self) -> Any:
        # the same function, defined again (a re-run cell): where it is defined, not the object
        fn = getattr(self.fn, "func", self.fn)  # (functools.partial)
        code = getattr(fn, "__code__", None)
        if code is not None:
            return (code.co_filename, code.co_firstlineno, getattr(fn, "__qualname__", ""))
        return (type(fn).__module__, type(fn).__qualname__)

    def settings(self) -> Any:
        # the same function: the same object, or the same code over the same closure and defaults
        # (a lambda in configure_optimizers, made again by each fit)
        fn = self.fn
        code = getattr(fn, "__code__", None)
        if code is None:
            return (id(fn),)  # (the earlier rule holds its fn: the id is not reused)
        cells = [_held_id(c) for c in fn.__closure__ or ()]
        return (code, cells, [id(d) for d in fn.__defaults__ or ()])

    def __repr__(self) -> str:
        return f"constrain({self.name})"


def _held_id(cell: Any) -> int | None:
    """``id`` of what a closure cell holds (``None``: empty)."""
    try:
        return id(cell.cell_contents)
    except ValueError:
        return None


def max_norm(value: float, dim: int | None = 0) -> MaxNorm:
    """Keras ``MaxNorm``: rescale so that each norm (over every dim but ``dim``) is at most ``value``."""
    return MaxNorm(value, dim)


def unit_norm(dim: int | None = 0) -> UnitNorm:
    """Keras ``UnitNorm``: divide by the norm over every dim but ``dim`` (plus ``1e-7``)."""
    return UnitNorm(dim)


def min_max_norm(min: float, max: float, rate: float = 1.0, dim: int | None = 0) -> MinMaxNorm:  # noqa: A002
    """Keras ``MinMaxNorm``: move each norm toward ``[min, max]`` by ``rate`` (1.0: clip)."""
    return MinMaxNorm(min, max, rate, dim)


def non_neg() -> NonNeg:
    """Keras ``NonNeg``: zero the negative entries."""
    return NonNeg()


def clamp(min: float | None = None, max: float | None = None) -> Clamp:  # noqa: A002
    """Elementwise ``clamp(w, min, max)`` (either bound may be ``None``)."""
    return Clamp(min, max)


def _single_tensor_constraint(
    c: Constraint, ts: list[torch.Tensor], names: list[str], origin: str, ok: torch.Tensor | None = None
) -> None:
    """``t <- c(t)`` tensor by tensor (the Keras formula, out of place; a user callable's only path).
    Every new value is computed and validated first, then written: a failure writes nothing. Under a
    device verdict ``ok``: ``t <- where(ok, c(t), t)``."""
    news = []
    with no_subclass():
        for t, name in zip(ts, names):
            try:
                new = c(t.detach())
            except Exception as exc:
                raise UpdateError(
                    f"constraint {c.name!r} (declared at {origin}) raised on {name!r}: "
                    f"{type(exc).__name__}: {exc}. Nothing of this constraint was written."
                ) from exc
            if (
                not isinstance(new, torch.Tensor)
                or new.shape != t.shape
                or new.device != t.device
                or (new.is_floating_point() and not t.is_floating_point())
            ):
                got = where(new) if isinstance(new, torch.Tensor) else type(new).__name__
                raise UpdateError(
                    f"constraint {c.name!r} (declared at {origin}) returned {got} for {name!r} "
                    f"({where(t)}): a constraint must return a tensor of the same shape and device. "
                    "Nothing of this constraint was written."
                )
            news.append(new)
        for t, new in zip(ts, news):
            if new is t:
                continue
            if ok is not None:  # (no DTensor here: a sharded model's verdict is taken on the host)
                select_(ok, [t], [new])
            elif sharding.is_sharded(t):  # the value laid out like t, then written shard onto shard
                from ._sharded import like

                sharding.local(t).copy_(sharding.local(like(t, new)))
            else:
                t.copy_(new)


def _multi_tensor_constraint(c: Constraint, ts: list[torch.Tensor], plan: Any, ok: torch.Tensor | None = None) -> None:
    """``t <- c(t)`` for every tensor, in place, per device, dtype and rank: for a norm constraint the
    norms of a group, its factors in one pass, one ``torch._foreach_mul_``; for a clamp
    ``torch._foreach_clamp_min_`` / ``_max_`` (:func:`_kernels`: ``bind`` then ``run``). Under a device
    verdict ``ok``, ``where(ok, c(t), t)``."""
    bind, run = _kernels(c)
    run(c, bind(c, ts, plan), ok)


# --- the foreach path: plain functions of a constraint's math ----------------------------------------
def _plan(c: Constraint, ts: list[torch.Tensor], norms: str = "auto") -> Any:
    """What the foreach path of ``c`` needs for ``ts``, as indices into ``ts`` (a rule must not keep the
    tensors alive), made again when any tensor's storage changes: for a norm constraint
    :func:`_norm_plan`; else the positions of the non-empty tensors per device and dtype."""
    if isinstance(c, _Norm):
        return _norm_plan(c.dim, ts, norms)
    return _device_groups(ts, [i for i, t in enumerate(ts) if t.numel()])


def _device_groups(ts: list[torch.Tensor], keep: list[int]) -> list[list[int]]:
    """The positions ``keep`` of ``ts``, per device and dtype."""
    if not keep:
        return []
    grouped = _group_tensors_by_device_and_dtype([[ts[i] for i in keep]], with_indices=True)
    return [[keep[j] for j in idx] for _k, (_, idx) in grouped.items()]


def _norm_plan(dim: int | None, ts: list[torch.Tensor], norms: str) -> Any:
    """``(wholes, rows)``: the positions whose norm is over the whole tensor (``dim=None``, 0-dim), per
    device and dtype; and per device, dtype, rank and kept dim, the positions and how their row norms are
    computed (:data:`NORMS`): segment lengths on accelerators, CPU batches ``(concatenated?, size)``."""
    whole: list[int] = []
    by_rank: dict[tuple, list[int]] = {}
    for i, t in enumerate(ts):
        if t.numel() == 0:
            continue  # nothing to constrain (and _chunk_cat refuses empty tensors)
        if dim is None or t.ndim == 0:
            whole.append(i)
        else:
            by_rank.setdefault((t.device, t.dtype, t.ndim, dim % t.ndim), []).append(i)
    rows = []
    for (dev, _dt, nd, d), idx in by_rank.items():
        if norms == "segments" or (norms == "auto" and dev.type != "cpu"):
            counts = [ts[i].shape[d] for i in idx]
            per_row = [ts[i].numel() // ts[i].shape[d] if ts[i].shape[d] else 0 for i in idx]
            lengths = torch.tensor(per_row, dtype=torch.long).repeat_interleave(torch.tensor(counts)).to(dev)
            rows.append((idx, d, counts, lengths, nd))
            continue
        # CPU: small tensors of one trailing shape are concatenated and reduced in one call
        # (the copy costs less than the per-call overhead it saves); large ones one call each.
        batches: dict[Any, list[int]] = {}
        for i in idx:
            t = ts[i]
            trail = tuple(s for j, s in enumerate(t.shape) if j != d)
            small = norms == "concat" or (norms == "auto" and t.numel() <= CAT_NUMEL)
            key = ("cat", trail) if small and nd > 1 else ("each",)
            batches.setdefault(key, []).append(i)
        order = [i for b in batches.values() for i in b]
        kinds = [(k[0] == "cat", len(b)) for k, b in batches.items()]
        rows.append((order, d, [ts[i].shape[d] for i in order], kinds, nd))
    return _device_groups(ts, whole), rows


def _norm_bind(c: Constraint, ts: list[torch.Tensor], plan: Any) -> Any:
    """Per group of the plan, its tensors (the kept dim first: views, so writes reach the tensors),
    the shape of its norms, and its CPU batches of small tensors: :func:`_multi_tensor_norm`'s lists."""
    wholes, rows = plan
    bound_rows = []
    for idx, d, counts, lengths, nd in rows:  # lengths: segment lengths, or CPU batches (cat?, size)
        vs = [ts[i] for i in idx] if d == 0 else [ts[i].movedim(d, 0) for i in idx]
        shape = (-1, *([1] * (nd - 1)))
        if isinstance(lengths, torch.Tensor) or nd == 1:
            bound_rows.append((vs, shape, counts, lengths, None, None))
            continue
        batches, at = [], 0
        for cat, k in lengths:
            batches.append((cat, vs[at : at + k]))
            at += k
        bound_rows.append((vs, shape, counts, batches, tuple(range(1, nd)), None))
    return [[ts[i] for i in idx] for idx in wholes], bound_rows


def _norm_keep(bound: Any) -> Any:
    """:func:`_norm_bind`'s lists for a plan kept between commits (``Constrain.bind``): each CPU group of
    row norms gets its buffers, made once: the norms ``n`` (one ``vector_norm(..., out=)`` view per batch
    of small tensors, one per large tensor), the factors ``c.factor(n)`` (written in place,
    :meth:`_Norm.factor_`) and their views per tensor, the operands of its ``torch._foreach_mul_``. The
    same kernels on the same inputs as :func:`_norm_bind`'s path, so the same bits; what goes is the
    ``torch.cat`` of the norms and the ``split_with_sizes`` of the factors (one view per tensor) of
    every commit. Held with the plan's lists (by the ``RuleSet``): a few floats per row."""
    wholes, rows = bound
    kept_rows = []
    for vs, shape, counts, batches, dims, _ in rows:
        if dims is None:
            kept_rows.append((vs, shape, counts, batches, dims, None))
            continue
        n = torch.empty(sum(counts), dtype=vs[0].dtype, device=vs[0].device)
        f = torch.empty_like(n).view(shape)
        jobs, at = [], 0
        for cat, batch in batches:
            for part in [batch] if cat else [[v] for v in batch]:
                rows_of = sum(v.shape[0] for v in part)
                jobs.append((part, n[at : at + rows_of]))
                at += rows_of
        kept_rows.append((vs, shape, counts, batches, dims, (jobs, n.view(shape), f, f.split_with_sizes(counts))))
    return wholes, kept_rows


def _multi_tensor_norm(c: Any, bound: Any, ok: torch.Tensor | None = None) -> None:
    """``w <- w * c.factor(n)``, ``n`` the L2 norms over every dim but ``dim``: per group, its norms, the
    factors of the whole group in one pass, one ``torch._foreach_mul_``; under a device verdict ``ok``
    the factors are ``where(ok, f, 1)``. A group with buffers kept (:func:`_norm_keep`) writes its norms
    and factors into them (the same kernels, the same order: the same bits)."""
    wholes, rows = bound
    for group in wholes:
        n = torch.stack(torch._foreach_norm(group))
        torch._foreach_mul_(group, list(_gate(c.factor(n), ok).unbind(0)))
    for vs, shape, counts, lengths, dims, kept in rows:
        if kept is not None and ok is None:
            jobs, n, f, fs = kept
            for part, out in jobs:
                torch.linalg.vector_norm(torch.cat(part) if len(part) > 1 else part[0], dim=dims, out=out)
            c.factor_(n, f)
            torch._foreach_mul_(vs, fs)
            continue
        if isinstance(lengths, torch.Tensor):
            # accelerators: launch bound; the whole group in a handful of kernels
            flat = _flat(vs)
            n = torch.segment_reduce(flat.square_(), "sum", lengths=lengths, unsafe=True).sqrt_().view(shape)
        elif dims is None:  # 1-D: one norm per element
            n = torch.cat(torch._foreach_abs(vs)).view(shape)
        else:
            # CPU (torch has no foreach norm over a dim): one vector_norm per batch of small
            # tensors of one trailing shape, one per large tensor (memory bound: no copy).
            parts: list[torch.Tensor] = []
            for cat, batch in lengths:
                if cat:
                    parts.append(torch.linalg.vector_norm(torch.cat(batch) if len(batch) > 1 else batch[0], dim=dims))
                else:
                    parts.extend(torch.linalg.vector_norm(v, dim=dims) for v in batch)
            n = (torch.cat(parts) if len(parts) > 1 else parts[0]).view(shape)
        torch._foreach_mul_(vs, _gate(c.factor(n), ok).split_with_sizes(counts))


def _clamp_bind(c: Any, ts_all: list[torch.Tensor], plan: Any) -> Any:
    """Per device and dtype: the tensors and the bounds in their kind (integers for integer tensors)."""
    out = []
    for idx in plan:
        ts = [ts_all[i] for i in idx]
        lo, hi = c.min, c.max
        if not ts[0].is_floating_point():
            lo = None if lo is None else int(lo)
            hi = None if hi is None else int(hi)
        out.append((ts, lo, hi))
    return out


def _multi_tensor_clamp(c: Any, bound: Any, ok: torch.Tensor | None = None) -> None:
    """``w <- clamp(w, lo, hi)``: ``torch._foreach_clamp_min_`` / ``_max_`` per device and dtype; under a
    device verdict ``ok`` out of place, then ``where(ok, clamped, w)``."""
    for ts, lo, hi in bound:
        if ok is not None:  # out of place, then where(ok, clamped, w)
            new = ts
            if lo is not None:
                new = torch._foreach_clamp_min(new, lo)
            if hi is not None:
                new = torch._foreach_clamp_max(new, hi)
            select_(ok, ts, new)
            continue
        if lo is not None:
            torch._foreach_clamp_min_(ts, lo)
        if hi is not None:
            torch._foreach_clamp_max_(ts, hi)


def _own_bind(c: Constraint, ts: list[torch.Tensor], plan: Any) -> Any:
    return ts, plan


def _own_apply(c: Constraint, bound: Any, ok: torch.Tensor | None = None) -> None:
    c.apply_(*bound)  # (no ok: a constraint of the user's does not gate, Constrain.gates)


def _kernels(c: Constraint) -> tuple[Callable[..., Any], Callable[..., None]]:
    """``(bind, run)``: the foreach path of ``c`` as two plain functions. ``bind(c, ts, plan)`` makes the
    lists of the plan's groups (once per plan: the rule set keeps them while the storage is unchanged);
    ``run(c, bound, ok)`` applies in place, with no Python work per tensor in the built-in ones. A
    constraint of the user's: its own ``apply_(ts, plan)``."""
    if isinstance(c, _Norm):
        return _norm_bind, _multi_tensor_norm
    if isinstance(c, _Clamp):
        return _clamp_bind, _multi_tensor_clamp
    return _own_bind, _own_apply


class Constrain(DeclaredRule):
    """A constraint declared on some tensors (phase ``after_grad``)."""

    phase = AFTER_GRAD
    per_optimizer_update = True

    def __init__(
        self,
        named: list[tuple[str, torch.Tensor]],
        constraint: Constraint,
        origin: str,
        foreach: bool = True,
        root: nn.Module | None = None,
        norms: str = "auto",
    ) -> None:
        super().__init__(origin)
        self.constraint = constraint
        self.norms = norms
        # a user callable has only the reference path: c(w) tensor by tensor
        self.foreach = foreach and not isinstance(constraint, CallableConstraint)
        self.kind = f"constrain:{constraint.name}"
        self._bind, self._run = _kernels(constraint)  # (the foreach path's two plain functions)
        self.infallible = constraint.infallible
        # declared on a module: follows its parameters by name (e.g. into fully_shard's DTensors)
        self.hold(named, root)
        # DTensors (FSDP2): positions constrained on their local shards (the foreach plan is over those
        # shards), and positions whose norms reduce over a sharded dim (rules/_sharded.py)
        self._sharded = False
        self._local_idx: list[int] = []
        self._reduce_idx: list[int] = []

    def same_kind(self) -> Any:
        return ("constrain", self.constraint.same_kind())

    @property
    def gates(self) -> bool:  # type: ignore[override]
        """The built-in constraints and callables apply under a device verdict (module docstring); a
        ``Constraint`` subclass of the user's may write in any way: its steps are decided on the host."""
        c = self.constraint
        return isinstance(c, CallableConstraint) or type(c).__module__ == __name__

    def settings(self) -> Any:
        c = self.constraint.settings()
        return None if c is None else (c, self.foreach)

    def describe(self) -> str:
        return f"pu.constrain({self.constraint.name})"

    def drop(self, ids: set[int]) -> bool:
        return not self.keep_except(ids)

    def keep_positions(self, keep: list[int]) -> None:
        super().keep_positions(keep)
        self._live = []

    def make_plan(self, ctx: CommitContext, live: list[Any]) -> Any:
        """Storage changed (the first commit, ``model.to()``, ``p.data = ...``): validate again before
        anything is written, and group for the foreach path."""
        ts = [t for t in live if t is not None]
        with no_subclass():
            for t, name in zip(ts, self.names):
                self.constraint.validate(ctx.index.name_of(t) or name, t, self.origin)
            self._sharded = sharding.any_sharded(ts) and not isinstance(self.constraint, CallableConstraint)
            if self._sharded:
                from ._sharded import split_norms

                # which norms are local (kept dim sharded, or nothing sharded) is decided on the global
                # layout, the same on every rank, so every rank joins the same collectives
                self._local_idx, self._reduce_idx = split_norms(self.constraint, ts, ctx.index, self.origin)
                return self.constraint.plan(sharding.locals_of([ts[i] for i in self._local_idx]), self.norms)
            return self.constraint.plan(ts, self.norms) if self.foreach else None

    def bind(self, ctx: CommitContext, live: list[Any]) -> Any:
        """The constraint's lists for plain aliases of the live tensors (:func:`_kernels`' ``bind``, the
        foreach path of a constraint on plain tensors). ``None`` (:meth:`run` makes them each commit)
        for DTensors, the reference path, and a traced commit, which takes the tensors themselves:
        dynamo guards them already (an alias would be one more)."""
        if self._sharded or not self.foreach or torch.compiler.is_compiling():
            return None
        bound = self._bind(self.constraint, aliases([t for t in live if t is not None]), self.plan)
        builtin = type(self.constraint).__module__ == __name__  # (a subclass of the user's: its own factor)
        return _norm_keep(bound) if self._bind is _norm_bind and builtin else bound

    def run(self, ctx: CommitContext, live: list[Any], args: Any) -> None:
        ok = ctx.ok
        if args is not None and not torch.compiler.is_compiling():
            # (plain aliases: no subclass to step around)
            self._run(self.constraint, args, ok)
            return
        ts = [t for t in live if t is not None]
        if self._sharded:  # DTensors: local shards, and one all-reduce for norms over sharded dims
            from ._sharded import apply_norms

            if self._local_idx:
                _multi_tensor_constraint(
                    self.constraint, sharding.locals_of([ts[i] for i in self._local_idx]), self.plan
                )
            if self._reduce_idx:
                apply_norms(self.constraint, [ts[i] for i in self._reduce_idx])
            return
        if not self.foreach:
            names = [ctx.index.name_of(t) or "?" for t in ts]
            _single_tensor_constraint(self.constraint, ts, names, self.origin, ok)
            return
        with plain_if(self._sub):
            _multi_tensor_constraint(self.constraint, ts, self.plan, ok)


def constrain(
    params: torch.Tensor | nn.Module | Any,
    constraint: Constraint | Callable[[torch.Tensor], torch.Tensor],
    *,
    foreach: bool | None = None,
    norms: str = "auto",
) -> Constrain:
    """Declare ``constraint`` on ``params``; phase ``after_grad``.

    After each ``optimizer.step()`` (once per optimizer update), every tensor
    of ``params`` is replaced by ``constraint(tensor)``. ``params``: a tensor,
    an iterable of tensors or ``(name, tensor)`` pairs, or a module (all its
    parameters). ``constraint``: ``pu.max_norm``, ``pu.unit_norm``,
    ``pu.non_neg``, ``pu.min_max_norm``, ``pu.clamp`` (foreach, Keras
    semantics; see the module docstring for the math and the ``dim``
    convention) or any callable ``tensor -> tensor`` (same shape and device).
    Several constraints on one tensor apply in declaration order. ``foreach=False``
    runs the reference path (``t <- c(t)`` tensor by tensor; equal to the foreach path
    up to the rounding of the norms). ``norms``: how the foreach path of a norm constraint
    computes row norms (``"auto"``, ``"segments"``, ``"concat"``, ``"each"``: see :data:`NORMS`; a
    speed choice, the result is the same up to rounding). Returns the rule (``.remove()`` undeclares it).
    """
    if norms not in NORMS:
        raise ValueError(f"pu.constrain: norms must be one of {NORMS}, not {norms!r}")
    origin = call_site(2)
    if not isinstance(constraint, Constraint):
        if not callable(constraint):
            raise TypeError(
                f"pu.constrain at {origin}: constraint must be a pu constraint or a callable, "
                f"not {type(constraint).__name__}"
            )
        constraint = CallableConstraint(constraint)
    named = named_tensors(params, "pu.constrain")
    if not named:
        raise ValueError(f"pu.constrain at {origin}: no tensors given")
    root = params if isinstance(params, nn.Module) else None
    refuse_inside_step("pu.constrain", origin, [t for _, t in named])
    check_declared(named, root, "pu.constrain", origin)
    for name, t in named:
        constraint.validate(name, t, origin)
    rule = Constrain(named, constraint, origin, foreach is not False, root, norms)
    adopt_known(rule, root)
    register(rule)
    return rule
