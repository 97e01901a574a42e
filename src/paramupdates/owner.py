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


class Caches:
    """What the steps of one ``(model, optimizer)`` keep from one to the next, shared by every ``pu.step``,
    ``Stepper`` and attachment on them (commits on one model run one at a time; a commit nested in
    another's optimizer step takes fresh copies, see ``rollback``; an entry in use by one journal is not
    handed to another). Kept on the model's index, per optimizer held weakly: they live as long as both do.

    * ``pool``: the rollback copies kept between commits on CPU (``copy_for_rollback``);
    * ``ruleset``: the declared rules' plans and their one-pass re-check (``rules.base.RuleSet``);
    * ``entries``: the journal entries of earlier steps, for a new journal to reuse;
    * ``checked``: the sharding support has looked at the model and optimizer (once);
    * ``guard``: where the guard of a ``pu.step``'s optimizer step sits (``step._guard_optimizer``; the
      optimizer held weakly: nothing here may hold the optimizer this is kept for).
    """

    __slots__ = ("pool", "ruleset", "entries", "checked", "guard")

    def __init__(self) -> None:
        self.pool = SnapshotPool()
        self.ruleset = RuleSet()
        self.entries: dict = {}
        self.checked = False
        self.guard: tuple[weakref.ref, dict, Any] | None = None


def commit_caches(index: ModelIndex, optimizer: torch.optim.Optimizer | None) -> Caches:
    """The :class:`Caches` of ``(model, optimizer)``, made the first time."""
    return index.caches_for(optimizer, Caches)


class Owner:
    """What Stepper and Attachment share: the model, the options, counters, the last schedule, state."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, options: StepOptions, weak: bool = False
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
        self.index = index_of(model)
        caches = self._caches = commit_caches(self.index, optimizer)  # (this optimizer's; flush() takes None's)
        if not caches.checked:  # (once per model and optimizer: pu.step makes a Stepper per step)
            support = hooks.sharding_support()  # sharding hook: refuse engines whose parameters pu cannot update
            if support is not None:
                support.check_model(model, optimizer, type(self).__name__)
            caches.checked = True
        # ``weak`` (an attachment): model and optimizer are held weakly, so that a forgotten attachment
        # keeps neither alive (docs/design.md, "Attachments hold their model weakly")
        forget = self._forget if weak else None
        self._model_ref = WatchedRef(model, forget)  # (``.gone``: see refs.WatchedRef)
        self._optimizer_ref = weakref.ref(optimizer, forget) if optimizer is not None else None
        self._strong = None if weak else (model, optimizer)
        self.options = options
        # Steps applied and skipped as decided on the host, and the steps whose verdict was taken on the
        # device (on_nonfinite="skip" with no host sync): how many, and how many of those were skipped (a
        # 0-dim int64 tensor on the device, never read here). ``steps`` / ``skipped_steps`` read them.
        self._n_applied = 0
        self._n_skipped = 0
        self._n_on_device = 0
        self._skipped_on_device: torch.Tensor | None = None
        self._last_ok: torch.Tensor | bool | None = None  # the last commit's verdict (None: no commit yet)
        # Steps closed so far (committed, skipped, discarded or rolled back); a
        # commit's sync sends it so that ranks check they commit the same step
        # (distributed sync, rule 9). Read and written only outside the forward (commit, discard):
        # a value read in a compiled forward would be guarded on, and recompile.
        self._closed = 0
        self._last: Schedule | Commit | None = None  # (the last commit, or its plan once read: schedule())
        self._reuse_entries = caches.entries

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
        caches = self._caches if optimizer is not None else commit_caches(self.index, None)
        c = Commit(journal, optimizer, self.options, caches, self._closed)
        self._closed += 1
        return c

    def _reuse(self) -> dict:
        """The entries of earlier steps on this model and optimizer, for a new journal to reuse
        (looked up once, at construction: an attachment opens journals inside a forward dynamo
        may trace, where a cache lookup would be guarded on)."""
        return self._reuse_entries

    def _committed(self, c: Commit) -> None:
        """Count a finished commit and keep its plan (a verdict taken on the device is counted there)."""
        ok = c.ok
        if ok is not None:
            self._n_on_device += 1
            skipped = self._skipped_on_device
            if skipped is None or skipped.device != ok.device:
                base = 0 if skipped is None else skipped.to(ok.device)  # (a model moved between steps)
                self._skipped_on_device = (~ok).to(torch.int64) + base
            else:
                skipped.add_(~ok)
            self._last_ok = ok
        elif c.skipped:
            self._n_skipped += 1
            self._last_ok = False
        else:
            self._n_applied += 1
            self._last_ok = True
        self._last = c  # (its plan, made when schedule() is first read)
        c.release()

    def _fold(self) -> None:
        """Bring the device's count into the host's: one read of it (a host sync, made by whoever reads
        ``steps`` or ``skipped_steps``), only after steps decided on the device."""
        if self._n_on_device:
            n = int(self._skipped_on_device)  # type: ignore[arg-type]
            self._n_applied += self._n_on_device - n
            self._n_skipped += n
            self._n_on_device = 0
            self._skipped_on_device = None

    @property
    def steps(self) -> int:
        """The number of steps applied. After steps whose verdict was taken on the device
        (``on_nonfinite="skip"`` with a fused optimizer), reading it waits for the device once (the
        reader's sync, not the library's); :attr:`applied` and :attr:`skipped_count` do not wait."""
        self._fold()
        return self._n_applied

    @steps.setter
    def steps(self, value: int) -> None:
        self._fold()
        self._n_applied = int(value)

    @property
    def skipped_steps(self) -> int:
        """The number of steps skipped (``on_nonfinite="skip"``, a scaler's overflow); as :attr:`steps`,
        a read after steps decided on the device waits for it."""
        self._fold()
        return self._n_skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._fold()
        self._n_skipped = int(value)

    @property
    def applied(self) -> torch.Tensor:
        """Whether the last step was applied, as a 0-dim bool tensor; never read on the host here.

        Where the verdict was taken on the device (``on_nonfinite="skip"`` with an optimizer that takes
        ``found_inf``, see docs/design.md rule 7) it is that verdict, on the device, available as soon as
        the commit has been launched; ``bool(applied)`` waits for the device (the reader's sync, not
        the library's). Elsewhere the host knew: a CPU tensor. ``False`` before the first step."""
        ok = self._last_ok
        if isinstance(ok, torch.Tensor):
            return ok
        return torch.tensor(bool(ok))

    @property
    def skipped_count(self) -> torch.Tensor:
        """The number of skipped steps as a 0-dim int64 tensor, on the device where verdicts were taken
        there (no host sync to make or read it; ``int()`` of it is the reader's): ``skipped_steps``
        without the wait."""
        dev = self._skipped_on_device
        if dev is None:
            return torch.tensor(self._n_skipped)
        return dev + self._n_skipped

    def _open_journal(self) -> Journal | None:
        raise NotImplementedError

    @property
    def skipped(self) -> bool:
        """Whether the last step was dropped (a non-finite value, a scaler's overflow): ``not applied``, read
        on the host (a wait for the device where the verdict was taken there). False before any step."""
        ok = self._last_ok
        return ok is not None and not bool(ok)

    def schedule(self) -> Schedule:
        """The plan of the last committed step (phase, target, op, condition, origin)."""
        last = self._last
        if last is None:
            return Schedule()
        if not isinstance(last, Schedule):
            self._last = last = last.schedule()  # (the last commit's plan, made now: most are never read)
        return last

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
