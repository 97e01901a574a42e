"""``pu.ema``: an exponential moving average of a model's weights, phase ``after_step``.

Math, once per optimizer update, for each floating tensor ``a`` of the
averaged copy and its source ``p`` in the model (parameters, and buffers when
``include_buffers``)::

    a <- a + (1 - d_t) * (p - a)          # torch._foreach_lerp_(a, p, 1 - d_t)
    d_t = decay                                        warmup=None
    d_t = min(decay, (1 + t) / (warmup + t))           warmup=W (a number; True means 10,
                                                       TensorFlow's num_updates formula)
    d_t = warmup(t)                                    warmup a callable
    t   = the number of EMA updates before this one (0, 1, 2, ...)

Non-floating buffers (``num_batches_tracked``) are copied, not averaged; with
``include_buffers=False`` every buffer is copied, so the copy evaluates with the
model's current statistics.

It runs in phase ``after_step``, after every other phase of the commit, so it
averages the values just committed: the new weights and the running statistics
of this step. Under gradient accumulation it runs once per optimizer update.

The copy starts as ``copy.deepcopy(model)`` at declaration (``requires_grad``
off, ``eval()`` mode); its tensors belong to no step's model. Its state (the
copy's ``state_dict`` and ``t``) is in the ``state_dict()`` of every Stepper or
attachment whose model owns the averaged tensors.

``torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay),
use_buffers=True)`` computes the same floating-point average bitwise, except:
its first ``update_parameters`` copies instead of averaging (call it once at
creation to align), and it "averages" integer buffers in float and truncates
(``num_batches_tracked`` stops growing), where this copies them.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from ..errors import UpdateError
from ..origin import call_site
from ..phases import AFTER_STEP
from ..schedule import ScheduleEntry
from .base import Rule, register
from .common import has_subclass, no_subclass, plain_if, refuse_inside_step, storage_key, where

if TYPE_CHECKING:
    from ..commit import CommitContext
    from ..targets import ModelIndex

Warmup = bool | float | int | Callable[[int], float] | None

_BY_COPY: weakref.WeakKeyDictionary[nn.Module, weakref.ref[EMA]] = weakref.WeakKeyDictionary()


class EMA(Rule):
    """The averaging rule behind :func:`ema` (see the module docstring for the math)."""

    phase = AFTER_STEP
    kind = "ema"
    infallible = True  # foreach lerp/copy on pairs validated in check()
    per_optimizer_update = True
    foreach = True  # False: the per-tensor reference path (bitwise the same result)

    def __init__(
        self, model: nn.Module, module: nn.Module, decay: float, warmup: Warmup, include_buffers: bool, origin: str
    ) -> None:
        super().__init__(origin)
        self._model = weakref.ref(model)
        self.module = module
        self.decay = decay
        self.warmup = warmup
        self.include_buffers = include_buffers
        self.updates = 0
        names: list[str] = []
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        avg: list[bool] = []
        for kind in ("parameters", "buffers"):
            a = dict(getattr(model, f"named_{kind}")())
            b = dict(getattr(module, f"named_{kind}")())
            for name, t in a.items():
                names.append(name)
                src.append(t)
                dst.append(b[name])
                avg.append((t.is_floating_point() or t.is_complex()) and (kind == "parameters" or include_buffers))
        self.names = names
        self._src = src  # strong: the rule ends with the model (alive()), not with its tensors
        self._dst = dst
        self._avg = avg
        self._sub = has_subclass(src) or has_subclass(dst)
        self._pairs = src + dst  # what check() keys on
        self._key: tuple | None = None
        self._lerp: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._copy: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    # --- ownership -------------------------------------------------------
    def alive(self) -> bool:
        return self._model() is not None

    def owner_tensors(self) -> list[torch.Tensor]:
        return self._src

    def tensors(self) -> list[torch.Tensor]:
        return self._dst

    def rows(self, index: ModelIndex) -> list[ScheduleEntry]:
        n = sum(self._avg)
        what = f"ema of {n} tensors" + (f" (+{len(self._avg) - n} copied)" if n < len(self._avg) else "")
        return [ScheduleEntry(self.phase, what, f"ema(decay={self.decay})", "-", str(self.origin))]

    # --- math --------------------------------------------------------------
    def decay_at(self, t: int) -> float:
        """``d_t`` for the ``t``-th update (0-based)."""
        w = self.warmup
        if w is None or w is False:
            return self.decay
        if callable(w):
            d = float(w(t))
            if not 0.0 <= d <= 1.0:
                raise UpdateError(f"pu.ema (declared at {self.origin}): warmup({t}) returned {d}, not in [0, 1]")
            return d
        c = 10.0 if w is True else float(w)
        return min(self.decay, (1.0 + t) / (c + t))

    def check(self, ctx: CommitContext) -> None:
        """Before any write: the pairs still match (a moved model or copy is an error, not a half-update)."""
        key = storage_key(self._pairs, self._sub)
        if key != self._key:
            self._build()
            self._key = key
        self._weight = 1.0 - self.decay_at(self.updates)  # a user warmup callable fails here, before writes

    def fingerprint(self) -> list[torch.Tensor] | None:
        return self._pairs

    def revalidate(self, ctx: CommitContext, held: list[torch.Tensor]) -> bool:
        if self._key is None:
            return False
        self._weight = 1.0 - self.decay_at(self.updates)
        return True

    def _build(self) -> None:
        with no_subclass():
            for name, s, d in zip(self.names, self._src, self._dst):
                if s.shape != d.shape or s.dtype != d.dtype or s.device != d.device:
                    raise UpdateError(
                        f"pu.ema (declared at {self.origin}): {name!r} is {where(s)} in the model but {where(d)} in "
                        "the averaged copy. Move or cast the copy the same way as the model (ema_model.to(...)), "
                        "or declare pu.ema again. Nothing of this step was written."
                    )
            pairs = {True: ([], []), False: ([], [])}
            for s, d, a in zip(self._src, self._dst, self._avg):
                pairs[a][0].append(d)
                pairs[a][1].append(s)
            self._lerp, self._copy = [], []
            for flag, out in ((True, self._lerp), (False, self._copy)):
                dsts, srcs = pairs[flag]
                if dsts:
                    for _k, ([gd, gs], _) in _group_tensors_by_device_and_dtype([dsts, srcs]).items():
                        out.append((list(gd), list(gs)))

    def apply(self, ctx: CommitContext) -> None:
        w = self._weight
        with plain_if(self._sub):
            if not self.foreach:  # the reference path: one pair at a time
                for s, d, a in zip(self._src, self._dst, self._avg):
                    if a:
                        d.lerp_(s, w)
                    else:
                        d.copy_(s)
                self.updates += 1
                return
            for d, s in self._lerp:
                torch._foreach_lerp_(d, s, w)
            for d, s in self._copy:
                torch._foreach_copy_(d, s)
        self.updates += 1

    # --- state -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"module": the copy's state_dict, "updates": t, "decay": decay}`` (tensors by reference, as torch does)."""
        return {"module": self.module.state_dict(), "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])

    def save(self) -> Any:
        return self.updates

    def restore(self, saved: Any) -> None:
        self.updates = saved


def ema(
    model: nn.Module,
    decay: float,
    *,
    warmup: Warmup = None,
    include_buffers: bool = True,
    foreach: bool | None = None,
) -> nn.Module:
    """Declare an exponential moving average of ``model``; phase ``after_step``. Returns the averaged copy.

    After each optimizer update of a step whose model owns ``model``'s
    tensors, ``a <- lerp(a, p, 1 - d_t)`` for every floating parameter (and
    floating buffer if ``include_buffers``) ``p`` and its average ``a``; other
    buffers are copied. ``d_t``: ``decay``; with ``warmup=W`` (a number, or
    ``True`` for 10) ``min(decay, (1 + t) / (W + t))``; with a callable,
    ``warmup(t)``; ``t`` counts the EMA's updates from 0.

    The returned module is a deep copy of ``model`` (in ``eval()`` mode, no
    ``requires_grad``) to evaluate with. Tensors are bound at declaration:
    replacing a parameter or buffer object of ``model`` later (rather than
    writing it in place) is not followed. ``pu.rules.ema.rule_of(copy)`` is
    the rule (``.updates``, ``.remove()``). ``foreach=False`` runs the per-tensor
    reference path (``a.lerp_(p, 1 - d_t)`` pair by pair; bitwise the same result).
    """
    origin = call_site(2)
    refuse_inside_step("pu.ema", origin)
    if not isinstance(model, nn.Module):
        raise TypeError(f"pu.ema at {origin}: expected a torch.nn.Module, got {type(model).__name__}")
    decay = float(decay)
    if not 0.0 <= decay <= 1.0 or math.isnan(decay):
        raise ValueError(f"pu.ema at {origin}: decay must be in [0, 1], got {decay}")
    if warmup is not None and not isinstance(warmup, bool) and not callable(warmup):
        if not float(warmup) > 0:
            raise ValueError(f"pu.ema at {origin}: warmup must be None, True, a positive number or a callable")
    module = copy.deepcopy(model)
    module.requires_grad_(False)
    module.eval()
    rule = EMA(model, module, decay, warmup, bool(include_buffers), origin)
    rule.foreach = foreach is not False
    register(rule)
    _BY_COPY[module] = weakref.ref(rule)
    return module


def rule_of(averaged: nn.Module) -> EMA:
    """The :class:`EMA` rule that updates ``averaged`` (a module returned by :func:`ema`)."""
    ref = _BY_COPY.get(averaged)
    rule = ref() if ref is not None else None
    if rule is None:
        raise ValueError("not a module returned by pu.ema (or its model is gone)")
    return rule
