"""``sync="mean"`` / ``sync="sum"``: every rank commits the same value (distributed sync, rule 9).

The rule
    A target is *synced* in a step when one of its updates in that step asks
    for ``sync``. At commit, before anything is validated or written, the
    target's pending value ``v_r`` (its value at the end of the step on rank
    ``r``, after all of that rank's updates, in program order) is replaced on
    every rank by

    * ``sync="sum"``:  ``sum_r v_r``
    * ``sync="mean"``: ``(sum_r v_r) / R`` (``R`` = size of the process group;
      for integer targets the quotient is floored, ``torch.div(...,
      rounding_mode="floor")``)

    so every rank writes bitwise the same value. For an update of the form
    ``v_r = (1 - m) * old + m * s_r`` with ``old`` equal on all ranks (as
    after any synced commit), ``"mean"`` commits ``(1 - m) * old + m *
    mean_r(s_r)``: the mean over ranks of the per-rank updates. Because the
    values, not the deltas, are averaged, ranks whose ``old`` differ (buffers
    not broadcast at DDP construction) agree from the first synced commit on.

Collectives
    The pending values are flattened into one bucket per (device, reduction
    dtype) and all-reduced with one ``all_reduce(SUM)`` per bucket, whatever
    the number of targets and of reductions: ``float16``/``bfloat16``/
    ``float32`` travel as ``float32`` (the sum is rounded once, back to the
    target's dtype), integers as ``int64``, ``float64`` and complex as
    themselves. A model whose statistics are all ``float32`` on one device
    costs one collective per step.

    Seven numbers ride in the first bucket, so that agreeing costs nothing
    extra: the number of ranks whose *unsynced* pending values are not finite
    (so that ``on_nonfinite="skip"`` drops the step on every rank or on none,
    and ``"raise"`` raises on every rank), and a fingerprint ``x`` of the
    bucket layout (targets, shapes, dtypes, reductions, and the number of
    steps this stepper has opened), sent as small integers ``x`` together with
    ``x**2``: every rank sent the same ``x`` exactly when ``R * sum(x**2) ==
    sum(x)**2``. Ranks that disagree (one took a different branch, or skipped
    a step after an exception and went on) get an
    :class:`~paramupdates.UpdateError` on every rank, before anything is
    written. (A layout of a different *size* cannot
    be caught this way: gloo aborts the process with "Received data size
    doesn't match"; ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` names the collective.)

Group and timeout
    ``pu.Stepper(..., process_group=g, sync_timeout=s)`` (and the same
    arguments of ``pu.step`` and ``pu.attach``) reduce over ``g`` (default:
    the default process group) and wait at most ``s`` seconds for the other
    ranks (default: the group's own timeout, ``init_process_group(timeout=)``,
    30 minutes unless set). A rank that raised inside its step and never
    reaches the commit makes the others raise :class:`UpdateError` after
    the timeout, with nothing written; the process group is then unusable
    (a collective is left half done): destroy it and restart.

Registered into the core as its sync backend (``hooks.register_sync_backend``):
:class:`DistributedSync`.

Outside a step (eager outside a step, rule 8) a synced update is reduced at once: one blocking
``all_reduce`` over the default group per update, then the in-place write;
every rank must issue it. Without an initialised process group (one
process), or in a group of one, sync is the identity and costs nothing.
"""

from __future__ import annotations

import datetime
import functools
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.hooks import RemovableHandle

from .. import hooks, sharding
from ..errors import UpdateError, listed
from ..ops import apply_inplace, apply_op

if TYPE_CHECKING:
    from ..commit import Commit
    from ..journal import Entry, Journal

SYNC_KINDS = ("mean", "sum")
_CHUNKS = 3  # the layout fingerprint travels as 3 small integers x_i and their squares
_HEADER = 1 + 2 * _CHUNKS  # [ranks with non-finite unsynced values, x_1..x_3, x_1**2..x_3**2]


def is_distributed(group: Any = None) -> bool:
    """Whether sync has anything to do: an initialised group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def check_group(process_group: Any, sync_timeout: float | datetime.timedelta | None) -> float | None:
    """Validate ``process_group`` / ``sync_timeout`` of a stepper; the timeout in seconds."""
    if process_group is not None and not (dist.is_available() and dist.is_initialized()):
        raise UpdateError(
            "process_group was given, but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group(...) before creating the stepper."
        )
    if sync_timeout is None:
        return None
    secs = sync_timeout.total_seconds() if isinstance(sync_timeout, datetime.timedelta) else float(sync_timeout)
    if not secs > 0:
        raise ValueError(f"sync_timeout must be a positive number of seconds, not {sync_timeout!r}")
    return secs


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a synced value travels (and is summed) in."""
    if dtype.is_complex:
        return dtype
    if dtype.is_floating_point:
        return torch.float64 if dtype == torch.float64 else torch.float32
    return torch.int64


def _ddp_broadcasting(journal: Journal) -> Any:
    """The DistributedDataParallel that broadcasts this model's buffers in forward, if any.

    The model given to the stepper may be the DDP wrapper itself, or its
    ``.module``; in the second case the wrapper is the one whose forward is
    running (DDP sets ``_active_ddp_module`` around its module's forward).
    """
    for m in (getattr(DDP, "_active_ddp_module", None), journal.index.model):
        if isinstance(m, DDP):
            will = getattr(m, "will_sync_module_buffers", None)
            if will() if will is not None else bool(getattr(m, "broadcast_buffers", False)):
                return m
    return None


def _check_kind(where_: str, sync: str, dtype: torch.dtype) -> None:
    if sync not in SYNC_KINDS:
        raise UpdateError(f"{where_}: sync must be None, 'mean' or 'sum', not {sync!r}.")
    if dtype == torch.bool:
        raise UpdateError(
            f"{where_}: sync={sync!r} on a bool tensor has no meaning (a sum of bools is not a bool). "
            "Keep the flag as an integer (sync='sum' counts ranks) and compare it."
        )


def check_sync(journal: Journal, e: Entry, sync: str | None, phase: str, fn: str, origin: str) -> None:
    """Validate an update of a target that is (or becomes) synced; called at the call site."""
    where_ = f"{fn} on {e.name!r} at {origin}"
    if sync is not None:
        _check_kind(where_, sync, e.target.dtype)
        if e.sharded:  # a DTensor: only over the mesh dims that replicate it (HSDP)
            check_sync_target(e.target, where_, sync)
        if e.trainable:
            raise UpdateError(
                f"{where_}: sync={sync!r} on a trainable parameter is not supported "
                "(DDP already averages its gradients). Sync auxiliary (non-trainable) targets only."
            )
        if e.sync is not None and e.sync != sync:
            first = next(r.origin for r in e.records if r.sync)
            raise UpdateError(
                f"{where_}: sync={sync!r}, but an earlier update of {e.name!r} in this step (at {first}) "
                f"asked for sync={e.sync!r}. A target is reduced once per step: use one reduction."
            )
        if e.info is not None and e.info.kind == "buffer":
            ddp = _ddp_broadcasting(journal)
            if ddp is not None:
                raise UpdateError(
                    f"{where_} asks for sync={sync!r}, but the DistributedDataParallel around this model "
                    "broadcasts buffers (broadcast_buffers=True, the default): at the start of every forward it "
                    "copies rank 0's buffers into every rank, in place, so the pending statistics of the other "
                    "ranks would be overwritten between micro-batches (lost) and a buffer written before commit. "
                    "paramupdates already makes every rank commit the same value: construct it with "
                    "DistributedDataParallel(..., broadcast_buffers=False) "
                    "(forward_sync_buffers=False on torch >= 2.13)."
                )
    synced = sync is not None or e.sync is not None
    if synced and e.records and any(r.phase != phase for r in e.records):
        other = next(r for r in e.records if r.phase != phase)
        raise UpdateError(
            f"{where_}: {e.name!r} is synced in this step, and its updates would land in two phases "
            f"({other.phase!r} at {other.origin}, {phase!r} here). A synced target is reduced once, as "
            "its final value: issue all its updates of a step in one phase."
        )


def check_rules(commit: Commit, synced: Sequence[Entry]) -> None:
    """A declared rule may not write a synced target (its value is the reduced one)."""
    ids = {id(e.target): e for e in synced}
    for rule in commit.rules:
        for t in rule.tensors():
            e = ids.get(id(t))
            if e is not None:
                raise UpdateError(
                    f"{commit.label}: {e.name!r} is synced in this step (update at {e.records[-1].origin}) and "
                    f"also written by the {rule.kind} rule declared at {rule.origin}. A synced target commits "
                    "its reduced value: exclude it from the rule, or drop sync."
                )


@functools.lru_cache(maxsize=64)  # (layouts repeat step after step)
def _layout_crc(key: tuple) -> int:
    """CRC32 of a layout's text."""
    return zlib.crc32(";".join(f"{n}:{shape}:{dt}:{dev}:{how}" for n, how, dt, dev, shape in key).encode())


def layout_fingerprint(plan: Sequence[tuple[Any, Sequence[Entry]]], seq: int | None, world: int) -> list[int]:
    """``_CHUNKS`` integers in ``[0, 2**b)`` from a CRC of the layout and the step number.

    ``b`` is chosen so that ``world * sum(x**2)`` is exact in float32 (24-bit
    mantissa), the narrowest dtype a bucket travels in: 11 bits a chunk (33
    bits in all, the whole CRC) for 2 ranks, 5 bits for 4096 ranks. The
    device enters by type only: under NCCL rank r's tensors live on cuda:r.
    """
    key = tuple(
        (e.name, e.sync, e.value.dtype, e.value.device.type, tuple(e.value.shape)) for _k, es in plan for e in es
    )
    crc = zlib.crc32(f"#{seq}".encode(), _layout_crc(key))
    b = max(1, (24 - world.bit_length()) // 2)
    return [(crc >> (b * i)) % (1 << b) for i in range(_CHUNKS)]


def all_reduce_sum(flats: Sequence[torch.Tensor], group: Any, timeout: float | None) -> None:
    """``all_reduce(SUM)`` of each tensor, launched together, waited for within ``timeout`` seconds in all."""
    deadline = None if timeout is None else time.monotonic() + timeout
    works = [dist.all_reduce(f, op=dist.ReduceOp.SUM, group=group, async_op=True) for f in flats]
    for w in works:
        if deadline is None:
            w.wait()
        else:
            w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


def incomplete(what: str, err: RuntimeError, timeout: float | None, where_: str) -> UpdateError:
    """The error for a collective of ``what`` (who issued it, on which targets) that failed or timed out:
    which rank to suspect, and that this rank wrote nothing."""
    limit = "" if timeout is None else f" (sync_timeout={timeout:g} s)"
    return UpdateError(
        f"{what}: did not complete{limit}: {str(err).rstrip('.!')}. Another rank did not reach {where_} "
        "(did it raise inside its step, or stop?). The process group is now unusable (a collective is left "
        "half done): destroy it (torch.distributed.destroy_process_group()) and restart the job. Nothing was "
        "written on this rank."
    )


def _divide(flat: torch.Tensor, world: int) -> torch.Tensor:
    """``flat / world`` in place; floored for integers."""
    if flat.is_floating_point() or flat.is_complex():
        return flat.div_(world)
    return flat.copy_(torch.div(flat, world, rounding_mode="floor"))


def apply_eager(
    op: str, target: torch.Tensor, operand: Any, key: Any, cond: torch.Tensor | None, sync: str, name: str, origin: str
) -> None:
    """A synced update outside a step (eager outside a step, rule 8 with distributed sync (rule 9)): reduce the new value now, then write it.

    One blocking ``all_reduce`` over the default group per update (the
    group's timeout applies): every rank must issue it, as any collective.
    Without a process group it is the plain eager update.
    """
    _check_kind(f"pu.{op} on {name!r} at {origin}", sync, target.dtype)
    if sharding.is_sharded(target):  # a DTensor: reduced among the replicas of each shard (HSDP), or refused
        from ..rules._sharded import like

        check_sync_target(target, f"pu.{op} on {name!r} at {origin}", sync)
        with torch.no_grad():
            new = like(target, apply_op(op, target.detach(), operand, key, cond))
            try:
                new = sync_dtensor(new, sync)
            except RuntimeError as err:
                raise incomplete(
                    f"pu.{op} on {name!r} at {origin} (sync={sync!r}, outside a step)", err, None, "this update"
                ) from err
            sharding.local(target).copy_(sharding.local(new))
        return
    if not is_distributed():
        apply_inplace(op, target, operand, key, cond)
        return
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        raw = target.detach()
        flat = apply_op(op, raw, operand, key, cond).reshape(-1).to(_acc_dtype(raw.dtype), copy=True)
        try:
            all_reduce_sum([flat], None, None)
        except RuntimeError as err:
            raise incomplete(
                f"pu.{op} on {name!r} at {origin} (sync={sync!r}, outside a step)", err, None, "this update"
            ) from err
        if sync == "mean":
            _divide(flat, dist.get_world_size())
        raw.copy_(flat.view(raw.shape))


def _syncing(commit: Commit, entries: Sequence[Entry], group: Any) -> str:
    """What a failed sync of ``entries`` was, for :func:`incomplete`."""
    names = listed([repr(e.name) for e in entries], 4)
    return (
        f"{commit.label}: sync of {len(entries)} target(s) ({names}; last update at {entries[-1].records[-1].origin}) "
        f"over {dist.get_world_size(group)} ranks"
    )


def _sync_sharded(commit: Commit, entries: Sequence[Entry], group: Any, timeout: Any) -> list[Entry]:
    """Reduce the DTensor entries (HSDP) each among the replicas of its shard, not in the buckets;
    returns the others."""
    for e in entries:
        if e.sharded:
            try:
                e.value = sync_dtensor(e.value, e.sync, timeout)
            except RuntimeError as err:
                raise incomplete(_syncing(commit, [e], group), err, timeout, "this commit") from err
    return [e for e in entries if not e.sharded]


def _buckets(entries: Sequence[Entry]) -> list[tuple[tuple[torch.device, torch.dtype], list[Entry]]]:
    """The entries in buckets by (device, accumulation dtype), deterministic on every rank: the buckets
    sorted by their key, means before sums within each."""
    groups: dict[tuple[torch.device, torch.dtype], list[Entry]] = {}
    for e in entries:
        assert e.value is not None and e.sync is not None
        v = e.value
        groups.setdefault((v.device, _acc_dtype(v.dtype)), []).append(e)
    keys = sorted(groups, key=lambda k: (str(k[0]), str(k[1])))
    return [(k, sorted(groups[k], key=lambda e: e.sync != "mean")) for k in keys]


def sync_entries(commit: Commit, entries: Sequence[Entry], local_nonfinite: bool = False) -> int:
    """All-reduce the pending values of ``entries`` in place of the values (see the module docstring).

    ``local_nonfinite``: whether this rank's unsynced pending values are not
    all finite. Returns how many ranks reported such values.
    """
    group = commit.options.process_group
    timeout = commit.options.sync_timeout
    if not is_distributed(group):
        return 0
    entries = _sync_sharded(commit, entries, group, timeout)
    if not entries:
        return 0
    world = dist.get_world_size(group)
    plan = _buckets(entries)
    fp = layout_fingerprint(plan, commit.seq, world)
    flats: list[torch.Tensor] = []
    for i, (_k, ents) in enumerate(plan):
        v0 = ents[0].value
        acc = _acc_dtype(v0.dtype)
        # Pending values of non-trainable targets are detached already; cat
        # promotes float16/bfloat16 to float32 and narrow ints to int64.
        parts = [e.value.reshape(-1) for e in ents]
        if i == 0:
            head = [int(local_nonfinite), *fp, *(x * x for x in fp)]
            parts.insert(0, torch.tensor(head, dtype=acc, device=v0.device))
        flat = torch.cat(parts)
        flats.append(flat if flat.dtype == acc else flat.to(acc))
    try:
        all_reduce_sum(flats, group, timeout)
    except RuntimeError as err:
        raise incomplete(_syncing(commit, entries, group), err, timeout, "this commit") from err
    head = [int(h.real) if isinstance(h, complex) else int(h) for h in flats[0][:_HEADER].tolist()]
    nbad, sx, sxx = head[0], head[1 : 1 + _CHUNKS], head[1 + _CHUNKS :]
    # every rank sent the same x_i exactly when R * sum(x_i**2) == sum(x_i)**2 (Cauchy-Schwarz)
    if any(world * q != s * s for s, q in zip(sx, sxx)):
        raise UpdateError(
            f"{_syncing(commit, entries, group)}: the ranks disagree: they are not committing the same synced targets (names, shapes, dtypes, "
            "reductions) or not the same step of their stepper. Every rank must issue its synced updates "
            "to the same targets in each step (a pu.when(tensor) condition is fine, a Python branch that "
            "differs between ranks is not), and a rank whose step raised must not go on alone. Nothing was "
            "written on this rank."
        )
    for i, (_k, ents) in enumerate(plan):
        flat = flats[i][_HEADER:] if i == 0 else flats[i]
        n_mean = sum(e.value.numel() for e in ents if e.sync == "mean")
        if n_mean:
            _divide(flat[:n_mean], world)
        for e, part in zip(ents, flat.split([e.value.numel() for e in ents])):
            v = part.view(e.value.shape)
            e.value = v if v.dtype == e.value.dtype else v.to(e.value.dtype)
    return nbad


# ----------------------------------------------------------------------------
# sync= on DTensors (rule 9 with sharding)
# ----------------------------------------------------------------------------
def replicate_dims(t: Any) -> list[int]:
    """The mesh dims over which ``t`` is replicated (HSDP's replicate dim)."""
    return [i for i, p in enumerate(t.placements) if p.is_replicate()]


def check_sync_target(t: Any, where_: str, sync: str) -> None:
    """``sync=`` on a DTensor: refused unless some mesh dim replicates it."""
    if not replicate_dims(t):
        raise UpdateError(
            f"{where_}: sync={sync!r} on a sharded target (placements {tuple(t.placements)}): each rank holds a "
            "different Shard of it, so a mean over ranks would mix different rows. FSDP already averages the "
            "gradients; to average a statistic across ranks keep it in a buffer (FSDP does not shard buffers) "
            "and sync that. (Over HSDP's Replicate mesh dims a sharded target can be synced.)"
        )


def sync_dtensor(value: Any, sync: str, timeout: float | None = None) -> Any:
    """``value`` (a DTensor) with its local shard summed (``"sum"``) or averaged (``"mean"``) over the
    mesh dims that replicate it: the replicas of one shard agree, shards stay apart."""
    from torch.distributed.tensor import DTensor

    loc = sharding.local(value).detach()
    flat = loc.reshape(-1).to(_acc_dtype(loc.dtype), copy=True)
    count = 1
    for md in replicate_dims(value):
        all_reduce_sum([flat], value.device_mesh.get_group(md), timeout)
        count *= value.device_mesh.size(md)
    if sync == "mean":
        _divide(flat, count)
    out = flat.view(loc.shape).to(loc.dtype)
    return DTensor.from_local(
        out, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    )


class DistributedSync:
    """The core's sync backend: ``torch.distributed`` all-reduces (see the module docstring)."""

    def check_options(self, process_group: Any, sync_timeout: Any) -> float | None:
        return check_group(process_group, sync_timeout)

    def active(self, process_group: Any = None) -> bool:
        return is_distributed(process_group)

    def check_update(self, journal: Journal, e: Entry, sync: str | None, phase: str, fn: str, origin: str) -> None:
        check_sync(journal, e, sync, phase, fn, origin)

    def check_rules(self, commit: Commit, synced: list[Entry]) -> None:
        check_rules(commit, synced)

    def reduce(self, commit: Commit, synced: list[Entry], local_nonfinite: bool) -> int:
        return sync_entries(commit, synced, local_nonfinite)

    def apply_eager(
        self, op: str, target: torch.Tensor, operand: Any, key: Any, cond: Any, sync: str, name: str, origin: str
    ) -> None:
        apply_eager(op, target, operand, key, cond, sync, name, origin)


def install() -> list[RemovableHandle]:
    """Register the sync backend (``paramupdates/__init__.py`` calls it)."""
    return [hooks.register_sync_backend(DistributedSync())]
