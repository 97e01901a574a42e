"""Test isolation: ``pu.testing.reset()``."""

from __future__ import annotations

from . import context
from .rules import base


def reset() -> None:
    """Forget every step in progress, attachment and declared rule.

    Attachments are detached (their hooks removed, pending updates dropped),
    steps in progress are abandoned (nothing of them is written), the
    overlay is removed and every declared rule is undeclared. For test
    fixtures: ``yield; pu.testing.reset()``.
    """
    for att in list(context.attachments):
        att.detach()
    for j in {id(j): j for j in [*context.steps, *context.local.explicit]}.values():
        j.discard()  # (every thread's: a test's threads are gone)
    context.reset()
    base.clear()
