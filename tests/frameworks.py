"""Importing the optional frameworks (Lightning, accelerate, timm) for the tests, or skipping cleanly.

timm imports torchvision at import time (``timm.layers`` needs
``torchvision.ops.misc.FrozenBatchNorm2d``, pure Python). PyPI's torchvision
wheels are CUDA builds: beside the CPU build of torch 2.13.0 that this
project pins, their compiled ops cannot load (``_C.so`` needs
``libtorch_cuda.so``) and ``import torchvision`` then fails in
``torchvision._meta_registrations`` with ``operator torchvision::nms does not
exist``. timm's models and layers use none of those ops (detection boxes,
image decoding). So when, and only when, torchvision fails that way,
:func:`import_timm` imports it with its two op-registration modules left
empty: torchvision's Python (transforms, ``FrozenBatchNorm2d``) and all of
timm import, and calling a torchvision C++ op raises as it would anyway.
Where timm cannot import even so (not installed, another error), the tests
that need it skip with the reason.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import pytest

_OP_REGISTRATIONS = ("torchvision._meta_registrations", "torchvision._autograd_registrations")
_timm: Any = None
_why_not: str | None = None


def _forget(prefix: str) -> None:
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


def _try_timm() -> Any:
    global _timm, _why_not
    if _timm is not None or _why_not is not None:
        return _timm
    try:
        _timm = importlib.import_module("timm")
        return _timm
    except ModuleNotFoundError as e:
        _why_not = f"timm is not installed ({e}); pip install -e '.[timm]'"
        return None
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            _why_not = f"timm does not import: {type(e).__name__}: {e}"
            return None
        first = str(e)
    _forget("timm")
    _forget("torchvision")
    for name in _OP_REGISTRATIONS:
        sys.modules[name] = types.ModuleType(name)
    try:
        _timm = importlib.import_module("timm")
    except Exception as e:  # noqa: BLE001 - any failure means: skip, with the reason
        _forget("timm")
        _forget("torchvision")
        _why_not = f"timm does not import: torchvision's compiled ops fail ({first}), and then {type(e).__name__}: {e}"
        return None
    return _timm


def import_timm() -> Any:
    """``timm``, or skip the calling test with the reason it cannot be imported."""
    timm = _try_timm()
    if timm is None:
        pytest.skip(_why_not or "timm does not import")
    return timm


def import_or_skip(name: str, extra: str) -> Any:
    """``importlib.import_module(name)``, or skip with the ``pip install`` that brings it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.skip(f"{name} does not import ({e}); pip install -e '.[{extra}]'")
