"""Declared rules: updates that belong to parameters (or a model), not to a step.

A rule is declared once (``pu.weight_decay``, ``pu.constrain``, ``pu.ema``)
and registered here in declaration order. Every step whose model owns the
rule's tensors applies it at commit, once per real optimizer update, in the
rule's phase; inside a phase, rules run in declaration order, before the
updates issued during the step.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..schedule import ScheduleEntry

if TYPE_CHECKING:
    from ..targets import ModelIndex
    from ..transaction import CommitContext

_SEQ = itertools.count()


class Rule:
    """Base class of declared rules.

    Subclasses set ``phase`` and ``kind`` and implement :meth:`tensors`
    (what the rule writes: used for ownership and rollback) and
    :meth:`apply` (the in-place math, under ``torch.no_grad()``).

    ``infallible``: a rule whose :meth:`apply` cannot raise once :meth:`check`
    has passed (inputs validated, foreach math on matching tensors) sets it to
    ``True``; the commit then needs no snapshot for what it writes when no
    fallible stage (the optimizer step, a rule that is not infallible) follows.
    Leave it ``False`` for anything that runs user code.

    ``per_optimizer_update``: the rule belongs to the gradient update and runs
    only in steps that have an optimizer (once per real optimizer update,
    never per micro-batch); ``False`` runs it in every committed step.
    """

    phase: str = ""
    kind: str = "rule"
    infallible: bool = False
    per_optimizer_update: bool = False

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.seq = next(_SEQ)
        self._owned: weakref.WeakKeyDictionary[ModelIndex, tuple[int, bool]] = weakref.WeakKeyDictionary()

    # --- ownership -------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """The tensors this rule writes at commit."""
        raise NotImplementedError

    def owner_tensors(self) -> list[torch.Tensor]:
        """Tensors whose owning model applies this rule (default: :meth:`tensors`)."""
        return self.tensors()

    def applies_to(self, index: ModelIndex) -> bool:
        """Whether ``index``'s model owns any of :meth:`owner_tensors` (cached per index build)."""
        hit = self._owned.get(index)
        if hit is not None and hit[0] == index.generation:
            return hit[1]
        owned = index.owns_any(self.owner_tensors())
        self._owned[index] = (index.generation, owned)
        return owned

    def remove(self) -> None:
        """Undeclare this rule: no later step applies it."""
        unregister(self)

    def alive(self) -> bool:
        return True

    # --- commit ----------------------------------------------------------
    def check(self, ctx: CommitContext) -> None:
        """Validate before the commit writes anything (raise :class:`UpdateError` to refuse the step)."""

    def apply(self, ctx: CommitContext) -> None:
        raise NotImplementedError

    # --- the one-pass re-check (rules/_fast.py) --------------------------
    def fingerprint(self) -> list[torch.Tensor] | None:
        """After :meth:`check`: the tensors whose storage the rule's plan depends on (None: no fast path)."""
        return None

    def revalidate(self, ctx: CommitContext, held: list[torch.Tensor]) -> bool:
        """In place of :meth:`check` when the storage of :meth:`fingerprint` (``held``) is unchanged:
        re-check the rest cheaply and get ready to apply; False: run the full :meth:`check`."""
        return False

    # A subclass that sets ``rows_tracked = True`` bumps ``_rows_version`` whenever what
    # rows() shows changes (its tensors); its rows are then cached between commits.
    rows_tracked = False
    _rows_version = 0
    _rows_cache: tuple[Any, int, int, list[ScheduleEntry]] | None = None

    def cached_rows(self, index: ModelIndex) -> list[ScheduleEntry]:
        """:meth:`rows`; for a ``rows_tracked`` rule recomputed only when ``index`` or its tensors changed."""
        if not self.rows_tracked:
            return self.rows(index)
        c = self._rows_cache
        if c is None or c[0]() is not index or c[1] != index.generation or c[2] != self._rows_version:
            c = (weakref.ref(index), index.generation, self._rows_version, self.rows(index))
            self._rows_cache = c
        return c[3]

    def rows(self, index: ModelIndex) -> list[ScheduleEntry]:
        ts = self.tensors()
        names = [index.name_of(t) or "?" for t in ts[:3]]
        if len(ts) == 1:
            target = names[0]
        else:
            target = f"{len(ts)} tensors ({', '.join(names)}{', ...' if len(ts) > 3 else ''})"
        return [ScheduleEntry(self.phase, target, self.kind, "-", self.origin)]

    # --- state (save/resume, rollback) ---------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def save(self) -> Any:
        """Python-level state to restore if the commit fails (tensors are snapshotted separately)."""
        return None

    def restore(self, saved: Any) -> None:
        pass


_RULES: list[Rule] = []


def register(rule: Rule) -> Rule:
    """Add a rule to the registry (declaration order is commit order)."""
    _RULES.append(rule)
    return rule


def unregister(rule: Rule) -> None:
    if rule in _RULES:
        _RULES.remove(rule)


def rules_for(index: ModelIndex) -> list[Rule]:
    """The live rules that apply to ``index``'s model, in declaration order."""
    dead = [r for r in _RULES if not r.alive()]
    for r in dead:
        _RULES.remove(r)
    return [r for r in _RULES if r.applies_to(index)]


class WeakTensors:
    """A list of tensors held weakly, so a rule does not keep a model alive."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._refs = [weakref.ref(t) for t in tensors]

    def get(self) -> list[torch.Tensor]:
        out = [r() for r in self._refs]
        return [t for t in out if t is not None]

    def alive(self) -> bool:
        return any(r() is not None for r in self._refs)
