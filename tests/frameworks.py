"""Importing the optional frameworks (Lightning, accelerate, timm) for the tests, or skipping cleanly.

torchvision: timm imports it at import time (``timm.layers`` needs
``torchvision.ops.misc.FrozenBatchNorm2d``, pure Python), and so does
Lightning through torchmetrics whenever it is installed. PyPI's torchvision
wheels are CUDA builds: beside the CPU build of torch 2.13.0 that this project
pins, their compiled ops cannot load (``_C.so`` needs ``libtorch_cuda.so``)
and ``import torchvision`` fails in ``torchvision._meta_registrations`` with
``operator torchvision::nms does not exist`` (so ``import timm`` and
``import lightning`` fail too). Neither timm's models and layers nor
Lightning's training loop use those ops (detection boxes, image decoding).
So when, and only when, torchvision fails that way, :func:`python_only_torchvision`
imports it with its two op-registration modules left empty: torchvision's
Python (transforms, ``FrozenBatchNorm2d``) imports, and calling one of its C++
ops raises, as it would anyway. Where a framework cannot import even so (not
installed, another error), the tests that need it skip with the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

import pytest

_OP_REGISTRATIONS = ("torchvision._meta_registrations", "torchvision._autograd_registrations")
_torchvision_note: str | None = None
_checked = False


def _forget(prefix: str) -> None:
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


def python_only_torchvision() -> str | None:
    """Make ``import torchvision`` work where only its compiled ops fail to load; say what was done."""
    global _checked, _torchvision_note
    if _checked:
        return _torchvision_note
    _checked = True
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        importlib.import_module("torchvision")
        return None
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        _torchvision_note = f"torchvision's compiled ops do not load ({e}); its Python parts only"
    _forget("torchvision")
    for name in _OP_REGISTRATIONS:
        sys.modules[name] = types.ModuleType(name)
    importlib.import_module("torchvision")
    return _torchvision_note


def import_or_skip(name: str, extra: str) -> Any:
    """``importlib.import_module(name)`` (torchvision prepared as above), or skip with the reason."""
    try:
        python_only_torchvision()
        return importlib.import_module(name)
    except ImportError as e:
        pytest.skip(f"{name} does not import ({e}); pip install -e '.[{extra}]'", allow_module_level=True)
    except Exception as e:  # noqa: BLE001 - any other failure to import: skip, with the reason
        pytest.skip(f"{name} does not import: {type(e).__name__}: {e}", allow_module_level=True)


def import_timm() -> Any:
    """``timm``, or skip the calling test (module) with the reason it cannot be imported."""
    return import_or_skip("timm", "timm")
