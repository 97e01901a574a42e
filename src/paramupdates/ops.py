"""The update operations as pure functions, and operand validation.

Each op maps ``(old, operand) -> new`` out of place, so a recorded update
never writes storage (deferred commit, rule 2) and the same function serves the overlay
(read-your-writes), the commit fold and eager application:

* ``assign``:      ``new = operand`` (cast to the target's dtype, broadcast from 0-dim)
* ``assign_add``:  ``new = old + operand``
* ``assign_sub``:  ``new = old - operand``
* ``assign_key``:  ``new = old.clone(); new[key] = operand``

A condition ``pred`` (a 0-dim bool tensor) gives ``new = where(pred, new, old)``.

A recorded update keeps its operands *as issued* (:func:`as_issued`): the commit may fold the
update again over the value its phase finds, and must compute it from the values the update had
when it was issued, not from a tensor written since (a scratch buffer the user reuses, a view of a
parameter the optimizer steps). A pending value made under ``torch.inference_mode()`` is made a
normal tensor (:func:`normal`); one of a trainable target made under ``no_grad`` passes its
gradient to the value it replaced (:func:`overwritten`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .errors import UpdateError

OPS = ("assign", "assign_add", "assign_sub", "assign_key")


def apply_op(
    op: str, old: torch.Tensor, operand: Any, key: Any, cond: torch.Tensor | None, fresh: bool = False
) -> torch.Tensor:
    """``new`` for one update; ``old`` is never modified.

    ``fresh``: the operand of an ``assign`` was made for this update and nobody else holds or
    writes it (``pu.nn``'s statistics): it becomes the pending value as is, without the
    defensive copy that protects a user's tensor from the user's later in-place writes.
    """
    if type(old) is not torch.Tensor or (cond is not None and type(cond) is not torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            return _apply_op(op, old, operand, key, cond, fresh)
    return _apply_op(op, old, operand, key, cond, fresh)


def _apply_op(
    op: str, old: torch.Tensor, operand: Any, key: Any, cond: torch.Tensor | None, fresh: bool
) -> torch.Tensor:
    if op == "assign":
        if isinstance(operand, torch.Tensor):
            new = operand.to(dtype=old.dtype, copy=not fresh)
            if new.shape != old.shape:
                new = new.expand(old.shape).clone()
        else:
            new = torch.full_like(old, operand)
    elif op == "assign_add":
        new = old + operand
    elif op == "assign_sub":
        new = old - operand
    elif op == "assign_key":
        new = old.clone()
        new[key] = operand
    else:  # pragma: no cover - guarded by the public functions
        raise ValueError(op)
    if new.dtype != old.dtype:
        new = new.to(old.dtype)
    if cond is not None:
        new = torch.where(cond, new, old)
    return new


def as_issued(op: str, operand: Any, key: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """``(operand, key)`` of an update as they are now, for its record: tensors copied (numbers are
    immutable). An ``assign``'s operand is copied once, cast to the target's ``dtype``: it is also
    the pending value (``apply_op(..., fresh=True)``), so ``assign`` costs one copy, as it always did;
    the delta of ``assign_add``/``assign_sub`` and the value of ``assign_key`` cost one copy more
    (detached: the fold runs under ``no_grad``), a tensor key one more."""
    if isinstance(operand, torch.Tensor):
        operand = operand.to(dtype=dtype, copy=True) if op == "assign" else operand.detach().clone()
    if isinstance(key, torch.Tensor):
        key = key.clone()
    elif isinstance(key, tuple) and any(isinstance(k, torch.Tensor) for k in key):
        key = tuple(k.clone() if isinstance(k, torch.Tensor) else k for k in key)
    return operand, key


class _Overwritten(torch.autograd.Function):
    """``new`` with the gradient of ``old``: forward returns ``new``'s storage (bitwise, no copy),
    backward passes the gradient to ``old`` unchanged (the identity, straight through)."""

    @staticmethod
    def forward(ctx: Any, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:  # noqa: D102
        # (detached: an input returned as is would become a view of it, which dynamo cannot trace)
        return new.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # noqa: D102
        return None, grad


def normal(new: torch.Tensor) -> torch.Tensor:
    """A value computed under ``torch.inference_mode()`` as a normal tensor (a clone made outside
    it), which autograd may save for backward."""
    with torch.inference_mode(False):
        return new.clone()


def overwritten(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` (bitwise: not ``old + (new - old).detach()``, which rounds) whose gradient goes to
    ``old`` unchanged (``d new / d old = I``, straight through): what plain PyTorch's in-place write
    under ``no_grad`` leaves of a leaf parameter, ``with torch.no_grad(): p.div_(p.norm())`` then
    ``loss(p)`` giving ``p.grad = d loss / d p``."""
    with torch.enable_grad():
        return _Overwritten.apply(new, old)


def apply_inplace(op: str, t: torch.Tensor, operand: Any, key: Any, cond: torch.Tensor | None) -> None:
    """Eager application (outside a step): write ``t`` in place under no_grad."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        if cond is None and op == "assign":
            if isinstance(operand, torch.Tensor):
                t.copy_(operand)
            else:
                t.fill_(operand)
        elif cond is None and op == "assign_add":
            t.add_(operand)
        elif cond is None and op == "assign_sub":
            t.sub_(operand)
        elif cond is None and op == "assign_key":
            t[key] = operand
        else:
            t.copy_(apply_op(op, t, operand, key, cond))


def _kind(dt: torch.dtype) -> int:
    return 3 if dt.is_complex else 2 if dt.is_floating_point else 0 if dt == torch.bool else 1


def _kind_ok(src: torch.dtype, dst: torch.dtype) -> bool:
    """``torch.can_cast(src, dst)`` (bool < integer < floating < complex), in plain
    Python so that dynamo can trace it."""
    return _kind(src) <= _kind(dst)


def _at(op: str, name: str, origin: Any) -> str:
    """How an error names the update (made only when one is raised: formatting the call site costs)."""
    return f"pu.{op} on {name!r} at {origin}"


def check_operand(op: str, target: torch.Tensor, operand: Any, key: Any, name: str, origin: str) -> None:
    """Shape, dtype kind and device of an operand; raises :class:`UpdateError`."""
    if isinstance(operand, torch.Tensor):
        if operand.device != target.device and not (operand.dim() == 0 and operand.device.type == "cpu"):
            raise UpdateError(
                f"{_at(op, name, origin)}: value is on device {operand.device}, the target on device {target.device}. "
                f"Move it first: value.to({str(target.device)!r})."
            )
        if operand.dtype is not target.dtype and not _kind_ok(operand.dtype, target.dtype):
            how = "value.real" if operand.dtype.is_complex else "value.round()"
            raise UpdateError(
                f"{_at(op, name, origin)}: value of dtype {operand.dtype} cannot be stored in a {target.dtype} "
                f"target without losing its kind (e.g. float into int). Convert it explicitly "
                f"({how}.to({target.dtype})) if that is what you mean."
            )
        if op == "assign_key":
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    sub = target.detach()[key]
                    if torch.broadcast_shapes(operand.shape, sub.shape) != sub.shape:
                        raise RuntimeError("shape")
            except (IndexError, RuntimeError, TypeError) as e:
                raise UpdateError(
                    f"{_at(op, name, origin)}: target[{key!r}] (target shape {tuple(target.shape)}) cannot take a "
                    f"value of shape {tuple(operand.shape)} ({e}). Index and value must match."
                ) from None
        elif operand.dim() != 0 and operand.shape != target.shape:
            raise UpdateError(
                f"{_at(op, name, origin)}: value has shape {tuple(operand.shape)}, the target {tuple(target.shape)}. "
                "An update keeps the target's shape: pass a tensor of exactly that shape or a scalar."
            )
    elif isinstance(operand, bool | int | float | complex):
        _check_number(op, target, operand, key, name, origin)
    else:
        raise UpdateError(
            f"{_at(op, name, origin)}: value of type {type(operand).__name__} is not a tensor or a Python number."
        )


def _check_number(op: str, target: torch.Tensor, operand: Any, key: Any, name: str, origin: str) -> None:
    """:func:`check_operand` for a Python number: it must fit the target's dtype without losing its kind
    or range; an ``assign_key`` key must index the target."""
    if isinstance(operand, complex) and not target.is_complex():
        raise UpdateError(
            f"{_at(op, name, origin)}: a complex value cannot be stored in a {target.dtype} target without losing its "
            "imaginary part. Pass a real number (value.real), or make the target complex."
        )
    if isinstance(operand, float) and not (target.is_floating_point() or target.is_complex()):
        raise UpdateError(
            f"{_at(op, name, origin)}: a float value cannot be stored in a {target.dtype} target. "
            "Pass an int, or convert the target."
        )
    if type(operand) is int and not (target.is_floating_point() or target.is_complex() or target.dtype == torch.bool):
        info = torch.iinfo(target.dtype)
        if not info.min <= operand <= info.max:
            raise UpdateError(
                f"{_at(op, name, origin)}: the value {operand} does not fit a {target.dtype} target (range {info.min} to "
                f"{info.max}). Pass a value in range, or use a wider target dtype (e.g. torch.int64)."
            )
    if op == "assign_key":
        try:
            target.detach()[key]
        except (IndexError, RuntimeError, TypeError) as e:
            raise UpdateError(
                f"{_at(op, name, origin)}: bad key {key!r} for shape {tuple(target.shape)} ({e})."
            ) from None


# --- a write under the step's device-side verdict (on_nonfinite="skip" decided on the device, rule 7) --------
def flag_on(ok: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``ok`` (a 0-dim bool) on ``device``: moved without a wait onto an accelerator; onto the CPU (a CPU
    copy of an accelerator's model, which its commit copies with a wait anyway) with one."""
    if ok.device == device:
        return ok
    return ok.to(device, non_blocking=device.type != "cpu")


def select_(ok: torch.Tensor, dst: list[torch.Tensor], new: Sequence[torch.Tensor]) -> None:
    """``dst[i] <- where(ok, new[i], dst[i])`` in place, for every ``i``: ``new[i]`` (cast to ``dst[i]``'s
    dtype, as ``copy_`` casts) where ``ok``, else ``dst[i]`` bitwise as it was. ``ok`` is never read on
    the host. (A select, not arithmetic: ``lerp(a, b, 0)`` or ``a * 1 + b * 0`` turn ``-0.0`` into ``+0.0``.)"""
    for d, n in zip(dst, new):
        if n.dtype != d.dtype:
            n = n.to(d.dtype)
        torch.where(flag_on(ok, d.device), n, d, out=d)
