"""Test isolation: ``pu.testing.reset()``."""

from __future__ import annotations

from . import routing, state
from .rules import base


def reset() -> None:
    """Forget every step in progress, attachment and declared rule.

    Attachments are detached (their hooks removed, pending updates dropped),
    steps in progress are abandoned (nothing of them is written), the
    overlay is removed and every declared rule is undeclared. For test
    fixtures: ``yield; pu.testing.reset()``.
    """
    for att in list(routing.attachments()):
        att.detach()
    journals = routing.live_journals(routing.PROCESS)
    for j in journals + [j for j in routing.explicit() if j not in journals]:
        j.discard()  # (every thread's: a test's threads are gone)
    state.reset()
    base.clear()
