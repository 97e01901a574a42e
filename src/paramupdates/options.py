"""The options of a step, defined and validated once (``pu.step``, ``pu.Stepper``, ``pu.attach``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, TypedDict

from . import hooks

NONFINITE = ("raise", "skip")


class StepOptionsDict(TypedDict, total=False):
    """The keyword arguments of :class:`StepOptions` (``**options`` of ``pu.step`` and ``pu.attach``)."""

    on_nonfinite: str
    check_finite: bool
    atomic: bool
    process_group: Any
    sync_timeout: float | datetime.timedelta | None


@dataclass(frozen=True)
class StepOptions:
    """How a step commits.

    Attributes:
        on_nonfinite: ``"raise"`` (an :class:`~paramupdates.UpdateError`, nothing written) or ``"skip"``
            (drop the whole step, optimizer included, and count it in ``skipped_steps``) when a
            pending value is NaN or infinite.
        check_finite: check pending values for NaN/inf at commit (one batched reduction and one
            host sync per step); ``False`` skips the check.
        atomic: before the commit writes while a fallible stage (the optimizer's step, a rule that
            runs user code) is still to come, copy what it writes, so that an exception there
            restores everything bitwise (costs one copy of the written tensors and the optimizer's
            state during the commit).
        process_group: the ``torch.distributed`` group that ``sync="mean"``/``"sum"`` updates reduce
            over at commit (distributed sync, rule 9); ``None``: the default group. Every rank of the group must commit
            its steps together.
        sync_timeout: seconds (or a ``timedelta``) to wait for the other ranks at the commit's
            all-reduce before raising :class:`~paramupdates.UpdateError`; ``None``: the group's own
            timeout (``init_process_group(timeout=...)``).
    """

    on_nonfinite: str = "raise"
    check_finite: bool = True
    atomic: bool = True
    process_group: Any = None
    sync_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.on_nonfinite not in NONFINITE:
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', not {self.on_nonfinite!r}")
        if self.process_group is not None or self.sync_timeout is not None:
            secs = hooks.sync_backend("process_group/sync_timeout").check_options(self.process_group, self.sync_timeout)
            object.__setattr__(self, "sync_timeout", secs)


def make_options(options: dict[str, Any], where: str) -> StepOptions:
    """:class:`StepOptions` from the ``**options`` of ``where``; a ``TypeError`` naming an unknown one."""
    unknown = set(options) - set(StepOptions.__dataclass_fields__)
    if unknown:
        raise TypeError(
            f"{where} got unknown option(s) {sorted(unknown)}; the options are "
            f"{sorted(StepOptions.__dataclass_fields__)}."
        )
    return StepOptions(**options)
