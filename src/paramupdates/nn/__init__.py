"""Update-safe modules: state that changes through ``pu.assign``, never in place in forward."""

from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d, SyncBatchNorm, UpdateSafeBatchNorm
from .convert import convert
from .spectral_norm import SpectralNorm, spectral_norm
from .stats import recompute_batchnorm_stats

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "SpectralNorm",
    "SyncBatchNorm",
    "UpdateSafeBatchNorm",
    "convert",
    "recompute_batchnorm_stats",
    "spectral_norm",
]
