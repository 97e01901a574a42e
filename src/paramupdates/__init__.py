"""paramupdates: ordered, deterministic, transactional custom updates of parameters.

See DESIGN.md for the rules; every public name's docstring states the
ordering rule that applies to it.
"""

from .conditions import when
from .errors import AmbiguousOrderError, UpdateError
from .parameter import Parameter
from .rules.constraints import clamp, constrain, max_norm, min_max_norm, non_neg, unit_norm
from .rules.ema import ema
from .rules.weight_decay import weight_decay
from .schedule import Schedule, ScheduleEntry
from .step import Attachment, Stepper, attach, step
from .updates import assign, assign_add, assign_key, assign_sub, read

__all__ = [
    "AmbiguousOrderError",
    "Attachment",
    "Parameter",
    "Schedule",
    "ScheduleEntry",
    "Stepper",
    "UpdateError",
    "assign",
    "assign_add",
    "assign_key",
    "assign_sub",
    "attach",
    "clamp",
    "constrain",
    "ema",
    "max_norm",
    "min_max_norm",
    "non_neg",
    "read",
    "step",
    "unit_norm",
    "weight_decay",
    "when",
]
