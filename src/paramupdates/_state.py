"""Process-wide state: the steps in progress and the pending pu.Parameters.

One training loop per process (like autograd's grad mode, but shared with the
backward thread so that recomputation in backward sees the same overlay).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .transaction import Entry, Transaction

# Explicit ``pu.step`` / ``Stepper`` transactions in progress (at most one).
explicit: list[Transaction] = []
# Explicit steps whose commit is running ``optimizer.step()``: that call is theirs, so an
# attachment on the same optimizer stands aside (its rules would apply a second time).
committing: list[Transaction] = []
# Live attachments (``pu.attach``), in attach order.
attachments: list[Any] = []
# id(pu.Parameter) -> its pending entry: what ``__torch_function__`` reads.
pu_pending: dict[int, Entry] = {}
# Set while a checkpointed segment is recomputed (see integrations.checkpoint).
replay: Any = None
# Innermost pu.checkpoint segment running its forward: notes eager (outside a
# step) writes, so that the recomputation can show the values at segment entry.
eager_log: Any = None
