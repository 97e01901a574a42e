"""Norm constraints on DTensors (FSDP2's sharded parameters), and values laid out like a DTensor.

A norm constraint ``w <- w * f(n)`` needs, per kept index along ``dim``, the
L2 norm ``n`` over every *other* dim. On a DTensor ``w`` with placements
``P`` (one per mesh dim):

* if no mesh dim shards a reduced dim (FSDP2's ``Shard(0)`` with ``dim=0``: a
  rank holds whole rows), every norm lies inside one rank's shard: the
  constraint runs on the local shards with the single-process foreach path,
  and no collective is issued (``split_norms`` puts such tensors in the local
  list);
* else each rank computes, on its local shard, the partial sums of squares
  ``s_r = sum over the reduced dims of w_r**2`` (a vector along the kept dim,
  or a scalar for ``dim=None``), and ``n = sqrt(sum_r s_r)`` where the sum runs
  over the ranks of the mesh dims that shard a reduced dim. The partial sums
  of *every* tensor of the rule that needs one go into one flat buffer and
  one ``all_reduce(SUM)`` per group of such mesh dims (one for FSDP2's 1-D
  mesh), then each rank scales its own shard by ``f(n)``.

A rank whose shard is empty (a weight with fewer rows than ranks) contributes
zeros and still joins the all-reduce: whether a tensor needs one is decided
from its global shape and placements, which every rank shares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import sharding
from ..errors import UpdateError

if TYPE_CHECKING:
    from ..targets import ModelIndex

Constraint = Any  # a rules.constraints.Constraint (a norm constraint with .dim / .norm_bound)


def _reduced_dims(t: torch.Tensor, dim: int | None) -> tuple[int, ...]:
    if dim is None or t.ndim == 0:
        return tuple(range(t.ndim))
    d = dim % t.ndim
    return tuple(i for i in range(t.ndim) if i != d)


def _mesh_dims(t: Any, dim: int | None, index: ModelIndex | None = None, origin: str = "?") -> tuple[int, ...]:
    """The mesh dims that shard one of the dims a norm of ``t`` reduces over."""
    reduced = _reduced_dims(t, dim)
    out = []
    for i, p in enumerate(t.placements):
        if p.is_partial():
            name = (index.name_of(t) if index is not None else None) or "?"
            raise UpdateError(
                f"constraint declared at {origin}: {name!r} is a DTensor with a Partial placement (a pending "
                "reduction); a constraint needs its value. Redistribute it to Shard/Replicate first."
            )
        if p.is_shard() and (dim is None or p.dim % max(t.ndim, 1) in reduced):
            out.append(i)
    return tuple(out)


def split_norms(
    constraint: Constraint, ts: list[torch.Tensor], index: ModelIndex, origin: str
) -> tuple[list[int], list[int]]:
    """Positions of ``ts`` constrained on their local shards, and those whose norms need an all-reduce."""
    if not hasattr(constraint, "factor"):  # not a norm constraint (constraints._Norm): elementwise, local
        return list(range(len(ts))), []
    local_idx, reduce_idx = [], []
    for i, t in enumerate(ts):
        if sharding.is_sharded(t) and _mesh_dims(t, constraint.dim, index, origin):
            reduce_idx.append(i)
        else:
            local_idx.append(i)
    return local_idx, reduce_idx


def apply_norms(constraint: Any, ts: list[Any]) -> None:
    """``w <- w * factor(n)`` for DTensors whose norms span shards: one all-reduce per group of mesh dims."""
    dim = constraint.dim
    buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]]] = {}
    for t in ts:
        loc = sharding.local(t)
        reduced = _reduced_dims(t, dim)
        acc = torch.float64 if loc.dtype == torch.float64 else torch.float32
        sq = loc.to(acc).square()
        part = sq.sum() if dim is None or t.ndim == 0 else sq.sum(dim=reduced, keepdim=True)
        key = (id(t.device_mesh), _mesh_dims(t, dim), acc)
        buckets.setdefault(key, []).append((loc, part, t.device_mesh))  # type: ignore[arg-type]
    for (_mesh_id, mesh_dims, _acc), items in sorted(buckets.items(), key=lambda kv: (kv[0][1], str(kv[0][2]))):
        flat = torch.cat([p.reshape(-1) for _, p, _ in items])
        mesh = items[0][2]
        for md in mesh_dims:  # a sum over a grid of ranks is the sum over each of its mesh dims in turn
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=mesh.get_group(md))
        norms = flat.sqrt_()
        factors = constraint.factor(norms)
        at = 0
        for loc, part, _ in items:
            f = factors[at : at + part.numel()].view(part.shape)
            at += part.numel()
            if loc.numel():
                loc.mul_(f.to(loc.dtype))


def like(t: Any, value: torch.Tensor) -> Any:
    """``value`` as a DTensor placed like ``t``.

    A plain tensor is taken as the whole value, the same on every rank
    (replicated); keeping ``t``'s shards of it is local (no communication).
    A DTensor placed differently is redistributed (which may communicate).
    """
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(value, DTensor):
        if value.ndim == 0:
            value = value.expand(t.shape)
        rep = DTensor.from_local(
            value,
            t.device_mesh,
            [Replicate()] * t.device_mesh.ndim,
            run_check=False,
            shape=t.shape,
            stride=value.stride(),
        )
        return rep.redistribute(t.device_mesh, t.placements)
    if tuple(value.placements) != tuple(t.placements) or value.device_mesh != t.device_mesh:
        return value.redistribute(t.device_mesh, t.placements)
    return value
