"""What ``pu.Stepper`` and ``pu.attach``'s attachments share: the model and optimizer, the options,
the counters, the last committed plan, ``state_dict`` / ``load_state_dict``."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from . import hooks, routing
from .commit import Commit
from .commit.rollback import SnapshotPool
from .errors import UpdateError
from .journal import Journal
from .options import StepOptions
from .origin import call_site
from .refs import WatchedRef
from .rules.base import RuleSet, rules_for
from .schedule import Schedule
from .targets import ModelIndex, index_of


def _new_caches() -> tuple[SnapshotPool, RuleSet, dict]:
    return (SnapshotPool(), RuleSet(), {})


def commit_caches(index: ModelIndex, optimizer: torch.optim.Optimizer | None) -> tuple[SnapshotPool, RuleSet, dict]:
    """The rollback copies, the rule set and the journal entries for reuse of ``(model, optimizer)``,
    shared by every ``pu.step``, ``Stepper`` and attachment on them (commits on one model run one at a
    time; a commit nested in another's optimizer step takes fresh copies, see ``rollback``; an entry
    in use by one journal is not handed to another). Kept on the model's index, per optimizer held
    weakly: they live as long as both do."""
    return index.caches_for(optimizer, _new_caches)


class Owner:
    """What Stepper and Attachment share: the model, the options, counters, the last schedule, state."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, options: StepOptions, weak: bool = False
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
        support = hooks.sharding_support()  # sharding hook: refuse engines whose parameters pu cannot update
        if support is not None:
            support.check_model(model, optimizer, type(self).__name__)
        # ``weak`` (an attachment): model and optimizer are held weakly, so that a forgotten attachment
        # keeps neither alive (docs/design.md, "Attachments hold their model weakly")
        forget = self._forget if weak else None
        self._model_ref = WatchedRef(model, forget)  # (``.gone``: see refs.WatchedRef)
        self._optimizer_ref = weakref.ref(optimizer, forget) if optimizer is not None else None
        self._strong = None if weak else (model, optimizer)
        self.options = options
        self.index = index_of(model)
        self.steps = 0
        self.skipped_steps = 0
        # Steps closed so far (committed, skipped, discarded or rolled back); a
        # commit's sync sends it so that ranks check they commit the same step
        # (distributed sync, rule 9). Read and written only outside the forward (commit, discard):
        # a value read in a compiled forward would be guarded on, and recompile.
        self._closed = 0
        self._last = Schedule()
        self._last_skipped = False
        self._reuse_entries = commit_caches(self.index, optimizer)[2]

    @property
    def model(self) -> nn.Module:
        """The model (``None`` once an attachment's model was collected)."""
        return self._model_ref()  # type: ignore[return-value]

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer, if any (``None`` once an attachment's optimizer was collected)."""
        ref = self._optimizer_ref
        return None if ref is None else ref()

    @staticmethod
    def _forget(_ref: Any) -> None:
        """Model or optimizer collected: drop every attachment left without one."""
        if routing is None:  # interpreter shutdown: module globals are cleared, nothing to keep tidy
            return
        routing.prune_attachments()

    def _commit(self, journal: Journal, optimizer: torch.optim.Optimizer | None) -> Commit:
        c = Commit(journal, optimizer, self.options, commit_caches(self.index, optimizer), self._closed)
        self._closed += 1
        return c

    def _reuse(self) -> dict:
        """The entries of earlier steps on this model and optimizer, for a new journal to reuse
        (looked up once, at construction: an attachment opens journals inside a forward dynamo
        may trace, where a cache lookup would be guarded on)."""
        return self._reuse_entries

    def _committed(self, c: Commit) -> None:
        """Count a finished commit and keep its plan."""
        if c.skipped:
            self.skipped_steps += 1
        else:
            self.steps += 1
        self._last_skipped = c.skipped
        self._last = c.schedule()
        c.release()

    def _open_journal(self) -> Journal | None:
        raise NotImplementedError

    @property
    def skipped(self) -> bool:
        """Whether the last step was dropped for a non-finite value."""
        return self._last_skipped

    def schedule(self) -> Schedule:
        """The plan of the last committed step (phase, target, op, condition, origin)."""
        return self._last

    def pending_schedule(self) -> Schedule:
        """The plan so far of the step in progress (empty if none is open)."""
        j = self._open_journal()
        if j is None:
            return Schedule()
        c = Commit(j, self.optimizer, self.options, None, self._closed)
        c.rules = rules_for(self.index, self.optimizer)
        return c.schedule()

    def state_dict(self) -> dict[str, Any]:
        """Counters and the state of every rule that applies to the model (EMA copies, counters)."""
        rules = rules_for(self.index, self.optimizer)
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "rules": {f"{i}:{r.kind}": r.state_dict() for i, r in enumerate(rules)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the model's rules must be declared the same way."""
        rules = rules_for(self.index, self.optimizer)
        saved = state.get("rules", {})
        keys = [f"{i}:{r.kind}" for i, r in enumerate(rules)]
        if sorted(saved) != sorted(keys):
            raise UpdateError(
                f"load_state_dict: the saved rules {sorted(saved)} do not match the rules declared on "
                f"this model {sorted(keys)}. Declare the same rules (same order) before loading."
            )
        for k, r in zip(keys, rules):
            r.load_state_dict(saved[k])
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])


def check_arguments(model: Any, optimizer: Any, where: str) -> None:
    """``TypeError`` naming the call site for a model that is not a module or an optimizer that is
    not one (``pu.step(model, model)``, swapped arguments)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{where} at {call_site(3)}: the model must be a torch.nn.Module, not {type(model).__name__}. "
            f"Call {where}(model, optimizer)."
        )
    if optimizer is not None and not (
        callable(getattr(optimizer, "step", None)) and hasattr(optimizer, "param_groups")
    ):
        raise TypeError(
            f"{where} at {call_site(3)} for {type(model).__name__}: the optimizer must be a torch.optim.Optimizer "
            f"(or None), not {type(optimizer).__name__}. Call {where}(model, optimizer)."
        )
