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

torch.nn norm layers that keep running statistics (``nn.BatchNorm*``, an
``InstanceNorm`` with ``track_running_stats=True``: not converted with
``pu.convert``) write them in place in forward, and again when the segment is
recomputed (pytorch/pytorch#96136). Where paramupdates is in play (a model
under ``pu.attach`` or in a ``pu.step``; any module in a ``pu.checkpoint``
segment), each recomputation gives them back the statistics it found
(:class:`RecomputedNorms`): ``torch.utils.checkpoint``'s two recomputations,
non-reentrant (its ``_recomputation_hook`` context) and reentrant
(``CheckpointFunction.backward``), are wrapped while paramupdates is imported
(:func:`install`); nothing runs outside a recomputation.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as _tc
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import hooks, routing
from ..nn.batchnorm import UpdateSafeBatchNorm
from ..replay import EagerLog, Segment, set_version

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
    """The segment probe for plain ``torch.utils.checkpoint(..., use_reentrant=False)``."""

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
    return seg.forward(), _recompute(seg)


@contextlib.contextmanager
def _recompute(seg: Segment) -> Iterator[None]:
    """``pu.checkpoint``'s recomputation: the replay, and every torch.nn norm layer it runs restored."""
    with RecomputedNorms(everywhere=True), seg.recompute():
        yield


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
    run without checkpointing, bitwise on CPU; torch.nn batch norms in the
    segment (not converted) too: the recomputation gives them back the
    statistics it found (:class:`RecomputedNorms`).

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


# --- torch.nn norm layers recomputed ------------------------------------------------------------------
def _keeps_statistics(module: nn.Module) -> bool:
    """A torch.nn norm layer that updates running statistics in place when called now (train mode,
    ``track_running_stats``), not one of paramupdates' update-safe batch norms (which replay)."""
    return (
        isinstance(module, nn.modules.batchnorm._NormBase)
        and module.training
        and module.track_running_stats
        and not isinstance(module, UpdateSafeBatchNorm)
    )


def _stepped(module: nn.Module) -> bool:
    """Whether ``module`` belongs to a model paramupdates steps: under ``pu.attach``, or the model of a
    ``pu.step`` in progress (in any thread), as those models were last indexed."""
    owners: list[Any] = [*routing.explicit_anywhere(), *routing.attachments()]
    return any(owner.index.module_name(module) is not None for owner in owners)


class RecomputedNorms:
    """Around one recomputation of a checkpointed segment: the torch.nn norm layers it runs get back,
    when it ends, the running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``)
    and version counters they had before it first ran them.

    In train mode such a layer updates its statistics in place from the batch (its output does not
    read them), so the segment's forward updated them once, as without checkpointing, and every
    recomputation would update them again (pytorch/pytorch#96136): restoring the bits makes them
    bitwise those of the run without checkpointing. ``everywhere``: every such layer (the segments of
    ``pu.checkpoint``); else only the layers of a model paramupdates steps (:func:`_stepped`).

    A global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``) notes each
    layer's statistics before its first call in the recomputation; it is registered for the
    recomputation only (when paramupdates is in play) and acts in this thread only.
    """

    def __init__(self, everywhere: bool) -> None:
        self.everywhere = everywhere
        self.thread = threading.get_ident()
        self.handle: RemovableHandle | None = None
        self.found: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}

    def __enter__(self) -> RecomputedNorms:
        if self.everywhere or routing.anything_open():
            self.handle = nn.modules.module.register_module_forward_pre_hook(self._note)
        return self

    def _note(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.found or not _keeps_statistics(module) or threading.get_ident() != self.thread:
            return
        if self.everywhere or _stepped(module):
            stats: list[Any] = [module.running_mean, module.running_var, module.num_batches_tracked]
            with torch.no_grad():
                self.found[id(module)] = [(t, t.detach().clone(), t._version) for t in stats if t is not None]

    def __exit__(self, *exc: Any) -> None:
        if self.handle is None:
            return
        self.handle.remove()
        self.handle = None
        with torch.no_grad():
            for kept in self.found.values():
                for t, value, version in kept:
                    t.detach().copy_(value)
                    set_version(t, version)
        self.found.clear()


class _TorchRecomputations:
    """``torch.utils.checkpoint``'s recomputations wrapped in :class:`RecomputedNorms` (scoped to the
    models paramupdates steps): the non-reentrant one's context class ``_recomputation_hook`` (entered
    around each recomputation) is replaced by a subclass, and the reentrant ``CheckpointFunction.backward``
    (which recomputes) by a wrapper. ``remove()`` puts torch's back."""

    def __init__(self) -> None:
        self.context = _tc._recomputation_hook
        self.backward = _tc.CheckpointFunction.backward

        class Recomputation(self.context):  # type: ignore[name-defined,misc]
            def __enter__(self) -> None:
                super().__enter__()
                self.pu_norms = RecomputedNorms(everywhere=False).__enter__()

            def __exit__(self, *exc: Any) -> None:
                try:
                    self.pu_norms.__exit__(*exc)
                finally:
                    super().__exit__(*exc)

        torch_backward = self.backward

        def backward(ctx: Any, *grads: Any) -> Any:
            with RecomputedNorms(everywhere=False):
                return torch_backward(ctx, *grads)

        self.ours = (Recomputation, backward)
        _tc._recomputation_hook = Recomputation  # type: ignore[misc]
        _tc.CheckpointFunction.backward = staticmethod(backward)  # type: ignore[method-assign]

    def remove(self) -> None:
        if _tc._recomputation_hook is self.ours[0]:
            _tc._recomputation_hook = self.context  # type: ignore[misc]
        if _tc.CheckpointFunction.backward is self.ours[1]:
            _tc.CheckpointFunction.backward = staticmethod(self.backward)  # type: ignore[method-assign]


def install() -> list[Any]:
    """Register the segment probe and wrap torch's recomputations (``paramupdates/__init__.py`` calls
    it); each handle's ``remove()`` undoes its part."""
    return [hooks.register_segment_probe(PROBE), _TorchRecomputations()]
