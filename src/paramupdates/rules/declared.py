"""The generic declared rule: what every rule over a list of tensors shares, around its math.

A rule's math is a pair of free functions in its own module, in the style of ``torch.optim``:
``_single_tensor_<rule>`` (readable, one tensor at a time: the reference) and
``_multi_tensor_<rule>`` (``torch._foreach_*`` per device and dtype), picked by ``foreach=`` and
tested against each other (``tests/test_rule_paths.py``). :class:`DeclaredRule` is everything else:

* the tensors, held weakly in declaration order with their qualified names, followed by name in
  the module the rule was declared on (or, once known, the model that owns them);
* the *plan* (groups, factors, pairs), made by :meth:`DeclaredRule.make_plan` when what it depends
  on changed, and kept between commits as indices into the tensors, never the tensors;
* the *arguments* of the math (:meth:`DeclaredRule.bind`: the plan's tensor lists, ready for the
  foreach kernels), made at a full check and kept between commits by the ``RuleSet`` that holds the
  tensors anyway, never by the rule;
* revalidation: a commit whose model, tensors and plan key (:meth:`DeclaredRule.same_plan`) are those
  of the last full check reuses the plan and its arguments after one pass over the tensors' storage
  (``RuleSet``), with no Python work per tensor;
* what is read or refused at every commit, before anything is written (:meth:`DeclaredRule.ready`:
  weight decay's refusal of a double decay, an EMA's ``d_t``), on both paths;
* the tensors held for one commit only (``_live``, ``_args``), released by every way out of it.

A subclass sets ``phase``/``kind``, builds ``names`` and ``_tensors`` in ``__init__`` (through
:meth:`DeclaredRule.hold`), and implements :meth:`plan_key`, :meth:`make_plan` and :meth:`run`
(and, for the fast path, :meth:`bind`). A rule over more tensors than it declares (the EMA: its
averaged copy's, followed by name in the copy) extends :meth:`DeclaredRule.current` and
:meth:`DeclaredRule.follow`.

The ordering of one commit: :meth:`check` (full: follow by name, :meth:`make_plan` where the key
changed, :meth:`bind`) or ``RuleSet``'s one pass and :meth:`revalidate`; then :meth:`ready`; then,
in the rule's phase, :meth:`run`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .base import Rule
from .common import OnTensorList, WeakList, any_none, follow_in, has_subclass, storage_key, untie

if TYPE_CHECKING:
    from .base import CommitContext


class DeclaredRule(OnTensorList, Rule):
    """A rule over a list of tensors (see the module docstring)."""

    foreach = True  # False: the rule's _single_tensor_ path

    def hold(self, named: list[tuple[str, torch.Tensor]], root: nn.Module | None) -> None:
        """Keep ``named`` (``(qualified name, tensor)``, in order): weakly, followed by name in ``root``."""
        self.names = [n for n, _ in named]
        self._tensors = WeakList([t for _, t in named], root, self.names if root is not None else None)
        follow_in(self, root)
        self._sub = has_subclass([t for _, t in named])
        # no plan_key of its own: the plan depends on the tensors' storage alone (no call per commit to ask)
        self._storage_only = type(self).plan_key is DeclaredRule.plan_key
        # nothing to read at each commit (no ready of its own): the re-check calls none
        self._reads = type(self).ready is not DeclaredRule.ready
        self._key: tuple | None = None
        self.plan: Any = None
        self._live: list[Any] = []
        self._args: Any = None
        self._tied = 0  # positions of the last full check left out: a tensor held under an earlier name too

    # --- what a subclass provides ------------------------------------------------------------------
    def plan_key(self, ctx: CommitContext, live: list[Any]) -> Any:
        """What the plan depends on besides the tensors' storage (learning rates, param groups, which
        tensors have a gradient); compared with ``==`` at each commit."""
        return None

    def make_plan(self, ctx: CommitContext, live: list[Any]) -> Any:
        """The plan for ``live`` (the declared tensors now, ``None`` where one died): validate, group."""
        raise NotImplementedError

    def same_plan(self, ctx: CommitContext, live: list[Any]) -> bool:
        """Whether :meth:`plan_key` is that of the last full check (a subclass may compare cheaper)."""
        if self._key is None:
            return False
        return self._storage_only or self.plan_key(ctx, live) == self._key[0]

    def ready(self, ctx: CommitContext) -> None:
        """What this commit reads besides the plan, before anything is written (both paths): raise here
        what must write nothing. Default: nothing."""

    def current(self) -> list[Any]:
        """The tensors the plan is over, as held now (``None`` where one is gone): the declared ones."""
        return self._tensors.current()

    def follow(self) -> bool:
        """Read the named slots again (:meth:`WeakList.resync`); True if any tensor changed."""
        return self._tensors.resync()

    def untie(self, live: list[Any]) -> int:
        """Leave out of ``live`` (``None``) each position whose tensor an earlier one holds too (tied
        weights: the rule writes each tensor once); the number left out. A rule that writes other tensors
        than it reads (the EMA: its copy's) overrides this."""
        return untie(live)

    def bind(self, ctx: CommitContext, live: list[Any]) -> Any:
        """The arguments of :meth:`run` made from :attr:`plan` and ``live`` (the lists the kernels take),
        or ``None``: :meth:`run` makes them each commit. Held strongly, by the ``RuleSet`` between commits."""
        return None

    def run(self, ctx: CommitContext, live: list[Any], args: Any) -> None:
        """Apply the math to ``live`` with :attr:`plan` (under ``torch.no_grad()``); ``args``: what
        :meth:`bind` made for this plan and these tensors."""
        raise NotImplementedError

    # --- ownership ---------------------------------------------------------------------------------
    def owner_tensors(self) -> list[torch.Tensor]:
        return self._tensors.live()

    def tensors(self) -> list[torch.Tensor]:
        """What this commit writes (the tensors its check saw), else every covered tensor."""
        return [t for t in self._live if t is not None] if self._live else self._tensors.live()

    def resync(self) -> None:
        if self.follow():
            self._key = None  # another tensor in a slot: plan again

    def alive(self) -> bool:
        return self._tensors.alive()

    # --- the commit --------------------------------------------------------------------------------
    def check(self, ctx: CommitContext) -> None:
        # a full check (the first, or something changed): read the named slots again, so that a tensor
        # replaced without a registration hook (Module._apply, to_empty) is followed even if the old one lives
        if self.follow():
            self._key = None
            lost = self.lost_names()
            if lost:  # (a name gone with no registration hook: refused before anything is written)
                model = ctx.index.model_ref()
                raise self.lost_error(type(model).__name__, lost)
        live = self.current()
        self._tied = self.untie(live)
        pk = self.plan_key(ctx, live)
        if (pk, storage_key([t for t in live if t is not None], self._sub)) != self._key:
            self.plan = self.make_plan(ctx, live)
            # (keyed on what the plan left: making it may move storage, as the EMA's copy follows its model)
            self._key = (pk, storage_key([t for t in live if t is not None], self._sub))
        self._live = live  # held for this commit only
        self._args = self.bind(ctx, live)
        self.ready(ctx)

    def fingerprint(self) -> list[torch.Tensor] | None:
        live = self._live
        if not live or (any_none(live) and sum(t is None for t in live) != self._tied):
            return None  # (a tensor gone: the full check decides; a tied name's gap is kept as planned)
        return live

    def bound(self) -> Any:
        return self._args

    def revalidate(self, ctx: CommitContext, held: list[torch.Tensor], bound: Any = None) -> bool:
        if not (self._storage_only and self._key is not None) and not self.same_plan(ctx, held):
            return False
        # the plan depends on the storage, which the caller checked, and the key; its arguments on both
        self._live, self._args = held, bound
        if self._reads:
            self.ready(ctx)
        return True

    def apply(self, ctx: CommitContext) -> None:
        live, self._live = self._live, []
        args, self._args = self._args, None
        self.run(ctx, live, args)

    def restore(self, saved: Any) -> None:
        self._live, self._args = [], None  # a failed commit: hold nothing past it
