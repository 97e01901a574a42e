"""``sync="mean"`` / ``sync="sum"``: all-reduce pending values at commit (rule 9).

At commit, before validation and before anything is written, the pending
values of synced targets are flattened into one bucket per (device, dtype,
reduction) and all-reduced over the default process group, so every rank
commits the same value. Without an initialised process group (a single
process) the world has one member and sync changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ..transaction import Entry


def _reduction(e: Entry) -> str:
    kinds = {r.sync for r in e.records if r.sync}
    if len(kinds) > 1:
        from ..errors import UpdateError

        raise UpdateError(
            f"{e.name!r}: updates in one step ask for different sync reductions {sorted(kinds)} "
            f"(last at {e.records[-1].origin}); use one."
        )
    return kinds.pop()


def sync_entries(entries: Sequence[Entry], group: dist.ProcessGroup | None = None) -> None:
    """All-reduce the pending value of each entry (bucketed), in place of the value."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(group)
    buckets: dict[tuple[torch.device, torch.dtype, str], list[Entry]] = {}
    for e in entries:
        assert e.value is not None
        buckets.setdefault((e.value.device, e.value.dtype, _reduction(e)), []).append(e)
    for (_dev, dtype, how), ents in sorted(buckets.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]), kv[0][2])):
        flat = torch.cat([e.value.detach().reshape(-1) for e in ents])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if how == "mean":
            if dtype.is_floating_point or dtype.is_complex:
                flat = flat / world
            else:
                flat = torch.div(flat, world, rounding_mode="floor")
        for e, part in zip(ents, flat.split([e.value.numel() for e in ents])):
            e.value = part.view(e.value.shape).to(dtype)
