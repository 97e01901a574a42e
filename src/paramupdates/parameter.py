"""``pu.Parameter``: a ``torch.nn.Parameter`` that may have custom updates.

Inside a step, every use of a ``pu.Parameter`` (any op, ``print``, indexing,
passing it to a module) sees its pending value: the updates issued before the
read, in program order (read-your-writes). Its
storage is written only at commit (deferred commit, rule 2). Outside a step it is an ordinary
parameter.
"""

from __future__ import annotations

from typing import Any

import torch

from . import guards, state
from .updates import issue

_empty_like = torch.empty_like

# Attributes that describe the parameter object itself, never its value. (``data`` is the value:
# ``p.data.clone()`` and ``p.data.norm()`` in legacy code read the pending value, as every use does.)
_STATE_ATTRS = frozenset(
    {
        "grad",
        "_grad",
        "grad_dtype",  # (dynamo reads it of a leaf it wraps: of the parameter, not of its pending value)
        "requires_grad",
        "is_leaf",
        "grad_fn",
        "_grad_fn",
        "_version",
        "_base",
        "retains_grad",
        "_backward_hooks",
        "_post_accumulate_grad_hooks",
        "names",
        "shape",
        "dtype",
        "device",
        "layout",
        "is_cuda",
        "ndim",
        "_cdata",
        "output_nr",
    }
)
# Methods that act on the object (hooks, storage, in-place writes), never on its value.
_OBJECT_METHODS = frozenset(
    {
        "backward",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "retain_grad",
        "__setstate__",
        "__reduce_ex__",
        "__deepcopy__",
        "untyped_storage",
        "storage",
        "_typed_storage",
        "data_ptr",
        "is_shared",
        "__setitem__",
        "size",
        "dim",
        "numel",
        "element_size",
        "stride",
        "storage_offset",
        "is_contiguous",
        "__len__",
        "__hash__",
    }
)


def _sub(a: Any) -> Any:
    if isinstance(a, Parameter):
        e = state.process.pu_pending.get(id(a))
        if e is not None and e.target is a and e.value is not None:
            return e.value
        return a
    if isinstance(a, list | tuple) and a and any(isinstance(x, Parameter) for x in a):
        return type(a)(_sub(x) for x in a)
    return a


def _substitutes(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        if name != "__get__":
            return False
        return getattr(getattr(func, "__self__", None), "__name__", "") not in _STATE_ATTRS
    if name in _OBJECT_METHODS:
        return False
    return not (name.endswith("_") and not name.endswith("__"))


# A function of ``func`` alone: dynamo evaluates it once at trace time (what
# ``torch._dynamo.assume_constant_result`` sets; set directly so that importing
# paramupdates does not import dynamo).
_substitutes._dynamo_marked_constant = True  # type: ignore[attr-defined]


class Parameter(torch.nn.Parameter):
    """A parameter that may take custom updates (``assign``, ``assign_add``, ...).

    Args:
        data: the initial value.
        trainable: whether the optimizer updates it (sets ``requires_grad``);
            ``None`` means ``not auxiliary``.
        auxiliary: ``True`` marks state updated by custom updates only
            (running statistics, counters, codebooks); it implies
            ``trainable=False`` unless ``trainable=True`` is given.
        weight_decay: a per-parameter rate that ``pu.weight_decay`` uses
            instead of its global rate (``0.0`` exempts the parameter).

    An unphased update of a trainable ``pu.Parameter`` inside a step raises
    :class:`~paramupdates.AmbiguousOrderError`: say ``phase="before_grad"`` or
    ``phase="after_grad"``.
    """

    auxiliary: bool
    weight_decay: float | None
    reads_pending = True  # reads see the pending value (overlay.shows_through)

    def __new__(
        cls,
        data: torch.Tensor | None = None,
        requires_grad: bool | None = None,
        *,
        trainable: bool | None = None,
        auxiliary: bool = False,
        weight_decay: float | None = None,
    ) -> Parameter:
        if trainable is None:
            trainable = requires_grad if requires_grad is not None else not auxiliary
        if data is None:
            data = torch.empty(0)
        with torch._C.DisableTorchFunctionSubclass():
            base = data.detach() if isinstance(data, torch.Tensor) else torch.as_tensor(data)
        t = torch.Tensor._make_subclass(cls, base, bool(trainable))
        t.auxiliary = bool(auxiliary)
        t.weight_decay = weight_decay
        return t

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: D107 - all done in __new__
        pass

    @property
    def trainable(self) -> bool:
        """Whether the optimizer updates this parameter (``requires_grad``)."""
        return bool(self.requires_grad)

    @trainable.setter
    def trainable(self, value: bool) -> None:
        self.requires_grad_(bool(value))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if state.process.pu_pending and _substitutes(func):
            args = tuple(_sub(a) for a in args)
            if kwargs:
                kwargs = {k: _sub(v) for k, v in kwargs.items()}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is _empty_like and args and isinstance(args[0], Parameter):
            guards.note_materialized(out, args[0])  # to_empty(): the index keeps the pu.Parameter type
        return out

    # -- methods: the update functions, bound ----------------------------
    def assign(self, value: Any, *, phase: str | None = None, sync: str | None = None) -> None:
        """``self <- value``; see :func:`paramupdates.assign`."""
        issue("assign", self, value, None, phase, sync)

    def assign_add(self, delta: Any, *, phase: str | None = None, sync: str | None = None) -> None:
        """``self <- self + delta``; see :func:`paramupdates.assign_add`."""
        issue("assign_add", self, delta, None, phase, sync)

    def assign_sub(self, delta: Any, *, phase: str | None = None, sync: str | None = None) -> None:
        """``self <- self - delta``; see :func:`paramupdates.assign_sub`."""
        issue("assign_sub", self, delta, None, phase, sync)

    def assign_key(self, key: Any, value: Any, *, phase: str | None = None, sync: str | None = None) -> None:
        """``self[key] <- value``; see :func:`paramupdates.assign_key`."""
        issue("assign_key", self, value, key, phase, sync)

    # -- copying and pickling keep the subclass and its attributes --------
    def __deepcopy__(self, memo: dict[int, Any]) -> Parameter:
        if id(self) in memo:
            return memo[id(self)]
        with torch._C.DisableTorchFunctionSubclass():
            data = self.detach().clone(memory_format=torch.preserve_format)
        out = Parameter(data, trainable=self.requires_grad, auxiliary=self.auxiliary, weight_decay=self.weight_decay)
        memo[id(self)] = out
        return out

    def __copy__(self) -> Parameter:
        """``copy.copy(p)``: a parameter sharing the storage of the value ``p`` shows (its pending value
        inside a step, read-your-writes, rule 1), as ``copy.copy`` of a ``torch.nn.Parameter`` shares its
        storage. (``copy.deepcopy`` and pickling save the stored value: serialization sees stored values.)"""
        with torch._C.DisableTorchFunctionSubclass():
            data = _sub(self).detach()
        return Parameter(data, trainable=self.requires_grad, auxiliary=self.auxiliary, weight_decay=self.weight_decay)

    def __reduce_ex__(self, proto: int) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            data = self.detach()
        return (_rebuild, (data, self.requires_grad, self.auxiliary, self.weight_decay))

    @classmethod
    def pu_rebuild(cls, old: Parameter, new: torch.nn.Parameter) -> Parameter:
        """``new`` (a plain parameter that replaces ``old``, e.g. from ``load_state_dict(assign=True)``)
        as a ``pu.Parameter`` with ``old``'s attributes, sharing ``new``'s storage."""
        return cls(new, trainable=new.requires_grad, auxiliary=old.auxiliary, weight_decay=old.weight_decay)

    def __repr__(self) -> str:
        kind = "auxiliary " if self.auxiliary else ""
        with torch._C.DisableTorchFunctionSubclass():
            value = _sub(self)
            body = torch.Tensor.__repr__(value if value is not self else self.detach())
        return f"pu.Parameter ({kind}{'trainable' if self.requires_grad else 'not trainable'}) containing:\n{body}"


def _rebuild(data: torch.Tensor, requires_grad: bool, auxiliary: bool, weight_decay: float | None) -> Parameter:
    return Parameter(data, trainable=requires_grad, auxiliary=auxiliary, weight_decay=weight_decay)


# torch.load(weights_only=True), the default since torch 2.6, loads only allowlisted globals: a
# state_dict(keep_vars=True) or a whole model holding pu.Parameters pickles _rebuild.
torch.serialization.add_safe_globals([Parameter, _rebuild])
