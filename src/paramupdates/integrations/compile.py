"""``torch.compile`` support: what the recording path does while dynamo traces it.

Eager recording walks Python frames (``sys._getframe``) to find the call site
of an update. Dynamo cannot trace a frame walk, so while it traces
(``torch.compiler.is_compiling()``) the call site is read from dynamo's own
record of the user stack at trace time, and baked into the graph's side
effects as a constant string (:func:`traced_call_site`).
"""

from __future__ import annotations

import sys

import torch

from .._origin import _is_internal, _relative


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
    its read-your-writes overlay).
    """
    return any(p is t for g in optimizer.param_groups for p in g["params"])
