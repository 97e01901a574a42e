"""What is in progress: the steps, the attachments, the pending ``pu.Parameter`` values.

The one place where the core keeps mutable state shared between modules.
Every module reads it as ``context.<name>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .journal import Journal
    from .replay import EagerLog, Replay

explicit: list[Journal] = []
"""``pu.step`` / ``Stepper`` / ``pu.func.functional_call`` journals in progress (innermost last), while
they record and while they commit."""

committing: list[Journal] = []
"""Journals whose commit is running ``optimizer.step()``: that call is theirs, so an attachment on the
same optimizer stands aside (its rules would apply a second time)."""

attachments: list[Any] = []
"""Live attachments (``pu.attach``), in attach order."""

pu_pending: dict[int, Any] = {}
"""``id(pu.Parameter)`` -> what it shows: an object with ``.target`` (the parameter) and ``.value``."""

conditions: list[bool | torch.Tensor | None] = [None]
"""The ``pu.when`` conditions in force, combined: ``None`` (unconditional), ``False``, a bool tensor."""

replay: Replay | None = None
"""The view of the targets while a checkpointed segment is recomputed (replay, rule 3)."""

eager_log: EagerLog | None = None
"""The innermost checkpointed segment running its forward outside a step: it notes the entry values
of what it writes eagerly, for its recomputation."""


def reset() -> None:
    """Forget everything in progress (see ``paramupdates.testing.reset``)."""
    global replay, eager_log
    explicit.clear()
    committing.clear()
    attachments.clear()
    pu_pending.clear()
    del conditions[1:]
    replay = None
    eager_log = None
