"""Storage for the rollback copies of atomic commits.

Before a commit writes a tensor while a fallible stage (the optimizer step, a
rule that runs user code) is still to come, it copies the tensor, so that an
exception restores it bitwise (rule 7). This module decides where the copies
live:

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

from typing import Any

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

_data_ptr = torch._C.TensorBase.data_ptr
_size = torch._C.TensorBase.size

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
        return sum(c.numel() * c.element_size() for plan in self._plans.values() for _, kept in plan if kept
                   for c in kept)

    def clear(self) -> None:
        self._plans.clear()
        self._used = set()
        self._holder = None
