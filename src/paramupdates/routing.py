"""Who owns a tensor: the one place that answers which open step or attachment records its updates.

A step in progress is a *journal* (``journal.Journal``). Journals are opened by this thread's
``pu.step`` / ``Stepper`` blocks (``state.local.explicit``, innermost last) and by attachments
(``pu.attach``: a journal opens at the first update after an ``optimizer.step()``). One meaning of
*live*, two scopes:

* :data:`THREAD`: what an update or a read issued by this thread sees: this thread's explicit
  journals, innermost first, then the attachments' open journals; while this thread recomputes a
  checkpointed segment, the journals that were live when the segment's forward ran (replay,
  rule 3), whichever thread that was;
* :data:`PROCESS`: every open journal of every thread (what serialization, ``load_state_dict`` and
  the assignment guards look at: a module's slots are shared between threads).

:func:`journal_of` routes an update: the innermost explicit journal whose model owns the target
(or whose pending value it is), else the attachment whose model owns it (opening its journal),
else ``(None, None)``: the update applies eagerly (rule 8), unless a step is in progress in this
thread, whose model does not own the target (``updates.issue`` then says so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import hooks, state
from .lookup import EAGER, Lookup
from .records import Entry

if TYPE_CHECKING:
    from .seams import Attachment, Journal

THREAD = "thread"
PROCESS = "process"

_local = state.local
_process = state.process


# --- what is live ---------------------------------------------------------------------------------------
def live_journals(scope: str = THREAD) -> list[Journal]:
    """The open journals of ``scope`` (see the module docstring), innermost explicit step first."""
    if scope == PROCESS:
        if not (_process.steps or _process.attachments):
            return []  # (the common case outside training: no list built)
        out = list(_process.steps)
    else:
        replay = _local.replay
        if replay is not None:
            return replay.journals
        out = list(reversed(_local.explicit))
    for att in _process.attachments:
        j = att.journal
        if j is not None and j not in out:
            out.append(j)
    return out


def attached_journals() -> list[Journal]:
    """The open journals of the attachments, in attach order."""
    return [a.journal for a in _process.attachments if a.journal is not None]


def explicit() -> list[Journal]:
    """This thread's explicit journals (``pu.step`` blocks), innermost last."""
    return _local.explicit


def explicit_anywhere() -> list[Journal]:
    """The explicit journals in progress in every thread (a module's slots, and an optimizer, are
    shared between threads)."""
    return _process.steps


def attachments() -> list[Attachment]:
    """The live attachments, in attach order."""
    return _process.attachments


def anything_open() -> bool:
    """Whether any step of any thread, or any attachment, exists (cheap: no list built)."""
    return bool(_process.steps or _process.attachments)


def nothing_records() -> bool:
    """Whether an update issued now by this thread would simply apply in place (rule 8): no step, no
    attachment, no recomputation, no checkpointed segment's forward, no ``pu.when`` condition, no
    ``torch.func`` transform and no compilation is in force (``pu.nn``'s batch norm then lets torch's
    kernel update its statistics in place, as eager ``assign`` would; asked at every call)."""
    if _local.explicit or _process.attachments or _local.replay is not None or _local.eager_log is not None:
        return False
    if _local.conditions[-1] is not None or torch.compiler.is_compiling():
        return False
    if torch._C._functorch.maybe_current_level() is not None:
        return False
    return not (hooks.saved_tensors_hooks(True) and hooks.in_segment())


# --- opening and closing ----------------------------------------------------------------------------------
def enter(j: Journal) -> None:
    """An explicit step (``pu.step``, ``Stepper``, ``pu.func.functional_call``) opens in this thread."""
    _local.explicit.append(j)
    _process.steps.append(j)


def leave(j: Journal) -> None:
    """The explicit step ``j`` is over (it no longer routes updates)."""
    if j in _local.explicit:
        _local.explicit.remove(j)
    if j in _process.steps:
        _process.steps.remove(j)


def add_attachment(att: Attachment) -> None:
    _process.attachments.append(att)


def remove_attachment(att: Attachment) -> None:
    if att in _process.attachments:
        _process.attachments.remove(att)


def prune_attachments() -> None:
    """Drop every attachment whose model or optimizer was collected."""
    _process.attachments[:] = [a for a in _process.attachments if a.model is not None and a.optimizer is not None]


# --- routing an update ------------------------------------------------------------------------------------
def _holding(t: torch.Tensor) -> Journal | None:
    """The live journal that has ``t`` as a pending value, found by identity: under dynamo, where a
    pending value (a new tensor every step) must not be looked up by ``id()``."""
    for j in reversed(_local.explicit):
        if j.holds(t):
            return j
    for att in _process.attachments:
        if att.journal is not None and att.journal.holds(t):
            return att.journal
    return None


def journal_of(t: torch.Tensor, origin: Any, op: str, how: Lookup = EAGER) -> tuple[Journal | None, Entry | None]:
    """The journal that records an update of ``t``, and ``t``'s entry in it; ``(None, None)``: no
    journal owns it (eager, or an error when this thread has a step in progress)."""
    if how.traced:
        j = _holding(t)
        if j is not None:
            e = j.find(t, True, how)
            if e is not None:
                return j, e
    for j in reversed(_local.explicit):
        e = j.find(t, True, how)
        if e is not None:
            return j, e
    for att in list(_process.attachments):
        if not how.traced and owned_elsewhere(t, att):
            continue
        j = att.journal
        if j is not None:
            # inside optimizer.step() (an LBFGS closure): updates join the committing step
            e = j.find(t, True, how)
            if e is not None:
                return j, e
            continue
        if att.index.lookup(t) is None:
            continue
        j = att.open_journal()
        return j, j.find(t, True, how)
    replay = _local.replay
    if replay is not None:
        # A recomputation in a thread without the step (autograd's device threads): the journals
        # live when the segment's forward ran (replay, rule 3; threads)
        for j in replay.journals:
            e = j.find(t, True, how)
            if e is not None:
                return j, e
    return None, None


def journal_for(t: torch.Tensor, how: Lookup = EAGER) -> Journal | None:
    """The journal of the step whose model has ``t`` as a parameter or buffer (its index as built,
    no rebuild), opening an attachment's if none is open; or None: a cheap look-up for
    ``updates.issue_computed``'s fast path."""
    if how.traced:
        j = _holding(t)
        if j is not None:
            return j
    k = id(t)
    for j in reversed(_local.explicit):
        info = j.index.by_id.get(k)  # (ModelIndex.peek, inlined: every batch norm call asks)
        if info is not None and info.ref() is t:
            return j
    for att in _process.attachments:
        info = att.index.by_id.get(k)
        if info is not None and info.ref() is t:
            return att.journal if att.journal is not None else att.open_journal()
    return None


def owned_elsewhere(t: torch.Tensor, att: Attachment) -> bool:
    """Whether ``t`` is known (without rebuilding any index) to belong to another model than
    ``att``'s only.

    A miss in an index rebuilds it (a module may have been added), which walks the whole module
    tree: with two attached models (a GAN's generator and discriminator), every update of the
    second would rebuild the first's index. A tensor that ``att``'s index does not know but another
    live step's or attachment's index does, or that is the pending value of another's step (a later
    micro-batch reads it), is theirs. (A rebuild while ``att``'s buffer slots show pending values
    would also index those values in place of the buffers.)"""
    if att.index.peek(t) is not None:
        return False
    if att.journal is not None and att.journal.find(t, False) is not None:
        return False
    for j in _local.explicit:
        if j.index.peek(t) is not None or j.find(t, False) is not None:
            return True
    return any(
        other is not att
        and (
            other.index.peek(t) is not None or (other.journal is not None and other.journal.find(t, False) is not None)
        )
        for other in _process.attachments
    )


# --- reading ------------------------------------------------------------------------------------------
def read(t: torch.Tensor, how: Lookup = EAGER) -> tuple[Journal, Entry] | None:
    """The live journal (this thread's scope) that has an entry for ``t``, and the entry."""
    for j in live_journals(THREAD):
        e = j.find(t, False, how)
        if e is not None:
            return j, e
    return None


# --- pending values and the stored tensors behind them -----------------------------------------------
def stored_of(v: torch.Tensor, journals: list[Journal] | None = None) -> tuple[torch.Tensor, dict | None] | None:
    """``(target, buffer slots)`` when ``v`` is a pending value shown by an open journal (any thread)."""
    for j in journals if journals is not None else live_journals(PROCESS):
        found = j.stored_of(v)
        if found is not None:
            return found
    return None


def stored(t: Any, journals: list[Journal] | None = None) -> Any:
    """The stored tensor behind ``t`` when a module slot shows ``t`` as a pending value (rule 1),
    else ``t``: what a rule that follows a module's tensors by name must take from a slot."""
    if not isinstance(t, torch.Tensor) or not anything_open():
        return t
    found = stored_of(t, journals)
    return t if found is None else found[0]


def pending_owner(t: torch.Tensor) -> tuple[Journal, str] | None:
    """``(journal, qualified name)`` if ``t`` is a target with pending updates in an open journal of
    any thread, or the pending value of one."""
    for j in live_journals(PROCESS):
        qn = j.pending_name_of(t)
        if qn is not None:
            return j, qn
    return None


def pending_of(tensors: list[torch.Tensor]) -> list[tuple[str, Journal, Attachment | None, list[str]]]:
    """For each journal this thread sees (its explicit steps, then attachments' open journals) that
    holds pending updates of some of ``tensors`` (a module's buffer slot shows the pending value:
    its id counts as the target's): ``(label, journal, attachment or None, their names)``."""
    ids = {id(t) for t in tensors}
    owners: list[tuple[str, Journal, Attachment | None]] = [(j.label, j, None) for j in _local.explicit]
    owners += [(a.label, a.journal, a) for a in _process.attachments if a.journal is not None]
    out = []
    for label, j, att in owners:
        j.settle()
        names = [
            e.name for e in j.entries.values() if e.value is not None and (id(e.target) in ids or id(e.value) in ids)
        ]
        if names:
            out.append((label, j, att, names))
    return out


def committing_optimizer(optimizer: Any) -> bool:
    """Whether a ``pu.step`` / ``Stepper`` commit of this thread is running ``optimizer.step()`` (that
    commit owns the step: an attachment on the optimizer stands aside)."""
    return any(c.optimizer is optimizer for c in _local.committing)
