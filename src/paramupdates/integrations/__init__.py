"""Integrations with PyTorch subsystems; each registers into the core (``paramupdates.hooks``) on import.

* ``checkpoint``: ``pu.checkpoint`` and update-safe ``torch.utils.checkpoint`` (a segment probe);
* ``compile``: ``torch.compile`` (tracing support);
* ``distributed``: ``sync="mean"`` / ``"sum"`` over ``torch.distributed`` (the sync backend);
* ``parametrize``: updates of ``torch.nn.utils.parametrize`` outputs (a module visitor, a target resolver);
* ``fsdp``: FSDP2's DTensor parameters; FSDP1 and DeepSpeed refused (the sharding support).

The core never imports this package; ``paramupdates/__init__.py`` does.
"""

from . import checkpoint, compile, distributed, fsdp, parametrize

__all__ = ["checkpoint", "compile", "distributed", "fsdp", "parametrize"]
