"""``pu.convert(model)``: swap ``torch.nn`` batch norms for the update-safe ones."""

from __future__ import annotations

from torch import nn

from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d, SyncBatchNorm, UpdateSafeBatchNorm

# Most derived first (SyncBatchNorm is not a subclass of BatchNorm*d).
_MAP: tuple[tuple[type[nn.Module], type[nn.Module]], ...] = (
    (nn.SyncBatchNorm, SyncBatchNorm),
    (nn.BatchNorm3d, BatchNorm3d),
    (nn.BatchNorm2d, BatchNorm2d),
    (nn.BatchNorm1d, BatchNorm1d),
)


def _replacement(m: nn.Module, sync_stats: bool) -> nn.Module | None:
    if isinstance(m, UpdateSafeBatchNorm):
        return None
    dst = next((d for s, d in _MAP if isinstance(m, s)), None)
    if dst is None:
        return None
    new = dst.__new__(dst)
    nn.Module.__init__(new)
    # Same attributes, same parameter and buffer *objects*: optimizers, EMA
    # copies and hooks that hold them keep working; nothing is copied.
    new.__dict__.update({k: v for k, v in m.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")})
    new._parameters = m._parameters
    new._buffers = m._buffers
    new._modules = m._modules
    new.sync_stats = sync_stats
    return new


def convert(model: nn.Module, *, sync_stats: bool = False) -> nn.Module:
    """Replace every ``torch.nn.BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` in ``model``.

    Each is swapped in place in the module tree for ``pu.nn.BatchNorm1d/2d/3d``
    (``pu.nn.SyncBatchNorm``) that shares its parameter and buffer tensors,
    its hyper-parameters (``eps``, ``momentum``, ``affine``,
    ``track_running_stats``), its train flag and hooks. Qualified names and
    ``state_dict`` keys do not change, so a converted model's state dict loads
    into the original and back. A model that is itself a batch norm is
    returned converted (the caller must use the return value); otherwise
    ``model`` itself is returned.

    ``sync_stats=True`` makes every converted module average its running
    statistics across ranks at commit (distributed sync, rule 9).
    """
    top = _replacement(model, sync_stats)
    if top is not None:
        return top
    done: dict[int, nn.Module | None] = {}  # a module shared by two parents stays shared
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) not in done:
                done[id(child)] = _replacement(child, sync_stats)
            new = done[id(child)]
            if new is not None:
                parent._modules[name] = new
    return model
