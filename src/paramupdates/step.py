"""One training step as a transaction: ``pu.step``, ``pu.Stepper``, ``pu.attach``.

A step records the updates issued during it (``journal.Journal``) and commits
them through one driver (``commit.Commit``) in the fixed phase order
(``phases.py``):

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

import datetime
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import routing, state
from .attach import hookable, refuse_pending_attachment
from .errors import UpdateError
from .journal import Journal
from .options import StepOptions
from .origin import Label, call_site, capture
from .owner import Owner, check_arguments

_local, _process = state.local, state.process


class Stepper(Owner):
    """A training step as a transaction over ``model`` (and ``optimizer``).

    ``with stepper: ...`` (or ``stepper.run(fn, *args)``) opens a step. Inside it an update
    (``pu.assign``, a batch norm's statistics) is recorded, not written: a later read in the step
    sees every update issued before it, and none issued after (read-your-writes, in program order);
    the storage is not touched, so what autograd saved stays valid. When the block exits cleanly the
    commit applies everything in a fixed order: ``before_grad`` (weight decay, then updates issued
    with ``phase="before_grad"``), ``optimizer.step()``, ``after_grad`` (constraints, then
    ``phase="after_grad"`` updates), the auxiliary updates (``phase=None`` on tensors the optimizer
    does not update: statistics), ``after_step`` (EMA); within a phase, in declaration and issue
    order. Every check runs before the first write. On an exception the step is discarded, and every
    parameter and buffer is what it was.

    Args:
        model: the module whose parameters and buffers may be targets.
        optimizer: stepped by the commit; ``None`` for steps without a gradient update.
        closure: passed to ``optimizer.step(closure)`` (LBFGS and friends); the commit's checks and
            ``before_grad`` run right after its first call, when the gradients exist. Updates it
            issues join the step.
        on_nonfinite: ``None`` (default: no check, no host sync), ``"raise"`` or ``"skip"`` (the
            whole step) when a pending value or a gradient is NaN or infinite.
        copy_for_rollback: copy what the commit writes first, so that an exception inside
            ``optimizer.step()`` restores everything bitwise (one copy per step).
        scaler: a ``torch.amp.GradScaler``: the commit calls ``scaler.step(optimizer)`` and
            ``scaler.update()``; a step whose scaled gradients overflow is dropped whole.
        process_group: the group ``sync=`` updates are all-reduced over (``None``: the default).
        sync_timeout: seconds to wait for the other ranks at that all-reduce.

    Each option in full: :class:`~paramupdates.options.StepOptions`.

    After each step, ``applied`` (a 0-dim bool tensor: whether it was applied, on the device where
    ``on_nonfinite="skip"`` decided there) and ``skipped_count`` (a 0-dim int64 tensor) tell what
    happened without a wait; ``steps`` and ``skipped_steps`` are the same as Python ints.

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
        on_nonfinite: str | None = None,
        copy_for_rollback: bool = False,
        scaler: Any = None,
        process_group: Any = None,
        sync_timeout: float | datetime.timedelta | None = None,
    ) -> None:
        check_arguments(model, optimizer, "pu.Stepper")
        options = StepOptions(
            on_nonfinite=on_nonfinite,
            copy_for_rollback=copy_for_rollback,
            process_group=process_group,
            sync_timeout=sync_timeout,
            scaler=scaler,
        )
        super().__init__(model, optimizer, options)
        self.closure = closure
        if closure is not None and self.options.scaler is not None:
            raise TypeError(
                f"pu.Stepper at {call_site(2)}: closure= and scaler= do not go together "
                "(torch.amp.GradScaler.step does not support closures)."
            )
        self._journal: Journal | None = None

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
        site = capture(3)  # (the caller of __enter__; formatted only if shown)
        if _local.explicit:
            other = _local.explicit[-1]
            raise UpdateError(
                f"pu.step at {site} for {type(self.model).__name__}: a step is already in progress "
                f"({other.label}, for {type(other.index.model).__name__}); pu.step blocks do not nest. "
                "Finish the outer step first, or open one step on a module that contains both models."
            )
        label = Label("pu.step", site)
        if _process.attachments:
            refuse_pending_attachment(self.model, label)
        ref = self._optimizer_ref  # (Owner.optimizer, inlined: once per step)
        optimizer = None if ref is None else ref()
        j = Journal(self.index, optimizer, label, self._reuse_entries)
        self._journal = j
        routing.enter(j)
        if optimizer is not None:
            j.guarded = self._guarded()
        return j

    def _guarded(self) -> Any:
        """:func:`_guard_optimizer` of this stepper's optimizer, looked for once per model and optimizer:
        later steps only check (one dict look-up) that the guard is still among its pre-hooks."""
        g = self._caches.guard
        if g is not None:
            opt = g[0]()  # (held weakly: the caches are the value of a weak dict keyed by the optimizer)
            if opt is not None and opt._optimizer_step_pre_hooks is g[1] and g[1].get(g[2]) is _refuse_foreign_step:
                return opt
        self._caches.guard = g = _guard_optimizer(self.optimizer)
        return None if g is None else g[0]()

    def _close(self, j: Journal) -> None:
        routing.leave(j)
        self._journal = None

    def _discard(self, j: Journal) -> None:
        self._close(j)
        j.discard()
        self._closed += 1

    def _finish(self, j: Journal, closure: Any) -> None:
        # the journal stays routable while the commit runs: a closure's forward records into it
        c = self._commit(j, j.optimizer)  # (the step's optimizer: the stepper's, held by the journal)
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


def _guard_optimizer(optimizer: Any) -> tuple[weakref.ref, dict, Any] | None:
    """``(a weak reference to the optimizer whose step pre-hooks run (hookable), its pre-hooks, the key of``
    :func:`_refuse_foreign_step` ``among them)``, kept in ``owner.Caches.guard``, the value of a weak dict
    keyed by the optimizer (a strong reference there would keep it alive as long as its model): the guard goes first (before an attachment's pre-hook),
    installed at the optimizer's first ``pu.step`` and kept while the optimizer lives (it does nothing
    outside a ``pu.step`` block). ``None``: no step hooks to guard with."""
    try:
        opt = hookable(optimizer)
    except UpdateError:
        return None
    hooks_ = opt._optimizer_step_pre_hooks
    key = next((k for k, h in hooks_.items() if h is _refuse_foreign_step), None)
    if key is None:
        key = opt.register_step_pre_hook(_refuse_foreign_step).id
        hooks_.move_to_end(key, last=False)
    return weakref.ref(opt), hooks_, key


def _runs_its_optimizer(j: Any) -> bool:
    """Whether the commit of ``j`` is running ``optimizer.step()`` in this thread."""
    for c in _local.committing:
        if c.journal is j:
            return True
    return False


def _refuse_foreign_step(o: Any, args: Any, kwargs: Any) -> None:
    """While a ``pu.step`` block records for ``o`` (in any thread), an ``o.step()`` that its commit does
    not make (the user's, or ``GradScaler.step``'s, or another thread's) raises :class:`UpdateError`
    before the optimizer writes: the commit owns that step."""
    for j in _process.steps:  # (every thread's pu.step blocks)
        if getattr(j, "guarded", None) is not o or _runs_its_optimizer(j):
            continue  # another optimizer's step, or the commit's own call
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


def step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    closure: Callable[[], Any] | None = None,
    on_nonfinite: str | None = None,
    copy_for_rollback: bool = False,
    scaler: Any = None,
    process_group: Any = None,
    sync_timeout: float | datetime.timedelta | None = None,
) -> StepBlock:
    """One training step as a transaction (context manager yielding a :class:`Stepper`).

    ``with pu.step(model, opt) as s: loss.backward()`` records every update issued in the block
    (later reads in the block see them; nothing is written) and, on a clean exit, commits them in
    the fixed phase order: ``before_grad`` (weight decay), ``optimizer.step()``, ``after_grad``
    (constraints), the auxiliary updates (statistics), ``after_step`` (EMA). An exception discards
    the step, leaving every parameter and buffer as it was. ``s.schedule()`` afterwards is the
    committed plan.

    The arguments are :class:`Stepper`'s (each option in full: :class:`~paramupdates.options.StepOptions`).

    Args:
        model, optimizer: the module whose tensors may be targets; the optimizer the commit steps.
        closure: for ``optimizer.step(closure)`` (LBFGS).
        on_nonfinite: ``None`` (no check, no host sync), ``"raise"`` or ``"skip"`` the whole step when
            a pending value or a gradient is NaN or infinite.
        copy_for_rollback: copy first, so that an exception inside ``optimizer.step()`` restores
            everything bitwise.
        scaler: a ``torch.amp.GradScaler``; a step whose scaled gradients overflow is dropped whole.
        process_group, sync_timeout: where and how long ``sync=`` updates are all-reduced.

    The commit makes the optimizer's step: do not call ``optimizer.step()`` in the block (it raises
    before writing); with a ``torch.amp.GradScaler`` pass ``scaler=scaler`` instead of calling
    ``scaler.step`` / ``scaler.update``. The returned object is one step: enter it once (or make a
    :class:`Stepper` once and enter it each step).
    """
    check_arguments(model, optimizer, "pu.step")
    stepper = Stepper(
        model,
        optimizer,
        closure=closure,
        on_nonfinite=on_nonfinite,
        copy_for_rollback=copy_for_rollback,
        scaler=scaler,
        process_group=process_group,
        sync_timeout=sync_timeout,
    )
    return stepper.step()
