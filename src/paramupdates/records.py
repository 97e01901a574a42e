"""The records of the core, as types: what a step remembers about a target and an update.

* :class:`TargetInfo`: where a tensor lives in a model (its qualified name, owning module,
  attribute, how a read sees its pending value);
* :class:`Record`: one call that issued updates (one per target it updates: ``pu.assign`` one, a
  batch norm's call three), with their condition, phase, sync and call site; a journal's issue
  order is its records;
* :class:`Entry`: a target with pending updates in one journal (its records, its pending value).

And the seams between the core's modules, as Protocols (:class:`JournalLike`,
:class:`OwnerLike`, :class:`RuleLike`, :class:`CommitLike`, :class:`IndexLike`,
:class:`ReplayLike`, :class:`EagerLogLike`): a low module names what it needs of a higher one
without importing it, so that the import graph has no cycle, ``TYPE_CHECKING`` imports
included (``tests/test_layering.py``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    its records. When the step is over (``Journal.close``) a record drops its operands (the schedule
    shows the op, the condition and the origin).
    """

    entries: list[Entry]
    ops: list[str]
    operands: list[Any] | None
    key: Any  # pu.assign_key's key (a single update)
    cond: torch.Tensor | None
    phase: str
    sync: str | None
    origin: Any  # an origin.Origin, or a string while dynamo traces


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
    journal: JournalLike | None = None  # the journal using it now (None: free to be reused by the next step)
    sharded: bool = False  # the target is a DTensor (FSDP2): written through its local shard

    def current(self) -> torch.Tensor:
        return self.target if self.value is None else self.value


# --- the seams, as Protocols --------------------------------------------------------------------------
class IndexLike(Protocol):
    """A model's index (``targets.ModelIndex``)."""

    generation: int
    by_id: dict[int, TargetInfo]
    has_meta: bool

    @property
    def model(self) -> nn.Module | None: ...
    def lookup(self, t: torch.Tensor) -> TargetInfo | None: ...
    def peek(self, t: torch.Tensor) -> TargetInfo | None: ...
    def name_of(self, t: torch.Tensor) -> str | None: ...
    def module_name(self, module: nn.Module) -> str | None: ...
    def meta_names(self) -> list[str]: ...
    def owns_any(self, tensors: list[torch.Tensor]) -> bool: ...


class JournalLike(Protocol):
    """The journal of one step (``journal.Journal``)."""

    index: Any
    optimizer: Any
    label: str
    entries: dict[int, Entry]

    def find(self, t: torch.Tensor, create: bool = ..., how: Any = ...) -> Entry | None: ...
    def holds(self, t: torch.Tensor) -> bool: ...
    def stored_of(self, v: torch.Tensor) -> tuple[torch.Tensor, dict | None] | None: ...
    def pending_names(self) -> list[str]: ...
    def pending_name_of(self, t: torch.Tensor) -> str | None: ...
    def current_of(self, e: Entry) -> torch.Tensor: ...
    def discard(self) -> None: ...


class OwnerLike(Protocol):
    """What opens journals: a ``pu.attach`` attachment (``attach.Attachment``)."""

    index: Any
    label: str
    journal: JournalLike | None

    @property
    def model(self) -> nn.Module | None: ...
    def open_journal(self) -> JournalLike: ...
    def detach(self) -> None: ...


class CommitLike(Protocol):
    """One commit (``commit.Commit``): what hooks and rules see of it."""

    journal: Any
    optimizer: Any
    options: Any
    label: str
    seq: int


class ReplayLike(Protocol):
    """The view of the targets while a checkpointed segment is recomputed (``replay.Replay``)."""

    journals: list[Any]
    explicit: list[Any]

    def lookup(self, j: Any, t: torch.Tensor) -> Entry | None: ...
    def current(self, j: Any, e: Entry) -> torch.Tensor: ...
    def set_value(self, j: Any, e: Entry, new: torch.Tensor) -> None: ...
    def eager_write(self, op: str, target: torch.Tensor, operand: Any, key: Any, cond: Any) -> None: ...


class EagerLogLike(Protocol):
    """Entry values of the targets a checkpointed segment writes eagerly (``replay.EagerLog``)."""

    def note(self, t: torch.Tensor) -> None: ...


class RuleLike(Protocol):
    """A declared rule (``rules.base.Rule``): what the core outside ``rules/`` uses of it."""

    phase: str
    kind: str
    origin: Any
    seq: int
    infallible: bool
    per_optimizer_update: bool

    def tensors(self) -> list[torch.Tensor]: ...
    def owner_tensors(self) -> list[torch.Tensor]: ...
    def alive(self) -> bool: ...
    def save(self) -> Any: ...
    def restore(self, saved: Any) -> None: ...
