"""``pu.attach``: commit a model's updates inside ``optimizer.step()``, so an unchanged loop works.

A step opens at the first update after an ``optimizer.step()`` (``routing.journal_of`` opens the
attachment's journal) and commits inside the next one: the optimizer's step pre-hook validates and
applies ``before_grad``, the optimizer applies the gradients, the post-hook applies the later
phases (phase order, rule 4). ``attach`` also wraps ``optimizer.step`` on the instance so that
every way out of it ends the step.
"""

from __future__ import annotations

import atexit
import datetime
import enum
import functools
import gc
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import accounting, routing, state
from .commit import Commit, optimizer_rows
from .errors import AccountingWarning, UpdateError, listed
from .journal import Journal, sharding_of
from .options import StepOptions
from .origin import call_site
from .owner import Owner, check_arguments
from .schedule import Schedule
from .targets import ModelIndex, index_of


def see_scalers() -> None:
    """Let every attachment see the ``torch.amp.GradScaler`` that steps its optimizer, ``scaler=`` given
    or not (rule 12). ``scaler.step(optimizer)`` skips ``optimizer.step()`` when the scaled gradients
    overflow: an attachment that does not see it would carry the skipped batch's pending updates into the
    next step (and, with ``on_nonfinite="skip"``, skip that good step too). So ``GradScaler.step`` is
    wrapped once, on the class, at the first ``pu.attach``: its first call with an attached optimizer
    whose attachment has no scaler hands the scaler to that attachment (:meth:`Attachment.take_scaler`),
    which from then on, this call included, drops a step the scaler skips, exactly as ``scaler=scaler``
    does. Every other call passes straight through (one look at the live attachments). Subclasses
    (``torch.cuda.amp.GradScaler``, FSDP's ``ShardedGradScaler``) inherit the wrapper."""
    cls = torch.amp.GradScaler
    if getattr(cls.step, "_pu_sees", False):
        return
    orig = cls.step

    @functools.wraps(orig)
    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        for att in routing.attachments():
            if att._scaler is None and att._stage is not DETACHED and att._steps(optimizer):
                att.take_scaler(scaler)
                return att._scaler_step(functools.partial(orig, scaler), optimizer, *args, **kwargs)
        return orig(scaler, optimizer, *args, **kwargs)

    step._pu_sees = True  # type: ignore[attr-defined]
    cls.step = step  # type: ignore[method-assign,assignment]


class Stage(enum.Enum):
    """Where an :class:`Attachment` is between two optimizer steps (see its docstring for the transitions)."""

    IDLE = "idle"  # attached, no step open: ``journal`` and ``commit`` are None
    RECORDING = "recording"  # a step is open: ``journal`` records its updates, ``commit`` is None
    HOOK = "hook"  # our step pre- or post-hook is beginning or finishing ``commit`` (of ``journal``)
    COMMITTING = "committing"  # between the hooks: the optimizer applies the gradients of ``commit``
    DETACHED = "detached"  # the hooks are removed: ``journal`` and ``commit`` are None for good


IDLE, RECORDING, HOOK, COMMITTING, DETACHED = Stage


class Attachment(Owner):
    """Commit a model's updates inside ``optimizer.step()``, so an unchanged training loop works.

    Made by :func:`attach`. A step opens at the first update after an ``optimizer.step()`` (or at
    the first one ever) and commits inside the next ``optimizer.step()``. Until then the updates
    are recorded, not written: reads see them in program order, and they are in no
    ``state_dict()``. The commit applies them in the fixed phase order of :func:`~paramupdates.step`:
    the optimizer's step pre-hook checks everything and applies ``before_grad`` (weight decay);
    the optimizer applies the gradients; the post-hook applies ``after_grad`` (constraints), the
    auxiliary updates (statistics) and ``after_step`` (EMA). Called with a closure
    (``optimizer.step(closure)``: LBFGS, Lightning), the checks and ``before_grad`` run right
    after the closure's first call, when the gradients exist.

    With no optimizer step to come (the last batch of training, evaluation, a recomputation of
    statistics), call :meth:`flush` to commit the pending updates without a gradient update, or
    :meth:`discard` to drop them. Updates still pending when the process exits are never
    committed: warned (:class:`~paramupdates.AccountingWarning`). (An attachment with pending updates
    holds its optimizer: it goes only with its model, which takes the updates along; warned then if a
    ``state_dict()``, pickling or a deep copy saved the model without them.)
    :meth:`detach` removes the hooks (and drops pending updates). ``applied`` and ``skipped_count`` tell,
    as tensors read without a wait, whether the last step was applied and how many were skipped
    (``steps`` / ``skipped_steps``: the same as Python ints).
    :meth:`Attachment.of` finds the attachment of a model again (a lost handle, a re-run cell).

    Updates issued inside ``optimizer.step()`` (an LBFGS closure's forward) join the step being
    committed and land in its later phases.

    If ``optimizer.step()`` itself raises (the optimizer, a rule, validation), the step is rolled
    back before the exception propagates: ``attach`` wraps ``optimizer.step`` on the instance for
    that (a bound method, so that an LR scheduler made before or after ``attach`` wraps it in turn;
    ``detach()`` unwraps it). An exception in your own code before ``optimizer.step()`` is
    invisible to the attachment: call :meth:`discard` in your ``except`` block to drop the updates
    recorded so far. (Should the class's ``step`` be called around the wrapper and raise, the next
    ``optimizer.step()``, :meth:`flush` or :meth:`state_dict` rolls it back, with a warning.)

    Its state is one :class:`Stage` (``_stage``); ``journal`` and ``commit`` are what the stage says is
    there. The transitions::

        IDLE --an update (routing opens the journal)--> RECORDING
        IDLE or RECORDING --optimizer.step()'s pre-hook--> HOOK --the hook returns--> COMMITTING
        COMMITTING --the post-hook--> HOOK --the commit is finished--> IDLE
        RECORDING --flush(), discard(), a step the scaler skips--> IDLE
        HOOK or COMMITTING --an exception, discard(), a recovery--> IDLE
        any --detach()--> DETACHED (final)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        on_nonfinite: str | None = None,
        copy_for_rollback: bool = False,
        scaler: Any = None,
        process_group: Any = None,
        sync_timeout: float | datetime.timedelta | None = None,
    ) -> None:
        check_arguments(model, optimizer, "pu.attach")
        optimizer = hookable(optimizer)
        options = StepOptions(
            on_nonfinite=on_nonfinite,
            copy_for_rollback=copy_for_rollback,
            process_group=process_group,
            sync_timeout=sync_timeout,
            scaler=scaler,
        )
        super().__init__(model, optimizer, options, weak=True)
        self.origin = call_site(2)
        self.label = f"pu.attach({type(model).__name__}) at {self.origin}"
        self._stage = IDLE
        self.journal: Journal | None = None  # the step being recorded (or committed)
        self.commit: Commit | None = None  # its commit, from the pre-hook to the end of the post-hook
        self._refuse_overlap(model, optimizer)
        self._structure = state.process.structure  # (the model's sharing was checked as of this)
        self._pre = optimizer.register_step_pre_hook(self._pre_hook)
        self._post = optimizer.register_step_post_hook(self._post_hook)
        self._calls = 0  # optimizer.step() calls running through the wrapper (nested ones counted)
        self._step_calls = 0  # (COMMITTING) ``_calls`` when the pre-hook began the commit
        self._nested = 0  # (COMMITTING) nested optimizer steps inside the committing one (super().step())
        self._idle_step = False  # an optimizer step with nothing to commit but its own update runs (_pre_hook)
        self._idle_schedule: Any = None  # the plan of such a step (made once, read by schedule())
        self._scaler_opt: Any = None  # the optimizer as given to the scaler's step, while it runs
        self._wrap_step(optimizer)
        # the GradScaler whose step this attachment sees: scaler=, or the first that steps the optimizer
        self._scaler = scaler
        self._scaler_fn = self._wrap_scaler(scaler) if scaler is not None else None
        if scaler is None:
            see_scalers()
        routing.add_attachment(self)

    @staticmethod
    def _forget(_ref: Any) -> None:
        """Model or optimizer collected: drop every attachment left without one, warning for each whose
        pending updates a ``state_dict()`` (or pickling, a deep copy) saved the model without: that copy
        lacks them for good (:func:`_warn_pending`). (Pending updates that nothing saved go with the model,
        unwarned: nothing that outlives it lacks them.)"""
        if routing is None:  # interpreter shutdown: module globals are cleared, nothing to keep tidy
            return
        gone = [a for a in routing.attachments() if a.model is None or a.optimizer is None]
        routing.prune_attachments()
        for att in gone:
            if att.journal is not None and att.journal.missed is not None:
                _warn_pending(att, "its model was collected")

    @classmethod
    def of(cls, model: nn.Module) -> Attachment | None:
        """The live attachment of ``model`` (made by ``pu.attach(model, ...)``), or ``None``.

        For a handle that was lost (a re-run notebook cell): ``pu.Attachment.of(model).detach()``,
        ``.flush()``, ``.schedule()``."""
        for att in routing.attachments():
            if att.model is model:
                return att
        return None

    def _refuse_overlap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """:class:`UpdateError` if ``model``, a module inside it or one around it is attached already (one
        attachment per model: an update of its tensors would belong to two optimizers' steps)."""
        others = _overlapping(model, self.index)
        if others:
            gc.collect()  # an optimizer dropped by a re-run cell may be held only by a reference cycle
            others = _overlapping(model, self.index)
        for other in others:
            if other.model is model:
                raise UpdateError(
                    f"pu.attach at {self.origin}: {type(model).__name__} is already attached to another "
                    f"{type(other.optimizer).__name__} ({other.label}). Detach that attachment first: "
                    "pu.Attachment.of(model).detach() (it drops its pending updates; .flush() before commits "
                    "them). (pu.attach with the same optimizer again returns or replaces the earlier "
                    "attachment. One attachment per model: for two optimizers over one model, attach each to "
                    "the submodule it steps, e.g. pu.attach(model.encoder, opt_enc) and "
                    "pu.attach(model.decoder, opt_dec), or give one optimizer param groups.)"
                )
            nested = _nesting(model, self.index, other)
            if nested is None:
                self._refuse_shared(other)  # (disjoint models that share a module)
                continue
            inner, outer, at = nested
            raise UpdateError(
                f"pu.attach at {self.origin}: the {type(inner).__name__} at {at!r} of the "
                f"{type(outer).__name__} would be attached twice (here, and by {other.label}): an update "
                "of its tensors (a batch norm's statistics, say) would belong to both optimizers' steps. "
                "Attach disjoint modules, one per optimizer (pu.attach(model.encoder, opt_enc) and "
                "pu.attach(model.decoder, opt_dec)), or detach() the other attachment first "
                "(pu.Attachment.of(module) finds it)."
            )

    def _refuse_shared(self, other: Attachment) -> None:
        """:class:`UpdateError` if this attachment's model and ``other``'s hold some of the same tensors: an
        update of a shared tensor (the shared encoder's batch-norm statistics) would be routed to one of the two
        attachments, and the other's optimizer steps would not commit it (accounted for, rule 12)."""
        names = shared_names(self.index, other.index)
        if not names:
            return
        mine, theirs = type(self.model).__name__, type(other.model).__name__
        raise UpdateError(
            f"{self.label}: {mine} and the {theirs} of {other.label} share {listed(list(map(repr, names)), 4)} "
            "(a module in both models). Under two attachments, an update of a shared tensor (its batch-norm "
            "statistics, say) would belong to one attachment only, and the other optimizer's steps would not "
            "commit it. Attach disjoint modules, one per optimizer (e.g. pu.attach(encoder, opt_encoder), "
            "pu.attach(head_a, opt_a), pu.attach(head_b, opt_b)); or drive these models with `with "
            "pu.step(model, optimizer):` blocks, whose updates belong to the step's model; or detach() the "
            "other attachment (pu.Attachment.of(model) finds it)."
        )

    def _refuse_shared_since_change(self) -> None:
        """At a commit, after a module of an attached model changed (torch's registration hooks): refuse if
        this attachment's model now shares tensors with another attachment's (see :meth:`_refuse_shared`)."""
        now = state.process.structure
        if self._structure == now or len(routing.attachments()) < 2:
            return
        self.index.refresh()
        for other in routing.attachments():
            if other.model is not None and other.index is not self.index:  # (one attachment per model)
                other.index.refresh()
                self._refuse_shared(other)
        self._structure = now

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
            if att is None or att._stage is DETACHED:
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
            self._idle_step = False  # (a step with nothing to commit: nothing was written but the optimizer's)
            if self._stage in (HOOK, COMMITTING) or (self._stage is RECORDING and self._calls == 1):
                self._abort(exc)
            raise
        finally:
            self._calls -= 1

    # scaler.step on the instance (scaler=) -----------------------------------
    def _wrap_scaler(self, scaler: Any) -> Callable[..., Any]:
        """Wrap ``scaler.step`` on the instance, as ``optimizer.step`` is, so that the attachment sees a
        step the scaler skips (it then never calls ``optimizer.step()``): :meth:`_scaler_step`."""
        call_orig = scaler.step  # (the class's, or a wrapper already on the instance)
        self._prev_scaler_step = scaler.__dict__.get("step")
        attachment = weakref.ref(self)

        @functools.wraps(type(scaler).step)
        def step(sc: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            att = attachment()
            if att is None or att._stage is DETACHED or not att._steps(optimizer):
                return call_orig(optimizer, *args, **kwargs)
            return att._scaler_step(call_orig, optimizer, *args, **kwargs)

        scaler.step = types.MethodType(step, scaler)
        return step

    def take_scaler(self, scaler: Any) -> None:
        """``scaler`` steps this attachment's optimizer, and ``scaler=`` was not given: from now on the
        attachment sees its steps as with ``scaler=scaler`` (:func:`see_scalers`)."""
        self._scaler = scaler
        self._scaler_fn = self._wrap_scaler(scaler)

    def _steps(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` (as given to ``scaler.step``) is this attachment's, outside a ``pu.step``
        commit of it (which drives the scaler itself)."""
        try:
            opt = hookable(optimizer)
        except UpdateError:
            return False
        return opt is self.optimizer and not routing.committing_optimizer(opt) and not self._model_ref.gone

    def _scaler_step(self, call_orig: Callable[..., Any], optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``scaler.step(optimizer)``: a commit inside it takes the scaler's verdict on the gradients (no
        second check); a step the scaler skips (overflow: ``optimizer.step()`` never called) is dropped
        whole, as under ``pu.step(scaler=)``: its pending updates are discarded, nothing is written,
        and it is counted in ``skipped_steps``."""
        closed = self._closed
        self._scaler_opt = optimizer
        try:
            out = call_orig(optimizer, *args, **kwargs)
        finally:
            self._scaler_opt = None
        if self._closed == closed:  # no commit ran: the scaler skipped optimizer.step()
            self._recover()
            c = self._commit(self.open_journal(), self.optimizer)
            self._idle()
            c.skip()
            self._committed(c)
        return out

    def _commit(self, journal: Journal, optimizer: torch.optim.Optimizer | None) -> Commit:
        c = super()._commit(journal, optimizer)
        # the scaler decides only for a commit inside its own step; elsewhere (a plain
        # optimizer.step(), flush()) the step is committed as without scaler=
        c.scaler, c.scaler_opt = (self._scaler, self._scaler_opt) if self._scaler_opt is not None else (None, None)
        return c

    # routing (``routing.journal_of`` decides; the attachment opens its journal) ---------------------
    def open_journal(self) -> Journal:
        """The journal of the step being recorded, opened now if none is (inside an optimizer step that
        had nothing to commit: that step's commit, made now, :meth:`_promote`)."""
        if self.journal is None:
            self.journal = Journal(self.index, self.optimizer, self.label, self._reuse())
            if self._idle_step:
                self._promote()
            elif self._stage is IDLE:
                self._stage = RECORDING
        return self.journal

    # the commit ----------------------------------------------------------------
    def _recover(self) -> None:
        """Roll back a commit whose optimizer step raised (no post-hook came)."""
        if self._stage is COMMITTING and not self._inside_own_step():
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
        self._idle()

    def _idle(self) -> None:
        """No step open any more (committed, skipped, dropped or rolled back): back to IDLE."""
        if self._stage is not DETACHED:
            self._stage = IDLE
        self.journal = None
        self.commit = None
        self._nested = 0
        self._idle_step = False

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if routing.committing_optimizer(optimizer) or self._model_ref.gone:
            return None
        if self._stage is not COMMITTING and accounting.initialising(optimizer):
            # torch.distributed.checkpoint making a fresh optimizer's state (zero gradients, zero learning
            # rate): no optimizer update, so no step: the pending updates wait for the next one, no rule runs
            return None
        if (self._stage is COMMITTING or self._idle_step) and self._inside_own_step():
            # A nested step: an optimizer subclass calling super().step(), whose
            # class is hooked too. Only the outermost call commits.
            self._nested += 1
            return None
        self._recover()  # the previous optimizer.step() raised, called around the wrapper
        if self.journal is None and self._nothing_to_commit(optimizer, args, kwargs):
            # the step's plan is the optimizer's update alone: no commit is made (an update issued
            # inside the optimizer's step makes it then: open_journal); the post-hook counts the step
            self._idle_step = True
            self._step_calls = self._calls
            accounting.applied(optimizer, [])  # (rule 12: this optimizer step's commit applies no rule)
            return None
        j = self.open_journal()
        try:
            self._refuse_shared_since_change()
        except UpdateError as exc:
            self._abort(exc)
            raise
        self._step_calls = self._calls
        return self._begin_commit(j, optimizer, args, kwargs)

    def _begin_commit(self, j: Journal, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """Make the commit of ``j`` and begin it (:meth:`_begin`), in the HOOK stage; on any exception the
        step is ended (:meth:`_abort`) before it propagates."""
        c = self.commit = self._commit(j, optimizer)
        self._stage = HOOK
        try:
            return self._begin(c, optimizer, args, kwargs)
        except BaseException as exc:
            self._abort(exc)
            raise
        finally:
            self._leave_hook()

    def _nothing_to_commit(self, optimizer: Any, args: Any, kwargs: Any) -> bool:
        """Whether this optimizer step has nothing to commit but the optimizer's own update, as the commit
        would find (guards of the plan, each a few compares): nothing pending (no journal), no rule declared
        in the process (none can apply: a rule declared later, or whose layer joins the model, is one), the
        default options (no verdict to take, nothing to copy), no closure, not inside ``scaler.step`` (the
        scaler's verdict is taken by a commit), a model last indexed not on the meta device (the commit
        refuses it) and not sharded (sharded ranks agree at every commit), and no sharing between attachments
        to check since the model's structure changed. The same step through the commit writes the same."""
        p, opts, index = state.process, self.options, self.index
        if p.rules or opts.on_nonfinite is not None or opts.copy_for_rollback or self._scaler_opt is not None:
            return False
        if len(args) > 1 or (kwargs and kwargs.get("closure") is not None) or index.has_meta:
            return False
        if self._structure != p.structure and len(routing.attachments()) > 1:
            return False
        return sharding_of(index) is None  # (what the commit asks: journal.sharding)

    def _promote(self) -> None:
        """An update is issued inside an optimizer step that had nothing to commit (an optimizer whose step
        runs the model): that step's commit is made now, as the pre-hook makes it, and the update joins it
        (its phases after the gradient update commit in the post-hook, as for a step with a commit)."""
        self._idle_step = False
        opt = self.optimizer
        self._begin_commit(self.journal, opt, (opt,), {})  # type: ignore[arg-type]

    def _count_idle(self) -> None:
        """Count an optimizer step that had nothing to commit as a committed step (its plan: the
        optimizer's update alone)."""
        self._closed += 1
        self._n_applied += 1
        self._last_ok = True
        if self._idle_schedule is None:
            name, label = type(self.optimizer).__name__, self.label  # (not self: no cycle through the plan)
            self._idle_schedule = Schedule.later(lambda: optimizer_rows(name, label))
        self._last = self._idle_schedule

    @staticmethod
    def _begin(c: Commit, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """The pre-hook's part of the commit: check and apply ``before_grad``, or (``optimizer.step(closure)``)
        wrap the closure, which does that after its first call."""
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
        return None

    def _leave_hook(self) -> None:
        """A hook returns or raises: back to COMMITTING, unless the step ended (IDLE) meanwhile."""
        if self._stage is HOOK:
            self._stage = COMMITTING

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if routing.committing_optimizer(optimizer) or self._model_ref.gone:
            return
        if self._nested:
            self._nested -= 1
            return
        if self._idle_step:
            self._idle_step = False
            self._count_idle()
            return
        c = self.commit
        if self._stage is not COMMITTING or c is None:
            return
        self._stage = HOOK
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
            self._leave_hook()
        self._committed(c)
        self._idle()

    # user controls ----------------------------------------------------------
    def flush(self) -> None:
        """Commit the pending updates now, without a gradient update (all phases but ``grad``)."""
        self._recover()
        j = self.journal
        if j is None:
            return
        try:
            self._refuse_shared_since_change()
        except UpdateError as exc:
            self._abort(exc)
            raise
        if self._stage is RECORDING:
            self._idle()
        else:  # (inside optimizer.step(), an LBFGS closure: as before, the commit under way is left as it is)
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
        self._stage = DETACHED
        opt = self.optimizer
        opt_dict = opt.__dict__ if opt is not None else {}
        now = opt_dict.get("step")
        if isinstance(now, types.MethodType) and now.__func__ is self._guard_fn:
            prev, bound = self._prev_step
            if prev is None:
                del opt_dict["step"]
            else:
                opt_dict["step"] = types.MethodType(prev, opt) if bound else prev
        self._unwrap_scaler()
        routing.remove_attachment(self)

    def _unwrap_scaler(self) -> None:
        """Put back what ``scaler.step`` was, if this attachment's wrapper is still the one on the
        instance (else the wrapper stays there, and passes every call through)."""
        scaler = self._scaler
        if self._scaler_fn is None or scaler is None:
            return
        now = scaler.__dict__.get("step")
        if isinstance(now, types.MethodType) and now.__func__ is self._scaler_fn:
            if self._prev_scaler_step is None:
                del scaler.__dict__["step"]
            else:
                scaler.__dict__["step"] = self._prev_scaler_step

    def state_dict(self) -> dict[str, Any]:
        self._recover()
        return super().state_dict()

    def _take_over(self, earlier: Attachment, journal: Journal | None) -> None:
        """Continue where ``earlier`` (of the same model and optimizer, detached) stopped: its pending
        updates (``journal``, committed by this attachment's next optimizer step) and its counters."""
        for name in ("_n_applied", "_n_skipped", "_n_on_device", "_skipped_on_device", "_last_ok", "_closed", "_last"):
            setattr(self, name, getattr(earlier, name))
        if journal is not None:
            journal.label = self.label
            self.journal = journal
            self._stage = RECORDING

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


def refuse_pending_attachment(model: nn.Module, what: Any) -> None:
    """Raise :class:`UpdateError` if an attachment of ``model`` (or of a module inside or around it)
    has updates pending since its last ``optimizer.step()``: a step opened now (``what``) would read
    them and write into them, and they would commit later on their own."""
    if not routing.attachments():
        return
    index = index_of(model)
    for att in routing.attachments():
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


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    on_nonfinite: str | None = None,
    copy_for_rollback: bool = False,
    scaler: Any = None,
    process_group: Any = None,
    sync_timeout: float | datetime.timedelta | None = None,
) -> Attachment:
    """Commit ``model``'s updates inside ``optimizer.step()`` via its step pre/post hooks, so an
    unchanged training loop works. Returns the :class:`Attachment` (``.schedule()``, ``.flush()``,
    ``.discard()``, ``.state_dict()``, ``.detach()``).

    Updates issued after an ``optimizer.step()`` are recorded (later reads see them; nothing is
    written) and committed inside the next one, in the fixed phase order of
    :func:`~paramupdates.step`: the pre-hook applies ``before_grad`` (weight decay), the optimizer
    the gradients, the post-hook ``after_grad`` (constraints), the auxiliary updates (statistics)
    and ``after_step`` (EMA). Updates issued after the last ``optimizer.step()`` (a final train-mode
    forward) wait for a step that never comes: call ``flush()`` (commit them, no gradient update)
    or ``discard()``.

    Called again for the same model and optimizer (a re-run notebook cell), it returns the
    attachment made earlier when the options are the same; with other options the earlier one is
    replaced, with a warning naming where it was made, and its pending updates and counters carry
    over to the new one. Another optimizer for an attached model is refused
    (:class:`~paramupdates.UpdateError`); :meth:`Attachment.of` finds the earlier attachment.

    The options are :class:`~paramupdates.Stepper`'s (``scaler=``: the loop keeps calling
    ``scaler.step(optimizer)`` and ``scaler.update()``; a step the scaler skips is dropped whole).
    The commit's all-reduce (``sync=``) runs in the pre-hook of ``optimizer.step()`` (or in
    ``flush()``), so every rank must call those together.
    """
    check_arguments(model, optimizer, "pu.attach")
    options = {
        "on_nonfinite": on_nonfinite,
        "copy_for_rollback": copy_for_rollback,
        "scaler": scaler,
        "process_group": process_group,
        "sync_timeout": sync_timeout,
    }
    earlier = Attachment.of(model)
    if earlier is None or earlier.optimizer is not hookable(optimizer):
        return Attachment(model, optimizer, **options)
    if earlier.options == StepOptions(**options):
        return earlier  # the same call again: nothing changes
    earlier._recover()
    journal, earlier.journal = earlier.journal, None  # carried over, not dropped
    earlier.detach()
    att = Attachment(model, optimizer, **options)
    att._take_over(earlier, journal)
    warnings.warn(
        f"pu.attach at {att.origin}: {type(model).__name__} was attached to this {type(att.optimizer).__name__} "
        f"already ({earlier.label}) with other options; that attachment is detached and this one takes its place "
        "(its pending updates and counters carry over). Call .detach() on the earlier attachment "
        "(pu.Attachment.of(model)) first to silence this warning.",
        UserWarning,
        stacklevel=2,
    )
    return att


def _overlapping(model: nn.Module, index: ModelIndex) -> list[Attachment]:
    """The live attachments of ``model``, of a module inside it, of one around it, or of a model that
    holds some of the same tensors (one encoder shared by two task models)."""
    return [
        other
        for other in routing.attachments()
        if other.model is model or _nesting(model, index, other) is not None or shared_names(index, other.index)
    ]


def shared_names(a: ModelIndex, b: ModelIndex) -> list[str]:
    """The qualified names in ``a``'s model of the tensors ``b``'s model holds too (both as last indexed)."""
    out = []
    for info in a.by_id.values():
        t = info.ref()
        if t is not None and b.peek(t) is not None:
            out.append(info.name)
    return out


def _warn_pending(att: Attachment, why: str) -> None:
    """:class:`AccountingWarning`: ``att`` has updates pending that no step will commit (``why``)."""
    j = att.journal
    names = j.pending_names() if j is not None and j.state == "open" else []
    if not names:
        return
    saved = (
        f": {j.missed} saved the model's stored values without them, and no optimizer.step() came after to commit them"
        if j is not None and j.missed is not None
        else ""
    )
    warnings.warn(
        f"{att.label}: updates of {listed(list(map(repr, names)), 5)} were issued after the last "
        f"optimizer.step() and are still pending when {why}: they were never committed, and are in no "
        f"state_dict{saved} (a train-mode forward after the last optimizer.step(), say). Call attachment.flush() "
        "after the last forward to commit them without an optimizer step (attachment.discard() drops them, "
        "as does a forward in model.eval()); pu.Attachment.of(model) finds the attachment.",
        AccountingWarning,
        stacklevel=2,
    )


@atexit.register
def _warn_pending_at_exit() -> None:
    """At interpreter exit: warn for every attachment whose updates are still pending."""
    for att in list(routing.attachments()):
        _warn_pending(att, "the process exits")
