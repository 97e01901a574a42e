"""Declared rules: updates that belong to parameters (or a model), not to a step.

A rule is declared once (``pu.weight_decay``, ``pu.constrain``, ``pu.ema``, or
a subclass of :class:`Rule` and :meth:`Rule.declare`) and kept in a registry in
declaration order. Every step whose model owns the rule's tensors applies it
at commit, once per real optimizer update, in the rule's phase; inside a
phase, rules run in declaration order, before the updates issued during the
step (the commit's fixed phase order: ``before_grad``, the optimizer's step, ``after_grad``, the
auxiliary updates, ``after_step``).

What is kept between commits, each on the model it belongs to, each with one key:

* which rules apply to the model: ``index.rules`` on its :class:`~paramupdates.targets.ModelIndex`,
  keyed by ``(rules_version, generation)`` (:func:`rules_for`);
* per model and optimizer (``ModelIndex.caches_for``), :class:`RuleSet`: what the last full check
  of those rules saw, re-checked in one pass over the storage of their tensors
  (:meth:`Rule.fingerprint` / :meth:`Rule.revalidate`) instead of one full check per rule, keyed by
  the rules' key above: ``benchmarks/rules.py``, part A "tiny", pu / foreach (five to six passes
  over per-tensor metadata per commit otherwise);
* under it, each declared rule's *plan* (grouping, pairs, factors: one protocol for every built-in
  rule, ``rules/declared.py``), made again at a full check only where its own key (its tensors'
  storage and :meth:`~paramupdates.rules.declared.DeclaredRule.plan_key`) changed: a change to one
  rule, or to the model's structure, re-plans none of the others.

What changes at every commit (a learning rate, an EMA's ``d_t``) is read at every commit
(:meth:`~paramupdates.rules.declared.DeclaredRule.ready`, weight decay's ``Factors``), never keyed.
"""

from __future__ import annotations

import operator
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import accounting, hooks, sharding, state
from ..errors import UpdateError, listed
from ..origin import call_site
from ..phases import BEFORE_GRAD
from ..schedule import ScheduleEntry
from .common import has_subclass, storage_key, stored_named

if TYPE_CHECKING:
    from ..targets import ModelIndex

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class CommitContext:
    """What rules see at commit: the optimizer, the model index, the learning rate of a parameter,
    what is written in phase ``before_grad`` after a given rule (:meth:`written_before_grad_after`), and
    ``ok``: ``None``, or the step's device-side verdict (a 0-dim bool tensor, never read on the host)
    under which a rule that :attr:`Rule.gates` applies (``on_nonfinite="skip"`` decided on the device)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        index: ModelIndex,
        journal: Any = None,
        rules: Sequence[Rule] = (),
    ) -> None:
        self.optimizer = optimizer
        self.index = index
        self.journal = journal
        self.rules = rules  # the commit's rules, in their order
        self.ok: torch.Tensor | None = None
        self._lr: dict[int, float | None] | None = None

    def written_before_grad_after(self, rule: Rule) -> set[int]:
        """``id()`` of the tensors that phase ``before_grad`` writes after ``rule``: those of the
        ``before_grad`` rules that follow it (declaration order), and the targets of the updates issued
        with that phase (they come after every rule). Held by those rules and by the journal until the
        commit ends. A rule that would defer its write past the phase (``pu.weight_decay`` into the
        optimizer's kernel) must not defer it for these: they must see its result."""
        out: set[int] = set()
        later = False
        for r in self.rules:
            if r is rule:
                later = True
            elif later and r.phase == BEFORE_GRAD:
                out.update(map(id, r.tensors()))
        j = self.journal
        if j is not None:
            out.update(id(e.target) for e in j.by_phase.get(BEFORE_GRAD, ()))
        return out

    def lr_of(self, p: torch.Tensor) -> float | None:
        """The learning rate of ``p``'s optimizer param group (None if not in it)."""
        if self.optimizer is None:
            return None
        if self._lr is None:
            self._lr = {}
            for g in self.optimizer.param_groups:
                lr = g.get("lr")
                lr = float(lr) if lr is not None else None
                for q in g["params"]:
                    self._lr[id(q)] = lr
        return self._lr.get(id(p))  # (the optimizer holds its parameters for this commit)


class Rule:
    """Base class of declared rules (public: ``pu.Rule``).

    A subclass sets :attr:`phase` (``"before_grad"``, ``"after_grad"`` or
    ``"after_step"``) and :attr:`kind` (its name in ``schedule()``), and
    implements :meth:`tensors` (what it writes: used for ownership and
    rollback) and :meth:`apply` (the in-place math, run under
    ``torch.no_grad()``). :meth:`declare` registers it::

        class Renorm(pu.Rule):
            phase, kind = "after_grad", "renorm"
            def __init__(self, p): super().__init__(); self.p = p
            def tensors(self): return [self.p]
            def apply(self, ctx): self.p.div_(self.p.norm())

        Renorm(model.lin.weight).declare()

    ``infallible``: a rule whose :meth:`apply` cannot raise once :meth:`check`
    has passed (inputs validated, foreach math on matching tensors) sets it to
    ``True``; a commit with ``copy_for_rollback`` then needs no copy for what it writes when no
    fallible stage (the optimizer step, a rule that is not infallible) follows.
    Leave it ``False`` for anything that runs user code.

    ``per_optimizer_update``: the rule belongs to the gradient update and runs
    only in steps that have an optimizer (once per real optimizer update,
    never per micro-batch); ``False`` runs it in every committed step.

    ``gates``: :meth:`apply` honours ``ctx.ok`` (``on_nonfinite="skip"`` decided on the
    device, rule 7): when ``ctx.ok`` is a tensor, the rule leaves every tensor it writes
    bitwise as it was where ``ctx.ok`` is False, and its Python state too, without reading
    the flag on the host (``torch.where``, a factor ``where(ok, f, 1)``). A rule that does
    not (the default, and every rule with Python state that depends on whether it ran) makes
    such a step take the synced check instead: one host sync.
    """

    phase: str = ""
    kind: str = "rule"
    infallible: bool = False
    per_optimizer_update: bool = False
    gates: bool = False
    removed: bool = False  # set by remove(): no step applies it, and nothing is raised about it

    def __init__(self, origin: Any = None) -> None:
        if origin is None:
            origin = call_site(2)
        self.origin = origin
        self.seq = next(state.process.rule_seq)

    # --- ownership -------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """The tensors this rule writes at commit."""
        raise NotImplementedError

    def owner_tensors(self) -> list[torch.Tensor]:
        """Tensors whose owning model applies this rule (default: :meth:`tensors`)."""
        return self.tensors()

    def declare(self) -> Rule:
        """Register this rule (declaration order is commit order within its phase); returns it."""
        return register(self)

    def remove(self) -> None:
        """Undeclare this rule: no later step applies it."""
        unregister(self)

    def alive(self) -> bool:
        """False once what the rule belongs to is gone (it is then dropped)."""
        return True

    def resync(self) -> None:
        """Follow tensors that were replaced in their module slots (``fully_shard`` replaces every
        parameter); run when ownership is recomputed, not per commit. Default: held by identity."""

    def adopt(self, index: ModelIndex) -> None:
        """The rule applies to ``index``'s model: tensors given without their module are followed in it
        by name from now on (``load_state_dict(assign=True)``, ``to_empty()``, ``model.to()`` that
        re-creates parameters). Default: nothing."""

    def lost_names(self) -> list[str]:
        """The qualified names of covered tensors that are gone from the module the rule follows them
        in (a layer removed or renamed): the next commit of that module's model raises."""
        return []

    def root(self) -> Any:
        """The module whose tensors the rule follows by name (``None``: none)."""
        return None

    def lost_error(self, model: str, lost: list[str]) -> UpdateError:
        """The error of a commit of ``model`` (its class name) that this rule cannot follow: ``lost`` are the
        covered names the model no longer has (:meth:`lost_names`)."""
        shown = listed(list(map(repr, lost)), 4)
        return UpdateError(
            f"{self.describe()} declared at {self.origin} covers {shown}, which {model} no longer has under that "
            "name (a layer removed or renamed after the declaration, a wrapper put in its place, a parametrization "
            "registered on it). Nothing of this step was written. Declare the rule again on the model as it is "
            "now (the same call: the new declaration takes the lost names' place, and this one keeps the rest), "
            f"or undeclare it: {self.how_to_remove()}."
        )

    def forget_lost(self) -> bool:
        """Stop covering the names :meth:`lost_names` returns (a rule of the same kind declared again
        where they were takes their place, :func:`register`); True when nothing is left (the rule is then
        undeclared). Default: all or nothing."""
        return True

    def rebase(self, old: Any, parent: Any, name: str) -> None:
        """The module the rule follows its tensors in (``old``) is being replaced in ``parent`` under
        ``name``: follow them under the module that takes its place. Default: nothing (held by identity)."""

    def held_tensors_only(self) -> bool:
        """Whether the rule holds bare tensors only (no module to follow them in): once they are all
        collected, the sharding support looks whether ``fully_shard`` replaced them (``rules_for``)."""
        return False

    # --- declared again (a re-run notebook cell) ------------------------------
    def same_kind(self) -> Any:
        """A key: a rule declared later with an equal key on some of the same tensors replaces this
        one on those tensors, with a warning (``None``, the default: never replaced; two such rules
        on one tensor both apply, in declaration order)."""
        return None

    def settings(self) -> Any:
        """What the rule does beyond its kind (rates, bounds), compared with ``==``: a rule declared
        again with an equal key, the same tensors and equal settings takes this one's place, quietly
        (nothing changes: ``configure_optimizers`` run again by a later ``fit``). ``None``, the
        default (and a rule with state of its own, an EMA): never equal."""
        return None

    def settings_on(self, ids: set[int]) -> Any:
        """:meth:`settings` as they are on the covered tensors whose ``id()`` is in ``ids`` (a rule with
        settings per tensor, weight decay's rates, keeps those of these tensors). Default: :meth:`settings`."""
        return self.settings()

    def drop(self, ids: set[int]) -> bool:
        """Stop covering the tensors whose ``id()`` is in ``ids`` (a later rule of the same kind took
        them over); True when nothing is left (the rule is then undeclared). Default: all or nothing."""
        return True

    def names_of(self, ids: set[int]) -> list[str]:
        """The names of the covered tensors whose ``id()`` is in ``ids`` (for messages)."""
        names = getattr(self, "names", None)
        ts = self.owner_tensors()
        if names is not None and len(names) == len(ts):
            return [n for n, t in zip(names, ts) if id(t) in ids]
        return [f"{len(ids)} tensors"]

    # --- commit ----------------------------------------------------------
    def check(self, ctx: CommitContext) -> None:
        """Validate before the commit writes anything (raise :class:`UpdateError` to refuse the step)."""

    def apply(self, ctx: CommitContext) -> None:
        """Apply the rule in place (under ``torch.no_grad()``)."""
        raise NotImplementedError

    # --- the one-pass re-check (RuleSet) --------------------------------
    def fingerprint(self) -> list[torch.Tensor] | None:
        """After :meth:`check`: the tensors whose storage the rule's plan depends on (None: no fast path)."""
        return None

    def bound(self) -> Any:
        """After :meth:`check`: what :meth:`apply` needs beyond the plan, made from ``held`` (the
        foreach lists), for the ``RuleSet`` to keep and hand back to :meth:`revalidate` (``None``: nothing)."""
        return None

    def revalidate(self, ctx: CommitContext, held: list[torch.Tensor], bound: Any = None) -> bool:
        """In place of :meth:`check` when the storage of :meth:`fingerprint` (``held``) is unchanged:
        re-check the rest cheaply and get ready to apply; False: run the full :meth:`check`. ``bound``:
        what :meth:`bound` returned after the last full check."""
        return False

    # --- the schedule ------------------------------------------------------
    def describe(self) -> str:
        """How messages name this kind of rule (``pu.weight_decay``, ``pu.constrain(max_norm)``, ...)."""
        return self.kind

    def how_to_remove(self) -> str:
        """How messages tell the user to undeclare this rule (what works with what its declaration
        returned)."""
        return (
            "pu.rules_of(model) lists the rules declared on the model, each with .remove() (so does the object that "
            "pu.weight_decay, pu.constrain and Rule.declare() return)"
        )

    def __repr__(self) -> str:
        names = getattr(self, "names", None)
        followed = getattr(getattr(self, "_tensors", None), "names", None) or names
        on = f" on {listed(list(map(repr, followed)), 4)}" if followed else ""
        lost = self.lost_names() if not self.removed else []
        tail = f", lost {listed(list(map(repr, lost)), 4)}" if lost else ""
        return f"<{self.describe()} declared at {self.origin}{on}{tail}{' (removed)' if self.removed else ''}>"

    def rows(self, index: ModelIndex) -> list[ScheduleEntry]:
        """This rule's rows in ``schedule()`` (made when the schedule is shown)."""
        ts = self.tensors()
        names = [index.name_of(t) or "?" for t in ts[:3]]
        if len(ts) == 1:
            target = names[0]
        else:
            target = f"{len(ts)} tensors ({', '.join(names)}{', ...' if len(ts) > 3 else ''})"
        return [ScheduleEntry(self.phase, target, self.kind, "-", str(self.origin))]

    # --- state (save/resume, rollback) ---------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def save(self) -> Any:
        """Python-level state to restore if the commit fails (tensors are copied separately)."""
        return None

    def restore(self, saved: Any) -> None:
        """Restore what :meth:`save` returned (also called to release what a failed commit held)."""

    def optimizer_done(self) -> None:
        """The optimizer's step that follows this rule's phase is over, or failed: give back what
        :meth:`apply` lent it (``pu.weight_decay`` sets a param group's own decay for one step)."""


# --- the registry -----------------------------------------------------------
def register(rule: Rule) -> Rule:
    """Add a rule to the registry (``state.process.rules``; declaration order is commit order).

    A rule of the same kind (:meth:`Rule.same_kind`) declared earlier on some of the same tensors
    loses them to this one, with a warning naming both call sites: declaring again (a re-run
    notebook cell) replaces, it never applies a rule twice. The same rule again (same kind, same
    tensors, equal :meth:`Rule.settings`) takes the earlier one's place in the order, quietly."""
    purge()
    accounting.watch()  # (an optimizer step that leaves a rule out is warned about from now on)
    registry = state.process.rules
    key = rule.same_kind()
    if key is not None:
        ids = {id(t) for t in rule.owner_tensors()}
        settings = rule.settings()
        _take_dead_places(rule, key)
        for old in list(registry):
            if old is rule or old.same_kind() != key:
                continue
            took = _takes_lost_names(rule, old)
            if took and old.forget_lost():
                unregister(old)  # (it covered nothing but the lost names: the new one takes its place)
                continue
            covered = {id(t) for t in old.owner_tensors()}
            common = covered & ids
            if not common:
                continue
            if (
                settings is not None
                and common == covered
                and (common == ids or took)
                and old.settings_on(common) == rule.settings_on(common)
            ):
                rule.seq = old.seq  # nothing changes: no warning, the same place in the order
                registry[registry.index(old)] = rule
                state.bump_rules()
                return rule
            names = old.names_of(common)
            shown = listed(list(map(repr, names)), 4)
            warnings.warn(
                f"{rule.describe()} declared at {rule.origin} replaces the {old.describe()} declared at "
                f"{old.origin} on {shown}: a rule of the same kind declared again on the same tensors "
                "replaces the earlier declaration (it is never applied twice). To silence this warning, "
                f"undeclare the earlier one first: {old.how_to_remove()}.",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )
            if old.drop(common):
                registry.remove(old)
    registry.append(rule)
    root = rule.root()
    if root is not None:  # (declared on a submodule of a model paramupdates knows: its place there from now on)
        places = [(w, idx.model) for idx in list(state.process.indexes.values()) if (w := idx.module_name(root))]
        if places:
            where, model = max(places, key=lambda p: len(p[0]))  # (the outermost model)
            follow_place(rule, model, where)
    state.bump_rules()
    return rule


def follow_place(rule: Rule, model: Any, where: str) -> None:
    """``rule`` is declared on the submodule at ``where`` in ``model``: from now on it follows that place,
    by qualified name in ``model`` (``where.<name>``), not the module object. A layer replaced there
    (``model.heads["a"] = ...``), popped and re-added (``old = model.heads.pop("a"); model.heads["a"] =
    ...``) or deleted and re-added is covered as the model holds it, whether or not anything still holds
    the old layer; a place left empty is a lost name, raised at the next commit (rule 12: nothing
    depends on when Python collects the old layer)."""
    rule.rebase(rule.root(), model, where)


def _within(module: Any, root: Any) -> bool:
    """Whether ``module`` is ``root`` or one of its submodules."""
    return module is root or any(m is module for m in root.modules())


def _declared_in(rule: Rule, model: Any) -> bool:
    """Whether ``rule`` is declared on ``model``'s tensors: it follows them in ``model`` or in one of its
    submodules (or in a module that holds ``model``), or ``model`` holds some of its tensors."""
    root = rule.root()
    if root is not None and (_within(root, model) or _within(model, root)):
        return True
    held = _tensor_ids(model)
    return any(id(t) in held for t in rule.owner_tensors())


def _takes_lost_names(rule: Rule, old: Rule) -> bool:
    """Whether ``rule`` (of ``old``'s kind, being declared) takes the place of the names ``old`` lost: ``old``
    lost names in the module it follows its tensors in, and ``rule`` is declared on that module's tensors
    (the fix that the lost-name error gives: "declare the rule again on the model as it is now")."""
    root = old.root()
    return root is not None and bool(old.lost_names()) and _declared_in(rule, root)


def _take_dead_places(rule: Rule, key: Any) -> None:
    """``rule`` (being declared, of kind ``key``) takes the place of the rules of its kind that died while
    they applied to a model it is declared on (the module they were declared on was removed from the model
    and collected: ``_refuse_dead`` raises about them until then)."""
    for index in list(state.process.indexes.values()):
        model = index.model_ref()
        dead = [r for r in index.rules if not r.removed and not r.alive()]
        if model is None or not dead or not _declared_in(rule, model):
            continue
        for r in dead:
            if r.same_kind() == key:
                r.removed = True


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning that points at the first frame outside paramupdates."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PKG_DIR):
        frame = frame.f_back
        level += 1
    return level


def unregister(rule: Rule) -> None:
    """Remove a rule from the registry (no-op if it is not there): ``rule.remove()``."""
    rule.removed = True
    registry = state.process.rules
    if rule in registry:
        registry.remove(rule)
    state.bump_rules()  # (also for a rule purged already: the indexes that keep it make their lists again)


def purge() -> None:
    """Drop the rules whose module or tensors were collected (flagged by a weak reference's callback:
    ``state.process.rules_dead``). A model that declared rules and is dropped without ever being stepped
    is collected with its EMA copy; a rule that applied to a model that lives on is still raised about
    at that model's next commit (:func:`rules_for` keeps it on the model's index)."""
    p = state.process
    if not p.rules_dead:
        return
    p.rules_dead = False
    dead = [r for r in p.rules if not r.alive()]
    if dead:
        p.rules[:] = [r for r in p.rules if r.alive()]
        p.graveyard.extend(r for r in dead if r.held_tensors_only())
        state.bump_rules()


def clear() -> None:
    """Undeclare every rule."""
    state.process.rules.clear()
    state.bump_rules()


def rules_of(model: torch.nn.Module) -> list[Rule]:
    """The declared rules that cover ``model``, in declaration order: each is a :class:`Rule`, with
    ``.remove()`` (undeclare it) and a ``repr`` that names it, where it was declared, the names it
    covers and those it lost.

    A rule covers ``model`` when it follows its tensors in ``model`` or in one of its submodules (a rule
    declared on the model, or on one of its layers: a name it lost included), or ``model`` holds some of
    the tensors it covers or writes (``pu.weight_decay`` on ``model.parameters()``; the EMA of a model, for
    the model and for its averaged copy). A rule that applied to ``model`` and whose module was removed
    from it and collected is listed too, until it is removed: the model's commits raise about it.

    What a lost-name error says to do works with it: ``for r in pu.rules_of(model): print(r)`` shows the
    rules; ``.remove()`` on one undeclares it. Removed rules are not listed."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"pu.rules_of() takes a torch.nn.Module (a model or a layer), got {type(model).__name__}")
    purge()
    modules = {id(m) for m in model.modules()}  # (alive while this runs: model holds them)
    held = _tensor_ids(model)
    out: list[Rule] = []
    for r in state.process.rules:
        root = r.root()
        if r.removed:
            continue
        if (root is not None and id(root) in modules) or any(id(t) in held for t in (*r.owner_tensors(), *r.tensors())):
            out.append(r)
    index = state.process.indexes.get(model)
    if index is not None:
        out.extend(r for r in index.rules if not r.removed and not r.alive() and all(r is not o for o in out))
    return sorted(out, key=_seq)


def declared() -> list[Rule]:
    """Every declared rule, in declaration order."""
    return sorted(state.process.rules, key=_seq)


def _seq(rule: Rule) -> int:
    return rule.seq


def rules_for(index: ModelIndex, optimizer: Any = None) -> list[Rule]:
    """The live rules that apply to a commit of ``index``'s model (with ``optimizer``), in declaration order.

    A rule applies to the model when the module it follows its tensors in is the model or inside it, or
    the model holds some of its tensors (a rule declared on a whole model, stepped through a submodule);
    a rule on bare tensors that no model holds applies to the commits of every optimizer that steps them
    (CLIP's ``logit_scale``, a learnable loss weight). The model's rules are kept on its index, made
    again when a rule is declared or removed or the model's structure changed (``index.refresh``); then
    every rule that applies reads its named slots again (:meth:`Rule.resync`): it covers the tensors the
    model holds now under its names, whether or not anything still holds the ones they replaced.

    A rule that applies and lost a name (a layer removed or renamed, a wrapper put in its place), or whose
    module was removed from the model, makes every commit raise until it is declared again or removed
    (accounted for, rule 12). Only the rules that may apply to this model follow their tensors anew, and
    they read the stored tensors behind any pending values the module slots show."""
    index.refresh()
    p = state.process
    if p.rules_dead:
        purge()
    key = (p.rules_version, index.generation)
    verified = index.followed == (key, p.moves)  # (nothing these rules follow moved since they were checked)
    if not verified and index.rules:
        _refuse_dead(index)
    if index.rules_key != key:
        _take_rules(index)
    if not verified:
        if index.rules:
            _refuse_lost(index)
        index.followed = (key, p.moves)
    extra = _unbound_rules(index, optimizer) if state.process.unbound else ()
    rules: list[Rule] = index.rules  # type: ignore[assignment]
    if not extra:
        return rules
    return sorted([*rules, *extra], key=_seq)


def _take_rules(index: ModelIndex) -> None:
    """Make ``index.rules``: the registered rules that apply to its model, following their names anew."""
    support = hooks.sharding_support()  # sharding hook: rules whose parameters fully_shard replaced
    graveyard = state.process.graveyard
    if support is not None and graveyard:
        support.lost_rules(index, list(graveyard))
    model = index.model
    held = _tensor_ids(model)
    out = []
    unbound = 0
    for r in state.process.rules:
        root = r.root()
        where = index.module_name(root) if root is not None else None
        if where is None and not any(id(t) in held for t in r.owner_tensors()):
            unbound += root is None
            continue  # another model's rule, or bare tensors this model does not hold
        if where:
            follow_place(r, model, where)
        r.resync()
        r.adopt(index)  # (bare tensors this model holds: followed by name in it from now on)
        out.append(r)
        unbound += r.root() is None
    state.process.unbound = unbound
    index.rules = sorted(out, key=_seq)
    index.rules_key = (state.process.rules_version, index.generation)


def _tensor_ids(model: Any) -> set[int]:
    """``id()`` of every parameter and buffer ``model`` holds now (stored tensors, not pending values)."""
    if model is None:
        return set()
    return {id(t) for kind in ("parameters", "buffers") for _, t in stored_named(model, kind)}


def _refuse_dead(index: ModelIndex) -> None:
    """Raise if a rule that applied to the model at its last commit died since (the module it was
    declared on was removed from the model and collected), until it is removed."""
    model = index.model_ref()
    if model is None:
        return
    for r in index.rules:
        if not r.alive() and not r.removed:
            raise UpdateError(
                f"{r.describe()} declared at {r.origin} applied to {type(model).__name__}, whose tensors it "
                "covered are gone from the model (the module it was declared on was removed and collected). "
                "Nothing of this step was written. Declare the rule again on the model as it is now (it takes "
                f"this one's place), or undeclare it: {r.how_to_remove()}."
            )


def _refuse_lost(index: ModelIndex) -> None:
    """Raise if a rule that applies to the model can no longer follow its tensors by name (looked at when
    what the rules follow moved, or the rules or the model's tensors changed: ``rules_for``)."""
    model = index.model_ref()
    if model is None:
        return
    for r in index.rules:
        lost = r.lost_names()
        if lost and not r.removed:
            raise r.lost_error(type(model).__name__, lost)


def _unbound_rules(index: ModelIndex, optimizer: Any) -> list[Rule]:
    """The rules on bare tensors that no model holds (not on ``index.rules``) whose tensors ``optimizer``
    steps: they apply to this commit (accounted for, rule 12)."""
    if optimizer is None:
        return []
    groups = optimizer.param_groups
    key = (state.process.rules_version, index.generation, len(groups), sum(len(g["params"]) for g in groups))
    hit = index.unbound.get(optimizer)
    if hit is not None and hit[0] == key:
        return hit[1]
    ids = {id(p) for g in groups for p in g["params"]}
    mine = index.rules
    out = [
        r
        for r in state.process.rules
        if r.root() is None and r not in mine and any(id(t) in ids for t in r.owner_tensors())
    ]
    index.unbound[optimizer] = (key, out)
    return out


# --- one pass over the storage of every rule's tensors ------------------------
class RuleSet:
    """The rules of one model and optimizer, and what their last full check saw.

    :meth:`check` runs every rule's :meth:`Rule.check` the first time, and
    afterwards, when the rules and the model's tensors are the same, checks
    the storage of every tensor the rules' plans depend on in one pass
    (``data_ptr``, mapped in C), and lets each rule re-check only what
    storage does not cover (:meth:`Rule.revalidate`). Any difference, or a
    rule without a fast path, runs the full checks again. The outcome is
    the full checks' in every case; only the cost differs. Shared by every
    ``pu.step``, ``Stepper`` and attachment on the same model and optimizer,
    so a fresh ``pu.step(model, opt)`` per iteration uses it. The tensors are
    held strongly while the model and optimizer live.
    """

    def __init__(self) -> None:
        self._sig: tuple[Any, ...] | None = None
        self._rules: list[Rule] = []
        self._held: list[list[torch.Tensor]] = []
        self._bound: list[Any] = []
        self._union: list[torch.Tensor] = []
        self._key: tuple[int, ...] | None = None
        self._sub = False
        self._sharded = True

    def check(self, rules: list[Rule], ctx: CommitContext) -> None:
        """Check every rule of a commit before it writes (raises what a rule's check raises)."""
        if not self._revalidate(rules, ctx):
            self.clear()  # (let go of the tensors first: a rule must see which of its own died)
            for rule in rules:
                rule.check(ctx)
            self._record(rules, ctx)

    def _signature(self, rules: list[Rule], ctx: CommitContext) -> tuple[Any, ...]:
        # (the rule set belongs to one model index and one optimizer: ``ModelIndex.caches_for``). The key of
        # the index's rules, ``(rules_version, generation)``, as ``rules_for`` made them for this commit: not
        # a second key of the model's structure
        return (len(rules), ctx.index.rules_key)

    def _revalidate(self, rules: list[Rule], ctx: CommitContext) -> bool:
        """The one guard of a kept plan: the same rules (by identity) of the same structure generation,
        the same storage behind every tensor their plans hold (one pass in C), then each rule's own
        re-check of what storage does not cover (:meth:`Rule.revalidate`)."""
        if self._sig != (len(rules), ctx.index.rules_key) or not all(map(operator.is_, rules, self._rules)):
            return False  # (None before the first record: never equal)
        if storage_key(self._union, self._sub, self._sharded) != self._key:
            return False
        for rule, held, bound in zip(rules, self._held, self._bound):
            if not rule.revalidate(ctx, held, bound):
                return False
        return True

    def _record(self, rules: list[Rule], ctx: CommitContext) -> None:
        held = [rule.fingerprint() for rule in rules]
        if any(h is None for h in held):
            self.clear()
            return
        seen: set[int] = set()
        union: list[torch.Tensor] = []
        for ts in held:
            for t in ts:  # type: ignore[union-attr]
                if t is not None and id(t) not in seen:  # (None: a tied name's gap, DeclaredRule.untie)
                    seen.add(id(t))
                    union.append(t)
        self._sub = has_subclass(union)
        self._sharded = sharding.any_sharded(union)  # (the same tensors, held: fixed until the next record)
        self._key = storage_key(union, self._sub, self._sharded)
        self._union = union
        self._held = held  # type: ignore[assignment]
        self._bound = [rule.bound() for rule in rules]
        self._rules = list(rules)
        self._sig = self._signature(rules, ctx)

    def clear(self) -> None:
        """Forget the last full check: the next commit runs every rule's full check."""
        self._sig, self._rules, self._held, self._bound, self._union, self._key = None, [], [], [], [], None
