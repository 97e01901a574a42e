"""Integrations with PyTorch subsystems; each registers into the core (``paramupdates.hooks``) on import.

* ``checkpoint``: ``pu.checkpoint`` and update-safe ``torch.utils.checkpoint`` (a segment probe; torch's
  recomputations wrapped, so that torch.nn batch norms of a stepped model count once);
* ``compile``: ``torch.compile`` (tracing support);
* ``distributed``: ``sync="mean"`` / ``"sum"`` over ``torch.distributed`` (the sync backend);
* ``parametrize``: updates of ``torch.nn.utils.parametrize`` outputs (a module visitor, a target resolver);
* ``fsdp``: FSDP2's DTensor parameters; FSDP1 and DeepSpeed refused (the sharding support).

The core never imports this package; ``paramupdates/__init__.py`` does, and calls :func:`install`
once. The frameworks (``lightning``, ``transformers``, ``returnn``) are imported by the user, through
their public paths ``paramupdates.lightning`` & co.
"""

from typing import Any

from . import checkpoint, compile, distributed, fsdp, parametrize

__all__ = ["checkpoint", "compile", "distributed", "fsdp", "install", "parametrize"]


def install() -> list[Any]:
    """Register every integration into the core; the handles undo it (``handle.remove()``)."""
    return [h for mod in (checkpoint, compile, distributed, fsdp, parametrize) for h in mod.install()]
