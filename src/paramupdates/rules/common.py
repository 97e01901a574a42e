"""What the built-in rules share: collecting declared tensors, weak holding, storage keys."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .. import context
from ..errors import UpdateError

Named = list[tuple[str, torch.Tensor]]

no_subclass = torch._C.DisableTorchFunctionSubclass
"""Context in which a ``pu.Parameter`` is a plain tensor to foreach kernels (no overlay lookup)."""

_PLAIN = (torch.Tensor, nn.Parameter)


def has_subclass(ts: list[torch.Tensor]) -> bool:
    """Whether any tensor has a ``__torch_function__`` subclass (``pu.Parameter``)."""
    return any(type(t) not in _PLAIN for t in ts)


def plain_if(flag: bool) -> Any:
    """``no_subclass()`` when ``flag`` (it slows every op down a little, so only where needed)."""
    return no_subclass() if flag else contextlib.nullcontext()


def named_tensors(obj: Any, fn: str) -> Named:
    """``(name, tensor)`` pairs from a module, a tensor, or an iterable of tensors / pairs.

    A module gives its qualified parameter names; an iterable of bare tensors
    gives their positions (``"0"``, ``"1"``, ... as in ``nn.ParameterList``).
    Duplicates (shared tensors) are kept once, first name wins.
    """
    if isinstance(obj, nn.Module):
        items: Named = list(obj.named_parameters())
    elif isinstance(obj, torch.Tensor):
        items = [("0", obj)]
    elif isinstance(obj, Iterable):
        items = []
        for i, x in enumerate(obj):
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor):
                items.append((str(x[0]), x[1]))
            elif isinstance(x, torch.Tensor):
                items.append((str(i), x))
            elif isinstance(x, dict) and "params" in x:
                raise TypeError(f"{fn}: pass tensors or a module, not optimizer param groups")
            else:
                raise TypeError(f"{fn}: expected tensors, (name, tensor) pairs or a module, got {type(x).__name__}")
    else:
        raise TypeError(f"{fn}: expected a module, a tensor or an iterable of tensors, got {type(obj).__name__}")
    seen: set[int] = set()
    out: Named = []
    for name, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def refuse_inside_step(fn: str, origin: str) -> None:
    """Rules are declared outside steps (their tensors must hold committed values)."""
    if context.explicit or any(a.journal is not None and a.journal.entries for a in context.attachments):
        raise UpdateError(
            f"{fn} at {origin} was called while a step with pending updates is in progress. "
            "Declare rules before training (or between steps)."
        )


class WeakList:
    """Tensors held weakly (a rule must not keep a model alive), in declaration order."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._refs = [weakref.ref(t) for t in tensors]

    def live(self) -> list[torch.Tensor]:
        return [t for r in self._refs if (t := r()) is not None]

    def alive(self) -> bool:
        return any(r() is not None for r in self._refs)


_data_ptr = torch._C.TensorBase.data_ptr


def storage_key(ts: list[torch.Tensor], sub: bool = True) -> tuple[int, ...]:
    """Identity of the storage behind each tensor: changes when ``.data`` is replaced (``model.to()``).

    ``sub``: some tensor may be a ``pu.Parameter`` (then skip its ``__torch_function__``).
    """
    with plain_if(sub):
        return tuple(map(_data_ptr, ts))


def where(t: torch.Tensor) -> str:
    return f"{t.device}/{str(t.dtype).removeprefix('torch.')}/{tuple(t.shape)}"
