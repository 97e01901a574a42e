"""``torch.compile`` support: the recording path as dynamo traces it.

Inside a compiled forward, ``pu.assign`` & co. run the ordinary recording
code (``updates._issue`` -> ``transaction.route`` -> ``Transaction.record``)
under dynamo: the pending values are graph tensors (``_ops.apply_op``, with
``torch.where`` for a tensor condition), and the bookkeeping (new entries and
records, the buffer slot swap of the overlay) are Python side effects on
pre-existing objects that dynamo replays after the graph. Where the eager
code does something dynamo cannot trace, or traces at a cost, the core asks
``torch.compiler.is_compiling()`` and calls the helpers below instead:

* the call site (:func:`traced_call_site`): dynamo's record of the user stack
  at trace time, a constant string, instead of ``sys._getframe``;
* identity instead of ``id()`` (:func:`find_traced`): ``id()`` of a tensor
  makes dynamo guard on that object (a recompilation per step for a pending
  value) and the id of a tensor made in the graph cannot be replayed. The
  id-keyed ``Transaction.aliases`` is marked stale by the graph and rebuilt at
  the next eager lookup. (``id()`` of a target itself, a parameter or buffer,
  is stable from step to step: ``_state.pu_pending`` keeps it.);
* trace-time constants (:func:`in_optimizer`, ``parameter._substitutes``):
  facts that depend only on objects that do not change between steps.

See ``docs/compile.md`` for what is supported and the limits.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from .._origin import _is_internal, _relative

if TYPE_CHECKING:
    from ..transaction import Entry, Transaction


@torch._dynamo.assume_constant_result
def traced_call_site() -> str:
    """``"file:line"`` of the innermost user frame dynamo is tracing (a trace-time constant)."""
    from torch._guards import TracingContext

    stack = TracingContext.extract_stack()
    for fs in reversed(stack):
        if not _is_internal(fs.filename):
            return f"{_relative(fs.filename)}:{fs.lineno}"
    # The traced frame is itself internal (dynamo compiles ``pu.assign`` as a
    # frame of its own when it runs the user's frame eagerly, e.g. after a
    # graph break): the user's frames are then real frames, below dynamo's.
    f = sys._getframe(1)
    while f is not None and _is_internal(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "<compiled>"
    return f"{_relative(f.f_code.co_filename)}:{f.f_lineno}"


@torch._dynamo.assume_constant_result
def in_optimizer(optimizer: torch.optim.Optimizer, t: torch.Tensor) -> bool:
    """Whether ``t`` is one of ``optimizer``'s parameters, decided at trace time.

    Iterating ``optimizer.param_groups`` inside the trace would make dynamo wrap
    every parameter from the optimizer's side, as plain tensors: a
    ``pu.Parameter`` read later in the graph would then lose its subclass (and
    its read-your-writes overlay), silently.
    """
    return any(p is t for g in optimizer.param_groups for p in g["params"])


def find_traced(tx: Transaction, t: torch.Tensor) -> Entry | None:
    """The entry whose target or pending value is ``t``, by identity."""
    for e in tx.entries.values():
        if e.target is t or e.value is t:
            return e
    return None
