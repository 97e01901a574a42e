"""``assign`` / ``assign_add`` / ``assign_sub`` / ``assign_key`` and ``read``.

Inside a step (``pu.step``, ``pu.Stepper``, or a model under ``pu.attach``)
an update is validated at its call site and recorded; reads issued after it
see it (rule 1); nothing is written until commit (rule 2), which applies it
in its phase (rule 4):

* ``phase=None``: the ``auxiliary`` phase, after the gradient update. On a
  trainable target (one the optimizer also updates) that is ambiguous and
  raises :class:`~paramupdates.AmbiguousOrderError` (rule 5);
* ``phase="before_grad"`` / ``"after_grad"``: before / after ``optimizer.step()``;
* ``phase="after_step"``: with EMA, after everything else.

Outside a step an update applies at once, in place, under ``torch.no_grad()``
(rule 8). Inside ``pu.when(False)`` nothing is recorded; inside
``pu.when(tensor)`` the update becomes ``new = where(pred, new, old)``.
``sync="mean"``/``"sum"`` all-reduces the pending value across the process
group at commit (rule 9; outside a step, at once, over the default group).
All return ``None``: read the target to see the new value.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _state, conditions
from ._ops import apply_inplace, check_operand
from ._origin import call_site
from .errors import UpdateError
from .integrations.checkpoint import adopt_torch_segment
from .integrations.parametrize import inverse
from .integrations.parametrize import source as parametrized_source
from .targets import describe, owner_anywhere
from .transaction import _plain, pending_value, route


def _issue(
    op: str, target: torch.Tensor, operand: Any, key: Any, phase: str | None, sync: str | None, fresh: bool = False
) -> None:
    cond = conditions.current()
    if cond is False:
        return
    pred = cond if isinstance(cond, torch.Tensor) else None  # None: unconditional
    origin = call_site(3)
    if not isinstance(target, torch.Tensor):
        raise UpdateError(
            f"pu.{op} at {origin}: the target is a {type(target).__name__}, not a tensor. "
            "Pass a pu.Parameter or a parameter or buffer of your model."
        )
    src = parametrized_source(target)
    if src is not None:
        # rule 10: an update of a parametrized tensor goes through right_inverse
        plist, name = src
        for original, value in inverse(plist, name, op, target, operand, key, origin):
            _issue("assign", original, value, None, phase, sync)
        return
    tx, entry = route(target, origin, op)
    if tx is not None and entry is not None:
        tx.record(entry, op, operand, key, phase, sync, origin, fresh)
        return
    if _state.replay is not None:
        # Re-issued by a pu.checkpoint recomputation: the forward already applied it (rule 3);
        # only the recomputation's own view moves.
        _state.replay.eager_write(op, target, operand, key, pred)
        return
    # Outside a step: eager, in place, under no_grad (rule 8).
    try:
        check_operand(op, target, operand, key, describe(target), origin)
    except UpdateError:
        # Name the target in the error if some model paramupdates has indexed owns it
        # (looked up only on this error path: an eager update stays cheap).
        owner = owner_anywhere(target)
        if owner is None:
            raise
        check_operand(op, target, operand, key, owner[0], origin)
        raise
    log = _state.eager_log if _state.eager_log is not None else adopt_torch_segment()
    if log is not None:
        log.note(target)  # inside a checkpointed segment: keep the value at segment entry (rule 3)
    if sync is not None:  # reduced across ranks before the write (rule 9)
        from .integrations.distributed import apply_eager

        owner = owner_anywhere(target)
        name = owner[0] if owner is not None else describe(target)
        apply_eager(op, target, operand, key, pred, sync, name, origin)
        return
    apply_inplace(op, target, operand, key, pred)


def assign(target: torch.Tensor, value: Any, *, phase: str | None = None, sync: str | None = None) -> None:
    """``target <- value`` (rule 4 phase ``phase``; see the module docstring)."""
    _issue("assign", target, value, None, phase, sync)


def assign_fresh(target: torch.Tensor, value: torch.Tensor, *, sync: str | None = None) -> None:
    """``assign`` of a tensor the caller made for this update and never touches again (``pu.nn``'s
    statistics): inside a step it becomes the pending value without a defensive copy. Internal."""
    _issue("assign", target, value, None, None, sync, True)


def assign_add(target: torch.Tensor, delta: Any, *, phase: str | None = None, sync: str | None = None) -> None:
    """``target <- target + delta``; several in one phase compose in issue order."""
    _issue("assign_add", target, delta, None, phase, sync)


def assign_sub(target: torch.Tensor, delta: Any, *, phase: str | None = None, sync: str | None = None) -> None:
    """``target <- target - delta``; several in one phase compose in issue order."""
    _issue("assign_sub", target, delta, None, phase, sync)


def assign_key(
    target: torch.Tensor, key: Any, value: Any, *, phase: str | None = None, sync: str | None = None
) -> None:
    """``target[key] <- value`` (out of place until commit: ``new = old.clone(); new[key] = value``)."""
    _issue("assign_key", target, value, key, phase, sync)


def read(target: torch.Tensor) -> torch.Tensor:
    """The value of ``target`` as the step in progress sees it.

    Returns the pending value if an update to ``target`` was issued in the
    step in progress, else ``target`` itself. Needed only for plain
    ``torch.nn.Parameter`` targets read through an old reference: a
    ``pu.Parameter`` reads its pending value by itself, a buffer through its
    module attribute.
    """
    v = pending_value(target)
    return target if v is None else _plain(v)
