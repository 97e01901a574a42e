"""paramupdates: ordered, deterministic, transactional custom updates of parameters.

Every parameter update that is not a plain gradient step (batch-norm statistics, weight decay,
constraints, an EMA, ``pu.assign``) goes through one mechanism:

* inside a step (``pu.step``, ``pu.Stepper``, or a model under ``pu.attach``) an update is
  recorded, not written: a later read in the step sees every update issued before it, and none
  after (read-your-writes, in program order); what autograd saved stays valid;
* the step commits atomically, in a fixed order: ``before_grad`` (weight decay, then updates
  issued with ``phase="before_grad"``), ``optimizer.step()``, ``after_grad`` (constraints, then
  ``phase="after_grad"`` updates), the auxiliary updates (``phase=None`` on tensors the optimizer
  does not update: statistics), ``after_step`` (EMA); within a phase, in declaration and issue
  order. Every check runs before the first write; an error leaves every parameter and buffer as
  it was;
* activation checkpointing (``pu.checkpoint``) replays the recorded updates on recomputation and
  never issues them twice;
* outside a step an update applies at once, in place, under ``torch.no_grad()``.

Each public name's docstring states the rule that applies to it. The full contract, with the test
of each rule, is ``docs/design.md`` in the source repository.
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
from .rules.base import Rule, rules_of
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
    "rules_of",
    "step",
    "testing",
    "unit_norm",
    "weight_decay",
    "when",
]
