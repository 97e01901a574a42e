"""The transaction behind a step: recording, the read-your-writes overlay, commit.

Recording (rules 1, 2, 5, 6)
    An update issued inside a step is validated (shape, dtype kind, device,
    phase) at its call site and recorded as ``(op, operand, condition, phase,
    origin)``. The target's pending value is computed out of place
    (``_ops.apply_op``) and becomes what reads of the target return:

    * a ``pu.Parameter`` reads its pending value through ``__torch_function__``
      (any reference to it, any op, ``print``);
    * a buffer of a module reads it through the module attribute
      (``module.running_mean``): the module's buffer slot holds the pending
      tensor until commit, and updates to that tensor go to the same target;
    * a plain ``torch.nn.Parameter`` keeps its committed value for
      ``module.weight`` (so ``model.parameters()`` and gradients are never
      disturbed); ``pu.read(p)`` returns its pending value.

    No storage is written (rule 2): saved tensors stay valid, version counters
    do not move.

Commit (rules 4, 7)
    1. the overlay is removed; synced values are all-reduced; every pending
       value is checked for finiteness in one batched reduction;
    2. ``before_grad`` -> the optimizer's step -> ``after_grad`` ->
       ``auxiliary`` -> ``after_step``: in each phase the declared rules (in
       declaration order), then the recorded updates (in issue order);
    3. before a tensor is first written, it is snapshotted (one foreach copy
       per device and dtype, into buffers kept between commits on CPU: see
       ``_snapshot``; the optimizer's parameters and state likewise), so an
       exception in the commit restores
       every tensor bitwise. Snapshots are taken only while a *fallible* stage
       is still to come (the optimizer's step, a rule that does not declare
       itself ``infallible``, e.g. a user-callable constraint): what is written
       after the last fallible stage cannot be undone by a failure, because no
       failure can follow it. Every rule's :meth:`Rule.check` runs before the
       first write, so a built-in rule fails (if at all) before anything moves.

    A target whose updates all lie in one phase and that nothing else wrote
    before that phase takes its pending value as is: one ``torch._foreach_copy_``
    per device and dtype. Other targets fold their records, in issue order,
    over the value the target has when their phase comes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from . import _state, conditions
from ._ops import apply_op, check_operand
from ._snapshot import Copies, SnapshotPool, clone_all
from .errors import AmbiguousOrderError, UpdateError
from .rules._fast import RuleCache
from .rules.base import Rule, rules_for
from .schedule import (
    AFTER_GRAD,
    AFTER_STEP,
    AUXILIARY,
    BEFORE_GRAD,
    GRAD,
    PHASES,
    Schedule,
    ScheduleEntry,
)
from .targets import ModelIndex, TargetInfo, describe, owner_anywhere

if TYPE_CHECKING:
    pass

_RECORD_PHASES = (BEFORE_GRAD, AFTER_GRAD, AUXILIARY, AFTER_STEP)


@dataclass(eq=False, slots=True)
class Record:
    """One issued update."""

    op: str
    operand: Any
    key: Any
    cond: torch.Tensor | None
    phase: str
    sync: str | None
    origin: str


@dataclass(eq=False)
class Entry:
    """A target with pending updates in one transaction."""

    target: torch.Tensor
    name: str
    info: TargetInfo | None
    trainable: bool
    value: torch.Tensor | None = None
    records: list[Record] = field(default_factory=list)
    swapped: bool = False
    sync: str | None = None  # "mean"/"sum" when an update of this step asked for it (rule 9)

    def base(self) -> torch.Tensor:
        return self.target

    def current(self) -> torch.Tensor:
        return self.target if self.value is None else self.value

    _phases: frozenset[str] = frozenset()
    _phases_n: int = 0

    def phases(self) -> frozenset[str]:
        """The phases of this entry's records (cached until a record is added)."""
        if self._phases_n != len(self.records):
            self._phases = frozenset(r.phase for r in self.records)
            self._phases_n = len(self.records)
        return self._phases


_PU_PARAMETER: type | None = None


def _is_pu_parameter(t: object) -> bool:
    global _PU_PARAMETER
    if _PU_PARAMETER is None:  # imported on first use: parameter.py imports this module's users
        from .parameter import Parameter

        _PU_PARAMETER = Parameter
    return isinstance(t, _PU_PARAMETER)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor sharing storage, version counter and autograd."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.view_as(t)


class CommitContext:
    """What rules see at commit: the optimizer, the model index, lr lookup."""

    def __init__(self, tx: Transaction) -> None:
        self.tx = tx
        self.optimizer = tx.optimizer
        self.index = tx.index
        self._lr: dict[int, float] | None = None

    def lr_of(self, p: torch.Tensor) -> float | None:
        """The learning rate of ``p``'s optimizer param group (None if not in it)."""
        if self.optimizer is None:
            return None
        if self._lr is None:
            self._lr = {}
            for g in self.optimizer.param_groups:
                lr = g.get("lr")
                lr = float(lr) if lr is not None else None
                for q in g["params"]:
                    self._lr[id(q)] = lr
        return self._lr.get(id(p))


class Transaction:
    """Pending updates of one step of one model (with its optimizer)."""

    def __init__(
        self,
        index: ModelIndex,
        optimizer: torch.optim.Optimizer | None,
        *,
        check_finite: bool = True,
        on_nonfinite: str = "raise",
        atomic: bool = True,
        label: str = "pu.step",
        process_group: Any = None,
        sync_timeout: float | None = None,
        seq: int | None = None,
        pool: SnapshotPool | None = None,
        rule_cache: RuleCache | None = None,
    ) -> None:
        self.index = index
        self.pool = pool  # where rollback copies live (kept CPU buffers); None: fresh copies
        self.rule_cache = rule_cache  # the owner's record of the last full rule check (rules/_fast.py)
        # Rule 9: synced values are reduced over ``process_group`` (None: the
        # default group), waiting at most ``sync_timeout`` seconds; ``seq``
        # (set by the owner when the commit begins) numbers its steps, so
        # ranks can check they commit the same one.
        self.process_group = process_group
        self.sync_timeout = sync_timeout
        self.seq = seq
        self.optimizer = optimizer
        self.check_finite = check_finite
        self.on_nonfinite = on_nonfinite
        self.atomic = atomic
        self.label = label
        self.entries: dict[int, Entry] = {}
        self.aliases: dict[int, Entry] = {}
        self._aliases_stale = False  # set when a compiled graph installed pending values
        self.order: list[tuple[Entry, Record]] = []
        self.state = "open"  # open -> committing -> closed
        self.done_phases: set[str] = set()
        self._opt_ids: set[int] | None = None
        self._protected: set[int] = set()
        self._snapshots: Copies = []
        # Fallible stages (optimizer step, rules not declared infallible) still to run.
        self._fallible_left = 1 << 30
        self._opt_saved: dict[int, tuple[torch.Tensor, dict | None]] | None = None
        self._rule_saved: list[tuple[Rule, Any]] = []
        self._dirty: set[int] = set()
        # Written tensors not yet added to _dirty (None: the optimizer's parameters); added only
        # when a phase has recorded entries to classify, so rules over many tensors cost nothing here.
        self._dirty_pending: list[list[torch.Tensor] | None] = []
        self.rules: list[Rule] = []
        self.skipped = False

    # ------------------------------------------------------------------
    # lookup
    # ------------------------------------------------------------------
    def opt_ids(self) -> set[int]:
        if self._opt_ids is None:
            ids: set[int] = set()
            if self.optimizer is not None:
                for g in self.optimizer.param_groups:
                    ids.update(id(p) for p in g["params"])
            self._opt_ids = ids
        return self._opt_ids

    def find(self, t: torch.Tensor, create: bool = True) -> Entry | None:
        """The entry of target ``t`` (or of a pending value read from it)."""
        if torch.compiler.is_compiling():
            from .integrations.compile import find_traced

            e = find_traced(self, t)
            if e is not None:
                return e
        else:
            e = self.entries.get(id(t))
            if e is not None and e.target is t:
                return e
            if self._aliases_stale:
                self.aliases = {id(x.value): x for x in self.entries.values() if x.value is not None}
                self._aliases_stale = False
            e = self.aliases.get(id(t))
            if e is not None and e.value is t:
                return e
        replay = _state.replay
        if replay is not None:
            # A value shown by a checkpoint recomputation (integrations.checkpoint).
            e = replay.lookup(self, t)
            if e is not None:
                return e
        if not create:
            return None
        info = self.index.lookup(t)
        if info is None:
            return None
        # Trainable: the optimizer also updates it (it requires grad and, when
        # the step has an optimizer, is one of its parameters).
        if torch.compiler.is_compiling():
            from .integrations.compile import in_optimizer

            trainable = bool(t.requires_grad) and (self.optimizer is None or in_optimizer(self.optimizer, t))
        else:
            trainable = bool(t.requires_grad) and (self.optimizer is None or id(t) in self.opt_ids())
        e = Entry(t, info.name, info, trainable)
        self.entries[id(t)] = e
        return e

    # ------------------------------------------------------------------
    # recording
    # ------------------------------------------------------------------
    def record(
        self, e: Entry, op: str, operand: Any, key: Any, phase: str | None, sync: str | None, origin: str,
        fresh: bool = False,
    ) -> None:
        fn = f"pu.{op}"
        if phase is None or phase == AUXILIARY:
            if e.trainable:
                raise AmbiguousOrderError(
                    f"{fn} on {e.name!r} at {origin} has no phase, but {e.name!r} is trainable "
                    "(the optimizer also updates it), so the order of the two updates is ambiguous. "
                    "Pass phase='before_grad' to apply it before the gradient update, or "
                    "phase='after_grad' to apply it after."
                )
            phase = AUXILIARY
        elif phase not in _RECORD_PHASES:
            raise UpdateError(
                f"{fn} on {e.name!r} at {origin}: unknown phase {phase!r}; use one of "
                f"None, 'before_grad', 'after_grad', 'after_step'."
            )
        if sync is not None or e.sync is not None:
            from .integrations.distributed import check_sync

            check_sync(self, e, sync, phase, fn, origin)
        if phase in self.done_phases:
            raise UpdateError(
                f"{fn} on {e.name!r} at {origin} with phase={phase!r} was issued after that phase was "
                f"committed (inside optimizer.step()). Issue it before the optimizer step, or use a later phase."
            )
        # (While dynamo traces, this is not a runtime check; a compiled forward
        # is not re-run by autograd: checkpointing inside it is a graph op.)
        if _state.replay is None and not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            raise UpdateError(
                f"{fn} on {e.name!r} at {origin} was issued during backward (from a hook, or from "
                "the recomputation of torch.utils.checkpoint with use_reentrant=True). Updates issued in "
                "backward would be applied twice or out of order: issue them in forward, and use "
                "pu.checkpoint (or torch.utils.checkpoint with use_reentrant=False) for activation "
                "checkpointing."
            )
        check_operand(op, e.target, operand, key, e.name, origin)
        if _state.replay is None and _state.eager_log is None:
            _adopt_torch_segment()  # inside a plain torch.utils.checkpoint segment: note its entry values (rule 3)
        cond = conditions.current()
        if isinstance(operand, torch.Tensor):
            operand = self.read(operand)
            if not e.trainable:
                operand = operand.detach()
        old = _plain(self.current_of(e))
        new = apply_op(op, old, operand, key, cond if isinstance(cond, torch.Tensor) else None, fresh)
        if not e.trainable:
            new = new.detach()
        rec = Record(op, operand, key, cond if isinstance(cond, torch.Tensor) else None, phase, sync, origin)
        replay = _state.replay
        if replay is not None:
            replay.set_value(self, e, new)
            return
        e.records.append(rec)
        if sync is not None:
            e.sync = sync
        self.order.append((e, rec))
        self.set_value(e, new)

    def set_value(self, e: Entry, new: torch.Tensor) -> None:
        """Make ``new`` what reads of ``e``'s target return."""
        old = e.value
        e.value = new
        if torch.compiler.is_compiling():
            self._aliases_stale = True
        else:
            if old is not None:
                self.aliases.pop(id(old), None)
            self.aliases[id(new)] = e
        if _is_pu_parameter(e.target):
            _state.pu_pending[id(e.target)] = e
        elif e.info is not None and e.info.kind == "buffer":
            owner = e.info.owner
            if owner is not None:
                cur = owner._buffers.get(e.info.attr)
                if cur is e.target or (old is not None and cur is old):
                    owner._buffers[e.info.attr] = new
                    e.swapped = True

    def current_of(self, e: Entry) -> torch.Tensor:
        """What a read of ``e``'s target sees now: its pending value, or the
        value a checkpoint recomputation shows (``_state.replay``)."""
        replay = _state.replay
        if replay is not None:
            return replay.current(self, e)
        return e.current()

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """The value of ``t`` as this step sees it (pending or committed)."""
        e = self.find(t, create=False)
        if e is None:
            return _plain(t)
        return _plain(self.current_of(e))

    # ------------------------------------------------------------------
    # overlay removal, discard
    # ------------------------------------------------------------------
    def remove_overlay(self) -> None:
        for e in self.entries.values():
            if e.swapped and e.info is not None:
                owner = e.info.owner
                if owner is not None and owner._buffers.get(e.info.attr) is e.value:
                    owner._buffers[e.info.attr] = e.target
                e.swapped = False
            if _state.pu_pending.get(id(e.target)) is e:
                del _state.pu_pending[id(e.target)]

    def reinstall_overlay(self) -> None:
        """Show still-pending values again (inside ``optimizer.step()`` under attach)."""
        for e in self.entries.values():
            if e.value is not None and e.phases() - self.done_phases:
                self.set_value(e, e.value)

    def discard(self) -> None:
        """Drop every pending update; storage was never touched."""
        self.remove_overlay()
        self.state = "closed"

    # ------------------------------------------------------------------
    # plan
    # ------------------------------------------------------------------
    def collect_rules(self) -> None:
        """The declared rules of this step.

        A rule with ``per_optimizer_update`` (weight decay, constraints, EMA)
        runs once per real optimizer update (DESIGN rule 1): a step without an
        optimizer (``pu.step(model)``, ``Attachment.flush()``, micro-batch
        steps of gradient accumulation) does not apply it.
        """
        rules = rules_for(self.index)
        if self.optimizer is None:
            rules = [r for r in rules if not r.per_optimizer_update]
        self.rules = rules

    def _count_fallible(self) -> None:
        n = 1 if self.optimizer is not None else 0
        n += sum(1 for r in self.rules if not r.infallible)
        self._fallible_left = n

    def stage_done(self, fallible: bool) -> None:
        """Mark one stage of the commit as run (a fallible one lowers the count)."""
        if fallible:
            self._fallible_left -= 1

    def schedule(self) -> Schedule:
        rows: list[ScheduleEntry] = []
        for phase in PHASES:
            if phase == GRAD:
                if self.optimizer is not None:
                    rows.append(
                        ScheduleEntry(GRAD, "<optimizer parameters>", f"{type(self.optimizer).__name__}.step", "-", self.label)
                    )
                continue
            for rule in self.rules:
                if rule.phase == phase:
                    rows.extend(rule.cached_rows(self.index))
            for e, r in self.order:
                if r.phase == phase:
                    cond = "-" if r.cond is None else "when(tensor)"
                    sync = f" sync={r.sync}" if r.sync else ""
                    rows.append(ScheduleEntry(phase, e.name, r.op + sync, cond, r.origin))
        return Schedule(rows)

    # ------------------------------------------------------------------
    # commit
    # ------------------------------------------------------------------
    def prepare(self) -> bool:
        """Remove the overlay, sync, check finiteness. False: skip this step."""
        self.state = "committing"
        self.remove_overlay()
        self.collect_rules()
        self._count_fallible()
        synced = [e for e in self.entries.values() if e.sync is not None]
        remote_bad = 0
        if synced:
            from .integrations import distributed

            distributed.check_rules(self, synced)
            if distributed.is_distributed(self.process_group):
                # Rule 9: reduce the synced values; other ranks' finiteness of
                # their unsynced values rides along, so all ranks decide alike.
                local_bad = False
                if self.check_finite:
                    ok = self._finite_flag([e for e in self.entries.values() if e.sync is None])
                    local_bad = ok is not None and not bool(ok)
                remote_bad = distributed.sync_entries(self, synced, local_bad)
        if self.check_finite:
            bad = self._nonfinite()
            if bad or remote_bad:
                if self.on_nonfinite == "skip":
                    self.skipped = True
                    self.state = "closed"
                    return False
                self.state = "closed"
                if not bad:
                    raise UpdateError(
                        f"{self.label}: {remote_bad} other rank(s) have non-finite pending values in this "
                        "step (see their error). Nothing was written on any rank. Fix the value, or pass "
                        "on_nonfinite='skip' to drop such steps (they are counted, on every rank alike)."
                    )
                lines = "; ".join(f"{e.name!r} (last update at {e.records[-1].origin})" for e in bad)
                raise UpdateError(
                    f"{self.label}: non-finite pending value for {lines}. Nothing was written. "
                    "Fix the value, or pass on_nonfinite='skip' to drop such steps (they are counted)."
                )
        if self.rules:
            ctx = CommitContext(self)
            cache = self.rule_cache
            if cache is None or not cache.revalidate(self, ctx):
                for rule in self.rules:
                    rule.check(ctx)  # before any write: a rule that cannot run fails here
                if cache is not None:
                    cache.record(self)
        return True

    @staticmethod
    def _float_entries(entries: Any) -> list[Entry]:
        return [e for e in entries if e.value is not None and (e.value.is_floating_point() or e.value.is_complex())]

    def _finite_flag(self, entries: Any) -> torch.Tensor | None:
        """A 0-dim bool on the CPU: all pending values of ``entries`` finite (None if none is floating)."""
        ents = self._float_entries(entries)
        if not ents:
            return None
        flags = []
        grouped = _group_tensors_by_device_and_dtype([[e.value.detach() for e in ents]])
        for (_dev, _dt), ([ts], _) in grouped.items():
            norms = torch._foreach_norm(ts, math.inf)
            flags.append(torch.stack(norms).isfinite().all().cpu())
        return torch.stack(flags).all()

    def _nonfinite(self) -> list[Entry]:
        ok = self._finite_flag(self.entries.values())
        if ok is None or bool(ok):
            return []
        return [e for e in self._float_entries(self.entries.values()) if not bool(e.value.isfinite().all())]

    # --- snapshots ------------------------------------------------------
    def protect(self, tensors: list[torch.Tensor]) -> None:
        """Snapshot tensors not yet snapshotted in this commit (before their first write).

        Nothing is copied once no fallible stage is left (see the module
        docstring). Tensors are keyed by identity; a tensor and an alias of
        its memory may both be snapshotted, which is harmless because
        :meth:`rollback` restores in reverse order (the oldest copy wins).
        """
        if not self.atomic or self._fallible_left <= 0:
            return
        seen = self._protected
        fresh = [t for t in tensors if id(t) not in seen]
        if not fresh:
            return
        seen.update(map(id, fresh))
        pool = self.pool if self.pool is not None and self.pool.claim(self) else None
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            self._snapshots.extend(_copies(pool, fresh))

    def protect_optimizer(self, all_params: bool) -> None:
        opt = self.optimizer
        if opt is None or not self.atomic:
            return
        params = [p for g in opt.param_groups for p in g["params"] if all_params or p.grad is not None]
        saved: dict[int, tuple[torch.Tensor, dict | None]] = {}
        tensors: list[torch.Tensor] = list(params)
        for p in params:
            st = opt.state.get(p)
            if st is None:
                saved[id(p)] = (p, None)
                continue
            copy = {k: (list(v) if isinstance(v, list) else v) for k, v in st.items()}
            saved[id(p)] = (p, copy)
            tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        self._opt_saved = saved
        self.protect(tensors)

    def save_rules(self) -> None:
        self._rule_saved = [(r, r.save()) for r in self.rules]

    def rollback(self) -> None:
        """Restore every snapshotted tensor, the optimizer state and the rules' counters.

        The overlay goes too: under ``pu.attach`` it is shown again inside
        ``optimizer.step()`` (``reinstall_overlay``), and an optimizer that
        raises there must not leave pending values visible.
        """
        self.remove_overlay()
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for ts, copies in reversed(self._snapshots):
                torch._foreach_copy_(ts, copies)
        if self._opt_saved is not None and self.optimizer is not None:
            state = self.optimizer.state
            for p, st in self._opt_saved.values():
                if st is None:
                    state.pop(p, None)
                else:
                    state[p] = st
        for r, saved in self._rule_saved:
            r.restore(saved)
        self._end()

    def _end(self) -> None:
        self.state = "closed"
        self._snapshots = []
        if self.pool is not None:
            self.pool.end_commit(self)

    # --- phases ----------------------------------------------------------
    def run_phase(self, phase: str) -> None:
        rules = [r for r in self.rules if r.phase == phase]
        if rules:
            ctx = CommitContext(self)
            with torch.no_grad():
                for rule in rules:
                    written = rule.tensors()
                    self.protect(written)
                    rule.apply(ctx)
                    self._dirty_pending.append(written)
                    self.stage_done(not rule.infallible)
        in_phase = [(e, ps) for e in self.entries.values() if phase in (ps := e.phases())]
        if not in_phase:
            self.done_phases.add(phase)
            return
        fast_dst: list[torch.Tensor] = []
        fast_src: list[torch.Tensor] = []
        slow: list[Entry] = []
        self._flush_dirty()
        for e, phases in in_phase:
            # A synced target (rule 9) commits its reduced value: it has one
            # phase, is not trainable and no rule writes it (checked before).
            if e.sync is not None or (len(phases) == 1 and id(e.target) not in self._dirty and not (
                phase != BEFORE_GRAD and e.trainable and GRAD in self.done_phases
            )):
                fast_dst.append(_plain(e.target).detach())
                fast_src.append(e.value.detach())
            else:
                slow.append(e)
        self.protect(fast_dst + [e.target for e in slow])
        with torch.no_grad():
            if fast_dst:
                grouped = _group_tensors_by_device_and_dtype([fast_dst, fast_src])
                for _k, ([dst, src], _) in grouped.items():
                    torch._foreach_copy_(dst, src)
            for e in slow:
                raw = _plain(e.target).detach()
                val: torch.Tensor = raw
                for r in e.records:
                    if r.phase == phase:
                        operand = r.operand.detach() if isinstance(r.operand, torch.Tensor) else r.operand
                        val = apply_op(r.op, val, operand, r.key, r.cond)
                raw.copy_(val)
        self._dirty.update(id(e.target) for e, _ in in_phase)
        self.done_phases.add(phase)

    def run_grad(self, closure: Any = None) -> Any:
        """The optimizer's step (phase ``grad``)."""
        out = None
        if self.optimizer is not None:
            self.protect_optimizer(all_params=closure is not None)
            _state.committing.append(self)  # an attachment on this optimizer stands aside
            try:
                out = self.optimizer.step() if closure is None else self.optimizer.step(closure)
            finally:
                _state.committing.remove(self)
            self.mark_optimizer_written()
            self.stage_done(True)
        self.done_phases.add(GRAD)
        return out

    def mark_optimizer_written(self) -> None:
        self._dirty_pending.append(None)

    def _flush_dirty(self) -> None:
        for ts in self._dirty_pending:
            self._dirty.update(self.opt_ids() if ts is None else map(id, ts))
        self._dirty_pending.clear()

    def finish(self) -> None:
        self._end()


_ADOPT: Any = None


def _adopt_torch_segment() -> None:
    global _ADOPT
    if torch.compiler.is_compiling():
        # No global store in a graph: it would guard on _ADOPT and recompile once.
        from .integrations.checkpoint import adopt_torch_segment

        adopt_torch_segment()
        return
    if _ADOPT is None:  # imported on first use: integrations.checkpoint imports this module
        from .integrations.checkpoint import adopt_torch_segment

        _ADOPT = adopt_torch_segment
    _ADOPT()


def _copies(pool: SnapshotPool | None, ts: list[torch.Tensor]) -> Copies:
    """Rollback copies of ``ts``, per device and dtype (kept buffers from ``pool`` on CPU; see ``_snapshot``)."""
    if pool is not None:
        return pool.copies(ts)
    return [(list(g), clone_all(list(g))) for _k, ([g], _) in _group_tensors_by_device_and_dtype([ts]).items()]


def route(t: torch.Tensor, origin: str, op: str) -> tuple[Transaction | None, Entry | None]:
    """Find the transaction that owns target ``t``; (None, None) means apply eagerly."""
    for tx in reversed(_state.explicit):
        e = tx.find(t)
        if e is not None:
            return tx, e
    for att in list(_state.attachments):
        tx, e = att.route(t)
        if e is not None:
            return tx, e
    if _state.explicit:
        tx = _state.explicit[-1]
        mine = type(tx.index.model).__name__
        other = owner_anywhere(t)
        if other is not None:
            name, model = other
            raise UpdateError(
                f"pu.{op} on {name!r} of {model} at {origin}: the target belongs to a {model}, but the "
                f"step in progress is for a {mine}, so this update would have no commit. Open the step "
                f"on a module that contains both (e.g. nn.ModuleDict({{'a': a, 'b': b}})), or issue the "
                "update outside the step."
            )
        computed = (
            " It is a computed tensor (it has a grad_fn), e.g. the output of a parametrization "
            "(torch.nn.utils.parametrize) or of an op: update the stored tensor it is computed from."
            if t.grad_fn is not None
            else ""
        )
        raise UpdateError(
            f"pu.{op} on {describe(t)} at {origin}: the target is not a parameter or buffer of the model "
            f"of the step in progress ({mine}). Register it on that model "
            f"(as a pu.Parameter, an nn.Parameter or a buffer), or issue the update outside the step.{computed}"
        )
    return None, None



def pending_value(t: torch.Tensor) -> torch.Tensor | None:
    """The pending value of ``t`` in any live transaction, or None."""
    for tx in live_transactions():
        e = tx.find(t, create=False)
        if e is not None:
            v = tx.current_of(e)
            return None if v is e.target else v
    return None


def live_transactions() -> list[Transaction]:
    """Every open transaction: explicit steps (innermost first), then attachments'."""
    out = list(reversed(_state.explicit))
    for att in _state.attachments:
        if att.tx is not None:
            out.append(att.tx)
    return out
