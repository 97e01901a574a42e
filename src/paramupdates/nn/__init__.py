"""Update-safe modules: state that changes through ``pu.assign``, never in place in forward."""

from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d, SyncBatchNorm, UpdateSafeBatchNorm
from .convert import ConvertWarning, convert, convert_module, register_converter
from .spectral_norm import SpectralNorm, spectral_norm
from .stats import recompute_batchnorm_stats

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "ConvertWarning",
    "SpectralNorm",
    "SyncBatchNorm",
    "UpdateSafeBatchNorm",
    "convert",
    "convert_module",
    "recompute_batchnorm_stats",
    "register_converter",
    "spectral_norm",
]
