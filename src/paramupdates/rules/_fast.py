"""The one-pass re-check of a stepper's or attachment's declared rules.

Before a commit writes anything, every rule checks that the plan it cached
(groups, factors, pairs) still fits its tensors (:meth:`Rule.check`): their
storage (a ``model.to()`` or ``.data =`` must fail, or rebuild the plan,
before any write), and rule by rule the rest (weight decay: the param groups,
their learning rates, which parameters have a gradient). Done rule by rule,
that is five to six passes over per-tensor metadata per commit, one to three
per rule, through weak references.

This cache keeps what the last full check saw, for the next commit on the
same model and optimizer (every ``pu.step``, ``Stepper`` and attachment on
them shares it, so a fresh ``pu.step(model, opt)`` per iteration uses it):
the rules (by identity), the model index's generation, the optimizer, and
the tensors each rule's plan depends on (held strongly, while the model and
optimizer live). The next commit then checks the
storage of all of them in one pass (``data_ptr``, mapped in C), and each rule
re-checks only what storage does not cover (:meth:`Rule.revalidate`). Any
difference, or a rule without a fast path, runs the full checks, which
rebuild whatever changed, and records again. The outcome is the same as the
full check's in every case; only the cost differs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._common import has_subclass, storage_key

if TYPE_CHECKING:
    from ..transaction import CommitContext, Transaction
    from .base import Rule


class RuleCache:
    """What the last full check of the rules of one model and optimizer saw (see the module docstring)."""

    def __init__(self) -> None:
        self._sig: tuple[Any, ...] | None = None
        self._rules: list[Rule] = []
        self._held: list[list[torch.Tensor]] = []
        self._union: list[torch.Tensor] = []
        self._key: tuple[int, ...] | None = None
        self._sub = False

    def _signature(self, tx: Transaction) -> tuple[Any, ...]:
        return (len(tx.rules), tx.index.generation, id(tx.optimizer))

    def revalidate(self, tx: Transaction, ctx: CommitContext) -> bool:
        """True: every rule of ``tx`` is checked and ready to apply, without its full check."""
        if self._sig is None or self._sig != self._signature(tx):
            return False
        if any(a is not b for a, b in zip(tx.rules, self._rules)):
            return False
        if storage_key(self._union, self._sub) != self._key:
            return False
        return all(rule.revalidate(ctx, held) for rule, held in zip(tx.rules, self._held))

    def record(self, tx: Transaction) -> None:
        """After the full checks of ``tx``'s rules: remember what they saw."""
        held = [rule.fingerprint() for rule in tx.rules]
        if any(h is None for h in held):
            self.clear()
            return
        seen: set[int] = set()
        union: list[torch.Tensor] = []
        for ts in held:
            for t in ts:  # type: ignore[union-attr]
                if id(t) not in seen:
                    seen.add(id(t))
                    union.append(t)
        self._sub = has_subclass(union)
        self._key = storage_key(union, self._sub)
        self._union = union
        self._held = held  # type: ignore[assignment]
        self._rules = list(tx.rules)
        self._sig = self._signature(tx)

    def clear(self) -> None:
        self._sig, self._rules, self._held, self._union, self._key = None, [], [], [], None
