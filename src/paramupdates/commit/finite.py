"""Finiteness, opt-in (validated commit, rule 7): one batched check of the pending values and of the
gradients the optimizer will use, and one host sync for all.

Called only when a step asks for it (``on_nonfinite="skip"`` / ``"raise"``, as
``optax.apply_if_finite`` and ``torch.amp.GradScaler`` check): by default the commit never waits on
the device. Values are grouped by device and dtype in C (``_group_tensors_by_device_and_dtype``);
each floating group is reduced in a few kernels; the flags of all groups meet in one 0-dim bool.
Nothing here writes a tensor: gradients are read, never unscaled or rewritten.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .. import sharding
from ..records import Entry


def pending_values(j: Any, unsynced: bool = False) -> list[torch.Tensor]:
    """Every pending value of ``j``'s entries (``unsynced``: but those of synced entries; rows: see
    ``Commit._row_groups``)."""
    return [e.value for e in j.entries.values() if e.value is not None and not (unsynced and e.sync is not None)]


def finite_flag(
    values: list[torch.Tensor], sharded: bool = False, grouped: dict | None = None, grads: list[torch.Tensor] = ()
) -> torch.Tensor | None:
    """A 0-dim bool on the CPU: all of ``values`` finite (None if none is floating); ``sharded``: some
    may be DTensors (their local shards are checked); ``grouped``: more values, already grouped by
    ``_group_tensors_by_device_and_dtype([dst, src])`` (the rows' commit groups: their ``src``).

    The values are grouped by device and dtype in C; each floating group is checked in a few
    kernels (:func:`_group_finite`); one host sync for all.
    """
    if not values and not grouped and not grads:
        return None
    flags = []
    with torch.no_grad():
        vals = values
        if sharded and vals:
            vals = sharding.locals_of(values)
            if not all(map(torch.Tensor.numel, vals)):
                # an empty tensor (an empty local shard: a rank past the last chunk of an uneven Shard) has
                # nothing to check, and _foreach_norm(inf) refuses it
                vals = [v for v in vals if v.numel()]
        for (_dev, dt), ([ts], _) in _group_tensors_by_device_and_dtype([vals]).items() if vals else ():
            if dt.is_floating_point or dt.is_complex:
                flags.append(group_finite(ts).cpu())
        for (_dev, dt), ([_dst, ts], _) in grouped.items() if grouped else ():
            if dt.is_floating_point or dt.is_complex:
                flags.append(group_finite(ts).cpu())
        if grads:
            flags.extend(_grads_finite(grads, sharded))
    if not flags:
        return None
    return flags[0] if len(flags) == 1 else torch.stack(flags).all()


CAT_NUMEL = 1 << 22
"""Up to this many elements, a group of values is checked as one concatenation (a copy: cheaper than a
kernel per tensor, measured 3-7x for 100 tensors of 16 to 256 elements on CPU); above, per tensor, with
no copy (``torch._foreach_norm(inf)``)."""


def group_finite(ts: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool: every element of ``ts`` (one device and dtype) is finite."""
    if not all(map(torch.Tensor.numel, ts)):
        ts = [t for t in ts if t.numel()]  # an empty tensor has nothing to check (and _chunk_cat refuses it)
        if not ts:
            return torch.ones((), dtype=torch.bool)
    if sum(map(torch.Tensor.numel, ts)) <= CAT_NUMEL:
        if all(map((1).__eq__, map(torch.Tensor.dim, ts))):
            # 1-D values (statistics): the fastest concatenation (every one 1-D: checked, not caught,
            # since dynamo cannot catch the error of a traced cat, and gradients of any rank join them)
            return torch.cat(ts).isfinite().all()
        chunk_cat = getattr(torch, "_chunk_cat", None)
        if chunk_cat is not None:
            return chunk_cat([t if t.dim() else t.reshape(1) for t in ts], 0, 1).isfinite().all()
    return torch.stack(torch._foreach_norm(ts, math.inf)).isfinite().all()


_grad_of = torch._C.TensorBase.grad.__get__  # the C getters, mapped without a Python-level loop
_requires_grad = torch._C.TensorBase.requires_grad.__get__
_layout_of = torch._C.TensorBase.layout.__get__


def _dense(g: torch.Tensor) -> torch.Tensor:
    """A sparse gradient's values (what decides whether it is finite); a dense one as it is."""
    return g if g.layout == torch.strided else g.coalesce().values()


def _grads_finite(grads: list[torch.Tensor], sharded: bool) -> list[torch.Tensor]:
    """Per device and dtype of ``grads``, a 0-dim bool on the CPU: all finite. The gradients are read,
    never written (``torch._amp_foreach_non_finite_check_and_unscale_``, GradScaler's kernel, writes
    every value back: an ``expand()``-ed gradient, which every torch optimizer accepts, would make it
    raise); sparse gradients are checked by their values."""
    gs = sharding.locals_of(grads) if sharded else grads
    if any(layout is not torch.strided for layout in set(map(_layout_of, gs))):
        gs = list(map(_dense, gs))
    out = []
    for (_dev, dt), ([ts], _) in _group_tensors_by_device_and_dtype([gs]).items():
        if dt.is_floating_point or dt.is_complex:
            out.append(group_finite(ts).cpu())
    return out


def optimizer_grads(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters of ``optimizer`` that have a gradient, and those gradients: what
    ``optimizer.step()`` will use (its param groups as they are now: read at each commit, since a
    group's list can be edited in place)."""
    params = list(itertools.chain.from_iterable([g["params"] for g in optimizer.param_groups]))
    grads = list(map(_grad_of, params))
    if any(map(operator.is_, grads, itertools.repeat(None))):
        kept = [(p, g) for p, g in zip(params, grads) if g is not None]
        params, grads = [p for p, _ in kept], [g for _, g in kept]
    return params, grads


def nonfinite(
    j: Any, rows_grouped: dict | None, grads: list[torch.Tensor], sharded: bool
) -> tuple[list[Entry], list[int]]:
    """The entries whose pending value is not finite, and the indices of the non-finite ``grads``
    (one batched check for all; per tensor only on failure)."""
    ok = finite_flag(pending_values(j), sharded, rows_grouped, grads)
    if ok is None or bool(ok):
        return [], []
    j.absorb()  # name them: rows become entries
    entries = list(j.entries.values())
    bad = [
        e
        for e in entries
        if e.value is not None
        and (e.value.is_floating_point() or e.value.is_complex())
        and not bool(sharding.local(e.value).isfinite().all())
    ]
    bad_grads = [
        i
        for i, g in enumerate(grads)
        if (g.is_floating_point() or g.is_complex()) and not bool(_dense(sharding.local(g)).isfinite().all())
    ]
    return bad, bad_grads
