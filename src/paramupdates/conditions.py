"""``pu.when(pred)``: conditional updates.

Inside ``with pu.when(pred):``

* ``pred`` a Python ``bool`` (``self.training`` is the idiom): ``False``
  records nothing at all, ``True`` records as if there were no condition;
* ``pred`` a 0-dim ``torch.bool`` tensor: every update records
  ``new = torch.where(pred, new, old)``; the predicate is never read on the
  host, so there is no device sync and no recompilation per value.

Nested ``when`` blocks AND together (``pred_outer & pred_inner``); a ``False``
anywhere in the nest records nothing.

A tensor ``pred`` is read when the block is entered (the block holds its own copy, as a nested
block holds the AND it computed): a flag tensor the user writes later, while the updates of the
block are still pending, does not change what they commit (rule 12: with the value they had when
issued).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from . import hooks, state
from .origin import call_site


def current() -> bool | torch.Tensor | None:
    """The combined condition in force: ``None``, ``False`` or a bool tensor."""
    return state.local.conditions[-1]


def _combine(outer: bool | torch.Tensor | None, pred: bool | torch.Tensor) -> bool | torch.Tensor | None:
    if outer is False or pred is False:
        return False
    if pred is True:
        return outer
    if outer is None:
        return pred.clone()  # (the user's tensor, read now: see the module docstring)
    return torch.logical_and(outer, pred)


def _check(pred: object) -> bool | torch.Tensor:
    if isinstance(pred, torch.Tensor):
        if pred.dim() != 0 or pred.dtype != torch.bool:
            raise ValueError(
                f"pu.when() at {call_site(3)} got a tensor of shape {tuple(pred.shape)} and dtype "
                f"{pred.dtype}; it takes a Python bool or a 0-dim torch.bool tensor. "
                "Reduce the predicate first, e.g. pu.when((x > 0).all())."
            )
        return pred
    if isinstance(pred, bool):
        return pred
    # numpy.bool_ and similar: accept anything that is exactly a truth value.
    if type(pred).__name__ in ("bool_", "bool") and hasattr(pred, "__bool__"):
        return bool(pred)
    raise TypeError(
        f"pu.when() at {call_site(3)} got {type(pred).__name__}; it takes a Python bool "
        "(e.g. self.training) or a 0-dim torch.bool tensor."
    )


@contextmanager
def when(pred: bool | torch.Tensor) -> Iterator[None]:
    """Make the updates issued inside the block conditional on ``pred``.

    ``pred`` is a Python ``bool`` (``False`` records nothing) or a 0-dim bool
    tensor (each update becomes ``new = torch.where(pred, new, old)``, with no
    host sync). Nested blocks AND their predicates. Reads inside the block see
    the conditional value, in program order (read-your-writes, rule 1).
    """
    local = state.local
    stack = local.conditions
    if local.eager_log is None and local.replay is None and hooks.segment_possible():
        hooks.adopt_segment()  # (before the push: the segment notes the condition at its entry)
    stack.append(_combine(stack[-1], _check(pred)))
    try:
        yield
    finally:
        stack.pop()
