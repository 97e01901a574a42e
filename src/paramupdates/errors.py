"""Exceptions raised by paramupdates.

Every message names the target (its qualified name in the model), the call
site (``file:line``) of the offending update, and what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence


def listed(items: Sequence[str], n: int = 3, sep: str = ", ") -> str:
    """The first ``n`` of ``items`` joined by ``sep``, and how many more: what an error shows of a
    long list of targets (a message stays readable for a model with hundreds of them)."""
    shown = sep.join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


class UpdateError(RuntimeError):
    """An update cannot be recorded or committed.

    Raised for a bad shape, dtype kind, device, a non-finite value at commit
    (with ``on_nonfinite="raise"``), a target that belongs to no registered
    model, or a misuse of a step. When it is raised, every parameter and
    buffer is bitwise what it was before the step.
    """


class AmbiguousOrderError(UpdateError):
    """An update with ``phase=None`` targets a trainable parameter.

    The optimizer also updates that parameter, so the order of the two
    updates would be a race. Pass ``phase="before_grad"`` or
    ``phase="after_grad"`` to say which comes first.
    """


class AccountingWarning(UserWarning):
    """Something declared or issued may not be applied as the user believes.

    paramupdates accounts for everything: at every optimizer step that updates a tensor a declared
    rule covers, the rule runs on the tensor the model holds then under that name, and an issued
    update is committed by the step of the model it was issued for, or the library raises or warns.

    Warned, once per cause, where paramupdates cannot prove a mistake but sees a declared rule or an
    issued update left without a step that applies it: a declared rule over tensors that an
    ``optimizer.step()`` updated with no ``pu.step`` / ``pu.attach`` of their model around it, a plain
    ``torch.nn`` batch norm recomputed by activation checkpointing, updates still pending when their
    attachment is collected. The message names the rule or update, where it was declared or issued,
    and the fix. The project's own tests turn it into an error (``pyproject.toml``): where nothing is
    wrong, nothing is warned.
    """
