"""``assign`` / ``assign_add`` / ``assign_sub`` / ``assign_key`` and ``read``.

Inside a step (``pu.step``, ``pu.Stepper``, or a model under ``pu.attach``)
an update is validated at its call site and recorded; reads issued after it
see it (read-your-writes); nothing is written
until commit (deferred commit, rule 2), which applies it in its phase (phase order, rule 4):

* ``phase=None``: the ``auxiliary`` phase, after the gradient update. On a
  trainable target (one the optimizer also updates) that is ambiguous and
  raises :class:`~paramupdates.AmbiguousOrderError` (ambiguity is an error, rule 5);
* ``phase="before_grad"`` / ``"after_grad"``: before / after ``optimizer.step()``;
* ``phase="after_step"``: with EMA, after everything else.

Outside a step an update applies at once, in place, under ``torch.no_grad()``
(eager outside a step, rule 8). Inside ``pu.when(False)`` nothing is recorded; inside
``pu.when(tensor)`` the update becomes ``new = where(pred, new, old)`` (conditions, rule 6).
``sync="mean"``/``"sum"`` all-reduces the pending value across the process
group at commit (distributed sync, rule 9; outside a step, at once, over the default group).
All return ``None``: read the target to see the new value.

An update commits what it computes from its operands as they are when it is issued: a tensor
operand, key or ``pu.when`` flag written later (a reused scratch tensor, a view of a parameter the
optimizer steps) changes nothing (rule 12). Issued under ``torch.no_grad()``, an update of a
trainable target leaves it trainable (the gradient of later reads passes straight through);
issued under ``torch.inference_mode()``, it leaves a normal tensor pending.
"""

from __future__ import annotations

from typing import Any

import torch

from . import hooks, lookup, overlay, routing, state
from .errors import UpdateError, listed
from .journal import Journal
from .lookup import Lookup
from .ops import apply_inplace, check_operand
from .origin import Origin, capture
from .targets import describe, owner_anywhere, reparametrizing, slot_name

_local = state.local  # this thread's steps and conditions (one attribute look-up less per update)


def issue(
    op: str,
    target: torch.Tensor,
    operand: Any,
    key: Any,
    phase: str | None,
    sync: str | None,
    fresh: bool = False,
    depth: int = 3,
) -> None:
    """Issue one update (what every public update function calls).

    ``fresh``: ``operand`` was made for this update and nobody else holds it (``pu.nn``'s
    statistics): it becomes the pending value without a defensive copy. ``depth``: frames
    between the user's call and this function.
    """
    cond = _local.conditions[-1]
    if cond is False:
        _dropped()
        return
    if torch.compiler.is_compiling():  # the lookup strategy, eager or traced, once for the whole call
        how: Lookup = lookup.TRACED
        origin = how.origin(depth)
    else:
        how, origin = lookup.EAGER, capture(depth, False)
    if not isinstance(target, torch.Tensor):
        raise UpdateError(
            f"pu.{op} at {origin}: the target is a {type(target).__name__}, not a tensor. "
            "Pass a pu.Parameter or a parameter or buffer of your model."
        )
    j, e = routing.journal_of(target, origin, op, how)
    if e is not None:  # (a parameter or buffer of a model with a step open)
        j.record(e, op, operand, key, phase, sync, origin, fresh, how)  # type: ignore[union-attr]
        return
    if hooks.target_resolvers:  # (asked about tensors no step owns: a model's own tensors never are)
        for resolve in hooks.target_resolvers.values():
            stored = resolve(target, op, operand, key, origin)
            if stored is not None:
                # transformed parameters (rule 10): an update of a computed tensor becomes updates of what it is computed from
                for original, value in stored:
                    issue("assign", original, value, None, phase, sync, depth=depth + 1)
                return
    if j is None:
        _refuse_unowned(target, origin, op)
    _apply_eagerly(op, target, operand, key, sync, cond if isinstance(cond, torch.Tensor) else None, origin)


def _dropped() -> None:
    """An update dropped by ``pu.when(False)``: inside a ``torch.utils.checkpoint`` segment's forward,
    the segment is still found, so that its recomputation runs under the same condition and drops it
    too (replay, rule 3); else nothing."""
    if _local.eager_log is None and _local.replay is None and hooks.segment_possible():
        hooks.adopt_segment()


def _apply_eagerly(
    op: str, target: torch.Tensor, operand: Any, key: Any, sync: str | None, pred: Any, origin: Any
) -> None:
    """Outside a step: eager, in place, under no_grad (rule 8), ``pred`` the ``pu.when`` condition
    (``None``: unconditional); issued again by a checkpoint recomputation: only its view moves (rule 3)."""
    if _local.replay is not None:
        # Issued again by a checkpoint recomputation: the forward already applied it (replay, rule 3);
        # only the recomputation's own view moves.
        _local.replay.eager_write(op, target, operand, key, pred)
        return
    # Outside a step: eager, in place, under no_grad (eager outside a step, rule 8).
    if not isinstance(target, torch.nn.Parameter) and target.grad_fn is not None and target._base is None:
        _refuse_computed(target, op, origin)  # (a Parameter is a leaf: no attribute read through its subclass)
    try:
        check_operand(op, target, operand, key, describe(target), origin)
    except UpdateError:
        # Name the target in the error if some model paramupdates has indexed owns it
        # (looked up only on this error path: an eager update stays cheap).
        owner = owner_anywhere(target)
        if owner is None:
            raise
        check_operand(op, target, operand, key, owner[0], origin)
        raise
    log = (
        _local.eager_log
        if _local.eager_log is not None
        else (hooks.adopt_segment() if hooks.segment_possible() else None)
    )
    if log is not None:
        log.note(target)  # inside a checkpointed segment: keep the value at segment entry (replay, rule 3)
    if sync is not None:  # reduced across ranks before the write (distributed sync, rule 9)
        owner = owner_anywhere(target)
        name = owner[0] if owner is not None else describe(target)
        hooks.sync_backend(f"pu.{op} on {name!r} at {origin}").apply_eager(
            op, target, operand, key, pred, sync, name, str(origin)
        )
        return
    apply_inplace(op, target, operand, key, pred)


def _refuse_computed(t: torch.Tensor, op: str, origin: Any) -> None:
    """An eager update of a computed tensor that no resolver maps back (not a view: a view of a stored
    tensor, ``p[0]``, writes into it): written in place it would change a temporary and be lost."""
    raise UpdateError(
        f"pu.{op} on {describe(t)} at {origin}: the target is a computed tensor (it has a grad_fn, "
        f"{type(t.grad_fn).__name__}, and is not a view of a stored tensor), so writing into it would change no "
        "parameter or buffer and the update would be lost. Nothing was written. Update the stored tensor it is "
        "computed from: for a parametrized weight (torch.nn.utils.parametrize) registered before paramupdates was "
        "imported, module.parametrizations.<name>.original (original0, original1, ...), or first let "
        "paramupdates index its model (pu.Stepper(model), pu.attach, pu.convert), after which an update of "
        "module.<name> goes through right_inverse."
    )


def issue_computed(
    updates: list[tuple[torch.Tensor, str, Any, torch.Tensor]],
    sync: str | None = None,
    depth: int = 3,
    origin: Origin | str | None = None,
    module: Any = None,
) -> None:
    """Issue auxiliary updates whose new values the caller computed (``pu.nn``'s statistics).

    ``updates``: ``(target, op, operand, new value)``, the new value computed from the value the
    caller read (the pending one, read-your-writes); ``op`` and ``operand`` are what the schedule
    shows and what the commit folds if the target has other updates in the step. The call site,
    the condition and the journal are looked up once for all of them (``origin``: the call site,
    when the caller knows it: the user's call of a ``pu.nn`` module, naming what it updates,
    ``Origin.by``). ``module``: the module whose forward issues them (named in the error when a
    step of another model is in progress). The values are trusted: made by the caller for these
    updates alone, of the targets' shape, dtype and device.
    """
    if _local.conditions[-1] is False or not updates:
        if updates:
            _dropped()
        return
    how = lookup.TRACED if torch.compiler.is_compiling() else lookup.EAGER  # (lookup.choose, inlined)
    if origin is None:
        origin = how.origin(depth)
    if sync is None:
        j = routing.journal_for(updates[0][0], how)
        if j is not None and j.record_batch(updates, origin, how):
            return  # the fast path: nothing else pending for these targets
    j, e = routing.journal_of(updates[0][0], origin, updates[0][1], how)
    if j is None:
        _refuse_unowned(updates[0][0], origin, updates[0][1], (updates, module))
    if j is None or e is None:  # outside a step: the eager path, with its checks
        for target, _op, _operand, new in updates:
            issue("assign", target, new, None, None, sync, True, depth + 1)
        return
    items = [(e, updates[0][1], updates[0][2], updates[0][3])]
    for target, op, operand, new in updates[1:]:
        other = j.find(target, True, how)  # the same module's: the same journal
        if other is None:
            issue("assign", target, new, None, None, sync, True, depth + 1)
        else:
            items.append((other, op, operand, new))
    j.record_computed(items, sync, origin, how)


def _refuse_unowned(t: torch.Tensor, origin: Any, op: str, computed: Computed | None = None) -> None:
    """No journal owns ``t`` (``routing.journal_of``): the error when this thread has a step in
    progress, which cannot own it (``computed``: the updates of a module's forward that ``t`` is the
    first of, and the module); else nothing (the update applies eagerly)."""
    steps = routing.explicit()
    if steps:
        if computed is not None and not reparametrizing():  # (torch.func: _refuse_foreign says what to do)
            _refuse_foreign_module(steps[-1], computed, origin)
        _refuse_foreign(steps[-1], t, origin, op)


Computed = tuple[list[tuple[torch.Tensor, str, Any, torch.Tensor]], Any]
"""``(updates, module)``: what ``issue_computed`` was given (``module``: the module whose forward
issued them, or None)."""

_FIXES = (
    "open the step on a module that holds both models (pu.step(nn.ModuleList([model, other]), optimizer), "
    "where other is the {theirs}: its updates then commit with this step, as plain PyTorch writes them in place), "
    "or attach the {theirs} with its own optimizer (pu.attach(other, other_optimizer): its updates are then held "
    "for its own next optimizer step)"
)


def _refuse_foreign_module(j: Journal, computed: Computed, origin: Any) -> None:
    """A module's forward (``pu.nn``'s batch norm) issued updates of its own tensors inside a step whose
    model does not hold it (a GAN's generator step through the discriminator): say which, in the
    user's terms, where the module was called, and the fixes that work."""
    updates, module = computed
    targets = [u[0] for u in updates]
    other = owner_anywhere(targets[0])
    if other is not None:
        model_name = other[1]
        names = [o[0] if (o := owner_anywhere(t)) is not None else describe(t) for t in targets]
        whose = f"of {model_name}"
    else:  # a module no model paramupdates has seen holds: its class and attributes
        model_name = type(module).__name__ if module is not None else "the model"
        attrs = {id(v): k for k, v in module._buffers.items()} if module is not None else {}
        names = [attrs.get(id(t), describe(t)) for t in targets]
        whose = f"of a {model_name} that belongs to no model paramupdates has seen"
    by = getattr(origin, "by", None) or "its running state"
    mine = type(j.index.model).__name__
    raise UpdateError(
        f"the update of {listed([repr(n) for n in names], 4)} {whose} ({by}) by the call of the module at "
        f"{origin}: the step in progress ({j.label}, for {mine}) does not hold them, so this update would have "
        f"no commit. Either {_FIXES.format(theirs=model_name)}, or run the {model_name} in eval mode "
        "for this pass (other.eval(), then other.train()), so that it updates nothing."
    )


def _refuse_foreign(j: Journal, t: torch.Tensor, origin: Any, op: str) -> None:
    """A step of this thread is in progress and its model does not own ``t``: the update would have
    no commit. Say why, and what to do."""
    mine = type(j.index.model).__name__
    if reparametrizing():
        name = slot_name(j.index.model, t) or describe(t)
        raise UpdateError(
            f"pu.{op} on {name!r} at {origin}, inside torch.func.functional_call in {j.label} (for {mine}): "
            "the tensor it updates was passed to functional_call, so it is not a parameter or buffer the "
            "step owns, and its update would have no commit. Use pu.func.functional_call(model, "
            "params_and_buffers, args), which returns the updates as values ({name: new value}), then "
            "pu.func.commit(model, updates) to commit them with this step; or pass only parameters (the "
            "model's buffers then take the updates); or call torch.func.functional_call outside the step."
        )
    other = owner_anywhere(t)
    if other is not None:
        name, model = other
        raise UpdateError(
            f"pu.{op} on {name!r} of {model} at {origin}: the step in progress ({j.label}, for {mine}) does not "
            f"hold it, so this update would have no commit. Either {_FIXES.format(theirs=model)}, or issue the "
            "update outside the step."
        )
    computed = (
        " It is a computed tensor (it has a grad_fn), e.g. the output of a parametrization "
        "(torch.nn.utils.parametrize) or of an op: update the stored tensor it is computed from."
        if t.grad_fn is not None
        else ""
    )
    raise UpdateError(
        f"pu.{op} on {describe(t)} at {origin}: the target is not a parameter or buffer of the model "
        f"of the step in progress ({mine}). Register it on that model "
        f"(as a pu.Parameter, an nn.Parameter or a buffer), or issue the update outside the step.{computed}"
    )


def assign(target: torch.Tensor, value: Any, *, phase: str | None = None, sync: str | None = None) -> None:
    """``target <- value``: recorded inside a step, written at its commit; at once outside a step.

    Inside a step (``pu.step``, ``pu.Stepper``, or a model under ``pu.attach``) the update is
    checked now (shape, dtype kind, device: an error names ``target`` and this call) and recorded:
    every read of ``target`` after it in the step sees the new value, and nothing is written until
    the commit, which applies it in its phase:

    * ``phase=None``: the auxiliary phase, after the optimizer's update (statistics, counters). On a
      tensor the optimizer also updates, the order would be a race:
      :class:`~paramupdates.AmbiguousOrderError`, asking for one of the two below;
    * ``"before_grad"`` / ``"after_grad"``: before / after ``optimizer.step()``;
    * ``"after_step"``: last, with the EMA.

    Updates of one target in one phase compose in issue order. Outside a step it applies at once, in
    place, under ``torch.no_grad()``. Inside ``pu.when(pred)`` it is conditional (``False``: not
    recorded; a bool tensor: ``where(pred, new, old)``). ``sync="mean"`` / ``"sum"``: all-reduced
    across ranks at commit, so every rank commits the same value. Returns ``None``: read the target
    to see the new value.
    """
    issue("assign", target, value, None, phase, sync)


def assign_fresh(target: torch.Tensor, value: torch.Tensor, *, sync: str | None = None) -> None:
    """``assign`` of a tensor the caller made for this update and never touches again (``pu.nn``'s
    statistics): inside a step it becomes the pending value without a defensive copy."""
    issue("assign", target, value, None, None, sync, True)


def assign_add(target: torch.Tensor, delta: Any, *, phase: str | None = None, sync: str | None = None) -> None:
    """``target <- target + delta``, recorded and committed as :func:`assign` is; several in one phase
    compose in issue order."""
    issue("assign_add", target, delta, None, phase, sync)


def assign_sub(target: torch.Tensor, delta: Any, *, phase: str | None = None, sync: str | None = None) -> None:
    """``target <- target - delta``, recorded and committed as :func:`assign` is; several in one phase
    compose in issue order."""
    issue("assign_sub", target, delta, None, phase, sync)


def assign_key(
    target: torch.Tensor, key: Any, value: Any, *, phase: str | None = None, sync: str | None = None
) -> None:
    """``target[key] <- value``, recorded and committed as :func:`assign` is (out of place until the
    commit: ``new = old.clone(); new[key] = value``)."""
    issue("assign_key", target, value, key, phase, sync)


def read(target: torch.Tensor) -> torch.Tensor:
    """The value of ``target`` as the step in progress sees it.

    Returns the pending value if an update to ``target`` was issued in the
    step in progress, else ``target`` itself. Needed only for plain
    ``torch.nn.Parameter`` targets read through an old reference: a
    ``pu.Parameter`` reads its pending value by itself, a buffer through its
    module attribute.
    """
    found = routing.read(target, lookup.choose())
    if found is None:
        return target
    j, e = found
    v = j.current_of(e)
    return target if v is e.target else overlay.plain(v)
