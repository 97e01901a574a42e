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
# Live attachments (``pu.attach``), in attach order.
attachments: list[Any] = []
# id(pu.Parameter) -> its pending entry: what ``__torch_function__`` reads.
pu_pending: dict[int, Entry] = {}
# Set while a checkpointed segment is recomputed (see integrations.checkpoint).
replay: Any = None
# Set by a compiled graph that installed pending pu.Parameter values: the
# id-keyed ``pu_pending`` is rebuilt from the open transactions at the next
# eager read (dynamo does not reliably replay id()-keyed dict writes).
pu_stale: bool = False


def open_transactions() -> list[Transaction]:
    """The transactions whose overlay is visible: explicit steps, then attachments'."""
    out = [tx for tx in explicit if tx.state == "open"]
    for att in attachments:
        tx = att.tx
        if tx is not None and tx.state == "open":
            out.append(tx)
    return out


def rebuild_pu_pending() -> None:
    """Re-derive ``pu_pending`` from the open transactions (after a compiled graph)."""
    global pu_stale
    from .transaction import _is_pu_parameter

    pu_stale = False
    for tx in open_transactions():
        for e in tx.entries.values():
            if e.value is not None and _is_pu_parameter(e.target):
                pu_pending[id(e.target)] = e
