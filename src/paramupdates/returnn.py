"""RETURNN's frontend (``rf``) on its PyTorch backend, with paramupdates' semantics.

::

    import paramupdates.returnn as pur
    pur.enable()        # before the model is built (in a RETURNN config: at its top)

While enabled (:func:`disable` restores RETURNN's own functions; both are idempotent):

* the raw tensor RETURNN makes for a new ``rf.Parameter`` is a
  ``pu.Parameter`` (a ``torch.nn.Parameter`` subclass), so every read of the
  parameter inside a step sees its pending value (rule 1 of DESIGN.md:
  program order), and nothing is written before commit (rule 2);
* ``rf.Parameter.assign`` / ``assign_add`` / ``assign_key`` are
  ``pu.assign`` / ``pu.assign_add`` / ``pu.assign_key`` of that raw tensor,
  in the phase of the innermost :func:`phase` block (rule 4);
* ``rf.BatchNorm``'s running statistics are such updates, in both its
  paths (masked: ``assign_add``; fused: ``F.batch_norm`` on copies, then ``assign``);
* RETURNN's ``gradient_checkpoint_scope`` replays its recorded ops on the
  very tensors the forward read.

Outside a step every update applies at once, in place, under ``no_grad``
(rule 8): bitwise what RETURNN writes without the bridge. Inside a step
(``pu.step(pt_model, opt)``, ``pu.attach(pt_model, opt)``, or RETURNN's
``Engine`` through :func:`optimizer`; ``pt_model`` is
``rf_module_to_pt_module(model)``) updates are recorded and committed in
the fixed phase order: ``before_grad`` (:func:`weight_decay`, then
updates), ``optimizer.step()``, ``after_grad`` (:func:`constrain`, then
updates), auxiliary updates (statistics, counters), ``after_step``. Under
``torch.utils.checkpoint(use_reentrant=False)`` and
``rf.gradient_checkpoint_scope`` the recomputation sees the values at
segment entry and re-issued updates are dropped (rule 3): counters and
running statistics equal the run without checkpointing, bitwise on CPU.

RETURNN's ``Engine`` from the config alone::

    import paramupdates.returnn as pur
    pur.enable()
    optimizer = pur.optimizer({"class": "adam", "epsilon": 1e-8})   # commits inside optimizer.step()
    epoch_end = pur.epoch_end                                        # flushes what no optimizer step committed

The patched RETURNN functions and the paramupdates internals this uses are
listed in :mod:`paramupdates.integrations.returnn`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .integrations import returnn as _rt
from .rules.constraints import constrain as _pu_constrain
from .rules.weight_decay import weight_decay as _pu_weight_decay
from .step import Attachment

__all__ = [
    "assign",
    "assign_add",
    "assign_key",
    "attachment",
    "constrain",
    "disable",
    "enable",
    "epoch_end",
    "flush",
    "is_enabled",
    "optimizer",
    "phase",
    "weight_decay",
]


def enable() -> None:
    """Route rf parameter updates and rf batch-norm statistics on the torch backend through paramupdates.

    Idempotent. Patches RETURNN's ``TorchBackend.create_parameter_raw`` /
    ``parameter_assign`` / ``parameter_assign_key`` / ``parameter_move_to`` /
    ``batch_norm``, ``RFModuleAsPTModule._apply`` and two functions of its
    gradient-checkpoint scope (the list and the reasons:
    :mod:`paramupdates.integrations.returnn`). Parameters created before
    this call keep plain ``torch.nn.Parameter`` raw tensors: their updates
    stay eager outside a step and raise ``pu.UpdateError`` inside one, so
    enable before the model is built. Raises ``RuntimeError`` (and patches
    nothing) on a RETURNN without one of those functions.
    """
    _rt.install()


def disable() -> None:
    """Restore RETURNN's own functions (idempotent). Raw tensors already made stay ``pu.Parameter``\\ s,
    which behave as plain parameters outside a step."""
    _rt.uninstall()


def is_enabled() -> bool:
    """Whether rf parameter updates go through paramupdates now."""
    return _rt.installed()


@contextlib.contextmanager
def phase(name: str | None) -> Iterator[None]:
    """The phase of the rf updates issued inside the block (rule 4 of DESIGN.md).

    ``rf.Parameter.assign`` has no phase argument. An update of a trainable
    parameter (one the optimizer also updates) inside a step must say whether
    it applies before or after ``optimizer.step()``; without a phase it raises
    ``pu.AmbiguousOrderError`` naming the parameter and the line::

        with pur.phase("before_grad"):
            self.weight.assign_add(noise)      # the optimizer then updates weight + noise

    ``name``: ``"before_grad"``, ``"after_grad"``, ``"after_step"``, or ``None``
    (the ``auxiliary`` phase of non-trainable targets). The innermost block
    wins. ``assign_add``/``assign_key`` compose with the optimizer's update;
    ``assign(v)`` sets ``v``, computed when issued (in ``after_grad`` it
    overwrites the optimizer's update). A projection of the updated weight
    (a constraint, a renormalization) is a declared rule: :func:`constrain`.
    Outside a step the phase is irrelevant: updates apply at once.
    """
    _rt.check_phase(name, "paramupdates.returnn.phase")
    _rt.phase_stack.append(name)
    try:
        yield
    finally:
        _rt.phase_stack.pop()


def assign(param: Any, value: Any, *, phase: str | None = None) -> None:
    """``param <- value``: ``rf.Parameter.assign`` with a phase (see :func:`phase`).

    ``value``: an rf ``Tensor`` (in a subset of ``param``'s dims, broadcast) or a
    Python number. Inside a step the update is recorded and committed in
    ``phase`` (``None``: the enclosing :func:`phase` block's); outside, applied at once.
    """
    _rt.check_phase(phase, "paramupdates.returnn.assign")
    raw, value = _rt.raw_and_value(param, value)
    _rt.issue(raw, "assign", value.copy_compatible_to_dims_raw(param.dims), ph=phase)


def assign_add(param: Any, value: Any, *, phase: str | None = None) -> None:
    """``param <- param + value``: ``rf.Parameter.assign_add`` with a phase (see :func:`phase`)."""
    _rt.check_phase(phase, "paramupdates.returnn.assign_add")
    raw, value = _rt.raw_and_value(param, value)
    _rt.issue(raw, "assign_add", value.copy_compatible_to_dims_raw(param.dims), ph=phase)


def assign_key(param: Any, axis: Any, key: Any, key_dim: Any, value: Any, *, phase: str | None = None) -> None:
    """``param[key] <- value`` along ``axis``: ``rf.Parameter.assign_key`` with a phase (see :func:`phase`)."""
    _rt.check_phase(phase, "paramupdates.returnn.assign_key")
    raw, value = _rt.raw_and_value(param, value)
    key_raw, res_dims = _rt.key_raw(param, axis, key, key_dim)
    _rt.issue(raw, "assign_key", value.copy_compatible_to_dims_raw(res_dims), key_raw, ph=phase)


def weight_decay(params: Any, *, scale_by_lr: bool = True) -> list[Any]:
    """Honour ``rf.Parameter.weight_decay``: ``pu.weight_decay`` with each parameter's own rate (RETURNN #1439).

    For every trainable ``rf.Parameter`` ``p`` of ``params`` (an rf module, its
    torch module, a parameter, or an iterable of parameters or ``(name,
    parameter)`` pairs) with ``p.weight_decay = r > 0``, before
    ``optimizer.step()`` (phase ``before_grad``, once per optimizer update, for
    parameters with a gradient)::

        p <- p * (1 - lr * r)      (scale_by_lr=False: p <- p * (1 - r))

    ``lr`` is ``p``'s param group's learning rate at commit (RETURNN's learning
    rate control sets it). That is AdamW's decoupled decay: ``Adam`` plus this
    is ``AdamW`` bitwise. (RETURNN's TF backend with ``decouple_constraints``
    instead subtracts ``2 r p`` times ``decouple_constraints_factor * lr / lr_0``.)
    The rates are read now; one ``pu.weight_decay`` rule is declared per
    distinct rate, in order of first appearance. Declare it before training
    (e.g. in the config's ``get_model``). Returns the rules (``.remove()``).
    """
    by_rate: dict[float, list[tuple[str, Any]]] = {}
    for name, p in _rt.named_rf_params(params):
        rate = float(p.weight_decay or 0.0)
        if rate < 0.0:
            raise ValueError(f"paramupdates.returnn.weight_decay: {name!r} has weight_decay={rate}; it must be >= 0")
        if rate > 0.0 and p.raw_tensor.requires_grad:
            by_rate.setdefault(rate, []).append((name, p.raw_tensor))
    return [_pu_weight_decay(named, rate, exclude=None, scale_by_lr=scale_by_lr) for rate, named in by_rate.items()]


def constrain(params: Any, constraint: Any) -> Any:
    """``pu.constrain`` on rf parameters (RETURNN #1214): ``p <- constraint(p)`` after each ``optimizer.step()``.

    Phase ``after_grad``, once per optimizer update, for every ``rf.Parameter``
    of ``params`` (an rf module, its torch module, a parameter, or an iterable).
    ``constraint``: ``pu.max_norm``, ``pu.unit_norm``, ``pu.min_max_norm``,
    ``pu.non_neg``, ``pu.clamp`` or a callable ``tensor -> tensor``. The norm
    constraints' ``dim`` is an axis of the raw tensor, whose axes are the
    parameter's ``dims`` in order: ``rf.Linear.weight`` is ``(in, out)``, so a
    max-norm per output unit (Keras') is ``pu.max_norm(v, dim=1)``. Returns the
    rule (``.remove()``).
    """
    named = [(name, p.raw_tensor) for name, p in _rt.named_rf_params(params)]
    return _pu_constrain(named, constraint)


def optimizer(
    opts: str | type | dict[str, Any] = "adam",
    *,
    on_nonfinite: str = "raise",
    check_finite: bool = True,
    atomic: bool = True,
) -> dict[str, Any]:
    """The value of a RETURNN config's ``optimizer``: RETURNN's Engine with paramupdates, config only.

    ``opts`` is what ``optimizer`` would be without the bridge (a dict with
    ``"class"``, or the class or its name). The optimizer RETURNN builds from
    it is attached (``pu.attach``) to the model: the updates the model's rf
    code issues after an ``optimizer.step()`` form one step, committed inside
    the next ``optimizer.step()`` in the fixed phase order. With
    ``accum_grad_multiple_step = N`` RETURNN calls ``optimizer.step()`` once
    per N micro-batches: the updates of all N are one step (each read sees
    the ones before, rule 1) and declared rules run once per real update.
    Set ``epoch_end = paramupdates.returnn.epoch_end`` too: it commits what
    no ``optimizer.step()`` followed (the micro-batches of an incomplete
    accumulation), before RETURNN saves the model. ``on_nonfinite``,
    ``check_finite``, ``atomic``: as for ``pu.attach``.

    The returned dict sets ``param_groups_custom`` (RETURNN hands it the
    model); a ``param_groups_custom`` in ``opts`` is called from it, else
    RETURNN's own grouping applies (``weight_decay``,
    ``weight_decay_modules_blacklist``, ...). Not supported, with a
    ``pu.UpdateError`` when the Engine creates the optimizer:
    ``torch_optimizer_step`` and ``torch_cuda_graph`` (a replayed, captured
    optimizer step runs no step hooks; a captured forward issues no updates).
    """
    return _rt.engine_optimizer_opts(
        opts, {"on_nonfinite": on_nonfinite, "check_finite": check_finite, "atomic": atomic}
    )


def attachment(obj: Any) -> Attachment | None:
    """The ``pu.Attachment`` that :func:`optimizer` made for ``obj`` (an Engine, its torch optimizer, its torch
    model or rf model), or None: ``.schedule()``, ``.flush()``, ``.discard()``, ``.detach()``, ``.state_dict()``."""
    return _rt.attachment_of(obj)


def flush(obj: Any) -> None:
    """Commit now the pending updates of ``obj``'s attachment (see :func:`attachment`), without a gradient
    update (declared rules, which run once per optimizer update, do not run)."""
    att = _rt.attachment_of(obj)
    if att is not None:
        att.flush()


def epoch_end(*, model: Any = None, **_kwargs: Any) -> None:
    """A RETURNN config's ``epoch_end``: commit what no ``optimizer.step()`` followed.

    RETURNN's Engine calls it after each epoch's last step, before saving the
    model (and after each evaluation), with the model. What is pending then
    (the micro-batches of an incomplete gradient accumulation, updates issued
    in evaluation) is committed as by ``attachment.flush()``. To keep an
    ``epoch_end`` of your own, call this from it:
    ``def epoch_end(**kwargs): pur.epoch_end(**kwargs); ...``.
    """
    if model is not None:
        flush(model)
