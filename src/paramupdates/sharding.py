"""Sharded tensors in the core: local views, and the hooks a sharding integration fills.

A sharded parameter (a ``torch.distributed.tensor.DTensor``, as FSDP2's
``fully_shard`` makes them) is written by paramupdates through its *local
shard*: every elementwise write of a commit (pending values, rollback copies,
weight decay, EMA, elementwise constraints) is the same math on each rank's
own shard, with no communication, because an elementwise op commutes with
sharding. What needs the whole tensor (norms over a sharded dim, the decision
on non-finite values, ``sync=``) is the integration's job.

This module imports nothing from ``torch.distributed``: a program that never
loaded DTensor pays one ``sys.modules`` lookup per call. The integration
(``integrations/fsdp.py``) registers a :class:`ShardingHooks` object with
``hooks.register_sharding_support``; the core calls it at the few marked
points (``# sharding hook`` in ``step.py``, ``journal.py``, ``commit.py``,
``rules/``) and nowhere else.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

    from .records import Entry
    from .seams import Commit, Journal, ModelIndex


def dtensor_type() -> type | None:
    """``DTensor`` if ``torch.distributed.tensor`` is loaded (else no tensor can be one)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return None if mod is None else getattr(mod, "DTensor", None)


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (sharded or replicated over a device mesh)."""
    dt = dtensor_type()
    return dt is not None and isinstance(t, dt)


def any_sharded(ts: Sequence[Any]) -> bool:
    """Whether any of ``ts`` is a DTensor (one pass over their types, in C)."""
    dt = dtensor_type()
    return dt is not None and any(issubclass(k, dt) for k in set(map(type, ts)))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself for a plain tensor).

    The DTensor's ``_local_tensor``: what ``DTensor.to_local()`` returns under
    ``no_grad`` (the same object, so writes reach the parameter; FSDP2's
    sharded parameter keeps its data there, ``FSDPParam._sharded_local_tensor``).
    """
    dt = dtensor_type()
    if dt is not None and isinstance(t, dt):
        return t._local_tensor  # type: ignore[attr-defined]
    return t


def locals_of(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`local` of each tensor (the list itself when none is a DTensor)."""
    dt = dtensor_type()
    if dt is None or not any(issubclass(k, dt) for k in set(map(type, ts))):  # (torch.optim loads DTensor)
        return ts
    return [t._local_tensor if isinstance(t, dt) else t for t in ts]  # type: ignore[attr-defined]


def storage_ok(t: torch.Tensor) -> bool:
    """Whether the memory behind ``t`` (its local shard) covers every element it addresses.

    FSDP frees its unsharded parameters by resizing their storage to 0 bytes
    (``free_storage`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``):
    a write into such a tensor is a write into freed memory.
    """
    t = local(t)
    n = t.numel()
    if n == 0:
        return True
    extent = t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 1)
    try:
        return t.untyped_storage().nbytes() >= extent * t.element_size()
    except (RuntimeError, NotImplementedError):  # pragma: no cover - tensors without storage (functional)
        return True


class ShardingHooks:
    """What a sharding integration provides; the base class is "nothing is sharded".

    Every method is called by the core at one marked point. Subclasses
    override what they support.
    """

    def check_model(self, model: nn.Module, optimizer: Any, label: str) -> None:
        """At ``pu.attach`` / ``pu.Stepper`` / ``pu.step``: refuse models the integration cannot serve."""

    def check_declared(self, tensors: Sequence[tuple[str, torch.Tensor]], root: Any, fn: str, origin: str) -> None:
        """At a rule's declaration: refuse tensors the rule cannot be correct on (flat parameters)."""

    def check_update(self, journal: Journal, e: Entry, fn: str, origin: str) -> None:
        """At the first update of a target in a step (before anything is recorded)."""

    def operand(self, e: Entry, operand: Any, fn: str, origin: str) -> Any:
        """The operand of an update of a sharded target, laid out like the target."""
        return operand

    def conform(self, e: Entry, value: torch.Tensor) -> torch.Tensor:
        """A pending value of a sharded target, placed like the target (so its local shard is the target's)."""
        return value

    def model_sharded(self, index: ModelIndex) -> bool:
        """Whether the model holds sharded parameters (its ranks must decide together)."""
        return False

    def agree_nonfinite(self, commit: Commit, local_bad: bool) -> int:
        """How many ranks of the model's mesh have non-finite pending values (one small collective)."""
        return 0

    def lost_rules(self, index: ModelIndex, rules: list[Any]) -> None:
        """At a commit: rules about to be dropped because their tensors died (raise to explain why)."""

    def copy_module(self, model: nn.Module) -> nn.Module | None:
        """``pu.ema``'s averaged copy of a sharded model (None: ``copy.deepcopy`` does)."""
        return None

    def follow_copy(self, copy: nn.Module, model: nn.Module) -> None:
        """``pu.ema`` declared before sharding: lay out the averaged copy as the model now is."""
