"""The options of a step, defined and validated once (``pu.step``, ``pu.Stepper``, ``pu.attach``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, TypedDict

from . import hooks

NONFINITE = (None, "raise", "skip")


class StepOptionsDict(TypedDict, total=False):
    """The keyword arguments of :class:`StepOptions` (``**options`` of ``pu.step`` and ``pu.attach``)."""

    on_nonfinite: str | None
    check_finite: bool | None
    copy_for_rollback: bool
    process_group: Any
    sync_timeout: float | datetime.timedelta | None
    scaler: Any


@dataclass(frozen=True)
class StepOptions:
    """How a step commits.

    Attributes:
        on_nonfinite: ``None`` (the default): no finiteness check, and the commit never waits on the
            device (validated commit, rule 7: shape, dtype kind, device and the rules' preconditions
            are still checked, at no sync). Opt in, as ``optax.apply_if_finite`` and
            ``torch.amp.GradScaler`` do: ``"raise"`` (an :class:`~paramupdates.UpdateError` naming
            the target or the parameter, nothing written) or ``"skip"`` (drop the whole step,
            optimizer included, and count it in ``skipped_steps``) when a pending value, or a
            gradient the optimizer would use, is NaN or infinite: one batched check of both, one
            host sync per step. With a ``scaler=`` the scaler's own ``found_inf`` decides for the
            gradients (no second check of them).
        check_finite: an older spelling: ``True`` checks as ``on_nonfinite="raise"`` does (unless
            ``on_nonfinite`` says ``"skip"``), ``False`` turns the check off whatever
            ``on_nonfinite`` says; ``None`` (the default): as ``on_nonfinite`` says.
        copy_for_rollback: before the commit writes while a fallible stage (the optimizer's step,
            a rule that runs user code) is still to come, copy what it writes and the optimizer's
            state, so that an exception there restores everything bitwise (validated commit,
            rule 7). Costs one copy of the parameters and the optimizer's state per step (kept
            between steps on CPU). Off by default: every check still runs before the first write,
            and an exception raised by the optimizer itself (or a user constraint after it) leaves
            what was written so far, as plain PyTorch does, drops the step's pending updates, and
            says which were applied.
        process_group: the ``torch.distributed`` group that ``sync="mean"``/``"sum"`` updates reduce
            over at commit (distributed sync, rule 9); ``None``: the default group. Every rank of the group must commit
            its steps together.
        sync_timeout: seconds (or a ``timedelta``) to wait for the other ranks at the commit's
            all-reduce before raising :class:`~paramupdates.UpdateError`; ``None``: the group's own
            timeout (``init_process_group(timeout=...)``).
        scaler: a ``torch.amp.GradScaler`` (``pu.step`` / ``Stepper`` only): the commit's gradient
            update is ``scaler.step(optimizer)`` then ``scaler.update()``, in place of
            ``optimizer.step()``. A step whose (scaled) gradients are not finite is skipped whole, as
            with ``on_nonfinite="skip"`` and whatever ``on_nonfinite`` says (overflow is the scaler's
            business): nothing of it is written, it is counted in ``skipped_steps``, and
            ``scaler.update()`` lowers the scale. Under ``pu.attach`` call ``scaler.step(opt)`` and
            ``scaler.update()`` in the loop as usual instead.
    """

    on_nonfinite: str | None = None
    check_finite: bool | None = None
    copy_for_rollback: bool = False
    process_group: Any = None
    sync_timeout: float | None = None
    scaler: Any = None

    def __post_init__(self) -> None:
        if self.on_nonfinite not in NONFINITE:
            raise ValueError(f"on_nonfinite must be None, 'raise' or 'skip', not {self.on_nonfinite!r}")
        how = self.on_nonfinite
        if self.check_finite is False:
            how = None
        elif self.check_finite is True and how is None:
            how = "raise"
        object.__setattr__(self, "on_nonfinite", how)
        object.__setattr__(self, "check_finite", how is not None)  # (what the commit reads)
        if self.scaler is not None and not (
            callable(getattr(self.scaler, "step", None)) and callable(getattr(self.scaler, "update", None))
        ):
            raise TypeError(f"scaler= takes a torch.amp.GradScaler, not {type(self.scaler).__name__}")
        if self.process_group is not None or self.sync_timeout is not None:
            secs = hooks.sync_backend("process_group/sync_timeout").check_options(self.process_group, self.sync_timeout)
            object.__setattr__(self, "sync_timeout", secs)


def make_options(options: dict[str, Any], where: str) -> StepOptions:
    """:class:`StepOptions` from the ``**options`` of ``where``; a ``TypeError`` naming an unknown one."""
    unknown = set(options) - set(StepOptions.__dataclass_fields__)
    if "atomic" in unknown:
        raise TypeError(
            f"{where}: atomic= is now copy_for_rollback= (default False: no copy of the parameters and "
            "optimizer state; every check still runs before the first write)."
        )
    if "scaler" in options and options["scaler"] is not None and where not in ("pu.step", "pu.Stepper"):
        raise TypeError(
            f"{where}: scaler= is for pu.step / pu.Stepper, whose commit calls the optimizer step. Under "
            "pu.attach keep scaler.step(optimizer) and scaler.update() in your loop: the attachment commits "
            "inside the optimizer.step() that scaler.step makes."
        )
    if unknown:
        raise TypeError(
            f"{where} got unknown option(s) {sorted(unknown)}; the options are "
            f"{sorted(StepOptions.__dataclass_fields__)}."
        )
    return StepOptions(**options)
