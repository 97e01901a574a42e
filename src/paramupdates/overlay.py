"""Showing pending values: what makes a read of a target see its pending value (read-your-writes, rule 1).

A target shows a value other than its stored one in one of two ways:

* a ``pu.Parameter`` (a class with ``reads_pending = True``): ``state.process.pu_pending``
  maps it to a *holder* (an object with ``.target`` and ``.value``), which its
  ``__torch_function__`` reads, so every reference to it, any op and
  ``print`` see the value;
* a buffer of a module: the module's buffer slot holds the value tensor, so
  ``module.running_mean`` reads it (an old reference to the buffer tensor
  keeps the stored value).

A plain ``torch.nn.Parameter`` is never swapped out of its module (so
``model.parameters()``, gradients and gradient clipping are never disturbed):
it shows nothing here, and ``pu.read(p)`` returns its pending value.

The journal of a step (``journal.Journal``) and the view of a recomputed
checkpoint segment (``replay.Replay``) both show values through these functions: this module is the
only writer of what a read shows (the buffer slots a pending value is put in, ``pu_pending``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from . import state
from .records import Entry, Record

PARAM = "param"
BUFFER = "buffer"


def shows_through(t: torch.Tensor, kind: str | None) -> str | None:
    """How ``t`` (of kind ``"parameter"``/``"buffer"``/None in its model) shows a pending value:
    :data:`PARAM`, :data:`BUFFER` or ``None`` (a plain parameter: through ``pu.read`` only)."""
    if getattr(type(t), "reads_pending", False):
        return PARAM
    return BUFFER if kind == "buffer" else None


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor sharing storage, version counter and autograd (a ``pu.Parameter``'s
    ``__torch_function__`` no longer applies to it)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.view_as(t)


def slot(e: Entry) -> Any:
    """What ``e``'s buffer slot holds now (``None`` when there is none)."""
    return None if e.slots is None else e.slots.get(e.attr)


def put(e: Entry, value: torch.Tensor) -> None:
    """Put ``value`` into ``e``'s buffer slot."""
    if e.slots is not None:
        e.slots[e.attr] = value


def show(e: Entry, value: torch.Tensor, holder: Any, prev: torch.Tensor | None = None) -> bool:
    """Make reads of ``e.target`` see ``value``; True when a buffer slot now holds it.

    ``holder``: what ``pu_pending`` maps a ``pu.Parameter`` to (``value is e.target``: nothing).
    A buffer slot is replaced only if it holds the target itself or ``prev`` (the value shown
    before): never a buffer the user put there.
    """
    if e.shows == PARAM:
        if value is e.target:
            state.process.pu_pending.pop(id(e.target), None)
        else:
            state.process.pu_pending[id(e.target)] = holder
        return False
    slots = e.slots
    if slots is not None:
        cur = slots.get(e.attr)
        if cur is e.target or (prev is not None and cur is prev):
            slots[e.attr] = value
            return True
    return False


def hide(e: Entry, value: torch.Tensor | None, holder: Any) -> None:
    """Undo :func:`show`: a buffer slot that holds ``value`` gets the target back; a ``pu.Parameter``
    that shows ``holder`` stops showing it."""
    if e.shows == PARAM:
        if state.process.pu_pending.get(id(e.target)) is holder:
            del state.process.pu_pending[id(e.target)]
    elif e.slots is not None and value is not None and e.slots.get(e.attr) is value:
        e.slots[e.attr] = e.target


def hide_all(records: Iterable[Record], entries: Iterable[Entry]) -> list[tuple[str, torch.Tensor, Any]]:
    """Undo :func:`show_loose` for loose ``records`` and :func:`show` for a journal's ``entries`` (each
    entry's own pending value as the one shown; a buffer slot's ``swapped`` mark cleared). Returns
    ``(name, target, what the slot holds)`` for each buffer slot that holds neither the target nor its
    pending value (converted or replaced in the step)."""
    out = []
    for rec in records:
        for t, v, info in zip(rec.targets, rec.values, rec.infos):  # type: ignore[arg-type]
            slots = info.slots
            if slots is not None:
                cur = slots.get(info.attr)
                if cur is v:
                    slots[info.attr] = t
                elif cur is not t:
                    out.append((info.name, t, cur))
    pending = state.process.pu_pending
    for e in entries:
        slots = e.slots
        if slots is not None:  # (hide, inlined: this loop runs over every target, every step)
            value = e.value
            if value is not None:
                cur = slots.get(e.attr)
                if cur is value:
                    slots[e.attr] = e.target
                elif cur is not e.target:
                    out.append((e.name, e.target, cur))
            e.swapped = False
        elif e.shows == PARAM and pending.get(id(e.target)) is e:
            del pending[id(e.target)]
    return out


def show_loose(records: Iterable[Record]) -> None:
    """Show the pending values of loose records (``Record.values``) through their buffer slots: a
    slot that holds the target itself gets the value (their targets are never ``pu.Parameter``)."""
    for rec in records:
        for t, v, info in zip(rec.targets, rec.values, rec.infos):  # type: ignore[arg-type]
            slots = info.slots
            if slots is not None and slots.get(info.attr) is t:
                slots[info.attr] = v
