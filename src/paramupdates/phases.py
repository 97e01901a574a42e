"""The phases of a commit, in their fixed order (design phase order (rule 4), ``docs/design.md``).

1. ``before_grad``: declared rules (weight decay), then updates issued with that phase;
2. ``grad``: the optimizer's step, if the step has an optimizer;
3. ``after_grad``: declared rules (constraints), then updates issued with that phase;
4. ``auxiliary``: updates issued with ``phase=None`` on non-trainable targets;
5. ``after_step``: declared rules that read the final values (EMA), then updates with that phase.

Inside a phase: declared rules in declaration order, then issued updates in issue order.
This module is the one place that lists them.
"""

from __future__ import annotations

BEFORE_GRAD = "before_grad"
GRAD = "grad"
AFTER_GRAD = "after_grad"
AUXILIARY = "auxiliary"
AFTER_STEP = "after_step"

PHASES: tuple[str, ...] = (BEFORE_GRAD, GRAD, AFTER_GRAD, AUXILIARY, AFTER_STEP)
"""Every phase, in commit order."""

RECORD_PHASES: tuple[str, ...] = (BEFORE_GRAD, AFTER_GRAD, AUXILIARY, AFTER_STEP)
"""The phases an issued update can land in (``grad`` is the optimizer's alone)."""

AFTER_OPTIMIZER: tuple[str, ...] = (AFTER_GRAD, AUXILIARY, AFTER_STEP)
"""The phases that follow the optimizer's step."""

ISSUE_PHASES = (None, BEFORE_GRAD, AFTER_GRAD, AFTER_STEP)
"""What ``phase=`` accepts (``None``: ``auxiliary``, refused on a trainable target)."""
