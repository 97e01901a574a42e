"""Declared rules that no step applies: a warning at the optimizer step that leaves them out (rule 12).

A declared rule (``pu.weight_decay``, ``pu.constrain``, ``pu.ema``, a ``pu.Rule``) runs inside a
commit: a ``pu.step(model, optimizer)`` block, or ``optimizer.step()`` of an optimizer attached with
``pu.attach(model, optimizer)``. An ``optimizer.step()`` that updates tensors a rule covers, with no such
commit around it, leaves the rule out: the user forgot ``pu.attach``, or stepped the optimizer outside a
``pu.step(model)`` opened without it. The user believes the rule runs; it does not.

torch has a global hook for exactly this (``torch.optim.optimizer.register_optimizer_step_post_hook``):
:func:`watch` registers it when the first rule is declared, so that a program that declares no rule pays
nothing. The hook compares what the commit of this optimizer step ran (:func:`applied`, told by the
commit) with the rules that cover a tensor the optimizer stepped (one with a gradient), and warns once
per rule with :class:`~paramupdates.AccountingWarning`, naming the rule, its declaration site, the
tensors, the ``optimizer.step()`` call and the fix. An optimizer stepped inside the step of the one a commit
runs, in the same thread (the base optimizer of a Lookahead, ``ZeroRedundancyOptimizer``'s local one: a
wrapper's step steps the optimizer it holds), is part of that step, whatever attribute holds it.

The one ``optimizer.step()`` that is no optimizer update: ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict`` / ``get_optimizer_state_dict`` on a fresh optimizer make its state by stepping it once
with zero gradients and a zero learning rate (``_init_optim_state``), which changes no parameter. No rule
is to run there, so none is left out: :func:`initialising` recognises that step (the call on the stack,
every learning rate zero), and neither this check nor an attachment's commit takes it for a step.

A compiled optimizer step (``torch.compile(optimizer.step)``) is not checked: the hooks do nothing while
dynamo traces (what a commit notes in a traced frame is not replayed as this check needs). Its eager
steps, the first ones before compiling included, are.
"""

from __future__ import annotations

import operator
import sys
import warnings
import weakref
from types import FrameType
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import state
from .errors import AccountingWarning, UpdateError, listed
from .origin import call_site, user_stacklevel


def watch() -> None:
    """Register the global optimizer step post-hook (once; called when a rule is declared)."""
    p = state.process
    if p.optimizer_watch is None:
        p.optimizer_watch = (
            register_optimizer_step_pre_hook(_before_step),
            register_optimizer_step_post_hook(_after_step),
        )


def applied(optimizer: Any, rules: list[Any]) -> None:
    """The commit that runs ``optimizer``'s next step in this thread applies ``rules`` (and is the one to
    answer for the rules that cover its tensors)."""
    if state.process.optimizer_watch is not None and not torch.compiler.is_compiling():
        state.local.applied = (weakref.ref(optimizer), rules)  # (no rule declared yet: nothing to answer for)


def _unwrapped(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimizers it wraps (``.optimizer``: accelerate's, Lightning's)."""
    out = [optimizer]
    inner = getattr(optimizer, "optimizer", None)
    while inner is not None and inner not in out and len(out) < 8:
        out.append(inner)
        inner = getattr(inner, "optimizer", None)
    return out


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: note the steps in progress in this thread, nested ones included (an
    optimizer subclass calling ``super().step()`` runs the hooks twice; a wrapper steps the optimizer it
    wraps inside its own step), so that the commit's rules are forgotten after the outermost one and a step
    nested in the one a commit runs is part of it. (Not while dynamo traces: a compiled ``optimizer.step``
    is not checked, see the module docstring.)"""
    if not torch.compiler.is_compiling():
        state.local.stepping.append(weakref.ref(optimizer))


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: warn about every rule that covers a tensor this step updated and
    that no commit applied (once per rule)."""
    if torch.compiler.is_compiling():
        return
    p, local = state.process, state.local
    done, stepping = local.applied, local.stepping
    if stepping:
        stepping.pop()  # (this step's own entry: the innermost)
    if not stepping:
        local.applied = None
    if not p.rules:
        return
    ran: Any = ()
    if done is not None:
        opt = done[0]()
        if opt is optimizer or optimizer in _unwrapped(opt) or _within(opt, stepping):
            ran = done[1]
    left_out = []
    for rule, tensors in _covering(optimizer):
        if rule in ran or rule in p.warned or rule.removed:
            continue
        stepped = [t for t in tensors if t.grad is not None]
        if stepped:
            left_out.append((rule, stepped))
    if left_out and initialising(optimizer):
        return  # (a state made for a checkpoint to load into: no optimizer update, no rule to run)
    for rule, stepped in left_out:
        p.warned.add(rule)
        _warn(rule, stepped, optimizer, done is not None)


_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def initialising(optimizer: Any) -> bool:
    """Whether this ``optimizer.step()`` is the one ``torch.distributed.checkpoint.state_dict`` makes to
    create a fresh optimizer's state (``_init_optim_state``, called by ``get_state_dict`` and
    ``get_optimizer_state_dict`` to have a state for ``dcp.load`` to load into): every gradient a zero
    tensor it made, every learning rate zero, so no parameter changes. Recognised by that function on the
    stack, stepping this optimizer (or one that wraps it), with every group's learning rate zero: a step of
    the training loop is never made inside it. Cheap where it cannot be: the module not imported, or a
    learning rate that is not zero (a host-side number), answer before any frame is read; a tensor learning
    rate is read only once that function is found on the stack (its read is a host sync, which a training
    step's commit never makes: rule 7)."""
    mod = sys.modules.get(_DCP_STATE_DICT)
    code = getattr(getattr(mod, "_init_optim_state", None), "__code__", None)
    if code is None or torch.compiler.is_compiling():
        return False
    tensors = []  # (a tensor learning rate is read only inside that function: a read is a host sync)
    for group in optimizer.param_groups:
        lr = group.get("lr", 0.0)
        if isinstance(lr, torch.Tensor):
            if lr.device.type != "cpu" or lr.numel() != 1:
                return False
            tensors.append(lr)
        elif lr != 0:
            return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            optim = frame.f_locals.get("optim")
            mine = optim is not None and (optimizer in _unwrapped(optim) or optim in _unwrapped(optimizer))
            return mine and all(lr.item() == 0 for lr in tensors)
        frame = frame.f_back
    return False


def _within(optimizer: Any, stepping: list[Any]) -> bool:
    """Whether ``optimizer``'s step is in progress in this thread around the step that just ended: that
    step is part of it (a wrapper, a Lookahead or ``ZeroRedundancyOptimizer``, steps the optimizer it holds
    inside its own step), whatever attribute holds the inner one."""
    return optimizer is not None and any(ref() is optimizer for ref in stepping)


_params_of = operator.itemgetter("params")


def _covering(optimizer: Any) -> list[tuple[Any, list[torch.Tensor]]]:
    """The declared rules that cover tensors of ``optimizer``'s param groups, with those tensors (kept per
    optimizer until a rule, the structure of a model or the groups change)."""
    p = state.process
    groups = optimizer.param_groups
    key = (p.rules_version, p.structure, len(groups), sum(map(len, map(_params_of, groups))))
    hit = p.covering.get(optimizer)
    if hit is not None and hit[0] == key:
        return hit[1]
    ids = {id(t) for g in groups for t in g["params"]}
    out = []
    for rule in p.rules:
        if not rule.per_optimizer_update or not rule.alive():
            continue  # (a rule whose module was collected applies to nothing: it is dropped)
        try:
            rule.resync()  # (followed by name: what its module holds now)
        except UpdateError:
            continue  # (it cannot follow its tensors: its model's next commit raises, naming it)
        tensors = [t for t in rule.owner_tensors() if id(t) in ids]
        if tensors:
            out.append((rule, tensors))
    p.covering[optimizer] = (key, out)
    return out


def _warn(rule: Any, stepped: list[torch.Tensor], optimizer: Any, other_commit: bool) -> None:
    name = type(optimizer).__name__
    shown = listed(list(map(repr, rule.names_of({id(t) for t in stepped}))), 3)
    why = (
        "the step in progress is another model's, which does not hold them"
        if other_commit
        else "no pu.step(model, optimizer) block or pu.attach(model, optimizer) applied it"
    )
    warnings.warn(
        f"{rule.describe()} declared at {rule.origin} did not run: {name}.step() at {call_site(2)} updated "
        f"{shown}, which it covers, but {why}. Declared rules run in the commit of a step of the model "
        "that holds their tensors: call pu.attach(model, optimizer) once before training (an unchanged loop "
        "then commits inside optimizer.step()), or step inside `with pu.step(model, optimizer):`, whose "
        "commit calls optimizer.step() (a pu.step(model) opened without its optimizer runs no rule of the "
        "gradient update). Warned once per rule.",
        AccountingWarning,
        stacklevel=user_stacklevel(),
    )
