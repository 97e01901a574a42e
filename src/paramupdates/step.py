"""One training step as a transaction: ``pu.step``, ``pu.Stepper``, ``pu.attach``.

Commit order (rule 4 of DESIGN.md), fixed:

1. ``before_grad``: declared rules (weight decay), then updates issued with
   ``phase="before_grad"``, in declaration / issue order;
2. ``grad``: ``optimizer.step()``, if there is an optimizer;
3. ``after_grad``: constraints, then updates issued with ``phase="after_grad"``;
4. ``auxiliary``: updates with ``phase=None`` on non-trainable targets;
5. ``after_step``: EMA and other rules that read the final values.

Updates to one target within a phase compose in issue order. A step commits
on a clean exit and discards everything on an exception; after any error,
every parameter and buffer is bitwise what it was before the step (rule 7).
"""

from __future__ import annotations

import datetime
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from . import _state
from ._origin import call_site
from ._snapshot import SnapshotPool
from .errors import UpdateError
from .integrations.distributed import check_group
from .rules._fast import RuleCache
from .rules.base import rules_for
from .schedule import AFTER_GRAD, AFTER_STEP, AUXILIARY, BEFORE_GRAD, Schedule
from .targets import ModelIndex, index_of
from .transaction import Entry, Transaction

_NONFINITE = ("raise", "skip")


def _check_nonfinite(on_nonfinite: str) -> None:
    if on_nonfinite not in _NONFINITE:
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', not {on_nonfinite!r}")


_CACHES: weakref.WeakKeyDictionary[ModelIndex, list[Any]] = weakref.WeakKeyDictionary()


def _commit_caches(index: ModelIndex, optimizer: torch.optim.Optimizer | None) -> tuple[SnapshotPool, RuleCache]:
    """The snapshot pool and rule cache of ``(model, optimizer)``, shared by every ``pu.step``,
    ``Stepper`` and attachment on them (commits on one model run one at a time; a commit nested in
    another's optimizer step takes fresh copies, see ``_snapshot``). They live as long as both do."""
    per = _CACHES.get(index)
    if per is None:
        per = _CACHES[index] = [None, weakref.WeakKeyDictionary()]
    if optimizer is None:
        if per[0] is None:
            per[0] = (SnapshotPool(), RuleCache())
        return per[0]
    caches = per[1].get(optimizer)
    if caches is None:
        caches = per[1][optimizer] = (SnapshotPool(), RuleCache())
    return caches


class _Owner:
    """What Stepper and Attachment share: the model, counters, schedule, state."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        on_nonfinite: str,
        check_finite: bool,
        atomic: bool,
        process_group: Any = None,
        sync_timeout: float | datetime.timedelta | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
        _check_nonfinite(on_nonfinite)
        self.process_group = process_group
        self.sync_timeout = check_group(process_group, sync_timeout)
        # Steps closed so far (committed, skipped, discarded or rolled back); a
        # commit's sync sends it so that ranks check they commit the same step
        # (rule 9). Read and written only outside the forward (commit, discard):
        # a value read in a compiled forward would be guarded on, and recompile.
        self._closed = 0
        self.model = model
        self.optimizer = optimizer
        self.on_nonfinite = on_nonfinite
        self.check_finite = check_finite
        self.atomic = atomic
        self.index = index_of(model)
        self.steps = 0
        self.skipped_steps = 0
        self._last = Schedule()
        # rollback copies kept between commits (CPU), and what the last full check of the rules saw:
        # per model and optimizer, so that a fresh pu.step(model, opt) per iteration reuses them
        self._pool, self._rule_cache = _commit_caches(self.index, optimizer)

    def _new_tx(self, label: str) -> Transaction:
        return Transaction(
            self.index,
            self.optimizer,
            check_finite=self.check_finite,
            on_nonfinite=self.on_nonfinite,
            atomic=self.atomic,
            label=label,
            process_group=self.process_group,
            sync_timeout=self.sync_timeout,
            pool=self._pool,
            rule_cache=self._rule_cache,
        )

    def schedule(self) -> Schedule:
        """The plan of the last committed step (phase, target, op, condition, origin)."""
        return self._last

    def _open_tx(self) -> Transaction | None:
        raise NotImplementedError

    def pending_schedule(self) -> Schedule:
        """The plan so far of the step in progress (empty if none is open)."""
        tx = self._open_tx()
        if tx is None:
            return Schedule()
        tx.collect_rules()
        return tx.schedule()

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

    def _commit_all(self, tx: Transaction, closure: Any = None) -> Any:
        """prepare -> before_grad -> grad -> after_grad -> auxiliary -> after_step."""
        out = None
        tx.seq = self._closed
        self._closed += 1
        try:
            if not tx.prepare():
                self.skipped_steps += 1
                self._last = tx.schedule()
                return None
            plan = tx.schedule()
            tx.save_rules()
            tx.run_phase(BEFORE_GRAD)
            out = tx.run_grad(closure)
            for phase in (AFTER_GRAD, AUXILIARY, AFTER_STEP):
                tx.run_phase(phase)
        except BaseException:
            tx.rollback()
            raise
        tx.finish()
        self.steps += 1
        self._last = plan
        return out


class Stepper(_Owner):
    """A training step as a transaction over ``model`` (and ``optimizer``).

    ``with stepper: ...`` (or ``stepper.run(fn, *args)``) opens a step; updates
    issued inside are recorded, reads see them in program order (rule 1), and
    nothing is written (rule 2) until the block exits cleanly, when the commit
    applies the phases in the fixed order of rule 4 (``optimizer.step()`` is
    called by the commit, between ``before_grad`` and ``after_grad``). On an
    exception the step is discarded, and every tensor is bitwise as before.

    Args:
        model: the module whose parameters and buffers may be targets.
        optimizer: stepped at commit; ``None`` for steps without a gradient update.
        on_nonfinite: ``"raise"`` (an :class:`UpdateError`) or ``"skip"`` (drop
            the whole step, optimizer included, and count it in ``skipped_steps``).
        check_finite: check pending values for NaN/inf at commit (one batched
            reduction and one host sync per step).
        atomic: snapshot what the commit writes, so that an exception raised
            by the optimizer or a rule restores everything (costs one copy of
            the written tensors during the commit).
        closure: passed to ``optimizer.step(closure)`` (LBFGS and friends).
        process_group: the ``torch.distributed`` group that ``sync="mean"``/``"sum"``
            updates reduce over at commit (rule 9); ``None``: the default group.
            Every rank of the group must commit its steps together.
        sync_timeout: seconds (or a ``timedelta``) to wait for the other ranks at
            the commit's all-reduce before raising :class:`UpdateError`; ``None``:
            the group's own timeout (``init_process_group(timeout=...)``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        on_nonfinite: str = "raise",
        check_finite: bool = True,
        atomic: bool = True,
        closure: Callable[[], Any] | None = None,
        process_group: Any = None,
        sync_timeout: float | datetime.timedelta | None = None,
    ) -> None:
        super().__init__(model, optimizer, on_nonfinite, check_finite, atomic, process_group, sync_timeout)
        self.closure = closure
        self._tx: Transaction | None = None
        self.result: Any = None

    @property
    def skipped(self) -> bool:
        """Whether the last step was dropped for a non-finite value."""
        return self._last_skipped

    _last_skipped = False

    @contextmanager
    def step(self, closure: Callable[[], Any] | None = None) -> Iterator[Stepper]:
        """Context manager: one step; commits on a clean exit, discards on an exception."""
        self._open()
        tx = self._tx
        assert tx is not None
        try:
            yield self
        except BaseException:
            self._close(tx)
            tx.discard()
            self._closed += 1
            raise
        self._close(tx)
        self._finish(tx, closure if closure is not None else self.closure)

    def _open(self) -> None:
        site = call_site(4)
        if _state.explicit:
            other = _state.explicit[-1]
            raise UpdateError(
                f"pu.step at {site} for {type(self.model).__name__}: a step is already in progress "
                f"({other.label}, for {type(other.index.model).__name__}); pu.step blocks do not nest. "
                "Finish the outer step first, or open one step on a module that contains both models."
            )
        tx = self._new_tx(f"pu.step at {site}")
        self._tx = tx
        _state.explicit.append(tx)

    def _close(self, tx: Transaction) -> None:
        if _state.explicit and _state.explicit[-1] is tx:
            _state.explicit.pop()
        self._tx = None

    def _finish(self, tx: Transaction, closure: Any) -> None:
        before = self.skipped_steps
        self.result = self._commit_all(tx, closure)
        self._last_skipped = self.skipped_steps != before

    def __enter__(self) -> Stepper:
        self._open()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        tx = self._tx
        assert tx is not None
        self._close(tx)
        if exc_type is not None:
            tx.discard()
            self._closed += 1
            return
        self._finish(tx, self.closure)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` inside one step and commit; returns ``fn``'s result."""
        with self.step():
            out = fn(*args, **kwargs)
        return out

    def _open_tx(self) -> Transaction | None:
        return self._tx


def step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    on_nonfinite: str = "raise",
    check_finite: bool = True,
    atomic: bool = True,
    closure: Callable[[], Any] | None = None,
    process_group: Any = None,
    sync_timeout: float | datetime.timedelta | None = None,
) -> Any:
    """One training step as a transaction (context manager yielding a :class:`Stepper`).

    ``with pu.step(model, opt) as s: loss.backward()`` records every update
    issued in the block and, on a clean exit, commits them in the fixed phase
    order (``before_grad``, ``optimizer.step()``, ``after_grad``,
    ``auxiliary``, ``after_step``). An exception discards the step.
    ``s.schedule()`` afterwards is the committed plan. ``process_group`` and
    ``sync_timeout``: see :class:`Stepper` (rule 9).
    """
    return Stepper(
        model,
        optimizer,
        on_nonfinite=on_nonfinite,
        check_finite=check_finite,
        atomic=atomic,
        closure=closure,
        process_group=process_group,
        sync_timeout=sync_timeout,
    ).step()


class Attachment(_Owner):
    """Commit inside ``optimizer.step()``, so an unchanged training loop works.

    A step opens at the first update after an ``optimizer.step()`` (or at the
    first one ever) and commits inside the next ``optimizer.step()``: the
    step pre-hook validates everything and applies ``before_grad``; the
    optimizer updates the gradients; the post-hook applies ``after_grad``,
    ``auxiliary`` and ``after_step``.

    With no optimizer step to come (evaluation, statistics recomputation),
    call :meth:`flush` to commit the pending updates without a gradient
    update, or :meth:`discard` to drop them. :meth:`detach` removes the hooks.

    Updates issued inside ``optimizer.step()`` (an LBFGS closure's forward)
    join the step being committed and land in its later phases.

    If ``optimizer.step()`` itself raises (the optimizer, a rule, validation),
    the step is rolled back before the exception propagates: ``attach`` wraps
    ``optimizer.step`` on the instance for that (``detach()`` unwraps it). An
    exception in your own code before ``optimizer.step()`` is invisible to the
    attachment: call :meth:`discard` in your ``except`` block to drop the
    updates recorded so far. (Should the class's ``step`` be called around
    the wrapper and raise, the next ``optimizer.step()``, :meth:`flush` or
    :meth:`state_dict` rolls it back, with a warning.)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        on_nonfinite: str = "raise",
        check_finite: bool = True,
        atomic: bool = True,
        process_group: Any = None,
        sync_timeout: float | datetime.timedelta | None = None,
    ) -> None:
        super().__init__(model, optimizer, on_nonfinite, check_finite, atomic, process_group, sync_timeout)
        self.tx: Transaction | None = None
        self._in_step = False
        self._skip_grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self._plan = Schedule()
        for other in _state.attachments:
            if other.model is model:
                raise UpdateError(
                    f"pu.attach: {type(model).__name__} is already attached; detach() the first attachment."
                )
        self._pre = optimizer.register_step_pre_hook(self._pre_hook)
        self._post = optimizer.register_step_post_hook(self._post_hook)
        # optimizer.step is wrapped on the instance (as lr schedulers once did) so
        # that an exception raised inside it rolls the commit back at once.
        self._calls = 0
        self._nested = 0
        self._orig_step = optimizer.step
        self._prev_step_attr = optimizer.__dict__.get("step")  # an instance wrapper already there
        guarded = self._guarded_step

        @functools.wraps(type(optimizer).step)
        def step(*args: Any, **kwargs: Any) -> Any:
            return guarded(*args, **kwargs)

        # keep the marks of an instance wrapper already there (an LR scheduler's
        # _wrapped_by_lr_sched), so that the scheduler does not warn
        step.__dict__.update(getattr(self._orig_step, "__dict__", {}))
        self._guard = step
        optimizer.step = self._guard  # type: ignore[method-assign]
        _state.attachments.append(self)

    def _guarded_step(self, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step``: on an exception the step is rolled back before it propagates."""
        self._calls += 1
        try:
            return self._orig_step(*args, **kwargs)
        except BaseException:
            if self._in_step:
                self._abort()
            raise
        finally:
            self._calls -= 1

    # routing -------------------------------------------------------------
    def route(self, t: torch.Tensor) -> tuple[Transaction | None, Entry | None]:
        # Under dynamo the shortcut would guard on id(t) of a pending value and
        # recompile per micro-batch; traced code resolves by identity instead.
        if not torch.compiler.is_compiling() and self._owned_elsewhere(t):
            return None, None
        # Between the pre- and post-hook (inside optimizer.step(), e.g. an LBFGS
        # closure) updates join the committing step and land in its later phases.
        if self.tx is not None:
            e = self.tx.find(t)
            return (self.tx, e) if e is not None else (None, None)
        if self.index.lookup(t) is None:
            return None, None
        self.tx = self._new_tx(f"pu.attach({type(self.model).__name__})")
        return self.tx, self.tx.find(t)

    def _owned_elsewhere(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is known (without rebuilding any index) to belong to another model only.

        A miss in this model's index rebuilds it (a module may have been
        added), which walks the whole module tree: with two attached models
        (a GAN's generator and discriminator), every update of the second
        would rebuild the first's index. A tensor that this index does not
        know but another live step's or attachment's index does is theirs.
        """
        if self.index.peek(t) is not None:
            return False
        if self.tx is not None and self.tx.find(t, create=False) is not None:
            return False
        for tx in _state.explicit:
            if tx.index.peek(t) is not None:
                return True
        return any(other is not self and other.index.peek(t) is not None for other in _state.attachments)

    def _recover(self) -> None:
        """Roll back a commit whose optimizer step raised (no post-hook came)."""
        if self._in_step and not self._hooks_running and not self._inside_own_step():
            warnings.warn(
                "pu.attach: the last optimizer.step() raised; its step was rolled back.", stacklevel=3
            )
            self._abort()

    _hooks_running = False
    _step_calls = 0

    def _inside_own_step(self) -> bool:
        """Whether the optimizer.step() call that opened the commit is still running."""
        return self._calls > 0 and self._calls == self._step_calls

    def _abort(self) -> None:
        tx = self.tx
        if tx is not None:
            if tx.state == "committing":
                tx.rollback()
            else:
                tx.discard()
            if tx.seq is None:  # closed before its commit began (which counts it)
                self._closed += 1
        self._restore_grads()
        self.tx = None
        self._in_step = False
        self._nested = 0

    # hooks ----------------------------------------------------------------
    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if _run_by_explicit_commit(optimizer):
            return
        if self._in_step and not self._hooks_running and self._inside_own_step():
            # A nested step: an optimizer subclass calling super().step(), whose
            # class is hooked too. Only the outermost call commits.
            self._nested += 1
            return
        self._recover()  # the previous optimizer.step() raised, called around the wrapper
        if self.tx is None:
            self.tx = self._new_tx(f"pu.attach({type(self.model).__name__})")
        tx = self.tx
        self._in_step = True
        self._step_calls = self._calls
        self._hooks_running = True
        tx.seq = self._closed
        self._closed += 1
        try:
            if not tx.prepare():
                self.skipped_steps += 1
                self._plan = tx.schedule()
                self._hide_grads()
                return
            self._plan = tx.schedule()
            tx.save_rules()
            tx.run_phase(BEFORE_GRAD)
            closure = kwargs.get("closure") if kwargs else (args[0] if args else None)
            tx.protect_optimizer(all_params=closure is not None)
            tx.mark_optimizer_written()
            tx.reinstall_overlay()  # reads in an LBFGS closure see the pending values (rule 1)
        except BaseException:
            self._abort()
            raise
        finally:
            self._hooks_running = False

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if _run_by_explicit_commit(optimizer):
            return
        if self._nested:
            self._nested -= 1
            return
        tx = self.tx
        if tx is None:
            return
        self._hooks_running = True
        try:
            if tx.skipped:
                self._restore_grads()
                self._last = self._plan
            else:
                tx.done_phases.add("grad")
                tx.stage_done(True)  # the optimizer's step, a fallible stage, is behind us
                tx.remove_overlay()
                for phase in (AFTER_GRAD, AUXILIARY, AFTER_STEP):
                    tx.run_phase(phase)
                tx.finish()
                self.steps += 1
                tx.collect_rules()
                self._last = tx.schedule()
        except BaseException:
            self._abort()
            raise
        finally:
            self._hooks_running = False
        self.tx = None
        self._in_step = False

    def _hide_grads(self) -> None:
        """Skipping under attach: the optimizer runs, but sees no gradients."""
        saved = []
        for g in self.optimizer.param_groups:  # type: ignore[union-attr]
            for p in g["params"]:
                saved.append((p, p.grad))
                p.grad = None
        self._skip_grads = saved

    def _restore_grads(self) -> None:
        if self._skip_grads is not None:
            for p, grad in self._skip_grads:
                p.grad = grad
            self._skip_grads = None

    # user controls ----------------------------------------------------------
    def flush(self) -> None:
        """Commit the pending updates now, without a gradient update (all phases but ``grad``)."""
        self._recover()
        tx = self.tx
        if tx is None:
            return
        self.tx = None
        saved_opt = tx.optimizer
        tx.optimizer = None
        try:
            self._commit_all(tx)
        finally:
            tx.optimizer = saved_opt

    def discard(self) -> None:
        """Drop the pending updates (or roll back a commit whose optimizer step raised)."""
        self._abort()

    def detach(self) -> None:
        """Remove the optimizer hooks; pending updates are discarded."""
        self._abort()
        self._pre.remove()
        self._post.remove()
        opt_dict = self.optimizer.__dict__  # type: ignore[union-attr]
        if opt_dict.get("step") is self._guard:
            if self._prev_step_attr is None:
                del opt_dict["step"]
            else:
                opt_dict["step"] = self._prev_step_attr
        if self in _state.attachments:
            _state.attachments.remove(self)

    def state_dict(self) -> dict[str, Any]:
        self._recover()
        return super().state_dict()

    def _open_tx(self) -> Transaction | None:
        return self.tx


def _run_by_explicit_commit(optimizer: Any) -> bool:
    """A ``pu.step`` / ``Stepper`` commit is running ``optimizer.step()``: that commit owns the step
    (its rules and updates), and an attachment on the optimizer stands aside; committing there too
    would apply the declared rules a second time."""
    return any(tx.optimizer is optimizer for tx in _state.committing)


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    on_nonfinite: str = "raise",
    check_finite: bool = True,
    atomic: bool = True,
    process_group: Any = None,
    sync_timeout: float | datetime.timedelta | None = None,
) -> Attachment:
    """Commit ``model``'s updates inside ``optimizer.step()`` via its step pre/post hooks.

    The commit order is the same as :func:`step` (rule 4): the pre-hook
    applies ``before_grad``; the optimizer applies the gradients; the
    post-hook applies ``after_grad``, ``auxiliary`` and ``after_step``.
    Returns an :class:`Attachment` (``.schedule()``, ``.flush()``,
    ``.discard()``, ``.state_dict()``, ``.detach()``). ``process_group`` and
    ``sync_timeout``: see :class:`Stepper` (rule 9); under attach the commit's
    all-reduce runs in the pre-hook of ``optimizer.step()`` (or in ``flush()``),
    so every rank must call those together.
    """
    return Attachment(
        model,
        optimizer,
        on_nonfinite=on_nonfinite,
        check_finite=check_finite,
        atomic=atomic,
        process_group=process_group,
        sync_timeout=sync_timeout,
    )
