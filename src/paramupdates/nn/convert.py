"""``pu.convert(model)``: swap ``torch.nn`` batch norms for the update-safe ones, never silently changing behaviour.

Which module becomes what is decided by a small registry of converters,
``register_converter(cls, fn)``: for a module of class ``T``, the converter
registered (last) for the first class ``C`` of ``T.__mro__`` that has one
decides. Built in: ``torch.nn.BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` (to
``pu.nn.BatchNorm1d/2d/3d`` / ``SyncBatchNorm``), and, once ``timm`` has been
imported, timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` (to
``paramupdates.nn.timm_layers``' update-safe versions, which keep the drop and
activation layers).

The rule that keeps ``convert`` honest: a converter for ``C`` replaces only
modules whose ``forward`` is ``C``'s. A subclass with a ``forward`` of its own
(normalization plus an activation, a split batch, ...) is left alone, with a
:class:`ConvertWarning` naming it, unless a converter is registered for that
subclass: replacing it by a plain update-safe batch norm would drop what its
``forward`` adds. So is any other ``_BatchNorm`` subclass no converter knows
(``LazyBatchNorm*d`` before its first forward, a batch norm written on
``_BatchNorm`` directly). A module left alone still updates its running
statistics in place in ``forward``, as plain PyTorch does (not update-safe).
"""

from __future__ import annotations

import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar, cast

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from ..targets import index_of
from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d, SyncBatchNorm, UpdateSafeBatchNorm

Converter = Callable[..., nn.Module | None]
"""``fn(module, *, sync_stats: bool) -> nn.Module | None``: the replacement, or None to leave ``module`` as is."""


class ConvertWarning(UserWarning):
    """``pu.convert`` left a batch norm unconverted (its behaviour would have changed)."""


# handle id -> (class, converter), in registration order (a later registration for a class wins)
_CONVERTERS: OrderedDict[int, tuple[type[nn.Module], Converter]] = OrderedDict()  # weakly referenced by handles


def register_converter(cls: type[nn.Module], fn: Converter) -> RemovableHandle:
    """Make ``pu.convert`` replace modules of class ``cls`` (and of subclasses that keep its ``forward``).

    ``fn(module, *, sync_stats)`` returns the replacement (typically
    :func:`convert_module` of an update-safe subclass that keeps the
    module's extra behaviour), or ``None`` to leave the module alone. The
    last registration for a class wins; ``handle.remove()`` undoes it (the
    previous one, if any, applies again). Registering for a built-in class
    (``torch.nn.BatchNorm2d``) overrides the built-in converter.

    Example, for a batch norm followed by an activation::

        class SafeNormAct(pu.nn.BatchNorm2d, NormAct):   # update-safe statistics first in the MRO
            def forward(self, x):
                return self.act(pu.nn.BatchNorm2d.forward(self, x))

        pu.nn.register_converter(NormAct, lambda m, *, sync_stats: pu.nn.convert_module(m, SafeNormAct,
                                                                                         sync_stats=sync_stats))
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_converter: cls must be a torch.nn.Module subclass, got {cls!r}")
    if not callable(fn):
        raise TypeError(f"register_converter: fn must be callable, got {type(fn).__name__}")
    handle = RemovableHandle(_CONVERTERS)
    _CONVERTERS[handle.id] = (cls, fn)
    return handle


def convert_module(module: nn.Module, cls: type[nn.Module], *, sync_stats: bool = False) -> nn.Module:
    """A new ``cls`` instance that shares ``module``'s state: what a converter usually returns.

    Same attributes (hyper-parameters, train flag, hooks) and the same
    parameter, buffer and submodule *objects*: optimizers, EMA copies and
    hooks that hold them keep working, nothing is copied, and ``state_dict``
    keys do not change. ``cls.__init__`` is not called. ``sync_stats`` is set
    on the new module (``pu.nn`` batch norms read it).
    """
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.__dict__.update({k: v for k, v in module.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")})
    new._parameters = module._parameters
    new._buffers = module._buffers
    new._modules = module._modules
    new.sync_stats = sync_stats
    return new


def _builtin(dst: type[nn.Module]) -> Converter:
    def fn(module: nn.Module, *, sync_stats: bool) -> nn.Module:
        return convert_module(module, dst, sync_stats=sync_stats)

    fn.__qualname__ = f"convert to {dst.__module__}.{dst.__qualname__}"
    return fn


for _src, _dst in (
    (nn.BatchNorm1d, BatchNorm1d),
    (nn.BatchNorm2d, BatchNorm2d),
    (nn.BatchNorm3d, BatchNorm3d),
    (nn.SyncBatchNorm, SyncBatchNorm),  # not a subclass of BatchNorm*d
):
    register_converter(_src, _builtin(_dst))

# frameworks whose layers have converters: (a module that is imported once the framework is in use, ours)
_LAZY: list[tuple[str, str]] = [("timm.layers.norm_act", "paramupdates.nn.timm_layers")]


def _load_lazy() -> None:
    """Register the converters for the frameworks in use, without importing any framework ourselves."""
    for theirs, ours in _LAZY:
        if theirs in sys.modules and ours not in sys.modules:
            __import__(ours)


def _lookup(t: type) -> tuple[type, Converter] | None:
    for c in t.__mro__:
        found = None
        for cls, fn in _CONVERTERS.values():
            if cls is c:
                found = (cls, fn)
        if found is not None:
            return found
    return None


def _own_forward(t: type, base: type) -> type | None:
    """The class of ``t.__mro__`` before ``base`` that defines ``forward``, if any."""
    for c in t.__mro__:
        if c is base:
            return None
        if "forward" in c.__dict__:
            return c
    return None


def _name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _replacement(m: nn.Module, qualname: str, sync_stats: bool) -> nn.Module | None:
    if isinstance(m, UpdateSafeBatchNorm):
        return None
    t = type(m)
    hit = _lookup(t)
    if hit is None:
        if isinstance(m, _BatchNorm):
            warnings.warn(
                f"pu.convert: {qualname} ({_name(t)}) is a batch norm that no converter knows; it is left alone "
                "and updates its running statistics in place in forward (not update-safe). Register a converter "
                f"that keeps its behaviour: pu.nn.register_converter({t.__qualname__}, fn).",
                ConvertWarning,
                stacklevel=3,
            )
        return None
    base, fn = hit
    own = _own_forward(t, base)
    if own is not None:
        warnings.warn(
            f"pu.convert: {qualname} ({_name(t)}) is a {base.__qualname__} whose forward is its own "
            f"({own.__qualname__}.forward); converting it like a {base.__qualname__} would drop what that forward "
            "adds, so it is left alone and updates its running statistics in place in forward (not update-safe). "
            f"Register a converter that keeps its behaviour: pu.nn.register_converter({t.__qualname__}, fn) "
            "(see pu.nn.convert_module).",
            ConvertWarning,
            stacklevel=3,
        )
        return None
    new = fn(m, sync_stats=sync_stats)
    return None if new is m else new


_M = TypeVar("_M", bound=nn.Module)
"""The model's own type: ``pu.convert(model)`` keeps it for type checkers (``pu.convert(nn.Sequential(...))[0]``)."""


def convert(model: _M, *, sync_stats: bool = False) -> _M:
    """Replace every batch norm of ``model`` that a converter knows by its update-safe version.

    ``torch.nn.BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` become
    ``pu.nn.BatchNorm1d/2d/3d`` / ``pu.nn.SyncBatchNorm``; timm's
    ``BatchNormAct2d`` / ``SyncBatchNormAct`` their update-safe versions (drop
    and activation kept); other classes as registered with
    :func:`register_converter`. Each is swapped in place in the module tree
    for a module that shares its parameter and buffer tensors, its
    hyper-parameters, its train flag and hooks (:func:`convert_module`).
    Qualified names and ``state_dict`` keys do not change, so a converted
    model's state dict loads into the original and back. A model that is
    itself a batch norm is returned converted (the caller must use the return
    value); otherwise ``model`` itself is returned.

    Never a silent change of behaviour: a batch norm subclass with a
    ``forward`` of its own and no converter of its own, or a batch norm no
    converter knows, is left alone with a :class:`ConvertWarning` naming it.

    ``sync_stats=True`` makes every converted module average its running
    statistics across ranks at commit (distributed sync, rule 9).
    """
    _load_lazy()
    if isinstance(model, _BatchNorm):
        top = _replacement(model, f"the model itself ({type(model).__qualname__})", sync_stats)
        index_of(model if top is None else top)
        return model if top is None else cast(_M, top)  # a converter's replacement: a subclass, as a rule
    done: dict[int, nn.Module | None] = {}  # a module shared by two parents stays shared
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) not in done:
                done[id(child)] = _replacement(child, f"{prefix}.{name}" if prefix else name, sync_stats)
            new = done[id(child)]
            if new is not None:
                parent._modules[name] = new
    index_of(model)  # known from now on: an error about its tensors names them in it (a GAN's discriminator)
    return model


def converters() -> list[tuple[type[nn.Module], Any]]:
    """The registered ``(class, converter)`` pairs, in registration order (the last for a class wins)."""
    _load_lazy()
    return list(_CONVERTERS.values())
