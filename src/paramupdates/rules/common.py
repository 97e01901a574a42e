"""What the built-in rules share: collecting declared tensors, weak holding, storage keys."""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .. import context, hooks, sharding
from ..errors import UpdateError

Named = list[tuple[str, torch.Tensor]]

no_subclass = torch._C.DisableTorchFunctionSubclass
"""Context in which a ``pu.Parameter`` is a plain tensor to foreach kernels (no overlay lookup)."""

_PLAIN = (torch.Tensor, nn.Parameter)
_PLAIN_SET = frozenset(_PLAIN)


def any_none(xs: list[Any]) -> bool:
    """``None in xs`` by identity, mapped in C (``in`` would call ``Tensor.__eq__``)."""
    return any(map(operator.is_, xs, itertools.repeat(None)))


def has_subclass(ts: list[torch.Tensor]) -> bool:
    """Whether any tensor has a ``__torch_function__`` subclass (``pu.Parameter``)."""
    return not set(map(type, ts)) <= _PLAIN_SET  # (one pass over the types, in C)


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
    if context.explicit or any(
        a.journal is not None and (a.journal.entries or a.journal.rows) for a in context.attachments
    ):
        raise UpdateError(
            f"{fn} at {origin} was called while a step with pending updates is in progress. "
            "Declare rules before training (or between steps)."
        )


def check_declared(named: Named, root: Any, fn: str, origin: str) -> None:
    """Refuse tensors no rule can be correct on (flat parameters of FSDP1 / DeepSpeed), at declaration."""
    support = hooks.sharding_support()  # sharding hook
    if support is not None:
        support.check_declared(named, root, fn, origin)


class WeakList:
    """Tensors held weakly (a rule must not keep a model alive), in declaration order.

    Declared on a module (``root``, with the tensors' qualified names), the
    list follows the module's tensors by name: when a tensor dies because its
    module slot now holds another one (``fully_shard`` replaces every
    parameter by a sharded ``DTensor`` parameter), the rule takes the new one.
    Tensors given without their module are held by identity only.
    """

    def __init__(
        self, tensors: list[torch.Tensor], root: nn.Module | None = None, names: list[str] | None = None
    ) -> None:
        self._refs = [weakref.ref(t) for t in tensors]
        self._root = weakref.ref(root) if root is not None else None
        self._names = names
        self.meta = [(tuple(t.shape), t.dtype) for t in tensors]  # what a lost tensor was (for errors)

    def current(self) -> list[torch.Tensor | None]:
        """Each declared tensor (None where it died and could not be followed)."""
        out = [r() for r in self._refs]
        if self._root is not None and any_none(out):
            self._follow(out)
        return out

    def _follow(self, out: list[torch.Tensor | None]) -> None:
        root = self._root() if self._root is not None else None
        if root is None or self._names is None:
            return
        for i, t in enumerate(out):
            if t is None:
                try:
                    t = root.get_parameter(self._names[i])
                except AttributeError:
                    try:
                        t = root.get_buffer(self._names[i])
                    except AttributeError:
                        continue
                if t is not None:
                    self._refs[i] = weakref.ref(t)
                    out[i] = t

    def resync(self) -> bool:
        """Take the tensor now in each named slot of ``root`` where it is another object (or ours died);
        True if any changed. One lookup per tensor: run when ownership is recomputed, not per commit."""
        root = self._root() if self._root is not None else None
        if root is None or self._names is None:
            return False
        changed = False
        for i, name in enumerate(self._names):
            try:
                t = root.get_parameter(name)
            except AttributeError:
                try:
                    t = root.get_buffer(name)
                except AttributeError:
                    continue
            old = self._refs[i]()
            if t is not None and t is not old:
                if old is not None and sharding.is_sharded(old) and not sharding.is_sharded(t):
                    continue  # inside FSDP's forward/backward: its temporary unsharded parameter, not a successor
                self._refs[i] = weakref.ref(t)
                changed = True
        return changed

    def live(self) -> list[torch.Tensor]:
        return [t for t in self.current() if t is not None]

    def alive(self) -> bool:
        for r in self._refs:  # (the first is alive in the common case: no pass over all of them)
            if r() is not None:
                return True
        return not all(map(operator.is_, self.current(), itertools.repeat(None)))  # followed by name?


_data_ptr = torch._C.TensorBase.data_ptr


def storage_key(ts: list[torch.Tensor], sub: bool = True) -> tuple[int, ...]:
    """Identity of the storage behind each tensor: changes when ``.data`` is replaced (``model.to()``).

    ``sub``: some tensor may be a ``pu.Parameter`` (then skip its ``__torch_function__``). A DTensor
    is keyed by its local shard (the DTensor itself has no storage: its ``data_ptr()`` is 0).
    """
    ts = sharding.locals_of(ts)
    with plain_if(sub):
        return tuple(map(_data_ptr, ts))


def where(t: torch.Tensor) -> str:
    return f"{t.device}/{str(t.dtype).removeprefix('torch.')}/{tuple(t.shape)}"
