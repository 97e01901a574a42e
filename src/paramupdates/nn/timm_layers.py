"""Update-safe versions of timm's batch norm + activation layers.

``timm.layers.BatchNormAct2d`` subclasses ``torch.nn.BatchNorm2d`` with a
``forward`` of its own: PyTorch's batch norm (running statistics updated in
place), then ``self.drop``, then ``self.act``. Converting it like a plain
``BatchNorm2d`` would drop the activation. The classes here keep both: the
statistics through ``pu.assign`` (``pu.nn.BatchNorm2d``'s forward: bitwise
PyTorch's outputs and statistics), then the same ``drop`` and ``act`` modules.
They subclass timm's classes, so ``isinstance(m, timm.layers.BatchNormAct2d)``
(timm's own conversions and freezing) still holds.

This module imports timm; ``pu.convert`` imports it, and so registers the
converters, only once timm itself has been imported (``paramupdates`` never
imports timm).
"""

from __future__ import annotations

import torch
from timm.layers import norm_act as _timm
from torch import Tensor

from .batchnorm import BatchNorm2d, SyncBatchNorm, UpdateSafeBatchNorm
from .convert import Converter, convert_module, register_converter

__all__ = ["BatchNormAct2d", "SyncBatchNormAct"]


class BatchNormAct2d(BatchNorm2d, _timm.BatchNormAct2d):
    """``timm.layers.BatchNormAct2d`` with running statistics updated through ``pu.assign``.

    ``forward(x) = act(drop(batch_norm(x)))`` as timm's; the batch norm is
    ``pu.nn.BatchNorm2d``'s (phase ``auxiliary`` for the statistics, rule 4).
    """

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102 - see the class docstring
        x = UpdateSafeBatchNorm.forward(self, x)
        x = self.drop(x)
        return self.act(x)


class SyncBatchNormAct(SyncBatchNorm, _timm.SyncBatchNormAct):
    """``timm.layers.SyncBatchNormAct`` (what ``timm.layers.convert_sync_batchnorm`` makes of a
    ``BatchNormAct2d``) with running statistics updated through ``pu.assign``."""

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102 - see the class docstring
        x = SyncBatchNorm.forward(self, x)
        if hasattr(self, "drop"):
            x = self.drop(x)
        if hasattr(self, "act"):
            x = self.act(x)
        return x


def _to(cls: type) -> Converter:
    def fn(module: torch.nn.Module, *, sync_stats: bool) -> torch.nn.Module:
        return convert_module(module, cls, sync_stats=sync_stats)

    return fn


handles = (
    register_converter(_timm.BatchNormAct2d, _to(BatchNormAct2d)),
    register_converter(_timm.SyncBatchNormAct, _to(SyncBatchNormAct)),
)
torch.serialization.add_safe_globals([BatchNormAct2d, SyncBatchNormAct])
