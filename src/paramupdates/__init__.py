"""paramupdates: ordered, deterministic, transactional custom updates of parameters.

The rules are in ``docs/design.md``; every public name's docstring states the
ordering rule that applies to it.
"""

from . import (
    func,
    guards,
    integrations,
    nn,
    testing,
)
from .attach import Attachment, attach
from .conditions import when
from .errors import AccountingWarning, AmbiguousOrderError, UpdateError
from .integrations.checkpoint import checkpoint
from .nn import convert, recompute_batchnorm_stats
from .parameter import Parameter
from .rules.base import Rule
from .rules.constraints import clamp, constrain, max_norm, min_max_norm, non_neg, unit_norm
from .rules.ema import ema
from .rules.weight_decay import weight_decay
from .schedule import Schedule, ScheduleEntry
from .step import Stepper, step
from .updates import assign, assign_add, assign_key, assign_sub, read

_INSTALLED = (guards.install(), *integrations.install())
"""What importing paramupdates puts in place (the guards of ``copy.deepcopy``, of pickling a module
and of module registration, the integrations' hooks); each has ``.remove()``."""

__all__ = [
    "AccountingWarning",
    "AmbiguousOrderError",
    "Attachment",
    "Parameter",
    "Rule",
    "Schedule",
    "ScheduleEntry",
    "Stepper",
    "UpdateError",
    "assign",
    "assign_add",
    "assign_key",
    "assign_sub",
    "attach",
    "checkpoint",
    "clamp",
    "constrain",
    "convert",
    "ema",
    "func",
    "max_norm",
    "min_max_norm",
    "nn",
    "non_neg",
    "read",
    "recompute_batchnorm_stats",
    "step",
    "testing",
    "unit_norm",
    "weight_decay",
    "when",
]
