"""The printable plan of a step: what a commit writes, in which order.

``Stepper.schedule()`` returns a :class:`Schedule`, a sequence of
:class:`ScheduleEntry` rows in commit order (the fixed phase order: ``before_grad``,
the optimizer's step, ``after_grad``, auxiliary, ``after_step``): inside a phase, declared rules in declaration
order, then issued updates in issue order. The rows are made when the
schedule is first read, not at commit (a commit only keeps what they are
made from), so a loop that never looks at its schedule does not pay for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload


@dataclass(frozen=True)
class ScheduleEntry:
    """One row of a step's plan.

    ``phase`` is one of ``phases.PHASES``; ``target`` the qualified name of the
    tensor written; ``op`` the operation (``assign``, ``assign_add``, a rule's
    name, or the optimizer's step); ``condition`` ``"-"`` or the ``when``
    predicate kind; ``origin`` the ``file:line`` where it was issued or
    declared.
    """

    phase: str
    target: str
    op: str
    condition: str
    origin: str


class Schedule(Sequence[ScheduleEntry]):
    """An ordered, immutable list of :class:`ScheduleEntry`; prints as a table.

    ``Schedule(rows)``, or ``Schedule.later(make)``: the rows are ``make()``, called once, when first read.
    """

    def __init__(self, rows: Sequence[ScheduleEntry] = ()) -> None:
        self._made: tuple[ScheduleEntry, ...] | None = tuple(rows)
        self._make: Callable[[], Sequence[ScheduleEntry]] | None = None

    @classmethod
    def later(cls, make: Callable[[], Sequence[ScheduleEntry]]) -> Schedule:
        """A schedule whose rows are made by ``make()`` when first read."""
        s = cls()
        s._made, s._make = None, make
        return s

    @property
    def _rows(self) -> tuple[ScheduleEntry, ...]:
        if self._made is None:
            assert self._make is not None
            self._made, self._make = tuple(self._make()), None
        return self._made

    @overload
    def __getitem__(self, i: int) -> ScheduleEntry: ...
    @overload
    def __getitem__(self, i: slice) -> Schedule: ...
    def __getitem__(self, i: int | slice) -> ScheduleEntry | Schedule:
        if isinstance(i, slice):
            return Schedule(self._rows[i])
        return self._rows[i]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[ScheduleEntry]:
        return iter(self._rows)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self._rows == other._rows

    def __hash__(self) -> int:
        return hash(self._rows)

    def phases(self) -> list[str]:
        """The phase of each row, in order."""
        return [r.phase for r in self._rows]

    def targets(self, phase: str | None = None) -> list[str]:
        """Target names in order, optionally of one phase only."""
        return [r.target for r in self._rows if phase is None or r.phase == phase]

    def __str__(self) -> str:
        header = ("#", "phase", "target", "op", "condition", "origin")
        body = [(str(i), r.phase, r.target, r.op, r.condition, r.origin) for i, r in enumerate(self._rows)]
        if not body:
            return "(empty schedule)"
        widths = [max(len(row[c]) for row in [header, *body]) for c in range(len(header))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in body]
        return "\n".join(line.rstrip() for line in lines)

    def __repr__(self) -> str:
        return f"Schedule({len(self._rows)} rows)\n{self}"
