"""``torch.compile`` support: what the core asks while dynamo traces it.

Inside a compiled forward, ``pu.assign`` & co. run the ordinary recording
code (``updates.issue`` -> ``updates.route`` -> ``Journal.record``) under
dynamo: the pending values are graph tensors (``ops.apply_op``, with
``torch.where`` for a tensor condition), and the bookkeeping (new entries and
records, the buffer slot swap of the overlay) are Python side effects on
pre-existing objects that dynamo replays after the graph. Where the eager
code does something dynamo cannot trace, or traces at a cost, the core asks
``torch.compiler.is_compiling()`` and then the tracing support registered
here (``hooks.register_tracing_support``):

* the call site (:meth:`DynamoSupport.call_site`): dynamo's record of the user
  stack at trace time, a constant string, instead of ``sys._getframe``;
* trace-time constants (:meth:`DynamoSupport.in_optimizer`, and
  ``parameter._substitutes``): facts that depend only on objects that do not
  change between steps.

The core itself resolves pending values by identity rather than ``id()``
while tracing (``Journal.find``): ``id()`` of a tensor makes dynamo guard on
that object (a recompilation per step for a pending value), and the id of a
tensor made in the graph cannot be replayed.

Importing this module does not import dynamo: the trace-time constants are
marked the way ``torch._dynamo.assume_constant_result`` marks them.

See ``docs/compile.md`` for what is supported and the limits.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .. import hooks
from ..origin import is_internal, relative


def _constant(fn: Any) -> Any:
    """``torch._dynamo.assume_constant_result`` without importing dynamo."""
    fn._dynamo_marked_constant = True
    return fn


@_constant
def traced_call_site() -> str:
    """``"file:line"`` of the innermost user frame dynamo is tracing (a trace-time constant)."""
    from torch._guards import TracingContext

    stack = TracingContext.extract_stack()
    for fs in reversed(stack):
        if not is_internal(fs.filename):
            return f"{relative(fs.filename)}:{fs.lineno}"
    # The traced frame is itself internal (dynamo compiles ``pu.assign`` as a
    # frame of its own when it runs the user's frame eagerly, e.g. after a
    # graph break): the user's frames are then real frames, below dynamo's.
    f: FrameType | None = sys._getframe(1)
    while f is not None and is_internal(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "<compiled>"
    return f"{relative(f.f_code.co_filename)}:{f.f_lineno}"


@_constant
def in_optimizer(optimizer: torch.optim.Optimizer, t: torch.Tensor) -> bool:
    """Whether ``t`` is one of ``optimizer``'s parameters, decided at trace time.

    Iterating ``optimizer.param_groups`` inside the trace would make dynamo wrap
    every parameter from the optimizer's side, as plain tensors: a
    ``pu.Parameter`` read later in the graph would then lose its subclass (and
    its read-your-writes overlay), silently.
    """
    return any(p is t for g in optimizer.param_groups for p in g["params"])


class DynamoSupport:
    """The tracing support the core consults while dynamo traces (see the module docstring)."""

    def call_site(self) -> str:
        return traced_call_site()

    def in_optimizer(self, optimizer: Any, t: torch.Tensor) -> bool:
        return in_optimizer(optimizer, t)


def install() -> list[RemovableHandle]:
    """Register the tracing support (``paramupdates/__init__.py`` calls it)."""
    return [hooks.register_tracing_support(DynamoSupport())]
