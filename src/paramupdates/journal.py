"""The journal of a step: what was issued, and what reads see (rules 1, 2, 5, 6 of ``docs/design.md``).

One representation of what a step issued: each call that issues updates is one :class:`Record`
(its ops, operands, condition, phase, sync, call site: one update for ``pu.assign`` & co., one per
statistic for a ``pu.nn`` module's call), appended to the journal's issue order (what the schedule
shows) and to the :class:`Entry` of each target it updates, which holds the target's pending value.
The commit folds the records of each phase per entry (one copy when a phase's record is a target's
only one), the same for every kind of call.

An update issued inside a step is validated at its call site (phase, shape, dtype kind, device);
the statistics a ``pu.nn`` module computed take :meth:`Journal.record_batch` (the checks that do
not depend on the target, once per call). The target's
pending value is computed out of place (``ops.apply_op``) and shown to later
reads (``overlay``): read-your-writes in program order (rule 1). No storage
is written (deferred commit, rule 2): saved tensors stay valid, version counters do not move.
The record keeps the operands as issued (``ops.as_issued``: a tensor the user writes later, or
that the optimizer steps, changes nothing the commit computes, rule 12). A pending value made
with autograd off is what later reads can use (:meth:`Journal._made_without_grad`).

While a checkpointed segment is recomputed (``state.local.replay``), an update
issued again moves only the replay's view and is not recorded (rule 3).

The journal is written by the recording path and read by the commit
(``commit.Commit``), which applies it.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from typing import Any

import torch

from . import hooks, overlay, sharding, state
from .errors import AmbiguousOrderError, UpdateError
from .lookup import EAGER, Lookup
from .ops import apply_op, as_issued, check_operand, normal, overwritten
from .origin import issued as issued_by
from .phases import AUXILIARY, ISSUE_PHASES, RECORD_PHASES
from .records import Entry, Record
from .targets import ModelIndex

_graph_task_id = torch._C._current_graph_task_id
_params_of = operator.itemgetter("params")
_saved_hooks = hooks.saved_tensors_hooks  # (falsy: no checkpointed segment's forward is running)
_local = state.local  # this thread's steps, conditions and replay (one attribute look-up less per update)
_data_ptr = torch._C.TensorBase.data_ptr


def _plain_view(t: torch.Tensor) -> torch.Tensor:
    """A plain detached view of ``t``'s storage (a ``pu.Parameter``'s pending value not substituted)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach()


def _where(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).removeprefix('torch.')} on {t.device}"


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def sharding_of(index: ModelIndex) -> Any:
    """The sharding support (``hooks.sharding_support``) if ``index``'s model holds sharded parameters,
    else None: a plain model's updates never call into a sharding integration. Decided once per model
    index generation (``ModelIndex.sharded_layout``, kept by the support)."""
    hit = index.sharded_layout
    if hit is not None and hit[0] == index.generation:
        return hooks.sharding_support() if hit[1] else None
    support = hooks.sharding_support()
    return support if support is not None and support.model_sharded(index) else None


class Journal:
    """The pending updates of one step of one model (with its optimizer).

    Every method that looks a tensor up takes the call's lookup strategy (``how``: ``lookup.EAGER``
    or, while dynamo traces, ``lookup.TRACED``), chosen once by the call that issued the update.
    """

    def __init__(
        self,
        index: ModelIndex,
        optimizer: torch.optim.Optimizer | None,
        label: Any,  # a str, or an origin.Label (formatted when shown)
        reuse: dict[int, Entry] | None = None,
    ) -> None:
        self.index = index
        self.optimizer = optimizer
        self.label = label
        # Entries of earlier steps on the same model and optimizer, reused (their per-step state reset):
        # a step of a model with many targets makes no new entry objects (benchmarks, launch-bound model).
        self.reuse = reuse
        self.entries: dict[int, Entry] = {}
        self.aliases: dict[int, Entry] = {}  # id(pending value) -> its entry
        self.aliases_stale = False  # set when a compiled graph installed pending values
        # Loose records (a pu.nn module's statistics, targets with nothing else pending): no entries made
        # (settle() makes them when something else touches a target); the commit copies loose_src into
        # loose_dst (the targets, plain) in one pass. A loose record marks its targets' infos with this
        # journal's serial (TargetInfo.loose_in: what the next record asks, one attribute read). loose_ids:
        # id(target) and id(pending value) -> the record's place in loose, for a reader that holds a
        # pending value; made when a reader first asks, for the records since (index_loose): a step whose
        # statistics nobody looks up by id() builds none.
        self.serial = -1  # taken at the first eager record (a journal opened while dynamo traces reads no counter)
        self.loose: list[Record] = []
        self.loose_dst: list[torch.Tensor] = []
        self.loose_src: list[torch.Tensor] = []
        self.loose_ids: dict[int, int] = {}
        self.loose_indexed = 0  # the records of loose that loose_ids covers (the first ones)
        self.traced_loose = False  # a compiled graph made loose records (no TargetInfo.loose_in marks)
        self.order: list[Record] = []  # issue order: what the schedule shows
        self.by_phase: dict[str, list[Entry]] = {}  # phase -> the entries with records in it
        # the phases with an entry whose pending value the commit may not take as is (a target with records
        # in several phases, or a trainable one, which the optimizer writes): those fold per entry
        self.mixed: set[str] = set()
        self.synced: list[Entry] = []  # the entries with a sync= update (distributed sync, rule 9)
        self.shown = False  # some pending value is shown (hide() has something to do)
        self.any_sharded = False  # some entry's target is a DTensor (its values are checked through local shards)
        self.state = "open"  # open -> committing -> closed
        self.guarded: Any = None  # the optimizer a pu.step block guards against steps its commit does not make
        self.done_phases: set[str] = set()
        self.changed: list[str] = []  # targets changed while updates to them were pending (hide())
        # what first saved the model's stored values in place of this step's pending values (``state_dict()
        # at file:line``, pickling, ``copy.deepcopy``): an attachment's pending updates that such a copy
        # lacks and that no step then commits are lost, and said so (``attach._warn_pending``)
        self.missed: str | None = None
        self.watch = True  # check for such changes (pu.func's journal: torch.func swaps the slots itself)
        self._opt_ids: set[int] | None = None

    # ------------------------------------------------------------------
    # lookup
    # ------------------------------------------------------------------
    def opt_ids(self) -> set[int]:
        """``id()`` of every parameter of the optimizer (held by it for this step)."""
        if self._opt_ids is None:
            opt = self.optimizer
            groups = opt.param_groups if opt is not None else ()
            self._opt_ids = set(map(id, itertools.chain.from_iterable(map(_params_of, groups))))  # (in C)
        return self._opt_ids

    def settle(self, how: Lookup = EAGER) -> None:
        """Make the entries of the loose records (:meth:`record_batch`), in their place in the issue
        order: what a reader of one of their targets (a second record, a read, a recomputation,
        ``pu.func``) or of every entry asks first. What reads show does not change."""
        if not self.loose:
            return
        loose, self.loose = self.loose, []
        self.loose_dst, self.loose_src, self.loose_ids, self.loose_indexed = [], [], {}, 0
        for rec in loose:
            targets, values = rec.targets, rec.values
            rec.targets = rec.values = None
            entries = [self.find(t, True, how) for t in targets]  # type: ignore[union-attr]
            if any(e is None for e in entries):  # (the model changed under the step's records)
                lost = [i.name for i, e in zip(rec.infos, entries) if e is None]  # type: ignore[arg-type]
                raise UpdateError(
                    f"{', '.join(map(repr, lost))}, updated at {rec.origin}, no longer belong to this step's "
                    "model (replaced after the update was issued?): issue the update again after the change."
                )
            rec.entries = entries  # type: ignore[assignment]
            self._take_values(rec, entries, values, how, show=False)  # type: ignore[arg-type]

    def index_loose(self) -> dict[int, int]:
        """``loose_ids``, brought up to date: the records made since it was last asked are added."""
        ids, loose = self.loose_ids, self.loose
        for i in range(self.loose_indexed, len(loose)):
            rec = loose[i]
            for t, v in zip(rec.targets, rec.values):  # type: ignore[arg-type]
                ids[id(t)] = ids[id(v)] = i
        self.loose_indexed = len(loose)
        return ids

    def rebuild_aliases(self) -> None:
        self.aliases = {id(x.value): x for x in self.entries.values() if x.value is not None}
        self.aliases_stale = False

    def find(self, t: torch.Tensor, create: bool = True, how: Lookup = EAGER) -> Entry | None:
        """The entry of target ``t`` (or of a pending value read from it); ``create``: make one for a
        target of the model."""
        e = how.entry(self, t)
        if e is not None:
            return e
        replay = _local.replay
        if replay is not None:
            e = replay.lookup(self, t)  # a value shown by a checkpoint recomputation
            if e is not None:
                return e
        if not create:
            return None
        reuse = self.reuse if how.reuses else None
        if reuse is not None:
            e = reuse.get(id(t))
            if (
                e is not None
                and e.target is t
                and e.journal is None
                and e.generation == self.index.generation
                and e.trainable == self._trainable(t, how)
            ):
                e.value, e.swapped, e.sync = None, False, None
                e.records.clear()  # (last step's: nothing reads them once it closed)
                e.phases.clear()
                e.journal = self
                self.entries[id(t)] = e
                if e.sharded:
                    self.any_sharded = True
                if e.shows == overlay.PARAM:
                    e.raw = _plain_view(t)  # its storage now (check_storage: replaced in the step?)
                return e
        info = self.index.lookup(t)
        if info is None:
            return None
        e = Entry(
            t,
            info.name,
            info,
            self._trainable(t, how),
            info.shows,
            info.slots,
            info.attr,
            sharded=sharding.is_sharded(t),
            generation=self.index.generation,
        )
        self.entries[id(t)] = e
        if e.sharded:
            self.any_sharded = True
        if reuse is not None:
            e.journal = self
            reuse[id(t)] = e
        if e.shows == overlay.PARAM and how.reuses and not e.sharded:
            e.raw = _plain_view(t)  # its storage now (check_storage: replaced in the step?)
        return e

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is the pending value of one of this step's targets, found by identity (what
        dynamo traces without guarding on ``id()`` of a tensor made in a step)."""
        return any(v is t for rec in self.loose for v in rec.values) or any(  # type: ignore[union-attr]
            e.value is t for e in self.entries.values()
        )

    def sharding(self) -> Any:
        """The sharding support if this step's model holds sharded parameters, else None
        (:func:`sharding_of`)."""
        return sharding_of(self.index)

    def _trainable(self, t: torch.Tensor, how: Lookup) -> bool:
        """Whether the optimizer also updates ``t``: it requires grad and, when the step has an
        optimizer, is one of its parameters."""
        if not t.requires_grad:
            return False
        if self.optimizer is None:
            return True
        return how.in_optimizer(self, t)

    # ------------------------------------------------------------------
    # recording
    # ------------------------------------------------------------------
    def record(
        self,
        e: Entry,
        op: str,
        operand: Any,
        key: Any,
        phase: str | None,
        sync: str | None,
        origin: Any,
        fresh: bool = False,
        how: Lookup = EAGER,
        new: torch.Tensor | None = None,
    ) -> None:
        """Validate one update of ``e``'s target and make its new value pending (see the module docstring).

        ``fresh``: an internal update (``pu.nn``'s statistics) whose operand was made for it from the
        target's own value: it is not validated again and becomes the pending value without a copy.
        ``new``: the new value, already computed by the caller from the value it read (an internal,
        ``fresh`` update; a ``pu.when`` condition still applies to it).
        """
        phase = self._phase_of(e, op, phase, sync, origin)
        replay = _local.replay
        # (While dynamo traces, this is not a runtime check; a compiled forward
        # is not re-run by autograd: checkpointing inside it is a graph op.)
        if replay is None and not how.traced and (_graph_task_id() != -1 or _saved_hooks(True)):
            self._refuse_in_backward(e.name, op, origin)  # (during backward, or in a checkpointed segment)
        support = None if how.traced else self.sharding()
        if support is not None and not e.records:
            support.check_update(self, e, f"pu.{op}", origin)  # sharding hook: FSDP's temporary parameters
        cond = _local.conditions[-1]
        pred = cond if isinstance(cond, torch.Tensor) else None
        issued = operand
        if new is None and not fresh:
            operand, key, issued = self._issued_operands(e, op, operand, key, origin, support, how)
        old = (e.target if e.value is None else e.value) if replay is None else replay.current(self, e)
        if type(old) not in _PLAIN:  # (current_of and overlay.plain, inlined: every update reads it)
            old = overlay.plain(old)
        if new is not None:
            if pred is not None:
                new = torch.where(pred, new, old)
        else:
            # (an assign's issued operand is its copy, cast: the pending value without a second copy)
            new = apply_op(op, old, issued if op == "assign" else operand, key, pred, True)
            if not e.trainable:
                new = new.detach()
        if e.sharded and support is not None:
            new = support.conform(e, new)  # sharding hook: the pending value's local shard is the target's
        if not torch.is_grad_enabled():  # no_grad or inference_mode: the value as later reads use it
            new = self._made_without_grad(e, new, how)
        if replay is not None:
            replay.set_value(self, e, new)  # issued again by a recomputation: only its view moves
            return
        self._store(e, Record([e], [op], [issued], key, pred, phase, sync, origin), new, how)

    def _phase_of(self, e: Entry, op: str, phase: str | None, sync: str | None, origin: Any) -> str:
        """The phase an update of ``e`` is recorded in: ``phase``, or ``auxiliary`` for ``None`` on a
        target the optimizer does not update (on one it does: :class:`AmbiguousOrderError`, rule 5); an
        unknown phase, a phase already committed, or a ``sync=`` the sync backend refuses raise."""
        if phase is None or phase == AUXILIARY:
            if e.trainable:
                raise AmbiguousOrderError(
                    f"{issued_by(op, e.name, origin)} has no phase, but {e.name!r} is trainable "
                    "(the optimizer also updates it), so the order of the two updates is ambiguous. "
                    "Pass phase='before_grad' to apply it before the gradient update, or "
                    "phase='after_grad' to apply it after."
                )
            phase = AUXILIARY
        elif phase not in RECORD_PHASES:
            raise UpdateError(
                f"{issued_by(op, e.name, origin)}: unknown phase {phase!r}; use one of "
                f"{', '.join(map(repr, ISSUE_PHASES))}."
            )
        if sync is not None or e.sync is not None:
            fn = f"pu.{op}"
            hooks.sync_backend(issued_by(op, e.name, origin)).check_update(self, e, sync, phase, fn, origin)
        if self.done_phases and phase in self.done_phases:
            raise UpdateError(
                f"{issued_by(op, e.name, origin)} with phase={phase!r} was issued after that phase was "
                f"committed (inside optimizer.step()). Issue it before the optimizer step, or use a later phase."
            )
        return phase

    def _made_without_grad(self, e: Entry, new: torch.Tensor, how: Lookup) -> torch.Tensor:
        """``e``'s pending value ``new``, made with autograd off, as the step's later reads use it.

        * Under ``torch.inference_mode()`` it becomes a normal tensor (``ops.normal``): a later
          training forward may save it for backward.
        * For a trainable target it passes the gradient to the value it replaces (``ops.overwritten``:
          the identity, as an in-place write under ``no_grad`` leaves a leaf parameter trainable), which
          passes it on to the parameter; under ``pu.when(tensor)`` and after earlier updates alike.
        """
        inference = not how.traced and torch.is_inference_mode_enabled()
        if inference:
            new = normal(new)
        if not e.trainable:
            return new
        with torch.inference_mode(False) if inference else contextlib.nullcontext(), torch.enable_grad():
            old = overlay.plain(self.current_of(e))  # (a view made with grad on: it carries the gradient)
            return overwritten(new, old) if old.requires_grad else new

    def _issued_operands(
        self,
        e: Entry,
        op: str,
        operand: Any,
        key: Any,
        origin: Any,
        support: Any,
        how: Lookup,
    ) -> tuple[Any, Any, Any]:
        """A user's update of ``e``: its operand checked and read as the step sees it (a pending value
        is read, not the stored one), and the operands as issued (``ops.as_issued``):
        ``(operand, key, issued operand)``; the key returned is the issued one."""
        check_operand(op, e.target, operand, key, e.name, origin)
        if e.sharded and support is not None:
            operand = support.operand(e, operand, f"pu.{op}", origin)  # sharding hook: laid out like e
        if isinstance(operand, torch.Tensor):
            operand = self.read(operand, how)
            if not e.trainable:
                operand = operand.detach()
        issued, key = as_issued(op, operand, key, e.target.dtype)
        return operand, key, issued

    @staticmethod
    def _refuse_in_backward(name: str, op: str, origin: Any) -> None:
        """An update issued during backward raises; one issued inside a ``torch.utils.checkpoint``
        segment's forward notes the segment's entry values (replay, rule 3)."""
        if _graph_task_id() != -1:
            raise UpdateError(
                f"{issued_by(op, name, origin)} was issued during backward (from a hook, or from "
                "the recomputation of torch.utils.checkpoint with use_reentrant=True). Updates issued in "
                "backward would be applied twice or out of order: issue them in forward, and use "
                "pu.checkpoint (or torch.utils.checkpoint with use_reentrant=False) for activation "
                "checkpointing."
            )
        if _local.eager_log is None and hooks.segment_probes and _saved_hooks(True):
            hooks.adopt_segment()

    def record_computed(
        self,
        items: list[tuple[Entry, str, Any, torch.Tensor]],
        sync: str | None,
        origin: Any,
        how: Lookup,
    ) -> None:
        """Several internal auxiliary updates whose new values the caller computed (``pu.nn``'s
        statistics: ``(entry, op, operand, new value)``), checked together: what :meth:`record`
        checks that does not depend on the target, once. One :class:`Record` for all of them but
        those of a trainable or synced target, which :meth:`record` takes one by one."""
        replay = _local.replay
        if self.done_phases and AUXILIARY in self.done_phases:
            self.record(items[0][0], "assign", items[0][3], None, None, sync, origin, True, how)  # raises
        if replay is None and not how.traced:
            self._refuse_in_backward(items[0][0].name, items[0][1], origin)
        cond = _local.conditions[-1]
        pred = cond if isinstance(cond, torch.Tensor) else None
        inference = not how.traced and torch.is_inference_mode_enabled()
        plain: list[tuple[Entry, str, Any, torch.Tensor]] = []
        for e, op, operand, new in items:
            if e.trainable or sync is not None or e.sync is not None:
                self.record(e, op, operand, None, None, sync, origin, True, how, new)  # the general path
                continue
            if pred is not None:
                new = torch.where(pred, new, overlay.plain(self.current_of(e)))
            if inference:
                new = normal(new)  # (see _made_without_grad)
            if replay is not None:
                replay.set_value(self, e, new)
            else:
                plain.append((e, op, operand, new))
        if plain:
            rec = Record(
                [x[0] for x in plain], [x[1] for x in plain], [x[2] for x in plain], None, pred, AUXILIARY, None, origin
            )
            self.order.append(rec)
            for e, _op, _operand, new in plain:
                self._store(e, rec, new, how, placed=True)

    def _batch_entries(self, targets: list[torch.Tensor], how: Lookup) -> list | None:
        """The entries of ``targets`` (found, reused or made by :meth:`find`), if every one can take
        :meth:`record_batch`'s path (a buffer or a non-trainable parameter of the model, not synced, not
        a ``pu.Parameter``, not sharded), else None. (A target's first record of a step is a loose one:
        this runs only for a target with something pending already, a module's second forward.)"""
        out = []
        for t in targets:
            e = None if t.requires_grad else self.find(t, True, how)
            if e is None or e.trainable or e.sync is not None or e.shows == overlay.PARAM or e.sharded:
                return None
            out.append(e)
        return out

    def record_batch(
        self, updates: list[tuple[torch.Tensor, str, Any, torch.Tensor]], origin: Any, how: Lookup
    ) -> bool:
        """Record auxiliary updates whose values the caller computed (``pu.nn``'s statistics:
        ``(target, op, operand, new value)``) as one :class:`Record`: the path of
        :meth:`record_computed` without its per-target checks. A loose record (no entries: its pending
        values shown through the module slots, listed for the commit's one copy, found by ``id()``)
        when no target has anything else pending (:meth:`_loose_infos`), else on the targets' entries
        (:meth:`_record_on_entries`, eager only). False (nothing recorded) unless one of those takes
        them, and no recomputation, checkpointed segment, backward or committed auxiliary phase is in
        the way."""
        if _local.replay is not None or _local.eager_log is not None or AUXILIARY in self.done_phases:
            return False
        if not how.traced and (_graph_task_id() != -1 or (_saved_hooks(True) and hooks.in_segment())):
            return False
        infos = self._loose_infos(updates, how)
        if infos is None:
            return False if how.traced else self._record_on_entries(updates, origin, how)
        cond = _local.conditions[-1]
        pred = cond if isinstance(cond, torch.Tensor) else None
        traced = how.traced
        inference = not traced and torch.is_inference_mode_enabled()
        ops: list[str] = []
        operands: list[Any] = []
        targets: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        dst, src = self.loose_dst, self.loose_src
        for t, op, operand, new in updates:  # (one loop, no comprehension: each is a frame of its own in 3.11)
            ops.append(op)
            operands.append(operand)
            if new.requires_grad or pred is not None or inference:
                new = self._loose_value(t, new, pred, inference)
            targets.append(t)
            values.append(new)
            dst.append(t if type(t) in _PLAIN else overlay.plain(t))
            src.append(new)
        rec = Record((), ops, operands, None, pred, AUXILIARY, None, origin, targets, infos, values)
        overlay.show_loose((rec,))  # read-your-writes through the module attributes (rule 1)
        if not traced:  # (while dynamo traces, no attribute of an object outside the graph is written)
            serial = self.serial
            for info in infos:
                info.loose_in = serial
        if traced:
            self.traced_loose = True  # (their infos are not marked: _loose_infos looks them up by id after the graph)
        self.loose.append(rec)
        self.order.append(rec)  # what the schedule shows
        self.shown = True
        return True

    @staticmethod
    def _loose_value(t: torch.Tensor, new: torch.Tensor, pred: torch.Tensor | None, inference: bool) -> torch.Tensor:
        """A loose record's pending value of ``t``: detached, under the ``pu.when`` condition, a normal
        tensor under inference mode (see :meth:`_made_without_grad`)."""
        if new.requires_grad:
            new = new.detach()
        if pred is not None:
            new = torch.where(pred, new, t)
        return normal(new) if inference else new

    def _loose_infos(self, updates: list[tuple[torch.Tensor, str, Any, torch.Tensor]], how: Lookup) -> list | None:
        """The index's info of each target of ``updates`` if they can make a loose record (each a
        buffer or a non-trainable parameter of the model, not a ``pu.Parameter``, not sharded, with
        nothing pending), else None."""
        infos = []
        if how.traced:
            index = self.index
            for t, _op, _operand, _new in updates:
                if t.requires_grad or self._pending(t):  # (by identity first: id() of a pending value is a guard)
                    return None
                info = index.lookup(t)
                if info is None or info.shows == overlay.PARAM or info.sharded:
                    return None
                infos.append(info)
            return infos
        # (one pass: this runs for every batch norm of every step). A target with something pending has
        # an entry, or a loose record of this journal marked its info; a pending value is not indexed
        entries, by_id, serial = self.entries, self.index.by_id, self.serial
        if serial < 0:
            serial = self.serial = next(state.process.journal_serials)
        ids = self.index_loose() if self.traced_loose else None  # (records a compiled graph made: by id)
        for t, _op, _operand, _new in updates:
            k = id(t)
            info = by_id.get(k)  # the index as built (no rebuild on a miss: the general path does that)
            if info is None or info.ref() is not t or info.loose_in == serial or t.requires_grad or k in entries:
                return None
            if info.shows == overlay.PARAM or info.sharded or (ids is not None and k in ids):
                return None
            infos.append(info)
        return infos

    def _record_on_entries(
        self, updates: list[tuple[torch.Tensor, str, Any, torch.Tensor]], origin: Any, how: Lookup
    ) -> bool:
        """:meth:`record_batch` on the targets' entries (some target has something pending: a second
        forward of the module in the step); False unless every target can take it
        (:meth:`_batch_entries`)."""
        self.settle()  # (a target of this call may be one of theirs)
        entries = self._batch_entries([u[0] for u in updates], how)
        if entries is None:
            return False
        cond = _local.conditions[-1]
        pred = cond if isinstance(cond, torch.Tensor) else None
        inference = torch.is_inference_mode_enabled()
        ops: list[str] = []
        operands: list[Any] = []
        values: list[torch.Tensor] = []
        rec = Record(entries, ops, operands, None, pred, AUXILIARY, None, origin)
        self.order.append(rec)
        for e, (_t, op, operand, new) in zip(entries, updates):
            ops.append(op)
            operands.append(operand)
            if new.requires_grad:
                new = new.detach()
            if pred is not None:
                old = e.value
                new = torch.where(pred, new, e.target if old is None else old)
            if inference:
                new = normal(new)  # (see _made_without_grad)
            values.append(new)
        self._take_values(rec, entries, values, how)
        return True

    def _pending(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a target or pending value of this step, found by identity (traced)."""
        return any(e.target is t or e.value is t for e in self.entries.values()) or self.in_loose(t)

    def in_loose(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a target or pending value of a loose record, found by identity (traced)."""
        return any(x is t for rec in self.loose for x in (*rec.targets, *rec.values))  # type: ignore[misc]

    def _take_values(
        self, rec: Record, entries: list[Entry], values: list[torch.Tensor], how: Lookup, show: bool = True
    ) -> None:
        """Make ``values[k]`` the pending value of ``entries[k]``, ``rec`` their latest record, and
        (``show``) show them through the module slots. A slot already showing it (a loose record's
        value, :meth:`settle`) is noted as such."""
        bucket = self.by_phase.get(AUXILIARY)
        if bucket is None:
            bucket = self.by_phase[AUXILIARY] = []
        aliases = None if how.traced else self.aliases  # (eager: Lookup.valued, inlined)
        for e, new in zip(entries, values):
            old = e.value
            e.records.append(rec)
            if AUXILIARY not in e.phases:
                e.phases.add(AUXILIARY)
                bucket.append(e)
                if len(e.phases) > 1:
                    self.mixed.update(e.phases)
            e.value = new
            if aliases is None:
                self.aliases_stale = True
            else:
                if old is not None:
                    aliases.pop(id(old), None)
                aliases[id(new)] = e
            if e.slots is not None:
                if show and overlay.show(e, new, e, old):  # read-your-writes through the module attribute (rule 1)
                    e.swapped = self.shown = True
                elif overlay.slot(e) is new:  # (a loose record's value, shown already)
                    e.swapped = True

    def _store(
        self, e: Entry, rec: Record, new: torch.Tensor, how: Lookup, show: bool = True, placed: bool = False
    ) -> None:
        """Keep ``rec`` and make ``new`` the pending value (``show``: show it to reads, see
        :meth:`set_value`; ``placed``: the caller puts it in the issue order)."""
        phase, sync = rec.phase, rec.sync
        e.records.append(rec)
        if phase not in e.phases:
            e.phases.add(phase)
            bucket = self.by_phase.get(phase)
            if bucket is None:
                bucket = self.by_phase[phase] = []
            bucket.append(e)  # (no id() of an entry: dynamo cannot replay the id of an object it made)
            if e.trainable or len(e.phases) > 1:
                self.mixed.update(e.phases)
        if sync is not None and e.sync is None:
            e.sync = sync
            self.synced.append(e)
        if not placed:
            self.order.append(rec)
        self.set_value(e, new, how, show)

    def set_value(self, e: Entry, new: torch.Tensor, how: Lookup = EAGER, show: bool = True) -> None:
        """Make ``new`` ``e``'s pending value and (``show``) what reads of ``e``'s target return."""
        old = e.value
        e.value = new
        how.valued(self, e, old, new)
        if show and e.shows is not None:
            self.shown = True
            if overlay.show(e, new, e, old):
                e.swapped = True

    def pending_names(self) -> list[str]:
        """The qualified names of the targets with pending updates."""
        names = [e.name for e in self.entries.values() if e.value is not None]
        for rec in self.loose:
            names += rec.names()
        return names

    def pending_name_of(self, t: torch.Tensor) -> str | None:
        """The name of ``t`` if it is a target with pending updates, or the pending value of one."""
        self.settle()  # (names an update's target: not on a step's path)
        e = self.entries.get(id(t))
        if e is not None and e.target is t and e.value is not None:
            return e.name
        found = self.stored_of(t)
        if found is not None:
            return self.pending_name_of(found[0])
        return None

    def stored_of(self, v: torch.Tensor) -> tuple[torch.Tensor, dict | None] | None:
        """``(target, buffer slots)`` when ``v`` is the pending value of one of this step's targets,
        else None (for serialization: the stored tensor stands for its pending value)."""
        if self.aliases_stale:
            self.rebuild_aliases()
        e = self.aliases.get(id(v))
        if e is not None and e.value is v:
            return e.target, e.slots
        if self.loose:
            i = self.index_loose().get(id(v))
            if i is not None:
                rec = self.loose[i]
                for t, x, info in zip(rec.targets, rec.values, rec.infos):  # type: ignore[arg-type]
                    if x is v:
                        return t, info.slots
        return None

    def current_of(self, e: Entry) -> torch.Tensor:
        """What a read of ``e``'s target sees now: its pending value, or the value a checkpoint
        recomputation shows (``state.local.replay``)."""
        replay = _local.replay
        if replay is not None:
            return replay.current(self, e)
        return e.current()

    def read(self, t: torch.Tensor, how: Lookup = EAGER) -> torch.Tensor:
        """The value of ``t`` as this step sees it (pending or stored), as a plain tensor."""
        k = id(t)
        if not (how.traced or self.loose or self.aliases_stale or k in self.entries or k in self.aliases):
            if _local.replay is None:  # (not a target, nor a pending value, of this step: as it is)
                return t if type(t) in _PLAIN else overlay.plain(t)
        e = self.find(t, False, how)
        if e is None:
            return overlay.plain(t)
        return overlay.plain(self.current_of(e))

    # ------------------------------------------------------------------
    # the overlay
    # ------------------------------------------------------------------
    def hide(self) -> None:
        """Stop showing pending values: module slots get their stored tensors back."""
        if not self.shown:
            return
        self.shown = False
        for name, stored, now in overlay.hide_all(self.loose, self.entries.values()):
            self._replaced(name, stored, now)

    # ------------------------------------------------------------------
    # targets changed under the step (model.to(), .half(), to_empty(), .data = ...)
    # ------------------------------------------------------------------
    def _replaced(self, name: str, stored: torch.Tensor, now: Any) -> None:
        """A buffer slot holds ``now``, neither the target nor its pending value: ``Module._apply``
        (``model.to()``, ``.half()``, ``to_empty()``) converted the pending value it showed. The
        conversion is applied to the stored value instead (``now`` takes its values), and the step
        may not commit (:meth:`changes`)."""
        if not self.watch:
            return
        if isinstance(now, torch.Tensor) and now.shape == stored.shape:
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                now.copy_(stored)
        self.changed.append(f"{name!r} (its buffer was converted or replaced: now {_where(now)})")

    def check_storage(self) -> list[str]:
        """After :meth:`hide`: the targets changed while updates to them were pending (their buffer
        slot replaced, see :meth:`_replaced`; a parameter replaced in its module, its storage, dtype
        or device changed). A ``pu.Parameter`` whose storage a conversion replaced showed its pending
        value to that conversion: it gets the stored value, converted. Returns what changed."""
        for e in self.entries.values() if self.watch else ():
            if e.value is None or e.slots is not None or e.sharded:
                continue
            t = e.target
            info = e.info
            owner = info.owner_ref() if info is not None and info.kind == "parameter" else None
            now = owner._parameters.get(e.attr) if owner is not None else t
            if now is not t:
                # a new parameter object in the slot (to_empty, overwrite-on-conversion, module.x = ...)
                if isinstance(now, torch.Tensor) and now.shape == t.shape:
                    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                        now.detach().copy_(e.raw if e.raw is not None else t)
                self.changed.append(f"{e.name!r} (the parameter was replaced: now {_where(now)})")
            elif e.raw is not None and e.shows == overlay.PARAM and _data_ptr(_plain_view(t)) != _data_ptr(e.raw):
                with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                    t.detach().copy_(e.raw)  # the stored value, converted, in place of the pending one
                self.changed.append(f"{e.name!r} (its storage was replaced: now {_where(t)})")
            elif t.dtype != e.value.dtype or t.device != e.value.device:
                self.changed.append(f"{e.name!r} (converted: now {_where(t)})")
        changed, self.changed = self.changed, []
        return changed

    def show_pending(self) -> None:
        """Show the values still pending (those of phases not committed yet) again."""
        if self.loose and AUXILIARY not in self.done_phases:
            overlay.show_loose(self.loose)
            self.shown = True
        for e in self.entries.values():
            if e.value is not None and e.phases - self.done_phases:
                self.set_value(e, e.value)

    def discard(self) -> None:
        """Drop every pending update; storage was never touched."""
        self.hide()
        self.check_storage()  # (a conversion in the step keeps the stored values, converted)
        self.close()

    def close(self) -> None:
        """The step is over: its entries may serve the next one, and nothing here holds a pending value
        any more (the last step's schedule keeps the journal: it must not keep a copy of the updated
        tensors alive until the next step)."""
        self.state = "closed"
        self.aliases = {}
        for rec in self.order:
            rec.operands = rec.targets = rec.values = None  # (the schedule shows op, condition and origin only)
        self.loose, self.loose_dst, self.loose_src, self.loose_ids, self.loose_indexed = [], [], [], {}, 0
        for e in self.entries.values():
            e.value = None
            e.journal = None
