"""The options of a step, defined and validated once (``pu.step``, ``pu.Stepper``, ``pu.attach``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, TypedDict

from . import hooks

NONFINITE = (None, "raise", "skip")


class StepOptionsDict(TypedDict, total=False):
    """The keyword arguments of :class:`StepOptions`, for what passes them on to ``pu.attach`` later (the
    frameworks' callbacks); ``pu.step``, ``pu.Stepper`` and ``pu.attach`` spell each one out."""

    on_nonfinite: str | None
    copy_for_rollback: bool
    process_group: Any
    sync_timeout: float | datetime.timedelta | None
    scaler: Any


@dataclass(frozen=True)
class StepOptions:
    """How a step commits: the keyword arguments of ``pu.step``, ``pu.Stepper`` and ``pu.attach``.

    Attributes:
        on_nonfinite: ``None`` (the default): no finiteness check, and the commit never waits on the
            device; shape, dtype kind, device and every declared rule's preconditions are still
            checked before the first write, at no host sync. Opt in, as ``optax.apply_if_finite``
            and ``torch.amp.GradScaler`` do: ``"raise"`` (an :class:`~paramupdates.UpdateError`
            naming the target or the parameter, nothing written) or ``"skip"`` (drop the whole
            step, the optimizer's update included, and count it in ``skipped_steps``) when a
            pending value, or a gradient the optimizer would use, is NaN or infinite: one batched
            check of both. ``"skip"`` is decided on the device, with no host sync, where the
            optimizer takes the verdict in its kernel (``found_inf``: torch's ``fused=True``
            optimizers) and every declared rule can apply under it (``Rule.gates``); elsewhere,
            and for ``"raise"``, one host sync per step (docs/design.md, rule 7, says which and
            why). ``applied`` / ``skipped_count`` of the stepper or attachment tell, as tensors,
            whether the last step was applied and how many were skipped. With a ``scaler=`` the
            scaler's own ``found_inf`` decides for the gradients (no second check of them).
        copy_for_rollback: before the commit writes while a fallible stage (the optimizer's step,
            a rule that runs user code) is still to come, copy what it writes and the optimizer's
            state, so that an exception there restores every parameter, buffer and optimizer state
            bitwise. Costs one copy of the parameters and the optimizer's state per step (kept
            between steps on CPU). Off by default: every check still runs before the first write,
            and an exception raised by the optimizer itself (or a user constraint after it) leaves
            what was written so far, as plain PyTorch does, drops the step's pending updates, and
            says which were applied.
        process_group: the ``torch.distributed`` group that ``sync="mean"``/``"sum"`` updates are
            all-reduced over at commit, so that every rank commits the same value; ``None``: the
            default group. Every rank of the group must commit its steps together.
        sync_timeout: seconds (or a ``timedelta``) to wait for the other ranks at the commit's
            all-reduce before raising :class:`~paramupdates.UpdateError`; ``None``: the group's own
            timeout (``init_process_group(timeout=...)``).
        scaler: a ``torch.amp.GradScaler``. A step whose scaled gradients overflow (the scaler skips
            ``optimizer.step()``) is dropped whole, whatever ``on_nonfinite`` says: none of its
            pending updates (batch-norm statistics) or rules is applied, it is counted in
            ``skipped_steps``, and the next step trains as usual. Under ``pu.step`` / ``Stepper``
            the commit's gradient update is what ``scaler.step(optimizer)`` then ``scaler.update()``
            do (do not call them in the block), with no host sync beyond theirs: none for a fused
            optimizer (the verdict is taken on the device), one read of ``found_inf`` otherwise. Under ``pu.attach`` the loop keeps calling
            ``scaler.step(optimizer)`` and ``scaler.update()``: the attachment wraps ``scaler.step``
            on that scaler instance to see the steps it skips (``detach()`` unwraps it). Without
            ``scaler=`` the attachment takes the first ``GradScaler`` that steps its optimizer
            (``GradScaler.step`` is watched from the first ``pu.attach`` on), with the same semantics.
    """

    on_nonfinite: str | None = None
    copy_for_rollback: bool = False
    process_group: Any = None
    sync_timeout: float | datetime.timedelta | None = None
    scaler: Any = None

    def __post_init__(self) -> None:
        if self.on_nonfinite not in NONFINITE:
            raise ValueError(f"on_nonfinite must be None, 'raise' or 'skip', not {self.on_nonfinite!r}")
        if self.scaler is not None and not (
            callable(getattr(self.scaler, "step", None)) and callable(getattr(self.scaler, "update", None))
        ):
            raise TypeError(f"scaler= takes a torch.amp.GradScaler, not {type(self.scaler).__name__}")
        if self.process_group is not None or self.sync_timeout is not None:
            secs = hooks.sync_backend("process_group/sync_timeout").check_options(self.process_group, self.sync_timeout)
            object.__setattr__(self, "sync_timeout", secs)

    @property
    def checks_finite(self) -> bool:
        """Whether the commit checks finiteness (``on_nonfinite`` is ``"raise"`` or ``"skip"``)."""
        return self.on_nonfinite is not None


OWN_SCALER_CALLS = ("pu.step", "pu.Stepper", "pu.attach")
"""Where ``scaler=`` is taken: the frameworks' callbacks leave the scaler to the framework."""


def make_options(options: dict[str, Any], where: str) -> StepOptions:
    """:class:`StepOptions` from the keyword arguments given to ``where``; a ``TypeError`` naming an
    unknown one."""
    unknown = set(options) - set(StepOptions.__dataclass_fields__)
    if options.get("scaler") is not None and where not in OWN_SCALER_CALLS:
        raise TypeError(
            f"{where}: scaler= is for pu.step, pu.Stepper and pu.attach; the framework drives its own GradScaler here."
        )
    if unknown:
        raise TypeError(
            f"{where} got unknown option(s) {sorted(unknown)}; the options are "
            f"{sorted(StepOptions.__dataclass_fields__)}."
        )
    return StepOptions(**options)
