"""``pu.attach``: commit a model's updates inside ``optimizer.step()``, so an unchanged loop works.

A step opens at the first update after an ``optimizer.step()`` (``routing.journal_of`` opens the
attachment's journal) and commits inside the next one: the optimizer's step pre-hook validates and
applies ``before_grad``, the optimizer applies the gradients, the post-hook applies the later
phases (phase order, rule 4). ``attach`` also wraps ``optimizer.step`` on the instance so that
every way out of it ends the step.
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

from . import routing
from .commit import Commit
from .errors import UpdateError, listed
from .journal import Journal
from .options import StepOptionsDict, make_options
from .origin import call_site
from .owner import Owner, check_arguments
from .targets import ModelIndex, index_of


class Attachment(Owner):
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
        check_arguments(model, optimizer, "pu.attach")
        optimizer = hookable(optimizer)
        super().__init__(model, optimizer, make_options(dict(options), "pu.attach"), weak=True)
        self.origin = call_site(2)
        self.label = f"pu.attach({type(model).__name__}) at {self.origin}"
        self.journal: Journal | None = None  # the step being recorded (or committed)
        self.commit: Commit | None = None  # its commit, between the pre- and post-hook
        for other in routing.attachments():
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
        routing.add_attachment(self)

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

    # routing (``routing.journal_of`` decides; the attachment opens its journal) ---------------------
    def open_journal(self) -> Journal:
        """The journal of the step being recorded, opened now if none is."""
        if self.journal is None:
            self.journal = Journal(self.index, self.optimizer, self.label, self._reuse())
        return self.journal

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
        if routing.committing_optimizer(optimizer) or self._model_ref.gone:
            return None
        if self.commit is not None and not self._hooks_running and self._inside_own_step():
            # A nested step: an optimizer subclass calling super().step(), whose
            # class is hooked too. Only the outermost call commits.
            self._nested += 1
            return None
        self._recover()  # the previous optimizer.step() raised, called around the wrapper
        self.open_journal()
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
        if routing.committing_optimizer(optimizer) or self._model_ref.gone:
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
        routing.remove_attachment(self)

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
