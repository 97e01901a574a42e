"""The records of the core, as types: what a step remembers about a target and an update.

* :class:`TargetInfo`: where a tensor lives in a model (its qualified name, owning module,
  attribute, how a read sees its pending value);
* :class:`Record`: one issued update (op, operand, condition, phase, sync, call site);
* :class:`Entry`: a target with pending updates in one journal (its records, its pending value);
* :class:`Row`: the auxiliary updates of one module call whose values the module computed
  (``pu.nn``'s statistics: a batch norm's three) of targets with nothing else pending: one object
  for all of them, instead of an entry and a record each;
* :class:`Issued`: an issued update in a journal's issue order. The order's items are those and
  rows: what ``schedule()`` shows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .phases import AUXILIARY

if TYPE_CHECKING:
    from .journal import Journal


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
    """One issued update."""

    op: str
    operand: Any
    key: Any
    cond: torch.Tensor | None
    phase: str
    sync: str | None
    origin: Any  # an origin.Origin, or a string while dynamo traces


@dataclass(eq=False, slots=True)
class Entry:
    """A target with pending updates in one journal."""

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
    journal: Journal | None = None  # the journal using it now (None: free to be reused by the next step)
    sharded: bool = False  # the target is a DTensor (FSDP2): written through its local shard

    def current(self) -> torch.Tensor:
        return self.target if self.value is None else self.value


@dataclass(eq=False, slots=True)
class Row:
    """The auxiliary updates of one module call whose values the module computed (``pu.nn``'s
    statistics), of targets with nothing else pending: the ``k``-th update writes ``values[k]``
    into ``targets[k]`` (``infos[k]`` says where it lives), shown by the schedule as ``ops[k]``.

    It is its own item in the journal's issue order. When the step is over (``Journal.close``)
    it drops its tensors but the condition, as a :class:`Record` does: the schedule reads the
    infos' names, the ops, the condition and the origin.
    """

    targets: list[torch.Tensor] | None
    infos: list[TargetInfo]
    ops: list[str]
    operands: list[Any] | None
    values: list[torch.Tensor] | None  # the pending values
    cond: torch.Tensor | None
    origin: Any

    @property
    def phase(self) -> str:
        return AUXILIARY

    def index(self, t: torch.Tensor) -> int:
        """``k`` where ``t`` is ``targets[k]`` or ``values[k]`` (-1 if neither)."""
        for k, x in enumerate(self.targets or ()):
            if x is t:
                return k
        for k, v in enumerate(self.values or ()):
            if v is t:
                return k
        return -1


@dataclass(eq=False, slots=True)
class Issued:
    """An issued update in a journal's issue order: its entry and its record."""

    entry: Entry
    record: Record

    @property
    def phase(self) -> str:
        return self.record.phase
