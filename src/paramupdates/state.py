"""All mutable state of paramupdates, in one place: what a thread has in progress, what the process
keeps, and :func:`reset`.

Steps are per thread (docs/design.md, "Threads"): what a thread has in progress (its explicit
steps, the commit running ``optimizer.step()``, its ``pu.when`` conditions, the recomputation it
runs, its checkpointed segment) lives in :data:`local`, a ``threading.local``. Two threads step two
models independently, and an update issued in one thread never sees another thread's step or
condition.

What belongs to objects rather than to a thread is per process (:data:`process`): the attachments
(found from their model's tensors, whichever thread issues the update), the pending values that
``pu.Parameter`` objects show, each model's index (which holds the model's rules and the caches of
its commits), and the caches of what never changes for an object while it lives. Every cache is
keyed by the object itself, held weakly (``weakref``, ``WeakIdKeyDictionary``): nothing is keyed by
an ``id()`` of an object it does not keep alive, so a collected model or optimizer can never lend
its identity to a later one. The only ``id()`` keys are of objects held by the value they map to
(:attr:`Process.pu_pending`).

Outside this module, the modules read it through ``routing`` (which step or attachment owns a
tensor) or keep their own objects in it; the hook registries (``hooks``) and the converter
registry (``nn.convert``) are the only other module-level state.
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from .seams import Attachment, EagerLog, Journal, Replay


class Local(threading.local):
    """What one thread has in progress (each thread starts with nothing)."""

    def __init__(self) -> None:
        self.explicit: list[Journal] = []
        """``pu.step`` / ``Stepper`` / ``pu.func.functional_call`` journals in progress in this thread
        (innermost last), while they record and while they commit."""
        self.committing: list[Any] = []
        """Commits of this thread running ``optimizer.step()``: that call is theirs, so an attachment
        on the same optimizer stands aside (its rules would apply a second time)."""
        self.conditions: list[bool | torch.Tensor | None] = [None]
        """The ``pu.when`` conditions in force in this thread, combined: ``None`` (unconditional),
        ``False``, a bool tensor."""
        self.replay: Replay | None = None
        """The view of the targets while this thread recomputes a checkpointed segment (replay,
        rule 3). Its journals are those live when the segment's forward ran, in whichever thread:
        autograd may recompute in one of its device threads."""
        self.applied: tuple[Any, list[Any]] | None = None
        """``(optimizer, rules)``: the commit that runs this thread's next ``optimizer.step()`` and the
        rules it applies (``accounting``: the global optimizer hook warns about the others)."""
        self.stepping: list[Any] = []
        """The ``optimizer.step()`` calls of this thread that are running, outermost first (weak references to
        their optimizers; nested: a subclass's ``super().step()``, the optimizer a wrapper steps: a Lookahead's
        base optimizer, ``ZeroRedundancyOptimizer``'s local one)."""
        self.eager_log: EagerLog | None = None
        """The innermost checkpointed segment whose forward this thread runs outside a step: it
        notes the entry values of what it writes eagerly, for its recomputation."""

    def clear(self) -> None:
        self.explicit.clear()
        self.committing.clear()
        del self.conditions[1:]
        self.conditions[0] = None
        self.replay = None
        self.applied = None
        self.stepping.clear()
        self.eager_log = None


class Process:
    """What the process keeps (shared by its threads). Each attribute, what it holds:"""

    # --- steps and what reads show -------------------------------------------------------------------
    steps: list[Journal]
    """Every explicit step in progress, of every thread (what serialization and ``load_state_dict``
    look at: a module's slots are shared between threads)."""
    attachments: list[Attachment]
    """Live attachments (``pu.attach``), in attach order. An attachment holds its model weakly and leaves
    this list when the model is collected."""
    pu_pending: dict[int, Any]
    """``id(pu.Parameter)`` -> what it shows: a holder with ``.target`` (the parameter, held, so the key
    cannot be reused while it is here) and ``.value``."""
    indexes: weakref.WeakKeyDictionary[Any, Any]
    """model -> its ``targets.ModelIndex`` (which holds the model's rules and commit caches)."""
    structure: int
    """Bumped whenever a module of an indexed model gets a parameter, buffer or submodule through torch's
    registration paths (assignment, ``register_*``, ``add_module``, ``load_state_dict(assign=True)``, item
    assignment in ``Sequential`` / ``ModuleList`` / ``ModuleDict``): each index compares it at its model's
    next commit and rebuilds (``targets.ModelIndex.refresh``)."""
    watched: weakref.WeakSet[Any]
    """The modules of indexed models (what :attr:`structure` watches)."""

    # --- declared rules ---------------------------------------------------------------------------------
    rules: list[Any]
    """The registry of declared rules, in declaration order (``rules.base.register``). Which of them
    apply to a model is kept on the model's index (``rules.base.rules_for``)."""
    rules_version: int
    """Bumped whenever a rule is declared, removed, or follows other tensors: an index's list of rules is
    current while it has the same version (a counter: it never repeats)."""
    rule_seq: itertools.count
    """Declaration order of rules (commit order within a phase)."""
    journal_serials: itertools.count
    """A journal's serial (``Journal.serial``: what a loose record marks its targets' infos with)."""
    moves: int
    """Bumped whenever something a rule follows was collected or moved (a held tensor or module
    collected, a module replaced in its parent): a model's rules, found whole and followable at a commit,
    are looked at again at its next one only if this moved (``rules.base.rules_for``)."""
    rules_dead: bool
    """Set (by a weak reference's callback) when what a rule belongs to was collected: the registry drops
    its dead rules at the next declaration or commit (``rules.base.purge``), so a model that declared
    rules and is dropped without ever being stepped is collected with its EMA copy."""
    graveyard: collections.deque[Any]
    """The last rules on bare tensors dropped because every tensor was collected: the sharding support
    looks whether ``fully_shard`` replaced them (bounded: no tensor is held)."""
    unbound: int
    """How many declared rules follow no module (bare tensors no indexed model holds), as of the last time
    an index took its rules: a commit looks for those its optimizer steps only if any."""
    rule_roots: weakref.WeakKeyDictionary[Any, Any]
    """A module a rule follows its tensors in -> the rules (a ``weakref.WeakSet``): when the module is
    replaced in its parent, they follow the new one by name (``guards.on_module_registration``)."""
    optimizer_watch: Any
    """The handles of the global optimizer step hooks (``accounting.watch``), once a rule was declared."""
    warned: weakref.WeakSet[Any]
    """Rules already warned about as left out of an optimizer step (``accounting``: once per rule)."""
    covering: weakref.WeakKeyDictionary[Any, Any]
    """optimizer -> ``(key, [(rule, its tensors the optimizer steps)])`` (``accounting``)."""
    ema_copies: weakref.WeakKeyDictionary[Any, Any]
    """An averaged copy returned by ``pu.ema`` -> a weak reference to its rule."""

    # --- modules and tensors paramupdates keeps an eye on -------------------------------------------------
    guarded: weakref.WeakSet[Any]
    """Modules whose ``state_dict`` / ``load_state_dict`` are hooked (``guards.guard_module``)."""
    materialized: WeakIdKeyDictionary
    """A storage made by ``torch.empty_like`` of a ``pu.Parameter`` (``to_empty()``) -> what to make its
    parameter again: ``(class, auxiliary, weight_decay)``."""
    assigned_plain: weakref.WeakSet[Any]
    """Plain ``nn.Parameter`` objects the user assigned in a ``pu.Parameter``'s place (``guards``): the
    index keeps them plain, where it makes one that torch re-created a ``pu.Parameter`` again."""
    parametrized: WeakIdKeyDictionary
    """The output tensor of a ``torch.nn.utils.parametrize`` parametrization (held weakly) -> its
    ``ParametrizationList`` (a weak reference) and the parametrized tensor's display name
    (``integrations.parametrize``: updates of it go through ``right_inverse``, rule 10)."""
    internal_by_file: dict[str, bool]
    """Per source file name: whether its frames are skipped when finding a call site (``origin``).
    Bounded (4096: the files of re-run notebook cells)."""

    def __init__(self) -> None:
        self.steps, self.attachments, self.pu_pending = [], [], {}
        self.indexes = weakref.WeakKeyDictionary()
        self.structure, self.watched = 0, weakref.WeakSet()
        self.rules, self.rules_version, self.rule_seq = [], 0, itertools.count()
        self.journal_serials = itertools.count()
        self.moves, self.rules_dead, self.unbound = 0, False, 0
        self.graveyard = collections.deque(maxlen=64)
        self.rule_roots = weakref.WeakKeyDictionary()
        self.optimizer_watch = None
        self.warned, self.covering = weakref.WeakSet(), weakref.WeakKeyDictionary()
        self.ema_copies = weakref.WeakKeyDictionary()
        self.guarded, self.materialized = weakref.WeakSet(), WeakIdKeyDictionary()
        self.assigned_plain, self.parametrized = weakref.WeakSet(), WeakIdKeyDictionary()
        self.internal_by_file = {}

    def clear(self) -> None:
        self.steps.clear()
        self.attachments.clear()
        self.pu_pending.clear()
        self.rules.clear()
        self.rules_version += 1
        self.ema_copies = weakref.WeakKeyDictionary()
        self.rule_roots = weakref.WeakKeyDictionary()
        self.graveyard.clear()
        self.warned = weakref.WeakSet()
        self.covering = weakref.WeakKeyDictionary()
        self.unbound = 0
        self.rules_dead = False
        self.materialized = WeakIdKeyDictionary()
        for index in list(self.indexes.values()):
            index.forget_rules()


local = Local()
"""This thread's steps, commits, conditions, replay and eager log."""

process = Process()
"""The process's attachments, steps of every thread, pending ``pu.Parameter`` values, model indexes
and caches."""


def bump_rules() -> None:
    """The declared rules changed: every index recomputes its list of rules at its next commit."""
    process.rules_version += 1


def reset() -> None:
    """Forget everything in progress in this thread, and every attachment, pending value and declared
    rule of the process (what ``paramupdates.testing.reset`` calls after detaching and discarding)."""
    local.clear()
    process.clear()
