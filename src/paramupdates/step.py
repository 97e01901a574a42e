"""One training step as a transaction: ``pu.step``, ``pu.Stepper``, ``pu.attach``.

A step records the updates issued during it (``journal.Journal``) and commits
them through one driver (``commit.Commit``) in the fixed phase order of rule 4
(``docs/design.md``; ``phases.py``):

1. ``before_grad``: declared rules (weight decay), then updates issued with
   ``phase="before_grad"``, in declaration / issue order;
2. ``grad``: ``optimizer.step()``, if there is an optimizer;
3. ``after_grad``: constraints, then updates issued with ``phase="after_grad"``;
4. ``auxiliary``: updates with ``phase=None`` on non-trainable targets;
5. ``after_step``: EMA and other rules that read the final values.

Updates to one target within a phase compose in issue order. A step commits
on a clean exit and discards everything on an exception; every check runs
before the first write (validated commit, rule 7).
"""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Unpack

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import context, hooks
from .commit import Commit
from .errors import UpdateError, listed
from .journal import Entry, Journal
from .options import StepOptions, StepOptionsDict, make_options
from .origin import call_site
from .rollback import SnapshotPool
from .rules.base import RuleSet, rules_for
from .schedule import Schedule
from .targets import ModelIndex, index_of

_CACHES: weakref.WeakKeyDictionary[ModelIndex, list[Any]] = weakref.WeakKeyDictionary()


def commit_caches(index: ModelIndex, optimizer: torch.optim.Optimizer | None) -> tuple[SnapshotPool, RuleSet, dict]:
    """The rollback copies, the rule set and the journal entries for reuse of ``(model, optimizer)``,
    shared by every ``pu.step``, ``Stepper`` and attachment on them (commits on one model run one at a
    time; a commit nested in another's optimizer step takes fresh copies, see ``rollback``; an entry
    in use by one journal is not handed to another). They live as long as both do."""
    per = _CACHES.get(index)
    if per is None:
        per = _CACHES[index] = [None, weakref.WeakKeyDictionary()]
    if optimizer is None:
        if per[0] is None:
            per[0] = (SnapshotPool(), RuleSet(), {})
        return per[0]
    caches = per[1].get(optimizer)
    if caches is None:
        caches = per[1][optimizer] = (SnapshotPool(), RuleSet(), {})
    return caches


class _Owner:
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
        self._model_ref = weakref.ref(model, forget)
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
        if context is None:  # interpreter shutdown: module globals are cleared, nothing to keep tidy
            return
        context.attachments[:] = [a for a in context.attachments if a.model is not None and a.optimizer is not None]

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
        c.rules = rules_for(self.index)
        return c.schedule()

    def state_dict(self) -> dict[str, Any]:
        """Counters and the state of every rule that applies to the model (EMA copies, counters)."""
        rules = rules_for(self.index)
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "rules": {f"{i}:{r.kind}": r.state_dict() for i, r in enumerate(rules)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the model's rules must be declared the same way."""
        rules = rules_for(self.index)
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


class Stepper(_Owner):
    """A training step as a transaction over ``model`` (and ``optimizer``).

    ``with stepper: ...`` (or ``stepper.run(fn, *args)``) opens a step; updates
    issued inside are recorded, reads see them in program order (read-your-writes, rule 1), and
    nothing is written (deferred commit, rule 2) until the block exits cleanly, when the commit
    applies the phases in their fixed order (phase order, rule 4; ``optimizer.step()`` is
    called by the commit, between ``before_grad`` and ``after_grad``). On an
    exception the step is discarded.

    Args:
        model: the module whose parameters and buffers may be targets.
        optimizer: stepped at commit; ``None`` for steps without a gradient update.
        closure: passed to ``optimizer.step(closure)`` (LBFGS and friends); the
            commit's checks and ``before_grad`` run right after its first call,
            when the gradients exist. Updates it issues join the step.
        **options: see :class:`~paramupdates.options.StepOptions` (``on_nonfinite``,
            ``check_finite``, ``copy_for_rollback``, ``process_group``, ``sync_timeout``,
            ``scaler``).

    While a step records, ``optimizer.step()`` belongs to its commit: a call made in the block
    (or by ``GradScaler.step``) raises :class:`UpdateError` before the optimizer writes. Steps are
    per thread: a thread's step is not seen by updates issued in other threads.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        closure: Callable[[], Any] | None = None,
        **options: Unpack[StepOptionsDict],
    ) -> None:
        _check_arguments(model, optimizer, "pu.Stepper")
        super().__init__(model, optimizer, make_options(dict(options), "pu.Stepper"))
        self.closure = closure
        if closure is not None and self.options.scaler is not None:
            raise TypeError(
                f"pu.Stepper at {call_site(2)}: closure= and scaler= do not go together "
                "(torch.amp.GradScaler.step does not support closures)."
            )
        self._journal: Journal | None = None
        self._foreign: RemovableHandle | None = None  # refuses optimizer steps not made by the commit

    def step(self, closure: Callable[[], Any] | None = None) -> StepBlock:
        """Context manager: one step; commits on a clean exit, discards on an exception."""
        return StepBlock(self, closure)

    def __enter__(self) -> Stepper:
        self._open()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        j = self._journal
        assert j is not None
        if exc_type is not None:
            self._discard(j)
            return
        self._finish(j, self.closure)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` inside one step and commit; returns ``fn``'s result."""
        with self.step():
            out = fn(*args, **kwargs)
        return out

    def _open(self) -> Journal:
        site = call_site(2)
        if context.local.explicit:
            other = context.local.explicit[-1]
            raise UpdateError(
                f"pu.step at {site} for {type(self.model).__name__}: a step is already in progress "
                f"({other.label}, for {type(other.index.model).__name__}); pu.step blocks do not nest. "
                "Finish the outer step first, or open one step on a module that contains both models."
            )
        refuse_pending_attachment(self.model, f"pu.step at {site}")
        j = Journal(self.index, self.optimizer, f"pu.step at {site}", self._reuse())
        self._journal = j
        context.local.explicit.append(j)
        context.steps.append(j)
        if self.optimizer is not None:
            self._foreign = _refuse_foreign_steps(self.optimizer, j)
        return j

    def _close(self, j: Journal) -> None:
        if context.local.explicit and context.local.explicit[-1] is j:
            context.local.explicit.pop()
        if j in context.steps:
            context.steps.remove(j)
        self._journal = None
        if self._foreign is not None:
            self._foreign.remove()
            self._foreign = None

    def _discard(self, j: Journal) -> None:
        self._close(j)
        j.discard()
        self._closed += 1

    def _finish(self, j: Journal, closure: Any) -> None:
        # the journal stays routable while the commit runs: a closure's forward records into it
        c = self._commit(j, self.optimizer)
        try:
            c.run(closure)
        finally:
            self._close(j)
        self._committed(c)

    def _open_journal(self) -> Journal | None:
        return self._journal


class StepBlock:
    """One step of a :class:`Stepper`, as a context manager (what ``pu.step(...)`` and
    ``stepper.step()`` return): entered once, it commits on a clean exit and discards on an
    exception. Entering it again is an :class:`UpdateError` (one ``pu.step(...)`` is one step)."""

    def __init__(self, stepper: Stepper, closure: Callable[[], Any] | None) -> None:
        self.stepper = stepper
        self.closure = closure
        self._journal: Journal | None = None
        self._used_at: str | None = None

    def __enter__(self) -> Stepper:
        if self._used_at is not None:
            raise UpdateError(
                f"pu.step at {call_site(2)} for {type(self.stepper.model).__name__}: this pu.step(...) object "
                f"was already used ({self._used_at}); one pu.step(...) is one step. Call "
                "pu.step(model, optimizer) again for each step, or make a pu.Stepper once and enter it each "
                "time (with stepper: ...)."
            )
        self._journal = self.stepper._open()
        self._used_at = self._journal.label
        return self.stepper

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        j, self._journal = self._journal, None
        assert j is not None
        if exc_type is not None:
            self.stepper._discard(j)
            return
        self.stepper._finish(j, self.closure if self.closure is not None else self.stepper.closure)


def _check_arguments(model: Any, optimizer: Any, where: str) -> None:
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


def _refuse_foreign_steps(optimizer: Any, j: Journal) -> RemovableHandle | None:
    """While ``j``'s step records, an ``optimizer.step()`` that its commit does not make (the user's,
    or ``GradScaler.step``'s) raises :class:`UpdateError` before the optimizer writes: the commit owns
    that step. A step pre-hook on the optimizer, run before any other (an attachment's too)."""
    try:
        opt = hookable(optimizer)
    except UpdateError:
        return None  # no step hooks to guard with

    def refuse(o: Any, args: Any, kwargs: Any) -> None:
        if any(c.journal is j for c in context.local.committing):
            return  # the commit's own call
        name = type(o).__name__
        raise UpdateError(
            f"{name}.step() at {call_site(1)} was called inside {j.label}, which owns that optimizer step: "
            f"its commit calls {name}.step() once, between the before_grad and after_grad phases, at the end "
            "of the block (this call would update the parameters a second time, in the middle of the "
            "transaction). Remove the optimizer.step() call from the block; with a torch.amp.GradScaler, "
            "remove scaler.step(optimizer) and scaler.update() too and pass scaler=scaler to pu.step. Or "
            "keep a loop that calls optimizer.step() itself with pu.attach(model, optimizer) instead of "
            "pu.step. Nothing was written; the step is discarded."
        )

    handle = opt.register_step_pre_hook(refuse)
    opt._optimizer_step_pre_hooks.move_to_end(handle.id, last=False)  # before an attachment's pre-hook
    return handle


def step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    closure: Callable[[], Any] | None = None,
    **options: Unpack[StepOptionsDict],
) -> StepBlock:
    """One training step as a transaction (context manager yielding a :class:`Stepper`).

    ``with pu.step(model, opt) as s: loss.backward()`` records every update
    issued in the block and, on a clean exit, commits them in the fixed phase
    order (``before_grad``, ``optimizer.step()``, ``after_grad``,
    ``auxiliary``, ``after_step``). An exception discards the step.
    ``s.schedule()`` afterwards is the committed plan. ``closure`` and
    ``**options`` (``on_nonfinite="raise"`` or ``"skip"``, ``check_finite``,
    ``copy_for_rollback``, ``process_group``, ``sync_timeout``, ``scaler``): see :class:`Stepper`.
    The commit makes the optimizer's step: do not call ``optimizer.step()`` in the block (it raises
    before writing); with a ``torch.amp.GradScaler`` pass ``scaler=scaler``. The returned object is
    one step: enter it once.
    """
    _check_arguments(model, optimizer, "pu.step")
    return Stepper(model, optimizer, closure=closure, **options).step()


class Attachment(_Owner):
    """Commit inside ``optimizer.step()``, so an unchanged training loop works.

    A step opens at the first update after an ``optimizer.step()`` (or at the
    first one ever) and commits inside the next ``optimizer.step()``: the
    step pre-hook validates everything and applies ``before_grad``; the
    optimizer updates the gradients; the post-hook applies ``after_grad``,
    ``auxiliary`` and ``after_step``. Called with a closure
    (``optimizer.step(closure)``: LBFGS, Lightning), the validation and
    ``before_grad`` run right after the closure's first call, when the
    gradients exist.

    With no optimizer step to come (evaluation, statistics recomputation),
    call :meth:`flush` to commit the pending updates without a gradient
    update, or :meth:`discard` to drop them. :meth:`detach` removes the hooks.

    Updates issued inside ``optimizer.step()`` (an LBFGS closure's forward)
    join the step being committed and land in its later phases.

    If ``optimizer.step()`` itself raises (the optimizer, a rule, validation),
    the step is rolled back before the exception propagates: ``attach`` wraps
    ``optimizer.step`` on the instance for that (a bound method, so that an LR
    scheduler made before or after ``attach`` wraps it in turn; ``detach()``
    unwraps it). An exception in your own code before ``optimizer.step()`` is
    invisible to the attachment: call :meth:`discard` in your ``except`` block
    to drop the updates recorded so far. (Should the class's ``step`` be
    called around the wrapper and raise, the next ``optimizer.step()``,
    :meth:`flush` or :meth:`state_dict` rolls it back, with a warning.)
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, **options: Unpack[StepOptionsDict]) -> None:
        _check_arguments(model, optimizer, "pu.attach")
        optimizer = hookable(optimizer)
        super().__init__(model, optimizer, make_options(dict(options), "pu.attach"), weak=True)
        self.origin = call_site(2)
        self.label = f"pu.attach({type(model).__name__}) at {self.origin}"
        self.journal: Journal | None = None  # the step being recorded (or committed)
        self.commit: Commit | None = None  # its commit, between the pre- and post-hook
        for other in context.attachments:
            om = other.model
            if om is model:
                raise UpdateError(
                    f"pu.attach at {self.origin}: {type(model).__name__} is already attached ({other.label}); "
                    "call detach() on that attachment first. (One attachment per model: for two optimizers "
                    "over one model, attach each to the submodule it steps, e.g. pu.attach(model.encoder, "
                    "opt_enc) and pu.attach(model.decoder, opt_dec), or give one optimizer param groups.)"
                )
            nested = _nesting(model, self.index, other)
            if nested is not None:
                inner, outer, at = nested
                raise UpdateError(
                    f"pu.attach at {self.origin}: the {type(inner).__name__} at {at!r} of the "
                    f"{type(outer).__name__} would be attached twice (here, and by {other.label}): an update "
                    "of its tensors (a batch norm's statistics, say) would belong to both optimizers' steps. "
                    "Attach disjoint modules, one per optimizer (pu.attach(model.encoder, opt_enc) and "
                    "pu.attach(model.decoder, opt_dec)), or detach() the other attachment first."
                )
        self._pre = optimizer.register_step_pre_hook(self._pre_hook)
        self._post = optimizer.register_step_post_hook(self._post_hook)
        self._calls = 0
        self._step_calls = 0
        self._nested = 0
        self._hooks_running = False
        self._detached = False
        self._wrap_step(optimizer)
        context.attachments.append(self)

    # optimizer.step on the instance ----------------------------------------
    def _wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Wrap ``optimizer.step`` on the instance so that an exception inside it rolls the commit back
        at once. A bound method (``torch.optim.lr_scheduler`` wraps ``opt.step.__func__``), keeping the
        marks of a wrapper already there (an LR scheduler's ``_wrapped_by_lr_sched``)."""
        orig = optimizer.step
        prev = optimizer.__dict__.get("step")  # an instance wrapper already there
        # what optimizer.step was, kept as a function of the optimizer: a bound method would hold the
        # optimizer, which the attachment holds weakly
        self._prev_step = (_unbound(prev, optimizer), _unbound(prev, optimizer) is not prev)  # (fn, was bound)
        attachment = weakref.ref(self)
        call_orig = _as_function_of(orig, optimizer)

        @functools.wraps(type(optimizer).step)
        def step(opt: Any, *args: Any, **kwargs: Any) -> Any:
            att = attachment()
            if att is None or att._detached:
                return call_orig(opt, *args, **kwargs)
            return att._guarded_step(call_orig, opt, *args, **kwargs)

        step.__dict__.update(getattr(orig, "__dict__", {}))
        step.__dict__.pop("__wrapped__", None)
        self._guard_fn = step
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def _guarded_step(self, orig: Callable[..., Any], opt: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step``: on an exception the step is ended (restored, or its pending updates dropped)
        before it propagates."""
        self._calls += 1
        try:
            return orig(opt, *args, **kwargs)
        except BaseException as exc:
            # Every way out of optimizer.step() ends the step: an exception of the optimizer or of
            # the commit (a commit is running), or of a step pre-hook that ran before ours (no
            # commit began: the pending updates are dropped all the same).
            if self.commit is not None or (self.journal is not None and self._calls == 1):
                self._abort(exc)
            raise
        finally:
            self._calls -= 1

    # routing -----------------------------------------------------------------
    def route(self, t: torch.Tensor, compiling: bool = False) -> tuple[Journal | None, Entry | None]:
        """The journal that records an update of ``t`` (opening a step if none is open)."""
        # Under dynamo the shortcut would guard on id(t) of a pending value and
        # recompile per micro-batch; traced code resolves by identity instead.
        if not compiling and self._owned_elsewhere(t):
            return None, None
        # Between the pre- and post-hook (inside optimizer.step(), e.g. an LBFGS
        # closure) updates join the committing step and land in its later phases.
        if self.journal is not None:
            e = self.journal.find(t, True, compiling)
            return (self.journal, e) if e is not None else (None, None)
        if self.index.lookup(t) is None:
            return None, None
        self.journal = Journal(self.index, self.optimizer, self.label, self._reuse())
        return self.journal, self.journal.find(t, True, compiling)

    def journal_for(self, t: torch.Tensor, compiling: bool = False) -> Journal | None:
        """The journal that records updates of ``t`` if this model has it as a parameter or buffer
        (the index as built, no rebuild), opening a step if none is open; else None."""
        if self.index.peek(t) is None:
            return None
        if self.journal is None:
            self.journal = Journal(self.index, self.optimizer, self.label, self._reuse())
        return self.journal

    def _owned_elsewhere(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is known (without rebuilding any index) to belong to another model only.

        A miss in this model's index rebuilds it (a module may have been
        added), which walks the whole module tree: with two attached models
        (a GAN's generator and discriminator), every update of the second
        would rebuild the first's index. A tensor that this index does not
        know but another live step's or attachment's index does, or that is
        the pending value of another's step (a later micro-batch reads it), is
        theirs. (A rebuild while this model's buffer slots show pending values
        would also index those values in place of the buffers.)
        """
        if self.index.peek(t) is not None:
            return False
        if self.journal is not None and self.journal.find(t, create=False) is not None:
            return False
        for j in context.local.explicit:
            if j.index.peek(t) is not None or j.find(t, create=False) is not None:
                return True
        return any(
            other is not self
            and (
                other.index.peek(t) is not None
                or (other.journal is not None and other.journal.find(t, create=False) is not None)
            )
            for other in context.attachments
        )

    # the commit ----------------------------------------------------------------
    def _recover(self) -> None:
        """Roll back a commit whose optimizer step raised (no post-hook came)."""
        if self.commit is not None and not self._hooks_running and not self._inside_own_step():
            warnings.warn("pu.attach: the last optimizer.step() raised; its step was rolled back.", stacklevel=3)
            self._abort()

    def _inside_own_step(self) -> bool:
        """Whether the optimizer.step() call that opened the commit is still running."""
        return self._calls > 0 and self._calls == self._step_calls

    def _abort(self, exc: BaseException | None = None) -> None:
        c, j = self.commit, self.journal
        if c is not None:
            c.abort(exc)
        elif j is not None:
            j.discard()
            self._closed += 1  # closed before its commit began (which counts it)
        self.journal = None
        self.commit = None
        self._nested = 0

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if _run_by_explicit_commit(optimizer) or self.model is None:
            return None
        if self.commit is not None and not self._hooks_running and self._inside_own_step():
            # A nested step: an optimizer subclass calling super().step(), whose
            # class is hooked too. Only the outermost call commits.
            self._nested += 1
            return None
        self._recover()  # the previous optimizer.step() raised, called around the wrapper
        if self.journal is None:
            self.journal = Journal(self.index, self.optimizer, self.label, self._reuse())
        c = self.commit = self._commit(self.journal, optimizer)
        self._step_calls = self._calls
        self._hooks_running = True
        try:
            # args[0] is the optimizer itself (torch's hook wrapper passes the bound call's args)
            closure = kwargs.get("closure") if kwargs and "closure" in kwargs else (args[1] if len(args) > 1 else None)
            if closure is not None:
                c.rollback.protect_optimizer(optimizer, all_params=True)
                c.optimizer_starting()
                wrapped = c.wrap_closure(closure)
                if kwargs and "closure" in kwargs:
                    return args, {**kwargs, "closure": wrapped}
                return (args[0], wrapped, *args[2:]), kwargs
            if not c.begin():
                c.hide_grads()  # skipped: the optimizer runs, but sees no gradients
                return None
            c.before_optimizer()
            c.rollback.protect_optimizer(optimizer, all_params=False)
            c.optimizer_starting()
        except BaseException as exc:
            self._abort(exc)
            raise
        finally:
            self._hooks_running = False
        return None

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if _run_by_explicit_commit(optimizer) or self.model is None:
            return
        if self._nested:
            self._nested -= 1
            return
        c = self.commit
        if c is None:
            return
        self._hooks_running = True
        try:
            if c.skipped:
                c.restore_grads()
            elif c.state == "new":
                raise UpdateError(
                    f"{c.label}: {type(optimizer).__name__}.step(closure) returned without calling the closure, "
                    "so this step's updates and rules could not run after the gradients were computed. "
                    "Call optimizer.step() without a closure, or use an optimizer that calls it."
                )
            else:
                c.optimizer_stepped()
                c.finish()
        except BaseException as exc:
            self._abort(exc)
            raise
        finally:
            self._hooks_running = False
        self._committed(c)
        self.journal = None
        self.commit = None

    # user controls ----------------------------------------------------------
    def flush(self) -> None:
        """Commit the pending updates now, without a gradient update (all phases but ``grad``)."""
        self._recover()
        j = self.journal
        if j is None:
            return
        self.journal = None
        c = self._commit(j, None)
        c.run()
        self._committed(c)

    def discard(self) -> None:
        """Drop the pending updates (or roll back a commit whose optimizer step raised)."""
        self._abort()

    def detach(self) -> None:
        """Remove the optimizer hooks; pending updates are discarded."""
        self._abort()
        self._pre.remove()
        self._post.remove()
        self._detached = True
        opt = self.optimizer
        opt_dict = opt.__dict__ if opt is not None else {}
        now = opt_dict.get("step")
        if isinstance(now, types.MethodType) and now.__func__ is self._guard_fn:
            prev, bound = self._prev_step
            if prev is None:
                del opt_dict["step"]
            else:
                opt_dict["step"] = types.MethodType(prev, opt) if bound else prev
        if self in context.attachments:
            context.attachments.remove(self)

    def state_dict(self) -> dict[str, Any]:
        self._recover()
        return super().state_dict()

    def _open_journal(self) -> Journal | None:
        return self.journal


def _unbound(method: Any, obj: Any) -> Any:
    """``method.__func__`` if ``method`` is bound to ``obj``, else ``method``."""
    return method.__func__ if isinstance(method, types.MethodType) and method.__self__ is obj else method


def _as_function_of(method: Any, obj: Any) -> Callable[..., Any]:
    """``f(obj, *args)`` calling ``method(*args)``, without holding ``obj`` when ``method`` is bound to it."""
    fn = _unbound(method, obj)
    if fn is not method:
        return fn
    return lambda _obj, *args, **kwargs: method(*args, **kwargs)


def _nesting(model: nn.Module, index: ModelIndex, att: Attachment) -> tuple[nn.Module, nn.Module, str] | None:
    """``(inner, outer, the inner's name in the outer)`` when ``model`` (indexed by ``index``) lies
    inside the model of attachment ``att`` or around it; else None (disjoint, same, or collected)."""
    other = att.model
    if other is None or other is model:
        return None
    at = att.index.module_name(model)
    if at is not None:
        return model, other, at
    at = index.module_name(other)
    return (other, model, at) if at is not None else None


def refuse_pending_attachment(model: nn.Module, what: str) -> None:
    """Raise :class:`UpdateError` if an attachment of ``model`` (or of a module inside or around it)
    has updates pending since its last ``optimizer.step()``: a step opened now (``what``) would read
    them and write into them, and they would commit later on their own."""
    if not context.attachments:
        return
    index = index_of(model)
    for att in context.attachments:
        pending = att.journal.pending_names() if att.journal is not None else []
        if pending and (att.model is model or _nesting(model, index, att) is not None):
            raise UpdateError(
                f"{what} for {type(model).__name__}: {att.label} has updates of it pending since its last "
                f"optimizer.step() ({listed(pending)}). Commit them with attachment.flush() (no "
                "optimizer step) or drop them with attachment.discard() first, or drive this model with one "
                "of pu.step and pu.attach."
            )


def hookable(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` whose step hooks an attachment registers on.

    A wrapper that holds a torch optimizer as ``.optimizer`` without step hook registries of its
    own is unwrapped: accelerate's ``AcceleratedOptimizer`` (never calls ``Optimizer.__init__``)
    and Lightning's ``LightningOptimizer`` (shares the wrapped optimizer's registries). An
    optimizer with registries of its own (a subclass, or one that steps an inner optimizer from
    its own ``step``, like Lookahead) is kept: its own ``step`` is the update. Anything else, with
    no step hooks to register (DeepSpeed's ZeRO optimizers), is refused with :class:`UpdateError`.
    """
    seen = optimizer
    while True:
        inner = getattr(seen, "optimizer", None)
        own = vars(seen).get("_optimizer_step_pre_hooks") if hasattr(seen, "__dict__") else None
        if (
            isinstance(inner, torch.optim.Optimizer)
            and inner is not seen
            and (own is None or own is getattr(inner, "_optimizer_step_pre_hooks", None))
        ):
            seen = inner
            continue
        break
    if not (
        callable(getattr(seen, "register_step_pre_hook", None))
        and isinstance(vars(seen).get("_optimizer_step_pre_hooks") if hasattr(seen, "__dict__") else None, dict)
    ):
        name = type(optimizer).__name__
        raise UpdateError(
            f"pu.attach: the optimizer {name} ({type(optimizer).__module__}) has no step hooks to commit in: it "
            "is not a torch.optim.Optimizer, and holds none as .optimizer. (DeepSpeed's ZeRO optimizers are "
            "of this kind.) Attach to the torch optimizer it steps, or commit explicitly around your own "
            "step call: with pu.step(model, optimizer): ... (the commit calls optimizer.step())."
        )
    return seen


def _run_by_explicit_commit(optimizer: Any) -> bool:
    """A ``pu.step`` / ``Stepper`` commit is running ``optimizer.step()``: that commit owns the step
    (its rules and updates), and an attachment on the optimizer stands aside; committing there too
    would apply the declared rules a second time."""
    return any(c.optimizer is optimizer for c in context.local.committing)


def attach(model: nn.Module, optimizer: torch.optim.Optimizer, **options: Unpack[StepOptionsDict]) -> Attachment:
    """Commit ``model``'s updates inside ``optimizer.step()`` via its step pre/post hooks.

    The commit order is the same as :func:`step` (phase order, rule 4): the pre-hook
    applies ``before_grad``; the optimizer applies the gradients; the
    post-hook applies ``after_grad``, ``auxiliary`` and ``after_step``.
    Returns an :class:`Attachment` (``.schedule()``, ``.flush()``,
    ``.discard()``, ``.state_dict()``, ``.detach()``). ``**options``: see
    :class:`Stepper`; under attach the commit's all-reduce (``sync=``) runs in
    the pre-hook of ``optimizer.step()`` (or in ``flush()``), so every rank
    must call those together.
    """
    return Attachment(model, optimizer, **options)
