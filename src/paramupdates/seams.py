"""What a low module names of a higher one (``docs/design.md``, "Architecture": the layers).

A module imports only from the layers below it, under ``if TYPE_CHECKING:`` too
(``tests/test_layering.py``). Where a low module's annotations name an object of a higher layer,
they take it from here instead:

* a small :class:`~typing.Protocol` naming only what the low module uses of it
  (:class:`Restorable`: a rule, as the commit's rollback saves and restores it;
  :class:`JournalView`: a journal, as a checkpoint's replay shows its pending values);
* ``Any``, under the higher class's name, where the low module only holds the object and hands it
  back (a registry's list, a hook's argument) or uses too much of it for a small Protocol
  (``routing`` finds a target's journal, and so uses most of one).

This module is for annotations only: it is imported under ``if TYPE_CHECKING:``, and imports
nothing of the package but ``records``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from .records import Entry

# --- opaque: held and handed back ------------------------------------------------------------------------

Journal = Any
"""A ``journal.Journal``: one step in progress."""

Attachment = Any
"""An ``attach.Attachment``: an optimizer whose steps commit what was recorded since the last one."""

Commit = Any
"""A ``commit.driver.Commit``: one commit of one journal (handed to the distributed hooks)."""

ModelIndex = Any
"""A ``targets.ModelIndex``: a model's tensors, its rules and its commits' caches."""

Rule = Any
"""A ``rules.base.Rule`` (``targets.ModelIndex.rules`` holds them; ``rules.base`` makes and reads them)."""

EagerLog = Any
"""A ``replay.EagerLog``: what a checkpointed segment wrote eagerly, for its recomputation."""

Replay = Any
"""A ``replay.Replay``: a checkpointed segment being recomputed."""


# --- protocols: what the low module uses -----------------------------------------------------------------


class Restorable(Protocol):
    """A rule as the commit's rollback sees it (``commit.rollback.Rollback.save_rules``)."""

    def save(self) -> Any:
        """Python-level state to restore if the commit fails."""

    def restore(self, saved: Any) -> None:
        """Restore what :meth:`save` returned."""


class JournalView(Protocol):
    """A journal as a checkpoint's replay sees it (``replay.Replay``, ``replay.entry_values``): its
    entries and the value each shows."""

    @property
    def entries(self) -> Mapping[int, Entry]:
        """``id(target)`` -> its entry."""

    def settle(self) -> None:
        """Make the entries of the loose records."""

    def current_of(self, e: Entry) -> torch.Tensor:
        """The value ``e``'s target shows now."""
