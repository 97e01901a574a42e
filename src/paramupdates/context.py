"""What is in progress: the steps, the attachments, the pending ``pu.Parameter`` values.

The one place where the core keeps mutable state shared between modules.

Steps are per thread (docs/design.md, "Threads"): what a thread has in
progress (its explicit steps, the commit running ``optimizer.step()``, its
``pu.when`` conditions, the recomputation it runs, its checkpointed segment)
lives in :data:`local`, a ``threading.local``; the core reads it as
``context.local.<name>``. Two threads step two models independently, and an
update issued in one thread never sees another thread's step or condition.

What belongs to objects rather than to a thread is global: the attachments
(an attachment is found from its model's tensors, whichever thread issues
the update) and the pending values shown by ``pu.Parameter`` objects.

(``context.local.explicit``, ``context.local.conditions``, ... still read the calling
thread's values, for code written against the module attributes.)
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .journal import Journal
    from .replay import EagerLog, Replay


class Local(threading.local):
    """What one thread has in progress (each thread starts with nothing)."""

    def __init__(self) -> None:
        self.explicit: list[Journal] = []
        """``pu.step`` / ``Stepper`` / ``pu.func.functional_call`` journals in progress in this thread
        (innermost last), while they record and while they commit."""
        self.committing: list[Any] = []
        """Commits of this thread running ``optimizer.step()``: that call is theirs, so an attachment
        on the same optimizer stands aside (its rules would apply a second time)."""
        self.conditions: list[bool | torch.Tensor | None] = [None]
        """The ``pu.when`` conditions in force in this thread, combined: ``None`` (unconditional),
        ``False``, a bool tensor."""
        self.replay: Replay | None = None
        """The view of the targets while this thread recomputes a checkpointed segment (replay,
        rule 3). Its journals are those live when the segment's forward ran, in whichever thread:
        autograd may recompute in one of its device threads."""
        self.eager_log: EagerLog | None = None
        """The innermost checkpointed segment whose forward this thread runs outside a step: it
        notes the entry values of what it writes eagerly, for its recomputation."""


local = Local()
"""This thread's steps, commits, conditions, replay and eager log."""

steps: list[Journal] = []
"""Every explicit step in progress, of every thread (what serialization and ``load_state_dict`` look at:
a module's slots are shared between threads)."""

attachments: list[Any] = []
"""Live attachments (``pu.attach``), in attach order. An attachment holds its model weakly and
leaves this list when the model is collected."""

pu_pending: dict[int, Any] = {}
"""``id(pu.Parameter)`` -> what it shows: an object with ``.target`` (the parameter) and ``.value``."""

_PER_THREAD = frozenset({"explicit", "committing", "conditions", "replay", "eager_log"})


def __getattr__(name: str) -> Any:
    # ``context.local.explicit`` & co.: the calling thread's (read-only through this path)
    if name in _PER_THREAD:
        return getattr(local, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def reset() -> None:
    """Forget everything in progress in this thread, and every attachment and pending value
    (see ``paramupdates.testing.reset``)."""
    local.explicit.clear()
    local.committing.clear()
    del local.conditions[1:]
    local.conditions[0] = None
    local.replay = None
    local.eager_log = None
    attachments.clear()
    steps.clear()
    pu_pending.clear()
