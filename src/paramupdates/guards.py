"""What ``torch.nn.Module`` operations see and may do while updates are pending.

Inside a step a module's buffer slot holds its pending value and a
``pu.Parameter`` shows its own (read-your-writes, rule 1). Reads see them;
what saves, copies, loads or replaces a module's tensors must not:

* ``module.state_dict()`` saves stored values: a ``state_dict`` post-hook on
  every module paramupdates indexes (:func:`guard_module`) puts each stored
  tensor in place of the pending value a slot shows;
* pickling a module (``torch.save(model)``, ``pickle.dumps(model)``) saves stored
  values: ``nn.Module.__getstate__`` (what pickling calls for every module) gives
  each buffer slot that shows a pending value as its stored tensor
  (:func:`module_getstate`; a ``pu.Parameter`` pickles its stored value itself);
  ``copy.copy(module)`` stays torch's shallow copy, which shares the slots (the
  same model under a second name: its reads see the pending values);
* ``copy.deepcopy(module)`` copies stored values: a plain tensor copied as part
  of its module's buffer dict, while it is a shown pending value, copies as
  the stored tensor (a handler in ``copy``'s dispatch table for ``torch.Tensor``:
  it also covers deep copies that copy a module's ``__dict__`` without
  ``__getstate__``, as a parametrized module's ``__deepcopy__`` does; a pending
  value read and copied (or pickled) on its own stays the pending value);
* ``module.load_state_dict(...)`` of tensors with pending updates raises
  :class:`UpdateError` before anything is loaded (a ``load_state_dict``
  pre-hook on every indexed module);
* assigning a parameter or buffer that has pending updates
  (``module.running_mean = t``, ``module.weight = nn.Parameter(...)``,
  ``load_state_dict(assign=True)``) raises at the call (global registration
  hooks of ``torch.nn.Module``); a ``pu.Parameter`` replaced by
  ``load_state_dict(assign=True)`` stays a ``pu.Parameter``.

What no hook sees (``model.to()``, ``.half()``, ``to_empty()``: ``Module._apply``
writes the slots directly) the commit finds (``Journal.hide`` and
``Journal.check_storage``): it raises, writes nothing of the step, and leaves
the conversion applied to the stored values.
"""

from __future__ import annotations

import copy
import sys
from types import FrameType
from typing import Any

import torch
from torch import nn

from . import overlay, routing, state
from .errors import UpdateError, listed
from .origin import call_site

_pending = state.process.pu_pending
_watched = state.process.watched


# --- state_dict --------------------------------------------------------------------------------------
def committed_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` post-hook: a buffer slot or ``pu.Parameter`` that shows a pending value is saved
    with its stored value (pending values are seen by reads, never by serialization)."""
    journals = routing.live_journals(routing.PROCESS)
    if journals:
        buffers = module._buffers
        for attr, t in _stored_slots(buffers, journals, "state_dict()").items():
            key = prefix + attr
            if key in state_dict:
                state_dict[key] = t if state_dict[key] is buffers[attr] else t.detach()
    if _pending:
        for attr, p in module._parameters.items():
            key = prefix + attr
            if p is not None and id(p) in _pending and key in state_dict and state_dict[key] is not p:
                state_dict[key] = overlay.plain(p).detach()  # the stored value (the pending one is shown by reads)
                owner = routing.pending_owner(p)
                if owner is not None:
                    missed(owner[0], "state_dict()")


def _stored_slots(buffers: dict[str, Any], journals: list[Any], what: str) -> dict[str, torch.Tensor]:
    """``{attr: stored tensor}`` for each slot of the buffer dict ``buffers`` that shows a pending value
    of one of ``journals`` (that journal's entry for it is this very slot); ``what`` saves them (noted on
    the journal: :func:`missed`)."""
    out = {}
    for attr, v in buffers.items():
        if v is not None:
            for j in journals:
                found = j.stored_of(v)
                if found is not None:
                    if found[1] is buffers:
                        out[attr] = found[0]
                        missed(j, what)
                    break
    return out


def missed(journal: Any, what: str) -> None:
    """Note on ``journal`` that ``what`` (``"state_dict()"``, pickling, ``copy.deepcopy``), called now,
    saved the stored values in place of its pending ones (the first such call, with its call site): should
    no step commit them (an attachment's, after the last ``optimizer.step()``), that copy lacks them for
    good, which is warned (``attach._warn_pending``)."""
    if journal.missed is None:
        journal.missed = f"{what} at {call_site(2)}"


# --- pickling ------------------------------------------------------------------------------------------
_TORCH_GETSTATE = nn.Module.__getstate__
_COPY_CODE = copy.copy.__code__


def module_getstate(module: nn.Module) -> dict[str, Any]:
    """``nn.Module.__getstate__`` while paramupdates is imported: torch's state (a copy of the module's
    ``__dict__``), with a new buffer dict holding the stored tensor of each slot that shows a pending
    value, so ``torch.save(model)``, ``pickle.dumps(model)`` (and ``copy.deepcopy``) save stored values.

    Pickling calls it once per module (a parent's state holds its children, each pickled by its own
    ``__reduce_ex__``). ``copy.copy(module)`` calls it too and keeps torch's state: a shallow copy shares
    the slot dicts (and the submodules), so it is the same model under a second name. Between steps it
    is torch's, plus one check (no journal open: nothing built)."""
    state = _TORCH_GETSTATE(module)
    journals = routing.live_journals(routing.PROCESS)
    if journals and sys._getframe(1).f_code is not _COPY_CODE:
        buffers = state.get("_buffers")
        stored = _stored_slots(buffers, journals, "pickling (torch.save(model))") if buffers else None
        if stored:
            state["_buffers"] = {**buffers, **stored}  # (the module's own dict is untouched)
    return state


# --- load_state_dict ---------------------------------------------------------------------------------
def refuse_load(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """``load_state_dict`` pre-hook: loading a tensor that has pending updates raises before anything is
    loaded (the first module of a load is the one it was called on: its hook sees the whole subtree)."""
    for j in routing.live_journals(routing.PROCESS):
        base = j.index.module_name(module)
        if base is None:
            continue  # not a module of that step's model
        keys = []
        for name in j.pending_names():
            if base and not name.startswith(base + "."):
                continue
            key = prefix + (name[len(base) + 1 :] if base else name)
            if key in state_dict:
                keys.append(key)
        if keys:
            shown = listed(list(map(repr, keys)))
            raise UpdateError(
                f"{type(module).__name__}.load_state_dict() at {call_site(1)} would load {shown}, which "
                f"{j.label} holds pending updates of. Nothing was loaded. Load between steps (after the "
                "commit, or before the first update of the step); under pu.attach, call flush() (commit "
                "them) or discard() (drop them) on the attachment first."
            )


# --- assigning a parameter or buffer ------------------------------------------------------------------
def _refuse_assignment(module: nn.Module, name: str, table: dict, kind: str) -> None:
    cur = table.get(name)
    found = routing.pending_owner(cur) if cur is not None and routing.anything_open() else None
    if found is not None:
        j, qn = found
        raise UpdateError(
            f"assigning the {kind} {qn!r} ({type(module).__name__}.{name} = ...) at {call_site(1)} while "
            f"{j.label} holds pending updates of it. Nothing was assigned. Assign it between steps; under "
            "pu.attach, call flush() or discard() on the attachment first."
        )


def _changed(module: nn.Module) -> None:
    """A parameter, buffer or submodule of ``module`` is being set: if ``module`` belongs to an indexed
    model, that model's index and the rules that follow its tensors by name look again at its next
    commit (accounted for, rule 12)."""
    if module in _watched:
        state.process.structure += 1


def on_buffer_registration(module: nn.Module, name: str, buffer: Any) -> None:
    """Global buffer registration hook: a buffer with pending updates is not replaced."""
    _refuse_assignment(module, name, module._buffers, "buffer")
    _changed(module)


def on_parameter_registration(module: nn.Module, name: str, param: Any) -> Any:
    """Global parameter registration hook: a parameter with pending updates is not replaced; a
    ``pu.Parameter`` that ``load_state_dict(assign=True)`` replaces stays a ``pu.Parameter``."""
    _refuse_assignment(module, name, module._parameters, "parameter")
    _changed(module)
    old = module._parameters.get(name)
    rebuild = getattr(type(old), "pu_rebuild", None)
    if rebuild is not None and param is not None and type(param) is nn.Parameter:
        if _loading():
            return rebuild(old, param)
        state.process.assigned_plain.add(param)  # the user's choice: the index keeps it a plain nn.Parameter
    return None


def assigned_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain ``nn.Parameter`` the user assigned in a ``pu.Parameter``'s place (through
    ``module.x = ...`` / ``register_parameter``), as opposed to one torch re-created there (``to_empty()``,
    ``model.to()`` with overwrite-on-conversion write the slot with no hook)."""
    return t in state.process.assigned_plain


def _loading() -> bool:
    """Whether ``Module._load_from_state_dict`` is on the stack (a few frames up: it assigns)."""
    f: FrameType | None = sys._getframe(2)
    for _ in range(4):
        if f is None:
            return False
        if f.f_code is _LOAD_CODE:
            return True
        f = f.f_back
    return False


_LOAD_CODE = nn.Module._load_from_state_dict.__code__


def on_module_registration(parent: nn.Module, name: str, module: Any) -> None:
    """Global module registration hook: ``parent.<name> = module`` (``model[2] = nn.Linear(...)``, a
    wrapper put in a layer's place). The rules that follow their tensors by name in the module it
    replaces follow them in ``parent`` under ``name`` from now on, so that they cover what the model
    holds there whether or not anything still holds the old module; and the model's index looks again
    (accounted for, rule 12)."""
    old = parent._modules.get(name)
    if old is not None and old is not module:
        followers = state.process.rule_roots.get(old)
        if followers:
            for rule in list(followers):
                rule.rebase(old, parent, name)
    _changed(parent)


# --- pu.Parameters re-created by to_empty() -----------------------------------------------------------
def note_materialized(result: torch.Tensor, source: Any) -> None:
    """``torch.empty_like(p, ...)`` of a ``pu.Parameter`` (what ``to_empty()`` calls): torch wraps the
    result in a plain ``nn.Parameter``; the index makes it a ``pu.Parameter`` again (by its storage,
    held weakly)."""
    if isinstance(result, torch.Tensor) and not result.is_meta:
        state.process.materialized[result.untyped_storage()] = (type(source), source.auxiliary, source.weight_decay)


def materialized(t: torch.Tensor) -> tuple[Any, Any, Any] | None:
    """``(class, auxiliary, weight_decay)`` if ``t``'s storage was made by :func:`note_materialized`."""
    made = state.process.materialized
    if not made or t.is_meta:
        return None
    return made.pop(t.untyped_storage(), None)


# --- the modules of indexed models --------------------------------------------------------------------
def guard_module(module: nn.Module) -> None:
    """Hook ``module``'s ``state_dict`` and ``load_state_dict`` (once per module)."""
    guarded = state.process.guarded
    if module not in guarded:
        module.register_state_dict_post_hook(committed_state)
        module.register_load_state_dict_pre_hook(refuse_load)
        guarded.add(module)


# A model saved whole (torch.save(model)) keeps these hooks (the load pre-hook in torch's _WrappedHook, which
# holds nothing but the hook and its module): it loads with torch.load(weights_only=True), stepped or not.
torch.serialization.add_safe_globals([committed_state, refuse_load, nn.modules.module._WrappedHook])


# --- deepcopy -------------------------------------------------------------------------------------------
def _deepcopy_tensor(x: torch.Tensor, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy`` of a plain tensor: a pending value shown in a module's buffer slot, copied as
    part of that module (its buffer dict is being copied: ``memo`` holds it), copies as the stored
    value. Copied on its own (``copy.deepcopy(module.running_mean)``, a read) it is the pending value."""
    if routing.anything_open():
        for j in routing.live_journals(routing.PROCESS):
            found = j.stored_of(x)
            if found is not None:
                if found[1] is not None and id(found[1]) in memo:
                    missed(j, "copy.deepcopy")
                    return copy.deepcopy(found[0], memo)
                break
    prev = _Installed.previous_deepcopy
    return prev(x, memo) if prev is not None else x.__deepcopy__(memo)


class _Installed:
    """What :func:`install` put in place (``remove()`` takes it out again)."""

    previous_deepcopy: Any = None

    def __init__(self) -> None:
        dispatch = copy._deepcopy_dispatch  # type: ignore[attr-defined]
        type(self).previous_deepcopy = dispatch.get(torch.Tensor)
        dispatch[torch.Tensor] = _deepcopy_tensor
        nn.Module.__getstate__ = module_getstate  # type: ignore[method-assign]
        self.module_hooks = (
            nn.modules.module.register_module_buffer_registration_hook(on_buffer_registration),
            nn.modules.module.register_module_parameter_registration_hook(on_parameter_registration),
            nn.modules.module.register_module_module_registration_hook(on_module_registration),
        )

    def remove(self) -> None:
        dispatch = copy._deepcopy_dispatch  # type: ignore[attr-defined]
        if dispatch.get(torch.Tensor) is _deepcopy_tensor:
            prev = type(self).previous_deepcopy
            if prev is None:
                del dispatch[torch.Tensor]
            else:
                dispatch[torch.Tensor] = prev
        if nn.Module.__getstate__ is module_getstate:
            nn.Module.__getstate__ = _TORCH_GETSTATE  # type: ignore[method-assign]
        for h in self.module_hooks:
            h.remove()


def install() -> _Installed:
    """Put the guards in place: ``copy.deepcopy``'s handler for plain tensors, ``nn.Module.__getstate__``
    (:func:`module_getstate`) and the global module registration hooks. ``paramupdates/__init__.py``
    calls it once, keeping the handle (``handle.remove()`` undoes it)."""
    return _Installed()
