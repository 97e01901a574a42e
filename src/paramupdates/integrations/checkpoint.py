"""Activation checkpointing that replays updates: ``pu.checkpoint`` and ``torch.utils.checkpoint``.

The semantics (replay: a recomputed segment sees what
its forward saw, and updates it issues again are dropped) live in the core,
``paramupdates.replay``. This module connects checkpointing mechanisms to it:

* ``pu.checkpoint(fn, *args, **kwargs)`` is
  ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, ...)``
  with a ``context_fn`` whose forward context notes the values at segment
  entry and whose recompute context shows them (``replay.Segment``);
* plain ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)`` is
  made update-safe too, for segments that issue updates (batch norm, spectral
  norm): a segment probe (``hooks.register_segment_probe``) finds the
  segment whose forward is running when it issues its first update, notes
  the values shown at that moment (nothing ran in the segment before it
  that could have changed them, so they are the values at segment entry) and
  wraps the segment's recompute function in the same replay. What it cannot
  see is a segment that issues *no* update but reads a target updated
  *after* it in the step: its recomputation reads the later value. Use
  ``pu.checkpoint`` there (it notes the values at entry, whatever the segment does).

Reentrant checkpointing (``use_reentrant=True``) recomputes inside backward
with no hook to replay through: an update it issues again inside a step
raises :class:`~paramupdates.UpdateError` (the step is discarded, nothing is
written); use ``pu.checkpoint``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as _tc
from torch.utils.hooks import RemovableHandle

from .. import hooks
from ..replay import EagerLog, Segment

__all__ = ["checkpoint"]

_FORWARD_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"
_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_SEGMENT_ATTR = "_pu_segment"


def torch_checkpoint_frame() -> Any:
    """The ``_CheckpointFrame`` of the innermost ``torch.utils.checkpoint`` (non-reentrant)
    segment whose forward is running, or None."""
    hooks_ = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if not hooks_:
        return None
    pack = hooks_[0]
    code = getattr(pack, "__code__", None)
    if getattr(pack, "__qualname__", "") != _FORWARD_HOOK or code is None or "frame" not in code.co_freevars:
        return None
    closure = pack.__closure__ or ()
    return closure[code.co_freevars.index("frame")].cell_contents


class TorchCheckpointProbe:
    """The segment probe for plain ``torch.utils.checkpoint(..., use_reentrant=False)``; it also keeps
    the modules ``pu.checkpoint`` warned about (held weakly: once per module)."""

    def __init__(self) -> None:
        self.warned: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def active(self) -> bool:
        """(Called outside dynamo's tracing only: the core asks while it does not trace.)"""
        return bool(_saved_tensors_hooks(True)) and torch_checkpoint_frame() is not None

    def adopt(self) -> EagerLog | None:
        """Called by the first update a segment issues in forward (and by every later one): notes
        the values shown now as the entry values and wraps the segment's ``recompute_fn`` in the
        replay. Returns the segment's eager log (None outside such a segment)."""
        if torch.compiler.is_compiling():
            return None
        frame = torch_checkpoint_frame()
        if frame is None:
            return None
        seg = getattr(frame, _SEGMENT_ATTR, None)
        if seg is None:
            orig = getattr(frame, "recompute_fn", None)
            if orig is None:
                return None
            seg = Segment()
            seg.noted()

            def recompute_fn(*args: Any) -> None:
                with seg.recompute():
                    orig(*args)

            frame.recompute_fn = recompute_fn
            setattr(frame, _SEGMENT_ATTR, seg)
        return seg.log


def _contexts() -> tuple[Any, Any]:
    seg = Segment()
    return seg.forward(), seg.recompute()


def _warn_plain_batchnorm(fn: Any) -> None:
    """torch.nn batch norms write in place, out of reach of the replay: say so once per module."""
    mod = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(mod, torch.nn.Module) or mod in PROBE.warned or not mod.training:
        return
    from ..nn.batchnorm import UpdateSafeBatchNorm

    plain = [
        n or type(m).__name__
        for n, m in mod.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, UpdateSafeBatchNorm)
    ]
    if plain:
        PROBE.warned.add(mod)
        warnings.warn(
            f"pu.checkpoint: {plain[:3]} are torch.nn batch norms; they update their statistics in place "
            "and the recomputation updates them again. Convert the model first: model = pu.convert(model).",
            stacklevel=3,
        )


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    **kwargs: Any,
) -> Any:
    """Update-safe activation checkpointing of ``fn(*args, **kwargs)`` (replay, rule 3).

    Forward runs ``fn`` once, keeping only its inputs; backward recomputes it
    (``torch.utils.checkpoint`` non-reentrant mode). Updates issued by ``fn``
    are recorded once, in forward; in the recomputation every read sees what
    it saw in forward and the updates issued again are dropped. Outputs,
    gradients, running statistics and every other pending value equal the
    run without checkpointing, bitwise on CPU.

    ``preserve_rng_state``, ``determinism_check`` and ``debug`` are passed to
    ``torch.utils.checkpoint.checkpoint``; every other keyword goes to ``fn``.
    """
    if torch.compiler.is_compiling():
        # Under torch.compile the recomputation is part of the compiled
        # backward and replays no Python side effect: the updates are recorded
        # once, by the forward's graph. (Dynamo accepts side effects in a
        # checkpointed region only with
        # torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True,
        # and no context_fn other than a pair of dispatch modes.)
        return _tc.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)
    _warn_plain_batchnorm(fn)
    return _tc.checkpoint(
        fn,
        *args,
        use_reentrant=False,
        context_fn=_contexts,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        **kwargs,
    )


PROBE = TorchCheckpointProbe()


def install() -> list[RemovableHandle]:
    """Register the segment probe (``paramupdates/__init__.py`` calls it)."""
    return [hooks.register_segment_probe(PROBE)]
