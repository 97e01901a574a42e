"""The records of the core, as types: what a step remembers about a target and an update.

* :class:`TargetInfo`: where a tensor lives in a model (its qualified name, owning module,
  attribute, how a read sees its pending value);
* :class:`Record`: one call that issued updates (one per target it updates: ``pu.assign`` one, a
  batch norm's call three), with their condition, phase, sync and call site; a journal's issue
  order is its records;
* :class:`Entry`: a target with pending updates in one journal (its records, its pending value),
  made when a second record, a read or the commit needs it: a record whose targets have nothing
  else pending (a batch norm's statistics, the common case) keeps their pending values itself.

"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(eq=False, slots=True)
class TargetInfo:
    """Where a target lives: ``owner.<attr>`` is the tensor, ``name`` its qualified name.

    ``shows``/``slots``: how a read sees its pending value (``overlay.shows_through``) and, for a
    buffer, the owning module's buffer dict, where the pending value is put.
    """

    ref: weakref.ref
    name: str
    owner_ref: weakref.ref
    attr: str
    kind: str  # "parameter" or "buffer"
    shows: str | None = None
    slots: dict | None = None
    sharded: bool = False  # a DTensor (FSDP2)
    kept: tuple | None = None  # a pu.Parameter: (its class, auxiliary, weight_decay), to keep its type
    meta: bool = False  # on the meta device when indexed (no values: nothing to step)
    loose_in: int = -1  # the serial of the journal where a loose record holds its pending value (Journal.serial)

    @property
    def owner(self) -> nn.Module | None:
        return self.owner_ref()


@dataclass(eq=False, slots=True)
class Record:
    """One call that issued updates: the ``k``-th folds ``ops[k]`` with ``operands[k]`` into the pending
    value of ``entries[k]``'s target. ``pu.assign`` & co. issue one update per call; a ``pu.nn`` module's
    call issues one per statistic it computed (a batch norm's three), under one condition, phase,
    sync and call site.

    The journal's issue order is a list of records (what ``schedule()`` shows), and each entry lists
    its records. A record of a ``pu.nn`` module's statistics whose targets have nothing else pending
    is *loose*: it has no entries, and keeps its ``targets``, their ``infos`` and the pending
    ``values`` itself until something else touches one of them (``Journal.settle`` then makes the
    entries) or the step ends. When the step is over (``Journal.close``) a record drops its operands
    and tensors (the schedule shows the op, the condition and the origin).
    """

    entries: Sequence[Entry]  # () while loose
    ops: list[str]
    operands: list[Any] | None
    key: Any  # pu.assign_key's key (a single update)
    cond: torch.Tensor | None
    phase: str
    sync: str | None
    origin: Any  # an origin.Origin, or a string while dynamo traces
    targets: list[torch.Tensor] | None = None  # a loose record's targets, and
    infos: list[TargetInfo] | None = None  # where they live (their names: what the schedule shows)
    values: list[torch.Tensor] | None = None  # their pending values

    def names(self) -> list[str]:
        """The qualified names of the targets, in order."""
        return [x.name for x in (self.entries or self.infos or ())]


@dataclass(eq=False, slots=True)
class Entry:
    """A target with pending updates in one journal: its records (in issue order) and its pending value."""

    target: torch.Tensor
    name: str
    info: TargetInfo | None
    trainable: bool
    shows: str | None  # how reads see the pending value: overlay.PARAM, overlay.BUFFER or None
    slots: dict[str, Any] | None = None  # overlay.BUFFER: the owning module's buffer dict (``attr`` in it)
    attr: str = ""
    value: torch.Tensor | None = None
    records: list[Record] = field(default_factory=list)
    phases: set[str] = field(default_factory=set)  # the phases of the records
    swapped: bool = False  # a buffer slot holds the pending value
    sync: str | None = None  # "mean"/"sum" when an update of this step asked for it (distributed sync, rule 9)
    raw: torch.Tensor | None = None  # the target as a plain tensor, for the commit's writes
    generation: int = -1  # the model index's generation it was made in
    journal: Any = None  # the journal.Journal using it now (None: free to be reused by the next step)
    sharded: bool = False  # the target is a DTensor (FSDP2): written through its local shard

    def current(self) -> torch.Tensor:
        return self.target if self.value is None else self.value
