"""Rollback of a commit: the copies that let an exception restore everything bitwise (validated commit, rule 7).

With ``copy_for_rollback=True``, before a commit writes a tensor while a fallible stage
(the optimizer step, a rule that runs user code) is still to come, it copies
the tensor (and, before the optimizer's step, the optimizer's state), so that
an exception restores them bitwise: :class:`Rollback`. Nothing is copied once
no fallible stage is left: what is written after the last one cannot be
undone by a failure, because no failure can follow it.

Where the copies live (:class:`SnapshotPool`):

* CPU tensors are copied into buffers kept from the previous commit that
  copied the same tensors (one ``torch._foreach_copy_`` per dtype). A fresh
  CPU allocation of a large copy is page-faulted in on every step (measured:
  ``torch._foreach_clone`` of 3 M float32 elements costs 2.9x a
  ``torch._foreach_copy_`` into kept buffers). The buffers are one extra copy
  of what the last commit protected, no more: plans that a commit did not use
  are dropped when it ends.
* A commit that finds the buffers held by another commit still running (one
  nested in the other's optimizer step) takes fresh copies.
* Accelerator tensors get fresh copies (``torch._foreach_clone``): the caching
  allocator already reuses that memory, and a kept copy would hold memory that
  activations need between steps.

A kept plan is reused only for the same tensors (identity), the same storage
(``data_ptr``) and the same sizes, so a ``model.to()``, a ``.data =`` or a
reshaped view makes a new one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .. import sharding

_data_ptr = torch._C.TensorBase.data_ptr
_size = torch._C.TensorBase.size

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..seams import Restorable

Copies = list[tuple[list[torch.Tensor], list[torch.Tensor]]]


def clone_all(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh bitwise copies of ``ts`` (one foreach call where available)."""
    clone = getattr(torch, "_foreach_clone", None)
    if clone is not None:
        return list(clone(ts))
    return [t.clone() for t in ts]  # pragma: no cover - torch without _foreach_clone


class SnapshotPool:
    """Rollback copies for the commits on one model and optimizer (see the module docstring)."""

    def __init__(self) -> None:
        self._plans: dict[Any, list[tuple[list[torch.Tensor], list[torch.Tensor] | None]]] = {}
        self._used: set[Any] = set()
        self._holder: Any = None  # the commit using the kept buffers now

    def claim(self, commit: Any) -> bool:
        """Whether ``commit`` may use the kept buffers (no other commit holds them)."""
        if self._holder is None:
            self._holder = commit
        return self._holder is commit

    def copies(self, ts: list[torch.Tensor]) -> Copies:
        """``(tensors, copies)`` per device and dtype: bitwise copies of ``ts`` as they are now."""
        key = (tuple(map(id, ts)), tuple(map(_data_ptr, ts)), tuple(map(_size, ts)))
        plan = self._plans.get(key)
        out: Copies = []
        if plan is None:
            plan = []
            for (dev, _dt), ([group], _) in _group_tensors_by_device_and_dtype([ts]).items():
                group = list(group)
                copies = clone_all(group)
                plan.append((group, copies if dev.type == "cpu" else None))
                out.append((group, copies))
            self._plans[key] = plan
        else:
            for group, kept in plan:
                if kept is None:
                    out.append((group, clone_all(group)))
                else:
                    torch._foreach_copy_(kept, group)
                    out.append((group, kept))
        self._used.add(key)
        return out

    def end_commit(self, commit: Any) -> None:
        """Release the buffers held by ``commit``; drop the plans it did not use (their buffers with them).

        A commit that copied nothing (a micro-batch step without an optimizer,
        a skipped step) keeps them: the next real update needs them again.
        """
        if self._holder is not commit:
            return
        self._holder = None
        if not self._used:
            return
        if len(self._plans) != len(self._used):
            self._plans = {k: v for k, v in self._plans.items() if k in self._used}
        self._used = set()

    def nbytes(self) -> int:
        """Bytes of the kept copies (live between commits)."""
        return sum(
            c.numel() * c.element_size() for plan in self._plans.values() for _, kept in plan if kept for c in kept
        )


def copies_of(pool: SnapshotPool | None, ts: list[torch.Tensor]) -> Copies:
    """Rollback copies of ``ts``, per device and dtype (kept buffers from ``pool`` on CPU)."""
    if pool is not None:
        return pool.copies(ts)
    return [(list(g), clone_all(list(g))) for _k, ([g], _) in _group_tensors_by_device_and_dtype([ts]).items()]


class Rollback:
    """What one commit must restore if it fails after writing (see the module docstring).

    ``fallible_left``: fallible stages (the optimizer's step, rules that are not
    ``infallible``) still to run; copies are taken only while it is positive.
    ``enabled=False`` (the default: ``copy_for_rollback=False``) takes none.
    """

    def __init__(self, enabled: bool, pool: SnapshotPool | None) -> None:
        self.enabled = enabled
        self.pool = pool
        self.fallible_left = 1 << 30
        self._protected: set[int] = set()
        self._snapshots: Copies = []
        self._opt_saved: dict[int, tuple[torch.Tensor, dict | None]] | None = None
        self._optimizer: Any = None
        self._rules: list[tuple[Restorable, Any]] = []
        self._applied: set[int] = set()  # id() of the rules that applied

    def applied(self, rule: Restorable) -> None:
        """``rule`` has written (it keeps its state unless everything is restored)."""
        self._applied.add(id(rule))

    def release(self) -> None:
        """Without copies nothing is restored: the rules that did not apply let go of what their
        checks held; those that did keep their state (it matches what they wrote)."""
        for r, saved in self._rules:
            if id(r) not in self._applied:
                r.restore(saved)

    def needs_copies(self) -> bool:
        """Whether :meth:`protect` copies anything now (copies on, a fallible stage still to come)."""
        return self.enabled and self.fallible_left > 0

    def stage_done(self, fallible: bool) -> None:
        """One stage of the commit has run (a fallible one lowers the count)."""
        if fallible:
            self.fallible_left -= 1

    def protect(self, tensors: list[torch.Tensor]) -> None:
        """Copy tensors not yet copied in this commit (before their first write).

        Tensors are keyed by identity; a tensor and an alias of its memory may
        both be copied, which is harmless because :meth:`restore` restores in
        reverse order (the oldest copy wins).
        """
        if not self.enabled or self.fallible_left <= 0:
            return
        seen = self._protected
        fresh = [t for t in tensors if id(t) not in seen]
        if not fresh:
            return
        seen.update(map(id, fresh))
        fresh = sharding.locals_of(fresh)  # sharding hook: a DTensor is copied (and restored) through its local shard
        pool = self.pool if self.pool is not None and self.pool.claim(self) else None  # (one commit, one Rollback)
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            self._snapshots.extend(copies_of(pool, fresh))

    def protect_optimizer(self, optimizer: torch.optim.Optimizer, all_params: bool) -> None:
        """Copy the parameters the optimizer will update (all of them when it calls a closure) and its state."""
        if not self.enabled:
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if all_params or p.grad is not None]
        saved: dict[int, tuple[torch.Tensor, dict | None]] = {}
        tensors: list[torch.Tensor] = list(params)
        for p in params:
            st = optimizer.state.get(p)
            if st is None:
                saved[id(p)] = (p, None)
                continue
            saved[id(p)] = (p, {k: (list(v) if isinstance(v, list) else v) for k, v in st.items()})
            tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        self._opt_saved = saved
        self._optimizer = optimizer
        self.protect(tensors)

    def save_rules(self, rules: Sequence[Restorable]) -> None:
        """Keep the rules' Python-level state (counters) to restore."""
        self._rules = [(r, r.save()) for r in rules]

    def restore(self) -> None:
        """Restore every copied tensor, the optimizer's state and the rules' state."""
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for ts, copies in reversed(self._snapshots):
                torch._foreach_copy_(ts, copies)
        if self._opt_saved is not None:
            state = self._optimizer.state
            for p, st in self._opt_saved.values():
                if st is None:
                    state.pop(p, None)
                else:
                    state[p] = st
        for r, saved in self._rules:
            r.restore(saved)

    def end(self) -> None:
        """The commit is over: release the copies (kept CPU buffers go back to the pool)."""
        self._snapshots = []
        self._opt_saved = None
        self._rules = []
        self._applied = set()
        if self.pool is not None:
            self.pool.end_commit(self)
