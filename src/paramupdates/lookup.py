"""How one call finds tensors: eagerly, or while dynamo traces. Chosen once per call.

An update (``updates.issue``), a batch of statistics (``updates.issue_computed``) and a read
(``pu.read``) ask :func:`choose` once, and hand the strategy to everything they call:

* :data:`EAGER` finds a target or a pending value by ``id()`` in a dict (one look-up), keeps the
  journal's alias table current, reuses the entries of earlier steps, and takes the call site from
  the frames;
* :data:`TRACED` (inside ``torch.compile``) finds them by identity (a scan of the step's entries):
  ``id()`` of a tensor makes dynamo guard on that object, a recompilation per step for a pending
  value, and the ``id()`` of a tensor made in the graph cannot be replayed. It reuses nothing
  (dynamo replays new objects only), lets the alias table be rebuilt after the graph ran, and asks
  the registered tracing support (``hooks.register_tracing_support``) for the call site and for
  trace-time constants.

The two differ in these few methods and nowhere else.
"""

from __future__ import annotations

from typing import Any

import torch

from . import hooks
from .origin import Origin, capture
from .records import Entry


class Lookup:
    """The eager strategy (see the module docstring); :class:`Traced` overrides what differs."""

    traced = False

    def origin(self, depth: int) -> Origin | str:
        """The call site ``depth`` frames above the caller."""
        return capture(depth + 1, False)

    def entry(self, j: Any, t: torch.Tensor) -> Entry | None:
        """The entry of ``j`` whose target or pending value is ``t`` (a loose record's: its entries
        are made first, ``Journal.settle``)."""
        if j.loose and id(t) in j.index_loose():
            j.settle(self)
        e = j.entries.get(id(t))
        if e is not None and e.target is t:
            return e
        if j.aliases_stale:
            j.rebuild_aliases()
            e = j.entries.get(id(t))
            if e is not None and e.target is t:
                return e
        e = j.aliases.get(id(t))
        if e is not None and e.value is t:
            return e
        return None

    def in_optimizer(self, j: Any, t: torch.Tensor) -> bool:
        """Whether ``t`` is one of the parameters of ``j``'s optimizer."""
        return id(t) in j.opt_ids()

    def valued(self, j: Any, e: Entry, old: torch.Tensor | None, new: torch.Tensor) -> None:
        """``e``'s pending value changed from ``old`` to ``new``: keep the alias table current."""
        if old is not None:
            j.aliases.pop(id(old), None)
        j.aliases[id(new)] = e

    reuses = True
    """Whether entries of earlier steps are reused, and plain views of targets made at once."""


class Traced(Lookup):
    """The strategy while dynamo traces (see the module docstring)."""

    traced = True

    def origin(self, depth: int) -> Origin | str:
        support = hooks.tracing()
        return support.call_site() if support is not None else "<compiled>"

    def entry(self, j: Any, t: torch.Tensor) -> Entry | None:
        if j.loose and j.in_loose(t):
            j.settle(self)
        for e in j.entries.values():
            if e.target is t or e.value is t:
                return e
        return None

    def in_optimizer(self, j: Any, t: torch.Tensor) -> bool:
        support = hooks.tracing()
        if support is not None:
            return support.in_optimizer(j.optimizer, t)
        return any(p is t for g in j.optimizer.param_groups for p in g["params"])

    def valued(self, j: Any, e: Entry, old: torch.Tensor | None, new: torch.Tensor) -> None:
        j.aliases_stale = True

    reuses = False


EAGER = Lookup()
TRACED = Traced()


def choose() -> Lookup:
    """:data:`TRACED` while dynamo traces, else :data:`EAGER`."""
    return TRACED if torch.compiler.is_compiling() else EAGER
