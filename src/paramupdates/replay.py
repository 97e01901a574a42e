"""Recomputation replays, never re-issues (rule 3 of ``docs/design.md``).

When activation checkpointing recomputes a segment in backward, the segment
must see exactly the values it saw in forward, and the updates it issues
again must be dropped. This module is that semantics; how a checkpointing
mechanism calls it is glue (``integrations/checkpoint.py`` for
``pu.checkpoint`` and ``torch.utils.checkpoint``):

* entering a segment in forward, :func:`entry_values` notes what every live
  journal shows for its targets: one reference per pending target, no copy
  (pending values are never written in place, deferred commit (rule 2));
* during the recomputation, ``state.local.replay`` is a :class:`Replay` that shows
  those values instead of the journals' latest ones. An update issued again
  moves only the replay's own view (so the segment's later reads see it, as
  they did the first time) and is not recorded: the journal keeps the one
  record the first run made.

Outside a step (eager updates, eager outside a step (rule 8)) a segment's writes happen in place, in
forward; the first write of each target in the segment keeps a copy of its
entry value (:class:`EagerLog`), which the recomputation is shown (copied in
with the version counter kept, and the latest value copied back after).

The ``pu.when`` condition in force when the segment's forward began is in
force again around its recomputation (:attr:`Segment.condition`), in place of
whatever the thread that recomputes has in force then (nothing, in backward):
an update the forward dropped (``when(False)``) or made conditional
(``when(tensor)``) is issued again under the same condition, so the
recomputation's reads see what the forward's saw.

So running statistics are updated once per forward call, whether or not the
segment is checkpointed, and a segment that reads a target after updating it
recomputes bitwise the same values, hence the same gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import overlay, routing, state
from .ops import apply_inplace
from .records import Entry

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .seams import JournalView

EntryValues = dict[tuple[int, int], torch.Tensor]
"""``(id(journal), id(entry))`` -> the value shown at segment entry."""


def entry_values() -> EntryValues:
    """What every live journal shows for its targets now (references, no copies)."""
    snap: EntryValues = {}
    for j in routing.live_journals(routing.THREAD):
        j.settle()
        for e in j.entries.values():
            v = j.current_of(e)
            if v is not e.target:
                snap[(id(j), id(e))] = v
    return snap


class View:
    """What ``pu_pending`` holds for a ``pu.Parameter`` during a replay."""

    __slots__ = ("target", "value")

    def __init__(self, target: torch.Tensor, value: torch.Tensor) -> None:
        self.target = target
        self.value = value


class Replay:
    """The view of the targets during the recomputation of one segment.

    ``current(j, e)`` is the value the segment sees now: the value at segment
    entry, then whatever the recomputed updates made it. ``set_value`` is what
    ``Journal.record`` calls instead of recording.
    """

    def __init__(self, snap: EntryValues, eager: EagerLog | None, explicit: Sequence[JournalView]) -> None:
        self.scratch: dict[tuple[int, int], torch.Tensor] = dict(snap)
        self.alias: dict[int, Entry] = {}
        self.eager = eager
        # The explicit steps live when the segment's forward ran (noted then, in that thread: the
        # recomputation may run in another one), then the attachments' journals.
        self.explicit = explicit
        self.journals: list[JournalView] = list(explicit)
        for j in routing.attached_journals():
            if j not in self.journals:
                self.journals.append(j)

    def eager_write(self, op: str, target: torch.Tensor, operand: Any, key: Any, cond: Any) -> None:
        """An eager update issued again by the recomputation: it moves the target's entry value
        (shown in place for the recomputation, swapped back after); other targets are dropped."""
        if self.eager is not None and self.eager.owns(target):
            apply_inplace(op, target, operand, key, cond)

    def current(self, j: JournalView, e: Entry) -> torch.Tensor:
        return self.scratch.get((id(j), id(e)), e.target)

    def lookup(self, j: JournalView, t: torch.Tensor) -> Entry | None:
        e = self.alias.get(id(t))
        if e is not None and self.scratch.get((id(j), id(e))) is t:
            return e
        return None

    def set_value(self, j: JournalView, e: Entry, new: torch.Tensor) -> None:
        self.scratch[(id(j), id(e))] = new
        self.alias[id(new)] = e
        self._show(e, new)

    # -- the overlay ---------------------------------------------------------
    def _shown(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.alias

    def _show(self, e: Entry, v: torch.Tensor) -> None:
        if e.shows == overlay.PARAM:
            overlay.show(e, v, View(e.target, v))
        elif e.shows == overlay.BUFFER:
            cur = overlay.slot(e)
            if cur is e.target or cur is e.value or self._shown(cur):
                overlay.put(e, v)

    def install(self) -> None:
        """Show the values at segment entry."""
        for j in self.journals:
            j.settle()
            for e in j.entries.values():
                v = self.current(j, e)
                self.alias[id(v)] = e
                self._show(e, v)

    def uninstall(self) -> None:
        """Show the journals' latest values again."""
        for j in self.journals:
            for e in list(j.entries.values()):
                if e.shows == overlay.PARAM:
                    overlay.show(e, e.current(), e)  # (the target itself: shows nothing)
                elif e.shows == overlay.BUFFER:
                    cur = overlay.slot(e)
                    if cur is e.target or self._shown(cur):
                        overlay.put(e, e.current() if e.swapped else e.target)


class EagerLog:
    """Values at segment entry of the targets a segment writes eagerly (outside a step).

    Eager updates write in place (eager outside a step, rule 8); the recomputation must still read
    what the forward read, so the first write of each target in the segment
    keeps a copy of its entry value, and the recomputation shows it by
    copying it in and the latest value back out afterwards, with the version
    counter restored both times (saved tensors stay valid).
    """

    def __init__(self, parent: EagerLog | None) -> None:
        self.parent = parent
        self.entry: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def note(self, t: torch.Tensor) -> None:
        log: EagerLog | None = self
        while log is not None:
            if id(t) not in log.entry:
                with torch._C.DisableTorchFunctionSubclass():
                    log.entry[id(t)] = (t, t.detach().clone())
            log = log.parent

    def versions(self) -> dict[int, int]:
        return {k: t._version for k, (t, _) in self.entry.items()}

    def swap(self, values: dict[int, torch.Tensor], versions: dict[int, int]) -> dict[int, torch.Tensor]:
        """Write ``values`` into their targets, set their version counters; return what was there."""
        out: dict[int, torch.Tensor] = {}
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for k, (t, _) in self.entry.items():
                out[k] = t.detach().clone()
                t.detach().copy_(values[k])
                set_version(t, versions[k])
        return out

    def owns(self, t: torch.Tensor) -> bool:
        rec = self.entry.get(id(t))
        return rec is not None and rec[0] is t


def set_version(t: torch.Tensor, version: int) -> None:
    """Set ``t``'s version counter (what a write that is undone leaves: saved tensors stay valid)."""
    try:
        torch._C._autograd._unsafe_set_version_counter((t,), (version,))
    except TypeError:  # torch < 2.5 takes one tensor
        torch._C._autograd._unsafe_set_version_counter(t, version)


class Segment:
    """One checkpointed segment: what its forward saw, and the two contexts around its runs.

    ``forward()`` is entered around the segment's forward (notes the values at
    entry and logs eager writes); ``recompute()`` around its recomputation
    (shows the entry values, drops re-issued updates). A mechanism that
    detects the segment only after its forward began (``torch.utils.checkpoint``)
    calls :meth:`noted` instead of entering ``forward()``.
    """

    def __init__(self) -> None:
        self.values: EntryValues | None = None
        self.log: EagerLog | None = None
        self.explicit: list[JournalView] = []
        self.condition: bool | torch.Tensor | None = None
        """The ``pu.when`` condition in force at segment entry (combined): in force again around the
        recomputation (rule 3: it sees what the forward saw)."""

    def noted(self, parent: EagerLog | None = None) -> EagerLog:
        """Note the values shown now as the entry values, this thread's steps and its ``pu.when``
        condition; return the eager log."""
        replay = state.local.replay  # (a segment inside a recomputation: that replay's steps)
        self.explicit = replay.explicit if replay is not None else list(reversed(routing.explicit()))
        self.condition = state.local.conditions[-1]
        self.values = entry_values()
        self.log = EagerLog(parent)
        return self.log

    def forward(self) -> _Forward:
        return _Forward(self)

    def recompute(self) -> _Recompute:
        return _Recompute(self)


class _Forward:
    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.prev: EagerLog | None = None

    def __enter__(self) -> None:
        self.prev = state.local.eager_log
        state.local.eager_log = self.seg.noted(self.prev)

    def __exit__(self, *exc: Any) -> None:
        state.local.eager_log = self.prev


class _Recompute:
    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.prev: Replay | None = None
        self.prev_log: EagerLog | None = None
        self.replay: Replay | None = None
        self.latest: dict[int, torch.Tensor] | None = None
        self.versions: dict[int, int] = {}

    def __enter__(self) -> None:
        log = self.seg.log
        self.prev = state.local.replay
        if self.prev is not None:
            self.prev.uninstall()
        self.replay = Replay(self.seg.values or {}, log, self.seg.explicit)
        self.replay.install()
        state.local.replay = self.replay
        self.prev_log = state.local.eager_log
        state.local.eager_log = None
        state.local.conditions.append(self.seg.condition)  # (the forward's, not this thread's now)
        if log is not None and log.entry:
            self.versions = log.versions()
            self.latest = log.swap({k: v for k, (_, v) in log.entry.items()}, self.versions)

    def __exit__(self, *exc: Any) -> None:
        assert self.replay is not None
        if self.latest is not None:
            assert self.seg.log is not None
            self.seg.log.swap(self.latest, self.versions)
            self.latest = None
        self.replay.uninstall()
        state.local.conditions.pop()
        state.local.replay = self.prev
        state.local.eager_log = self.prev_log
        if self.prev is not None:
            self.prev.install()
