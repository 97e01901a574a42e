"""paramupdates: ordered, deterministic, transactional custom updates of parameters.

See DESIGN.md for the rules; every public name's docstring states the
ordering rule that applies to it.
"""

from .conditions import when
from .errors import AmbiguousOrderError, UpdateError
from .parameter import Parameter
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
    "read",
    "step",
    "when",
]
