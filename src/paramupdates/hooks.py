"""Extension points of the core, in the style of ``torch.optim``'s hook registries.

The core (recording, the overlay, the commit) knows no integration. What an
integration adds, it registers here; each ``register_*`` returns a
``torch.utils.hooks.RemovableHandle`` (``handle.remove()`` undoes it).
``paramupdates/__init__.py`` imports ``paramupdates.integrations``, whose
modules register themselves:

=====================  ==============================================  =============================
extension point        called by the core                              registered by
=====================  ==============================================  =============================
target resolvers       at each update, before routing: a tensor that   ``integrations.parametrize``
                       is computed from stored ones (transformed parameters, rule 10) becomes   (``right_inverse``)
                       updates of those
module visitors        for each submodule when a model is indexed      ``integrations.parametrize``
computed sources       at a rule's declaration: what a computed        ``integrations.parametrize``
                       tensor (a parametrization's output) is
                       computed from, to declare the rule on instead
segment probes         at each update: the activation-checkpointing    ``integrations.checkpoint``
                       segment whose forward is running, if any        (``torch.utils.checkpoint``)
                       (replay, rule 3)
sync backend           ``sync=`` updates: validation at the call,       ``integrations.distributed``
                       the all-reduce at commit (distributed sync, rule 9)
tracing support        while ``torch.compile`` traces: the call site,   ``integrations.compile``
                       trace-time constants
internal files         finding an update's call site: frames of these   ``paramupdates.returnn``
                       files are skipped (a framework's plumbing)       (``rf.Parameter.assign``)
sharding support       DTensor targets (FSDP2): engines refused at       ``integrations.fsdp``
                       attach and at declaration, the first update of a
                       target, the non-finite agreement of a sharded
                       model, lost rules, the EMA copy
=====================  ==============================================  =============================

A hook runs on the hot path of every update: keep it cheap when it has
nothing to do.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from .errors import UpdateError

if TYPE_CHECKING:
    from torch import nn

    from .records import Entry
    from .seams import Commit, EagerLog, Journal


# --- target resolvers (transformed parameters, rule 10) ---------------------------------------------
TargetResolver = Callable[["torch.Tensor", str, Any, Any, Any], "list[tuple[torch.Tensor, torch.Tensor]] | None"]
"""``(target, op, operand, key, origin) -> [(stored tensor, new value), ...]`` when ``target`` is
computed from stored tensors (then the update becomes ``assign``s of those), else ``None``."""

target_resolvers: OrderedDict[int, TargetResolver] = OrderedDict()


def register_target_resolver(fn: TargetResolver) -> RemovableHandle:
    """Map updates of computed tensors (a parametrization's output) to their stored tensors."""
    handle = RemovableHandle(target_resolvers)
    target_resolvers[handle.id] = fn
    return handle


# --- module visitors -----------------------------------------------------------
ModuleVisitor = Callable[["nn.Module", str], None]
"""``(module, qualified name)``: called for each submodule when a model's tensors are indexed."""

module_visitors: OrderedDict[int, ModuleVisitor] = OrderedDict()


def register_module_visitor(fn: ModuleVisitor) -> RemovableHandle:
    """Be shown every submodule of every model paramupdates indexes (e.g. to hook it)."""
    handle = RemovableHandle(module_visitors)
    module_visitors[handle.id] = fn
    return handle


# --- computed sources (a rule declared on a computed tensor) ------------------------------------------
ComputedSource = Callable[["torch.Tensor"], "tuple[str, str] | None"]
"""``t -> (how to name t, what to declare a rule on instead)`` when ``t`` is a computed tensor the
integration knows (a parametrization's output), else ``None``."""

computed_sources: OrderedDict[int, ComputedSource] = OrderedDict()


def register_computed_source(fn: ComputedSource) -> RemovableHandle:
    """Say what a computed tensor is computed from, so that a rule declared on it is refused with the fix."""
    handle = RemovableHandle(computed_sources)
    computed_sources[handle.id] = fn
    return handle


def computed_source(t: torch.Tensor) -> tuple[str, str] | None:
    """What the registered computed sources say of ``t`` (the first that knows it), or ``None``."""
    for fn in computed_sources.values():
        found = fn(t)
        if found is not None:
            return found
    return None


# --- segment probes (replay, rule 3) ---------------------------------------------------
class SegmentProbe(Protocol):
    """Finds the activation-checkpointing segment whose forward is running."""

    def active(self) -> bool:
        """Whether an update issued now is inside such a segment (cheap)."""

    def adopt(self) -> EagerLog | None:
        """Make that segment's recomputation replay (note the values at its entry); return its eager
        log (where eager writes note their entry values), or ``None`` outside a segment."""


segment_probes: OrderedDict[int, SegmentProbe] = OrderedDict()


def register_segment_probe(probe: SegmentProbe) -> RemovableHandle:
    """Make checkpointed segments of another mechanism than ``pu.checkpoint`` replay their updates."""
    handle = RemovableHandle(segment_probes)
    segment_probes[handle.id] = probe
    return handle


saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
"""``saved_tensors_hooks(True)``: the innermost ``torch.autograd.graph.saved_tensors_hooks`` in force (a
C call): falsy outside every activation-checkpointing segment's forward, since checkpointing works by
such hooks. The core asks it before the probes, so that an update outside any segment calls none."""


def segment_possible() -> bool:
    """Whether a probe could find a segment running now (a probe is registered, some saved-tensors hooks
    are in force, and dynamo does not trace)."""
    return bool(segment_probes) and not torch.compiler.is_compiling() and bool(saved_tensors_hooks(True))


def adopt_segment() -> EagerLog | None:
    """The eager log of the segment a probe finds running, after adopting it (``None``: no segment)."""
    for probe in segment_probes.values():
        log = probe.adopt()
        if log is not None:
            return log
    return None


def in_segment() -> bool:
    """Whether some probe finds a checkpointed segment running (not asked while dynamo traces)."""
    for probe in segment_probes.values():
        if probe.active():
            return True
    return False


# --- sync backend (distributed sync, rule 9) -----------------------------------------------------
class SyncBackend(Protocol):
    """Reduces pending values across ranks."""

    def check_options(self, process_group: Any, sync_timeout: Any) -> float | None:
        """Validate a stepper's ``process_group`` / ``sync_timeout``; the timeout in seconds."""

    def active(self, process_group: Any = None) -> bool:
        """Whether there is anything to reduce over (a group of more than one rank)."""

    def check_update(self, journal: Journal, e: Entry, sync: str | None, phase: str, fn: str, origin: str) -> None:
        """Validate, at its call site, an update of a target that is (or becomes) synced."""

    def check_rules(self, commit: Commit, synced: list[Entry]) -> None:
        """Before the commit writes: refuse a declared rule that writes a synced target."""

    def reduce(self, commit: Commit, synced: list[Entry], local_nonfinite: bool) -> int:
        """Replace the pending values of ``synced`` by their reduction; return how many ranks
        reported non-finite unsynced values."""

    def apply_eager(
        self, op: str, target: torch.Tensor, operand: Any, key: Any, cond: Any, sync: str, name: str, origin: str
    ) -> None:
        """A synced update outside a step: reduce the new value now, then write it."""


_sync: OrderedDict[int, SyncBackend] = OrderedDict()


def register_sync_backend(backend: SyncBackend) -> RemovableHandle:
    """Set what ``sync="mean"`` / ``"sum"`` reduces with (the last registered wins)."""
    handle = RemovableHandle(_sync)
    _sync[handle.id] = backend
    return handle


def _last(registry: dict[int, Any]) -> Any:
    found = None
    for x in registry.values():  # (a plain loop: dynamo traces this)
        found = x
    return found


def sync_backend(where: str = "") -> SyncBackend:
    """The registered sync backend (the last registered); an error naming ``where`` if there is none."""
    backend = _last(_sync)
    if backend is None:
        raise UpdateError(
            f"{where}: sync= needs torch.distributed support, which is not registered "
            "(import paramupdates, which registers paramupdates.integrations.distributed)."
        )
    return backend


def sync_active(process_group: Any = None) -> bool:
    """Whether a sync backend is registered and has more than one rank to reduce over."""
    backend = _last(_sync)
    return backend is not None and backend.active(process_group)


# --- tracing support (torch.compile) -------------------------------------------
class TracingSupport(Protocol):
    """What the core asks while ``torch.compile`` traces it."""

    def call_site(self) -> str:
        """``file:line`` of the user code being traced (a trace-time constant)."""

    def in_optimizer(self, optimizer: Any, t: torch.Tensor) -> bool:
        """Whether ``t`` is one of ``optimizer``'s parameters (a trace-time constant)."""


_tracing: OrderedDict[int, TracingSupport] = OrderedDict()


def register_tracing_support(support: TracingSupport) -> RemovableHandle:
    """Set how the core answers, while dynamo traces, what it answers from frames and ``id()`` eagerly."""
    handle = RemovableHandle(_tracing)
    _tracing[handle.id] = support
    return handle


def tracing() -> TracingSupport | None:
    """The registered tracing support (the last registered), if any."""
    return _last(_tracing)


# --- internal files (call sites) -------------------------------------------------------------------------
internal_files: set[str] = set()
"""Source files whose frames a call site skips, like paramupdates' own (``origin.is_internal`` reads it)."""
_internal_files: OrderedDict[int, frozenset[str]] = OrderedDict()
internal_files_changed: list[Callable[[], None]] = []  # origin.py drops its per-code-object verdicts


class _InternalFilesHandle(RemovableHandle):
    def remove(self) -> None:
        super().remove()
        _update_internal_files()


def register_internal_files(*paths: str) -> RemovableHandle:
    """Skip frames of these source files when finding an update's call site: a framework's plumbing
    between the user's line and paramupdates (RETURNN's ``rf.Parameter.assign``), so that errors and
    schedules name the user's line."""
    handle = _InternalFilesHandle(_internal_files)
    _internal_files[handle.id] = frozenset(os.path.abspath(p) for p in paths)
    _update_internal_files()
    return handle


def _update_internal_files() -> None:
    internal_files.clear()
    internal_files.update(*_internal_files.values())
    for fn in internal_files_changed:
        fn()


# --- sharding support (FSDP2's DTensor parameters) ----------------------------------------------------
_sharding: OrderedDict[int, Any] = OrderedDict()


def register_sharding_support(support: Any) -> RemovableHandle:
    """Set what the core asks about sharded models (a ``sharding.ShardingHooks``; the last registered wins)."""
    handle = RemovableHandle(_sharding)
    _sharding[handle.id] = support
    return handle


def sharding_support() -> Any:
    """The registered sharding support (a ``sharding.ShardingHooks``), if any."""
    return _last(_sharding)
