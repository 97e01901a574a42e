"""Which tensors a model owns, under which qualified names.

A target of an update is a ``pu.Parameter`` or any parameter or buffer of a
registered model. The index maps a tensor (by identity) to its qualified
name, owning module and attribute, and is rebuilt when a lookup misses (a
module was added, a buffer was replaced).
"""

from __future__ import annotations

import itertools
import operator
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import guards, hooks, overlay, routing, sharding, state
from .records import TargetInfo

if TYPE_CHECKING:
    from .seams import Rule


class ModelIndex:
    """Identity map from the tensors of ``model`` to :class:`TargetInfo`; and what belongs to the
    model besides: the rules that apply to it (:attr:`rules`, kept by ``rules.base.rules_for``) and
    the caches of its commits (:meth:`caches_for`), which live as long as the model (and optimizer).

    ``by_id`` is keyed by ``id()`` of the tensors it maps, and each :class:`TargetInfo` checks its
    tensor by a weak reference: an entry whose tensor died is never taken for another tensor."""

    def __init__(self, model: nn.Module, reparametrized: bool = False) -> None:
        self.model_ref = weakref.ref(model)
        self.by_id: dict[int, TargetInfo] = {}
        self.generation = 0
        self.rules: list[Rule] = []
        """The rules that apply to the model, in declaration order (as of :attr:`rules_key`)."""
        self.rules_key: tuple[int, int] | None = None
        self.followed: tuple[Any, int] | None = None
        """``(rules_key, state.process.moves)`` when every rule of :attr:`rules` was last found followable
        (``rules.base.rules_for`` looks again only when either changed)."""
        """``(state.process.rules_version, generation)`` when :attr:`rules` was made."""
        self.unbound: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        """optimizer -> ``(key, rules)``: the rules on bare tensors no model holds that it steps
        (``rules.base.rules_for``)."""
        self._caches: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._caches_alone: Any = None
        self.sharded_layout: tuple[int, bool, Any] | None = None
        """What the sharding hook found of the model's layout: ``(generation, sharded, mesh)``. Kept here,
        not in a weak dictionary keyed by the index: a traced commit reads it, and dynamo guards on a
        weak dictionary's keys, which another model's collection changes under it."""
        # ``reparametrized``: index what the slots hold inside ``torch.func.functional_call`` (the
        # tensors passed in; ``pu.func``'s own index), as they are: a slot that shows the pending value
        # of a step around the call (the step's own forward ran first: a look-ahead) is indexed as that
        # value, so the call's updates of it are the call's, never the step's. A model's index keeps its
        # stored tensors then.
        self.reparametrized = reparametrized
        self._containers: list[weakref.ref] = []
        self._kids: list[Any] = []  # a weak reference to each container's submodules as last built
        self._shape_key: tuple[int, tuple[int, ...] | None] | None = None
        self.build()

    @property
    def model(self) -> nn.Module | None:
        return self.model_ref()

    def build(self) -> None:
        """Walk the module tree; the first name of a shared tensor wins.

        Built during a step (a module registered a buffer in forward, say), a buffer slot may show
        a pending value (read-your-writes, rule 1): the stored tensor behind it is indexed, never
        the pending value (whose updates would then be committed into it, not into the buffer)."""
        model = self.model
        if not self.reparametrized and self.by_id and (torch.compiler.is_compiling() or reparametrizing()):
            # the slots hold the tensors passed to torch.func.functional_call, not the model's; or a
            # traced commit (torch.compile(opt.step)): dynamo cannot walk the stack to tell, so a trace
            # keeps the index as last built (eagerly, or by the first trace), and tracing never breaks
            # the graph here. Dynamo guards what the trace read from it (each tensor, through a weak
            # reference): a replaced tensor retraces
            return
        by_id: dict[int, TargetInfo] = {}
        modules: dict[int, tuple[weakref.ref, str]] = {}
        containers: list[weakref.ref] = []
        journals = routing.live_journals(routing.PROCESS)
        struct = state.process.structure
        if model is not None:
            visitors = list(hooks.module_visitors.values())
            watched = state.process.watched
            for mod_name, mod in model.named_modules(remove_duplicate=True):
                for visit in visitors:
                    visit(mod, mod_name)  # e.g. transformed parameters (rule 10): recognise a parametrization's outputs
                mref = weakref.ref(mod)
                modules[id(mod)] = (mref, mod_name)
                watched.add(mod)  # (its registrations tell the index to look again: refresh)
                if mod._modules:
                    containers.append(mref)
                if mod._buffers or mod._parameters:
                    guards.guard_module(mod)  # state_dict() saves stored values inside a step
                    self._index_tensors(mod, mod_name, mref, journals, by_id)
        has_meta = any(info.meta for info in by_id.values())
        old = self.by_id
        if by_id.keys() != old.keys() or any(
            old[k].ref() is not v.ref() or old[k].name != v.name for k, v in by_id.items()
        ):
            self.generation += 1  # what the model owns changed: cached ownership answers are stale
        self.by_id = by_id
        self.modules = modules
        self.has_meta = has_meta  # some tensor is on the meta device (no values: nothing to step)
        self._containers = containers
        self._shape_key = (struct, _sizes(containers))
        self._kids = [_ref(m) for m in _children(containers)]

    def _index_tensors(
        self, mod: nn.Module, mod_name: str, mref: weakref.ref, journals: list, by_id: dict[int, TargetInfo]
    ) -> None:
        """Add the parameters and buffers of ``mod`` (named ``mod_name`` in the model) to ``by_id``: the
        stored tensor behind a buffer slot that shows a pending value (rule 1; ``pu.func``'s index takes
        the value shown, see ``reparametrized``), a ``pu.Parameter`` that torch re-created as a plain one
        made one again (:func:`_keep_type`)."""
        prefix = f"{mod_name}." if mod_name else ""
        for kind, table in (("parameter", mod._parameters), ("buffer", mod._buffers)):
            for attr, t in table.items():
                if journals and t is not None and kind == "buffer" and not self.reparametrized:
                    found = routing.stored_of(t, journals)
                    if found is not None and found[1] is table:
                        t = found[0]  # (the slot shows its pending value)
                if t is None or id(t) in by_id:
                    continue
                if kind == "parameter" and type(t) is nn.Parameter:
                    _keep_type(t, prefix + attr, self.by_id)
                shows = overlay.shows_through(t, kind)
                slots = mod._buffers if shows == overlay.BUFFER else None
                by_id[id(t)] = info = TargetInfo(
                    weakref.ref(t),
                    prefix + attr,
                    mref,
                    attr,
                    kind,
                    shows,
                    slots,
                    sharding.is_sharded(t),
                    meta=t.is_meta,
                )
                if shows == overlay.PARAM:
                    info.kept = (type(t), t.auxiliary, t.weight_decay)

    def refresh(self) -> None:
        """Rebuild if the model's structure may have changed since the last build: a module of an indexed
        model got a parameter, buffer or submodule through torch's registration paths (``state.process.structure``),
        or a container's submodules changed (``Sequential.insert``, ``ModuleList.pop``, ``del
        model[2]``: torch writes those dicts with no hook). A few integer compares when nothing changed;
        a commit calls it before it takes the model's rules (accounted for, rule 12)."""
        if torch.compiler.is_compiling():
            return  # a traced commit keeps the index as last built (see build; docs/compile.md)
        if self._shape_key != (state.process.structure, _sizes(self._containers)) or not _same_children(
            self._kids, self._containers
        ):
            self.build()

    def forget_rules(self) -> None:
        """Make :attr:`rules` be recomputed at the next commit."""
        self.rules, self.rules_key = [], None

    def caches_for(self, optimizer: Any, make: Callable[[], Any]) -> Any:
        """The caches of the commits on this model with ``optimizer`` (``None``: without one), made by
        ``make()`` the first time; they live as long as the model and the optimizer."""
        if optimizer is None:
            if self._caches_alone is None:
                self._caches_alone = make()
            return self._caches_alone
        caches = self._caches.get(optimizer)
        if caches is None:
            caches = self._caches[optimizer] = make()
        return caches

    def modules_and_tensors(self) -> list[Any]:
        """Every module and tensor of the model as last indexed (what rules are declared on)."""
        out: list[Any] = []
        for ref, _name in self.modules.values():
            m = ref()
            if m is not None:
                out.append(m)
        for info in self.by_id.values():
            t = info.ref()
            if t is not None:
                out.append(t)
        return out

    def meta_names(self) -> list[str]:
        """The qualified names of the model's tensors on the meta device (the index rebuilt first)."""
        self.build()
        return [info.name for info in self.by_id.values() if (t := info.ref()) is not None and t.is_meta]

    def module_name(self, module: nn.Module) -> str | None:
        """The qualified name of ``module`` in the model as last indexed (``""``: the model), or None."""
        hit = self.modules.get(id(module))
        return hit[1] if hit is not None and hit[0]() is module else None

    def lookup(self, t: torch.Tensor) -> TargetInfo | None:
        """The info of ``t`` if the model owns it (rebuilding once on a miss)."""
        info = self.by_id.get(id(t))
        if info is not None and info.ref() is t:
            return info
        self.build()
        info = self.by_id.get(id(t))
        if info is not None and info.ref() is t:
            return info
        return None

    def owns_any(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the model owns any of ``tensors`` (one rebuild at most, not one per miss)."""
        by_id = self.by_id
        for t in tensors:
            info = by_id.get(id(t))
            if info is not None and info.ref() is t:
                return True
        self.build()
        by_id = self.by_id
        return any((i := by_id.get(id(t))) is not None and i.ref() is t for t in tensors)

    def name_of(self, t: torch.Tensor) -> str | None:
        info = self.lookup(t)
        return None if info is None else info.name

    def peek(self, t: torch.Tensor) -> TargetInfo | None:
        """The info of ``t`` from the index as last built (no rebuild on a miss)."""
        info = self.by_id.get(id(t))
        return info if info is not None and info.ref() is t else None


_modules_of = operator.attrgetter("_modules")


_values = operator.methodcaller("values")


def _sizes(containers: list[weakref.ref]) -> tuple[int, ...] | None:
    """How many submodules each container module has now (``None``: one was collected)."""
    try:
        return tuple(map(len, map(_modules_of, map(operator.call, containers))))
    except AttributeError:
        return None


def _children(containers: list[weakref.ref]) -> Any:
    """The submodules (or ``None`` slots) of the container modules, in order, as one iterator."""
    return itertools.chain.from_iterable(map(_values, map(_modules_of, map(operator.call, containers))))


def _ref(m: Any) -> Any:
    return weakref.ref(m) if m is not None else _NONE


def _NONE() -> None:  # (what a slot holding None is compared with: it returns None, as that slot does)
    return None


def _same_children(refs: list[Any], containers: list[weakref.ref]) -> bool:
    """Whether the containers hold the submodules ``refs`` refer to, in order (their number compared
    already): what torch writes with no registration hook is seen too, a layer deleted and another
    inserted in its place included (``del model[2]; model.insert(2, ...)``). Weak references made at
    the build, not ``id()``: the new layer may be made where the collected one was, with its id; a
    reference to a dead module returns ``None``. One pass in C, no new reference made."""
    try:
        return all(map(operator.is_, map(operator.call, refs), _children(containers)))
    except AttributeError:  # (a container was collected)
        return False


_FUNCTIONAL_CALL = torch.nn.utils.stateless._functional_call.__code__


def reparametrizing(depth: int = 64) -> bool:
    """Whether ``torch.func.functional_call`` (``torch.nn.utils.stateless``) is on the stack: the
    module slots then hold the tensors passed to it in place of the model's own."""
    f = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code is _FUNCTIONAL_CALL:
            return True
        f = f.f_back
    return False


def index_of(model: nn.Module) -> ModelIndex:
    """The index of ``model`` (made once; it lives as long as the model)."""
    indexes = state.process.indexes
    idx = indexes.get(model)
    if idx is None:
        idx = indexes[model] = ModelIndex(model)
        _adopt_bare_rules(idx)
    return idx


def _adopt_bare_rules(idx: ModelIndex) -> None:
    """The model is known from now on: the rules declared on bare tensors it holds (all of them) follow
    them by name in it (``Rule.adopt``), as a rule declared after it was indexed does
    (``rules.common.adopt_known``). So ``load_state_dict(assign=True)``, ``to_empty()`` or a layer replaced
    after ``pu.attach`` or ``pu.Stepper`` finds the tensors the model holds then (accounted for, rule 12),
    whether or not anything still holds the ones declared."""
    if torch.compiler.is_compiling():
        return
    adopted = False
    for r in list(state.process.rules):
        if r.root() is None and r.held_tensors_only():
            r.adopt(idx)
            adopted = adopted or r.root() is not None
    if adopted:
        state.bump_rules()  # (an index that listed it as a rule no model holds lists it again)


def _keep_type(t: nn.Parameter, name: str, before: dict[int, TargetInfo]) -> None:
    """A plain ``nn.Parameter`` where a ``pu.Parameter`` was (under ``name`` when the model was last
    indexed, or made by ``to_empty()`` from one): torch re-creates parameters as ``nn.Parameter``
    (``to_empty()`` of a meta model, ``model.to()`` with overwrite-on-conversion). It becomes a
    ``pu.Parameter`` again, with the same attributes (the class changes in place, as
    ``torch.utils.swap_tensors`` does). Not one the user assigned there (``module.x = nn.Parameter(...)``:
    ``guards.assigned_plain``), whatever became of the old one."""
    kept = guards.materialized(t)
    if kept is None and not guards.assigned_plain(t):
        for info in before.values():
            if info.kept is not None and info.name == name and info.ref() is not t:
                kept = info.kept
                break
    if kept is not None:
        cls, auxiliary, weight_decay = kept
        t.__class__ = cls
        t.auxiliary, t.weight_decay = auxiliary, weight_decay


def slot_name(model: nn.Module | None, t: torch.Tensor) -> str | None:
    """The qualified name of the module slot of ``model`` that holds ``t`` now (for messages only:
    it walks the module tree)."""
    for mod_name, mod in model.named_modules() if model is not None else ():
        for table in (mod._parameters, mod._buffers):
            for attr, v in table.items():
                if v is t:
                    return f"{mod_name}.{attr}" if mod_name else attr
    return None


def describe(t: torch.Tensor) -> str:
    """A name for a tensor that belongs to no known model."""
    kind = type(t).__name__
    return f"<unnamed {kind} shape={tuple(t.shape)} dtype={t.dtype}>"


def index_owning(tensors: list[torch.Tensor]) -> ModelIndex | None:
    """An existing index whose model owns every one of ``tensors`` (as last indexed), or None."""
    for idx in list(state.process.indexes.values()):
        if tensors and all(idx.peek(t) is not None for t in tensors):
            return idx
    return None


def owner_anywhere(t: torch.Tensor) -> tuple[str, str] | None:
    """(qualified name, model class name) of ``t`` in any indexed model, or None.

    For error messages only: it may rebuild every index.
    """
    for model, idx in list(state.process.indexes.items()):
        info = idx.lookup(t)
        if info is not None:
            return info.name, type(model).__name__
    return None
