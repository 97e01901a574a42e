"""Finiteness, opt-in (validated commit, rule 7): one batched check of the pending values and of the
gradients the optimizer will use, as one 0-dim bool on the device.

Called only when a step asks for it (``on_nonfinite="skip"`` / ``"raise"``, as
``optax.apply_if_finite`` and ``torch.amp.GradScaler`` check): by default the commit never waits on
the device. Values are grouped by device and dtype in C (``_group_tensors_by_device_and_dtype``);
each floating group is reduced in a few kernels; the flags of all groups meet in one 0-dim bool
(:func:`device_flag`). The commit either applies the step under that flag, on the device
(``on_nonfinite="skip"`` where every writer can take it), or reads it once (:func:`finite_flag`: the
one host sync). Nothing here writes a tensor: gradients are read, never unscaled or rewritten.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .. import sharding
from ..records import Entry


def pending_values(j: Any, unsynced: bool = False) -> list[torch.Tensor]:
    """Every pending value of ``j``'s entries (``unsynced``: but those of synced entries)."""
    return [
        e.value for e in j.entries.values() if e.value is not None and not (unsynced and e.sync is not None)
    ] + j.loose_src  # (a loose record's target is never synced)


def finite_flag(values: list[torch.Tensor], sharded: bool = False, grads: list[torch.Tensor] = ()) -> bool | None:
    """Whether all of ``values`` and ``grads`` are finite (None if none is floating): :func:`device_flag`,
    read once on the host (the one host sync of the check)."""
    ok = device_flag(values, sharded, grads)
    return None if ok is None else bool(ok)


def device_flag(
    values: list[torch.Tensor], sharded: bool = False, grads: list[torch.Tensor] = ()
) -> torch.Tensor | None:
    """A 0-dim bool on the device, never read here: whether all of ``values`` and ``grads`` are finite;
    None if none is floating. ``sharded``: some may be DTensors (their
    local shards are checked).

    The values are grouped by device and dtype in C; each floating group is checked in a few kernels
    (:func:`group_finite`, exact); the flags of all groups meet on one device (an accelerator's, if any:
    a flag is moved there without a wait) in one ``all``."""
    if not values and not grads:
        return None
    groups: list[list[torch.Tensor]] = []
    with torch.no_grad():
        vals = sharding.locals_of(values) if sharded and values else values
        for (_dev, dt), ([ts], _) in _group_tensors_by_device_and_dtype([vals]).items() if vals else ():
            if dt.is_floating_point or dt.is_complex:
                groups.append(ts)
        if grads:
            groups.extend(_grad_groups(grads, sharded))
        groups = [g for g in (_nonempty(ts) for ts in groups) if g]
        if not groups:
            return None
        flags = [group_finite(ts) for ts in groups]
        return flags[0] if len(flags) == 1 else torch.stack(on_one_device(flags)).all()


def on_one_device(flags: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flags`` (0-dim tensors) moved without a wait to one device: an accelerator's where any is on one
    (a copy onto the CPU that did not wait could be read before it is made), else the CPU."""
    dev = next((f.device for f in flags if not f.is_cpu), flags[0].device)
    return [f if f.device == dev else f.to(dev, non_blocking=True) for f in flags]


def _nonempty(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``ts`` without its empty tensors (nothing to check; ``_chunk_cat`` and ``_foreach_norm`` refuse
    them: an empty buffer, an empty local shard of an uneven ``Shard``)."""
    return ts if all(map(torch.Tensor.numel, ts)) else [t for t in ts if t.numel()]


CAT_NUMEL = 1 << 17
"""Up to this many elements, a group of values is checked as one concatenation (a copy: cheaper than a
kernel per tensor, measured 3-7x for 100 tensors of 16 to 256 elements on CPU); above, with no copy:
on CPU one ``torch.aminmax`` per tensor, on accelerators one ``torch._foreach_norm(ts, inf)`` (the
fused multi-tensor kernel)."""


def group_finite(ts: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool: True exactly when every element of ``ts`` (one device and dtype, none empty) is finite.

    What is reduced is the extremes, never a sum that a finite group could overflow: the minimum and
    maximum (``torch.aminmax``: a NaN propagates into both, an infinity is one of them), or on an
    accelerator the largest magnitude (``_foreach_norm(ts, inf)``, which propagates NaN). The extremes of
    finite values are finite in their own dtype, so a finite group is never taken for a non-finite one."""
    if ts[0].is_complex():
        ts = [torch.view_as_real(t) for t in ts]
    if sum(map(torch.Tensor.numel, ts)) <= CAT_NUMEL:
        if all(map((1).__eq__, map(torch.Tensor.dim, ts))):
            # 1-D values (statistics): the fastest concatenation (every one 1-D: checked, not caught,
            # since dynamo cannot catch the error of a traced cat, and gradients of any rank join them)
            flat = torch.cat(ts)
        else:
            chunk_cat = getattr(torch, "_chunk_cat", None)
            ts_ = [t if t.dim() else t.reshape(1) for t in ts]
            flat = chunk_cat(ts_, 0, 1) if chunk_cat is not None else torch.cat([t.reshape(-1) for t in ts_])
        return torch.stack(torch.aminmax(flat)).isfinite().all()
    if not ts[0].is_cpu:
        return torch.stack(torch._foreach_norm(ts, float("inf"))).isfinite().all()
    return torch.stack([x for t in ts for x in torch.aminmax(t)]).isfinite().all()


_grad_of = torch._C.TensorBase.grad.__get__  # the C getters, mapped without a Python-level loop
_requires_grad = torch._C.TensorBase.requires_grad.__get__
_layout_of = torch._C.TensorBase.layout.__get__


def _dense(g: torch.Tensor) -> torch.Tensor:
    """A sparse gradient's values (what decides whether it is finite); a dense one as it is."""
    return g if g.layout == torch.strided else g.coalesce().values()


def _grad_groups(grads: list[torch.Tensor], sharded: bool) -> list[list[torch.Tensor]]:
    """The floating gradients, per device and dtype, to be read (never written: GradScaler's kernel,
    ``torch._amp_foreach_non_finite_check_and_unscale_``, writes every value back, and raises on an
    ``expand()``-ed gradient, which every torch optimizer accepts); sparse gradients by their values."""
    gs = sharding.locals_of(grads) if sharded else grads
    if any(layout is not torch.strided for layout in set(map(_layout_of, gs))):
        gs = list(map(_dense, gs))
    return [
        ts
        for (_dev, dt), ([ts], _) in _group_tensors_by_device_and_dtype([gs]).items()
        if dt.is_floating_point or dt.is_complex
    ]


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


def nonfinite(j: Any, grads: list[torch.Tensor], sharded: bool) -> tuple[list[Entry], list[int]]:
    """The entries whose pending value is not finite, and the indices of the non-finite ``grads``
    (one batched check for all; per tensor only on failure)."""
    ok = finite_flag(pending_values(j), sharded, grads)
    if ok is None or ok:
        return [], []
    j.settle()  # name them: loose records get their entries
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
