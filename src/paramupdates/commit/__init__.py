"""The commit: one step's journal applied in the fixed phase order (phase order, rule 4; validated
commit, rule 7).

* ``driver``: :class:`Commit`, the sequence every way of ending a step goes through;
* ``finite``: the opt-in finiteness check (one batched reduction, one sync);
* ``rollback``: the copies that let ``copy_for_rollback=True`` restore a failed commit bitwise.
"""

from .driver import Commit, CommitContext, optimizer_rows

__all__ = ["Commit", "CommitContext", "optimizer_rows"]
