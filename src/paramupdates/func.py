"""``pu.func``: updates under ``torch.func`` come back as values, not as mutations.

``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``...) forbid writing
into tensors from outside the transform, so a batch norm that updates its
running statistics in place fails under them in train mode (PyTorch's advice
is ``torch.func.replace_all_batch_norm_modules_``, which turns the statistics
off). With paramupdates the module *issues* its updates; under
:func:`functional_call` they are collected as pending values and returned::

    out, new_buffers = pu.func.functional_call(model, {**params, **buffers}, (x,))

``new_buffers`` maps the qualified name of every target updated during the
call (``"bn.running_mean"``, ``"bn.num_batches_tracked"``...) to its new
value, computed out of place in program order (read-your-writes, rule 1: later reads inside
the call see earlier updates); nothing of ``model`` or of the tensors passed
in is written. It is an ordinary output, so it composes with the transforms:

* ``torch.func.grad(f, has_aux=True)``: return ``(loss, new_buffers)``;
* ``torch.func.vmap``: the values come back batched along the mapped dim
  (e.g. one set of statistics per ensemble member or per micro-batch).

The caller decides what to keep, and commits with :func:`commit`
(``pu.assign`` of each value: at once outside a step, at the step's commit,
phase ``auxiliary``, inside one), or feeds ``new_buffers`` to the next
functional call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import routing
from .journal import Journal
from .targets import ModelIndex
from .updates import assign

__all__ = ["commit", "functional_call"]


def functional_call(
    module: nn.Module,
    parameter_and_buffer_dicts: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    args: Any = None,
    kwargs: dict[str, Any] | None = None,
    *,
    tie_weights: bool = True,
    strict: bool = False,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """``torch.func.functional_call`` that also returns the updates issued during the call.

    Arguments as ``torch.func.functional_call``. Returns ``(output, updates)``
    where ``updates`` is ``{qualified name: new value}`` for every parameter
    or buffer an update was issued on (see the module docstring). Updates of
    trainable parameters need a phase (ambiguity is an error, rule 5), as in a step.
    """
    j = Journal(ModelIndex(module, reparametrized=True), None, "pu.func.functional_call")
    j.watch = False  # torch.func swaps the module's tensors itself
    routing.enter(j)
    try:
        out = torch.func.functional_call(
            module, parameter_and_buffer_dicts, args, kwargs, tie_weights=tie_weights, strict=strict
        )
    finally:
        routing.leave(j)
        j.settle()
        updates = {e.name: e.value for e in j.entries.values() if e.value is not None}
        j.discard()
    return out, updates


def commit(model: nn.Module, updates: Mapping[str, torch.Tensor]) -> None:
    """``pu.assign(model.<name>, value)`` for each item of ``updates`` (phase ``auxiliary``).

    Outside a step the values are written at once; inside ``pu.step(model, ...)``
    (or under ``pu.attach``) they are recorded and commit with the step.
    """
    for name, value in updates.items():
        mod_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(mod_name)
        if attr in owner._buffers:
            target = owner._buffers[attr]
        elif attr in owner._parameters:
            target = owner._parameters[attr]
        else:
            raise KeyError(f"pu.func.commit: {type(model).__name__} has no parameter or buffer {name!r}")
        if target is None:
            raise KeyError(f"pu.func.commit: {name!r} is None in {type(model).__name__}")
        assign(target, value)
