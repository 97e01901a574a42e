"""``pu.weight_decay``: decoupled weight decay, phase ``before_grad``.

Math, for every covered parameter ``p`` that the optimizer updates in this
step (it is in one of the optimizer's param groups and has a gradient)::

    p <- p * (1 - lr_g * rate_p)     scale_by_lr=True  (lr_g: p's param group lr, read at commit)
    p <- p * (1 - rate_p)            scale_by_lr=False

``rate_p`` is ``p.weight_decay`` for a ``pu.Parameter`` that sets one, else the
rule's ``rate``. It is applied in phase ``before_grad``, i.e. before
``optimizer.step()``, which is exactly where ``torch.optim.AdamW`` decays
(``param.mul_(1 - lr * weight_decay)`` before the Adam update): so
``Adam(weight_decay=0)`` + ``pu.weight_decay(model, w)`` is ``AdamW(weight_decay=w)``.
Parameters without a gradient are skipped, as every ``torch.optim`` optimizer
skips them.

One ``torch._foreach_mul_`` (with a list of per-tensor factors) per device and
dtype; the grouping and the factors are cached and rebuilt only when the
learning rates, the param groups, the set of parameters with gradients, or the
tensors' storage (``model.to()``, ``.data =``) change. ``foreach=False`` runs the
readable reference path instead, ``p.mul_(1 - lr_g * rate_p)`` tensor by tensor
(bitwise the same result: ``tests/test_weight_decay.py``).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .. import sharding
from ..errors import UpdateError
from ..origin import call_site
from ..parameter import Parameter
from ..phases import BEFORE_GRAD
from .base import Rule, register
from .common import (
    OnTensorList,
    WeakList,
    adopt_known,
    any_none,
    check_declared,
    has_subclass,
    named_tensors,
    plain_if,
    refuse_inside_step,
    storage_key,
)

if TYPE_CHECKING:
    from .base import CommitContext

Exclude = Callable[[str, torch.Tensor], bool]
_grad_of = torch._C.TensorBase.grad.__get__  # the C getter, mapped without a Python-level loop


def skip_1d(name: str, tensor: torch.Tensor) -> bool:
    """The default ``exclude``: tensors with at most one dimension (biases, norm scales, scalars)."""
    return tensor.ndim <= 1


class WeightDecay(OnTensorList, Rule):
    """Decoupled weight decay (see the module docstring for the math)."""

    phase = BEFORE_GRAD
    kind = "weight_decay"
    infallible = True  # foreach mul by Python floats on floating tensors: validated at declaration
    per_optimizer_update = True

    def __init__(
        self,
        named: list[tuple[str, torch.Tensor, float]],
        scale_by_lr: bool,
        origin: str,
        foreach: bool = True,
        root: nn.Module | None = None,
    ) -> None:
        super().__init__(origin)
        self.foreach = foreach
        self.names = [n for n, _, _ in named]
        self.rates = [r for _, _, r in named]
        # declared on a module: follows its parameters by name (e.g. into fully_shard's DTensors)
        self._tensors = WeakList([t for _, t, _ in named], root, self.names if root is not None else None)
        self.scale_by_lr = scale_by_lr
        self._key: tuple | None = None
        # indices into the declared tensors, never the tensors (a rule must not keep them alive)
        self._groups: list[tuple[list[int], list[Any]]] = []
        self._written: list[int] = []
        self._factors: list[float] = []  # per written tensor: the reference path's Python factors
        self._all = False
        self._direct = False  # _all, in one group in declaration order: apply to the live list as is
        self._live: list[Any] = []
        self._written_ts: list[torch.Tensor] = []
        self._sub = has_subclass([t for _, t, _ in named])
        self._warned: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def owner_tensors(self) -> list[torch.Tensor]:
        return self._tensors.live()

    def resync(self) -> None:
        if self._tensors.resync():
            self._key = None  # another tensor in a slot: plan again

    def tensors(self) -> list[torch.Tensor]:
        """What the coming (or last) commit decays; all covered tensors before the first commit."""
        if self._key is None:
            return self._tensors.live()
        if self._live:
            return self._written_ts
        live = self._tensors.current()
        return [t for i in self._written if (t := live[i]) is not None]

    def alive(self) -> bool:
        return self._tensors.alive()

    def same_kind(self) -> Any:
        return "weight_decay"  # two decays of one tensor are never meant

    def settings(self) -> Any:
        live = self._tensors.current()
        return (self.scale_by_lr, self.foreach, sorted((id(t), r) for t, r in zip(live, self.rates)))

    def describe(self) -> str:
        return "pu.weight_decay"

    def drop(self, ids: set[int]) -> bool:
        keep = self.keep_except(ids)
        self.rates = [self.rates[i] for i in keep]
        return not keep

    # --- plan ------------------------------------------------------------------
    def check(self, ctx: CommitContext) -> None:
        opt = ctx.optimizer
        if opt is None:  # pragma: no cover - Commit._take_rules drops per-update rules without optimizer
            return
        live = self._tensors.current()
        small = self._opt_key(opt, live)
        # the storage too: model.to() / .data = change the device and dtype the cached groups and factors are for
        key = (small, storage_key([t for t in live if t is not None], self._sub))
        if key != self._key:
            has_grad = small[-1]
            self._build(opt, live, (True,) * len(live) if has_grad is True else has_grad)
            self._key = key
        self._hold(live)

    def _opt_key(self, opt: torch.optim.Optimizer, live: list[Any]) -> tuple:
        """What the plan depends on besides storage: the param groups, their lrs, which tensors have a gradient."""
        with plain_if(self._sub):
            grads = (
                list(map(_grad_of, live)) if not any_none(live) else [None if t is None else _grad_of(t) for t in live]
            )
        # the common case (every tensor alive with a gradient) without a per-tensor Python test
        has_grad: tuple[bool, ...] | bool = True if not any_none(grads) else tuple(g is not None for g in grads)
        groups = opt.param_groups
        lrs = tuple([float(g["lr"]) for g in groups]) if self.scale_by_lr else ()
        return (
            id(opt),
            tuple([id(g["params"]) for g in groups]),
            tuple([len(g["params"]) for g in groups]),
            lrs,
            has_grad,
        )

    def _hold(self, live: list[Any]) -> None:
        self._live = live  # held for this commit only
        self._written_ts = live if self._all else [live[i] for i in self._written]

    def fingerprint(self) -> list[torch.Tensor] | None:
        live = self._live
        return None if not live or any_none(live) else live

    def revalidate(self, ctx: CommitContext, held: list[torch.Tensor]) -> bool:
        opt = ctx.optimizer
        if opt is None or self._key is None or self._opt_key(opt, held) != self._key[0]:
            return False
        self._hold(held)
        return True

    def _build(self, opt: torch.optim.Optimizer, live: list[Any], has_grad: tuple[bool, ...]) -> None:
        group_of: dict[int, int] = {}
        for gi, g in enumerate(opt.param_groups):
            for q in g["params"]:
                group_of.setdefault(id(q), gi)
        ts: list[torch.Tensor] = []
        written: list[int] = []
        factors: list[float] = []
        double: list[str] = []
        for i, (t, name, rate, grad) in enumerate(zip(live, self.names, self.rates, has_grad)):
            if t is None or not grad or rate == 0.0:
                continue
            gi = group_of.get(id(t))
            if gi is None:
                continue  # not updated by this optimizer
            g = opt.param_groups[gi]
            if g.get("weight_decay", 0) and len(double) < 3:
                double.append(name)
            lr = float(g["lr"]) if self.scale_by_lr else 1.0
            ts.append(t)
            written.append(i)
            factors.append(1.0 - lr * rate)
        if double and opt not in self._warned:
            self._warned.add(opt)
            warnings.warn(
                f"pu.weight_decay (declared at {self.origin}) and {type(opt).__name__}(weight_decay=...) both decay "
                f"{', '.join(repr(n) for n in double)}: the parameters are decayed twice. Set the optimizer's "
                "weight_decay=0 (or drop pu.weight_decay).",
                stacklevel=2,
            )
        self._written = written
        self._factors = factors
        self._all = written == list(range(len(live)))  # every covered tensor is decayed (the common case)
        self._groups = []
        if ts:
            grouped = _group_tensors_by_device_and_dtype([ts], with_indices=True)
            for (dev, dt), (_, idx) in grouped.items():
                fs: list[Any] = [factors[i] for i in idx]
                if dev.type == "cpu":
                    # 0-dim factors, in float32 (float64 for float64 tensors): on CPU this is 2-3x faster
                    # than a Python scalar (no scalar wrapped per tensor), gives the products of
                    # Tensor.mul_(scalar) bitwise, and is also right for bfloat16/float16, where
                    # torch._foreach_mul_(ts, scalar) on CPU rounds the scalar to the tensors' dtype first
                    # (1 - 1e-3 becomes 1.0 in bfloat16) while Tensor.mul_ computes in float32.
                    fs = list(torch.tensor(fs, dtype=torch.float64 if dt == torch.float64 else torch.float32).unbind())
                self._groups.append(([written[i] for i in idx], fs))
        self._direct = self._all and len(self._groups) == 1 and self._groups[0][0] == written

    def restore(self, saved: Any) -> None:
        self._live, self._written_ts = [], []  # a failed commit: hold nothing past it

    # --- commit ------------------------------------------------------------------
    def apply(self, ctx: CommitContext) -> None:
        # elementwise: a DTensor (FSDP2) decays its local shard, with no communication
        live = sharding.locals_of(self._live)
        with plain_if(self._sub):
            if not self.foreach:  # the reference path: one tensor at a time
                for i, f in zip(self._written, self._factors):
                    live[i].mul_(f)
            elif self._direct:
                torch._foreach_mul_(live, self._groups[0][1])  # every covered tensor, one device and dtype, in order
            else:
                for idx, factors in self._groups:
                    torch._foreach_mul_([live[i] for i in idx], factors)
        self._live = []
        self._written_ts = []


def weight_decay(
    params: nn.Module | Any,
    rate: float,
    *,
    exclude: Exclude | None = skip_1d,
    scale_by_lr: bool = True,
    foreach: bool | None = None,
) -> WeightDecay:
    """Declare decoupled weight decay on ``params``; phase ``before_grad``.

    ``p <- p * (1 - lr * rate)`` (``scale_by_lr=True``, ``lr`` of ``p``'s param
    group, read at each commit, so schedulers apply) or ``p <- p * (1 - rate)``,
    before ``optimizer.step()``, once per optimizer update, for the parameters
    the optimizer updates in that step (in its param groups, with a gradient).

    Args:
        params: a module (its parameters, by qualified name), a tensor, or an
            iterable of tensors or ``(name, tensor)`` pairs (``model.named_parameters()``).
        rate: the decay rate (AdamW's ``weight_decay``), ``>= 0``.
        exclude: ``(qualified_name, tensor) -> bool``; ``True`` skips the tensor.
            The default skips tensors with ``ndim <= 1`` (biases, norm scales);
            ``None`` excludes nothing.
        scale_by_lr: multiply the rate by the learning rate (decoupled decay as
            in AdamW); ``False`` decays by ``rate`` alone.
        foreach: ``None``/``True``: one ``torch._foreach_mul_`` per device and dtype;
            ``False``: the per-tensor reference path (same result, bitwise).

    A ``pu.Parameter(weight_decay=r)`` uses ``r`` instead of ``rate``, and its
    explicit rate also overrides ``exclude`` (``weight_decay=0.0`` exempts it).
    A warning is issued once if the optimizer's own ``weight_decay`` is non-zero
    for a decayed parameter (double decay). Returns the rule (``.remove()`` undeclares it).
    """
    origin = call_site(2)
    if exclude is ...:  # the contract writes the default as "..."
        exclude = skip_1d
    rate = float(rate)
    if not rate >= 0.0:
        raise ValueError(f"pu.weight_decay at {origin}: rate must be >= 0, got {rate}")
    if exclude is not None and not callable(exclude):
        raise TypeError(f"pu.weight_decay at {origin}: exclude must be a callable (name, tensor) -> bool or None")
    chosen: list[tuple[str, torch.Tensor, float]] = []
    named = named_tensors(params, "pu.weight_decay")
    root = params if isinstance(params, nn.Module) else None
    refuse_inside_step("pu.weight_decay", origin, [t for _, t in named])
    check_declared(named, root, "pu.weight_decay", origin)
    for name, t in named:
        own = t.weight_decay if isinstance(t, Parameter) else None
        if own is None and exclude is not None and exclude(name, t):
            continue
        r = float(own) if own is not None else rate
        if not r >= 0.0:
            raise ValueError(f"pu.weight_decay at {origin}: {name!r} has weight_decay={own}; it must be >= 0")
        if not (t.is_floating_point() or t.is_complex()):
            if own is not None:
                raise UpdateError(
                    f"pu.weight_decay at {origin}: {name!r} is {t.dtype}, not floating point, but asks for "
                    f"weight_decay={own}. Decay applies to floating tensors: give it weight_decay=None (or 0.0)."
                )
            continue
        chosen.append((name, t, r))
    rule = WeightDecay(chosen, bool(scale_by_lr), origin, foreach is not False, root)
    adopt_known(rule, root)
    register(rule)
    return rule
