"""``pu.checkpoint``: activation checkpointing that replays updates, never re-issues them.

Rule 3 of DESIGN.md. ``pu.checkpoint(fn, *args, **kwargs)`` is
``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, ...)``
with a ``context_fn`` that makes the recomputation in backward see exactly
what the first run of the segment saw:

* entering the segment in forward, the values every live step shows for its
  targets (the overlay) are noted: one reference per pending target, no copy
  (pending values are never written in place, rule 2);
* during the recomputation, ``_state.replay`` is a :class:`Replay` that
  shows those values instead of the step's latest ones. An update issued
  again in the segment moves only the replay's own scratch view (so the
  segment's later reads see it, as they did the first time) and is dropped:
  the step keeps the one record the first run made.

Outside a step (eager updates, rule 8) the segment's in-place writes are
applied once, in forward; the first write of each target in the segment
keeps a copy of its entry value, which the recomputation is shown (copied in
with the version counter kept, and the latest value copied back after).

So running statistics are updated once per forward call, whether or not the
segment is checkpointed, and a segment that reads a target after updating
it recomputes bitwise the same values, hence the same gradients.

Plain ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)``
is made update-safe too, for segments that issue updates (batch norm,
spectral norm): the first update a segment issues in forward notes the
values shown at that moment (nothing ran in the segment before it that
could have changed them, so they are the values at segment entry) and wraps
the segment's recompute function in the same replay. What it cannot see is
a segment that issues *no* update but reads a target updated *after* it in
the step: its recomputation reads the later value. Use ``pu.checkpoint``
there (it notes the values at entry, whatever the segment does).

Reentrant checkpointing (``use_reentrant=True``) recomputes inside backward
with no hook to replay through: an update it re-issues inside a step raises
:class:`~paramupdates.UpdateError` (the step is discarded, nothing is
written); use ``pu.checkpoint``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as _tc

from .. import _state
from .._ops import apply_inplace
from ..transaction import Entry, Transaction, _is_pu_parameter, live_transactions

__all__ = ["Replay", "checkpoint"]

# (id(tx), id(entry)) -> value shown at segment entry
_Snapshot = dict[tuple[int, int], torch.Tensor]


class _View:
    """What ``pu_pending`` holds for a pu.Parameter during a replay."""

    __slots__ = ("target", "value")

    def __init__(self, target: torch.Tensor, value: torch.Tensor) -> None:
        self.target = target
        self.value = value


def _snapshot() -> _Snapshot:
    snap: _Snapshot = {}
    for tx in live_transactions():
        for e in tx.entries.values():
            v = tx.current_of(e)
            if v is not e.target:
                snap[(id(tx), id(e))] = v
    return snap


class Replay:
    """The view of the targets during the recomputation of one segment.

    ``current(tx, e)`` is the value the segment sees now: the value at segment
    entry, then whatever the recomputed updates made it. ``set_value`` is what
    ``Transaction.record`` calls instead of recording.
    """

    def __init__(self, snap: _Snapshot) -> None:
        self.scratch: dict[tuple[int, int], torch.Tensor] = dict(snap)
        self.alias: dict[int, Entry] = {}
        self._txs = live_transactions()

    eager: _EagerLog | None = None

    def eager_write(self, op: str, target: torch.Tensor, operand: Any, key: Any, cond: Any) -> None:
        """An eager update re-issued by the recomputation: it moves the target's entry value
        (shown in place for the recomputation, swapped back after); other targets are dropped."""
        if self.eager is not None and self.eager.owns(target):
            apply_inplace(op, target, operand, key, cond)

    def current(self, tx: Transaction, e: Entry) -> torch.Tensor:
        return self.scratch.get((id(tx), id(e)), e.target)

    def lookup(self, tx: Transaction, t: torch.Tensor) -> Entry | None:
        e = self.alias.get(id(t))
        if e is not None and self.scratch.get((id(tx), id(e))) is t:
            return e
        return None

    def set_value(self, tx: Transaction, e: Entry, new: torch.Tensor) -> None:
        self.scratch[(id(tx), id(e))] = new
        self.alias[id(new)] = e
        self._show(e, new)

    # -- overlay ---------------------------------------------------------
    def _show(self, e: Entry, v: torch.Tensor) -> None:
        if _is_pu_parameter(e.target):
            if v is e.target:
                _state.pu_pending.pop(id(e.target), None)
            else:
                _state.pu_pending[id(e.target)] = _View(e.target, v)  # type: ignore[assignment]
        elif e.info is not None and e.info.kind == "buffer" and e.info.owner is not None:
            owner = e.info.owner
            cur = owner._buffers.get(e.info.attr)
            if cur is e.target or cur is e.value or self._shown(cur):
                owner._buffers[e.info.attr] = v

    def _shown(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.alias

    def install(self) -> None:
        for tx in self._txs:
            for e in tx.entries.values():
                v = self.current(tx, e)
                self.alias[id(v)] = e
                self._show(e, v)

    def uninstall(self) -> None:
        for tx in self._txs:
            for e in list(tx.entries.values()):
                real = e.current()
                if _is_pu_parameter(e.target):
                    if e.value is None:
                        _state.pu_pending.pop(id(e.target), None)
                    else:
                        _state.pu_pending[id(e.target)] = e
                elif e.info is not None and e.info.kind == "buffer" and e.info.owner is not None:
                    owner = e.info.owner
                    cur = owner._buffers.get(e.info.attr)
                    if cur is e.target or self._shown(cur):
                        owner._buffers[e.info.attr] = real if e.swapped else e.target


class _EagerLog:
    """Values at segment entry of the targets a segment writes eagerly (outside a step).

    Eager updates write in place (rule 8); the recomputation must still read
    what the forward read, so the first write of each target in the segment
    keeps a copy of its entry value, and the recomputation shows it by
    copying it in and the latest value back out afterwards, with the version
    counter restored both times (saved tensors stay valid).
    """

    def __init__(self, parent: _EagerLog | None) -> None:
        self.parent = parent
        self.entry: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def note(self, t: torch.Tensor) -> None:
        log: _EagerLog | None = self
        while log is not None:
            if id(t) not in log.entry:
                with torch._C.DisableTorchFunctionSubclass():
                    log.entry[id(t)] = (t, t.detach().clone())
            log = log.parent

    def versions(self) -> dict[int, int]:
        return {k: t._version for k, (t, _) in self.entry.items()}

    def swap(self, values: dict[int, torch.Tensor], versions: dict[int, int]) -> dict[int, torch.Tensor]:
        """Write ``values`` into their targets, set their version counters; return what was there."""
        out: dict[int, torch.Tensor] = {}
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for k, (t, _) in self.entry.items():
                out[k] = t.detach().clone()
                t.detach().copy_(values[k])
                _set_version(t, versions[k])
        return out

    def owns(self, t: torch.Tensor) -> bool:
        rec = self.entry.get(id(t))
        return rec is not None and rec[0] is t


def _set_version(t: torch.Tensor, version: int) -> None:
    try:
        torch._C._autograd._unsafe_set_version_counter((t,), (version,))
    except TypeError:  # torch < 2.5 takes one tensor
        torch._C._autograd._unsafe_set_version_counter(t, version)


class _Forward:
    """Forward context of a segment: notes the overlay at entry and logs eager writes."""

    def __init__(self, cell: list[Any]) -> None:
        self.cell = cell
        self.prev: Any = None

    def __enter__(self) -> None:
        self.prev = _state.eager_log
        log = _EagerLog(self.prev)
        self.cell[:] = [_snapshot(), log]
        _state.eager_log = log

    def __exit__(self, *exc: Any) -> None:
        _state.eager_log = self.prev


class _Recompute:
    """Recompute context of a segment: shows the entry values, drops re-issued updates."""

    def __init__(self, cell: list[Any]) -> None:
        self.cell = cell
        self.prev: Any = None
        self.prev_log: Any = None
        self.replay: Replay | None = None
        self.latest: dict[int, torch.Tensor] | None = None
        self.versions: dict[int, int] = {}

    def __enter__(self) -> None:
        snap, log = self.cell if self.cell else ({}, None)
        self.prev = _state.replay
        if self.prev is not None:
            self.prev.uninstall()
        self.replay = Replay(snap)
        self.replay.install()
        _state.replay = self.replay
        self.prev_log = _state.eager_log
        _state.eager_log = None
        self.replay.eager = log
        if log is not None and log.entry:
            self.versions = log.versions()
            self.latest = log.swap({k: v for k, (_, v) in log.entry.items()}, self.versions)

    def __exit__(self, *exc: Any) -> None:
        assert self.replay is not None
        if self.latest is not None:
            self.cell[1].swap(self.latest, self.versions)
            self.latest = None
        self.replay.uninstall()
        _state.replay = self.prev
        _state.eager_log = self.prev_log
        if self.prev is not None:
            self.prev.install()


_FORWARD_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"
_CELL_ATTR = "_pu_replay_cell"


def _torch_checkpoint_frame() -> Any:
    """The ``_CheckpointFrame`` of the innermost ``torch.utils.checkpoint`` (non-reentrant)
    segment whose forward is running, or None."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if not hooks:
        return None
    pack = hooks[0]
    code = getattr(pack, "__code__", None)
    if getattr(pack, "__qualname__", "") != _FORWARD_HOOK or code is None or "frame" not in code.co_freevars:
        return None
    closure = pack.__closure__ or ()
    return closure[code.co_freevars.index("frame")].cell_contents


def adopt_torch_segment() -> _EagerLog | None:
    """Make a plain ``torch.utils.checkpoint(..., use_reentrant=False)`` segment update-safe.

    Called by the first update a segment issues in forward (and by every later
    one): the values shown at that moment are the values at segment entry
    (nothing else ran in between), so they are noted as for ``pu.checkpoint``,
    and the segment's ``recompute_fn`` is wrapped in the same recompute
    context. Returns the segment's eager log (None outside such a segment).
    """
    if torch.compiler.is_compiling():
        return None
    frame = _torch_checkpoint_frame()
    if frame is None:
        return None
    cell = getattr(frame, _CELL_ATTR, None)
    if cell is None:
        orig = getattr(frame, "recompute_fn", None)
        if orig is None:
            return None
        cell = [_snapshot(), _EagerLog(None)]
        ctx = _Recompute(cell)

        def recompute_fn(*args: Any) -> None:
            with ctx:
                orig(*args)

        frame.recompute_fn = recompute_fn
        setattr(frame, _CELL_ATTR, cell)
    return cell[1]


def _contexts() -> tuple[_Forward, _Recompute]:
    cell: list[Any] = []
    return _Forward(cell), _Recompute(cell)


_WARNED: set[int] = set()


def _warn_plain_batchnorm(fn: Any) -> None:
    """torch.nn batch norms write in place, out of reach of the replay: say so once per module."""
    mod = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(mod, torch.nn.Module) or id(mod) in _WARNED or not mod.training:
        return
    from ..nn.batchnorm import UpdateSafeBatchNorm

    plain = [n or type(m).__name__ for n, m in mod.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, UpdateSafeBatchNorm)]
    if plain:
        _WARNED.add(id(mod))
        warnings.warn(
            f"pu.checkpoint: {plain[:3]} are torch.nn batch norms; they update their statistics in place "
            "and the recomputation updates them again. Convert the model first: model = pu.convert(model).",
            stacklevel=3,
        )


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    **kwargs: Any,
) -> Any:
    """Update-safe activation checkpointing of ``fn(*args, **kwargs)`` (rule 3).

    Forward runs ``fn`` once, keeping only its inputs; backward recomputes it
    (``torch.utils.checkpoint`` non-reentrant mode). Updates issued by ``fn``
    are recorded once, in forward; in the recomputation every read sees what
    it saw in forward and the updates issued again are dropped. Outputs,
    gradients, running statistics and every other pending value equal the
    run without checkpointing, bitwise on CPU.

    ``preserve_rng_state``, ``determinism_check`` and ``debug`` are passed to
    ``torch.utils.checkpoint.checkpoint``; every other keyword goes to ``fn``.
    """
    _warn_plain_batchnorm(fn)
    return _tc.checkpoint(
        fn,
        *args,
        use_reentrant=False,
        context_fn=_contexts,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        **kwargs,
    )

