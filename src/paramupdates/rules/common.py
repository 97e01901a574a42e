"""What the built-in rules share: collecting declared tensors, weak holding, storage keys."""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .. import hooks, routing, sharding, state
from ..errors import UpdateError, listed
from ..targets import index_of, index_owning

Named = list[tuple[str, torch.Tensor]]

no_subclass = torch._C.DisableTorchFunctionSubclass
"""Context in which a ``pu.Parameter`` is a plain tensor to foreach kernels (no overlay lookup)."""

_PLAIN = (torch.Tensor, nn.Parameter)
_PLAIN_SET = frozenset(_PLAIN)


def any_none(xs: list[Any]) -> bool:
    """``None in xs`` by identity, mapped in C (``in`` would call ``Tensor.__eq__``)."""
    return any(map(operator.is_, xs, itertools.repeat(None)))


class Referents:
    """A sequence of objects by weak reference, compared by identity, element by element: equal
    only while each is the same live object. A cache key that keeps nothing alive, that no new
    object can match by taking the ``id()`` of a dead one, and that never calls ``Tensor.__eq__``.
    (CPython hands out one callback-less weak reference per object, so the same live object gives
    the same reference, compared with ``is`` in C.)"""

    __slots__ = ("refs",)

    def __init__(self, objs: Iterable[Any]) -> None:
        self.refs = tuple(map(weakref.ref, objs))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Referents) or len(self.refs) != len(other.refs):
            return False
        if torch.compiler.is_compiling():  # (dynamo cannot compare two weak references; it can call them)
            for a, b in zip(self.refs, other.refs):
                x = a()
                if x is None or x is not b():  # (two dead referents are not the same object)
                    return False
            return True
        return all(map(operator.is_, self.refs, other.refs))

    def same(self, objs: list[Any]) -> bool:
        """Whether ``objs`` are these objects, in order (one pass in C, no new references made; traced by
        dynamo as an identity test of each referent, which it folds into its guards)."""
        if len(objs) != len(self.refs):
            return False
        if torch.compiler.is_compiling():
            return all(r() is o for r, o in zip(self.refs, objs))
        return all(map(operator.is_, map(operator.call, self.refs), objs))

    __hash__ = None  # type: ignore[assignment]


def has_subclass(ts: list[torch.Tensor]) -> bool:
    """Whether any tensor has a ``__torch_function__`` subclass (``pu.Parameter``)."""
    return not set(map(type, ts)) <= _PLAIN_SET  # (one pass over the types, in C)


_detach = torch._C.TensorBase.detach


def aliases(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain tensors on each tensor's storage (``detach()``: a view, with the tensor's version counter),
    for the foreach kernels of a kept plan: their argument parsing then meets no ``Parameter``
    subclass (4-15 % of a ``_foreach_lerp_`` over 3000 small tensors). Valid while the storage is the
    same: whoever keeps them re-checks the tensors' storage before each use (``RuleSet``)."""
    with no_subclass():
        return list(map(_detach, ts))


_NOTHING = contextlib.nullcontext()  # (reusable and reentrant: one for every plain_if(False))


def plain_if(flag: bool) -> Any:
    """``no_subclass()`` when ``flag`` (it slows every op down a little, so only where needed)."""
    return no_subclass() if flag else _NOTHING


def named_tensors(obj: Any, fn: str) -> Named:
    """``(name, tensor)`` pairs from a module, a tensor, or an iterable of tensors / pairs.

    A module gives every qualified parameter name, a tensor held under two names (tied weights)
    under both: the rule covers the names, and writes a tensor once however many of them hold it
    (:func:`untie`), so that weights tied or untied after the declaration are covered as the module
    holds them. An iterable of bare tensors gives their positions (``"0"``, ``"1"``, ... as in
    ``nn.ParameterList``), a tensor given twice kept once.
    """
    if isinstance(obj, nn.Module):
        return list(obj.named_parameters(remove_duplicate=False))
    elif isinstance(obj, torch.Tensor):
        items = [("0", obj)]
    elif isinstance(obj, Iterable):
        items = []
        for i, x in enumerate(obj):
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor):
                items.append((str(x[0]), x[1]))
            elif isinstance(x, torch.Tensor):
                items.append((str(i), x))
            elif isinstance(x, dict) and "params" in x:
                raise TypeError(f"{fn}: pass tensors or a module, not optimizer param groups")
            else:
                raise TypeError(f"{fn}: expected tensors, (name, tensor) pairs or a module, got {type(x).__name__}")
    else:
        raise TypeError(f"{fn}: expected a module, a tensor or an iterable of tensors, got {type(obj).__name__}")
    seen: set[int] = set()
    out: Named = []
    for name, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def untie(live: list[Any]) -> int:
    """Keep each tensor of ``live`` once, at its first position: a later position holding the same
    object (weights tied after a rule was declared on both names, ``model.out.weight = model.emb.weight``)
    becomes ``None``, so that a rule writes a tensor once per commit (rule 1: once per optimizer update),
    never once per name. In place; the number of positions cleared. One pass, at a full check only."""
    if len(set(map(id, live))) == len(live):
        return 0  # (no tensor twice: the common case, one pass in C)
    seen: set[int] = set()
    tied = 0
    for i, t in enumerate(live):
        if t is None:
            continue
        if id(t) in seen:
            live[i] = None
            tied += 1
        else:
            seen.add(id(t))
    return tied


def refuse_inside_step(fn: str, origin: str, tensors: Iterable[torch.Tensor] = ()) -> None:
    """Refuse to declare a rule on ``tensors`` inside a step of their model (this thread's
    ``pu.step``: declare rules before training or between steps) or while an attachment has
    updates of them pending: a rule is declared on committed values. Steps of other threads and of
    other models, and attachments whose pending updates touch other tensors (a forgotten attachment
    of another model), are no obstacle."""
    tensors = list(tensors)
    if not tensors:
        return
    for j in routing.explicit():
        if j.index.owns_any(tensors):
            raise UpdateError(
                f"{fn} at {origin} was called inside {j.label}, a step of the model it is declared on. "
                "Declare rules before training (or between steps)."
            )
    for label, _j, att, names in routing.pending_of(tensors):
        shown = listed(list(map(repr, names)))
        fix = (
            "Call flush() (commit them now) or discard() (drop them) on that attachment first"
            if att is not None
            else "Declare it before the step (or between steps)"
        )
        raise UpdateError(
            f"{fn} at {origin}: {label} holds pending updates of {shown}, which this rule is declared on; "
            f"rules are declared on committed values. {fix}."
        )


def adopt_known(rule: Any, root: Any) -> None:
    """A rule declared on tensors given without their module follows them by name from now on when a
    model paramupdates knows (indexed: a step, an attachment, a rule declared on it) owns them all."""
    if root is None:
        idx = index_owning(rule.owner_tensors())
        if idx is not None:
            rule.adopt(idx)


def check_declared(named: Named, root: Any, fn: str, origin: str) -> None:
    """Refuse tensors no rule can be correct on (flat parameters of FSDP1 / DeepSpeed; a meta tensor
    given without its module: ``to_empty()`` replaces it and nothing could follow; a computed tensor,
    such as a parametrized weight: :func:`refuse_computed`), at declaration."""
    if root is not None:
        index_of(root)  # indexed now: a parameter the module re-creates (to_empty, model.to()) keeps its type
    else:
        for name, t in named:
            refuse_computed(name, t, fn, origin)
            if t.is_meta:
                raise UpdateError(
                    f"{fn} at {origin}: {name!r} is a meta tensor given without its module, and to_empty() will "
                    "replace it with another tensor, which a rule held by the tensor alone cannot follow. "
                    "Declare the rule on the module (e.g. pu.constrain(model.lin, ...) or "
                    "pu.weight_decay(model, ...)): it follows the module's parameters by name. Or declare it "
                    "after materializing the model."
                )
    support = hooks.sharding_support()  # sharding hook
    if support is not None:
        support.check_declared(named, root, fn, origin)


def refuse_computed(name: str, t: torch.Tensor, fn: str, origin: str) -> None:
    """Refuse a rule declared on a computed tensor: a parametrization's output (``layer.weight`` under
    ``weight_norm``, ``orthogonal``, ``spectral_norm``), recognised by the integration that hooks it
    (``hooks.computed_source``), or any tensor with a ``grad_fn`` that is not a view of a stored one.
    It is made anew on every read: a rule held by it would hold a temporary that dies at once, and
    never run. Nor is the rule applied through the parametrization's ``right_inverse``: that is not the
    rule on any stored tensor (weight decay of weight norm's ``weight`` would rescale its direction
    ``v`` to the magnitude ``g``; a decayed orthogonal matrix is not orthogonal)."""
    known = hooks.computed_source(t) if hooks.computed_sources else None
    if known is None and (t.grad_fn is None or t._base is not None):
        return
    if known is not None:
        shown, instead = known
    else:
        shown = f"{name!r} (a computed tensor: it has a grad_fn, {type(t.grad_fn).__name__}, and is not a view)"
        instead = (
            "the stored tensor it is computed from (for a parametrized weight: "
            "module.parametrizations.<name>.original, or original0, original1, ...), or the module that holds it"
        )
    raise UpdateError(
        f"{fn} at {origin}: {shown} is not stored but made anew on every read, so a rule held by it would hold a "
        f"temporary that dies at once and never run. Declare the rule on {instead}. (It is not applied through "
        "the parametrization: mapped back through right_inverse, a rule on the computed weight is not that rule "
        "on any stored tensor.)"
    )


def slot_tensor(root: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer ``name`` of ``root``: the stored tensor, also where its module slot shows
    a pending value of a step in progress (of this model or another: read-your-writes, rule 1)."""
    try:
        t = root.get_parameter(name)
    except AttributeError:
        try:
            t = root.get_buffer(name)
        except AttributeError:
            return None
    return routing.stored(t)


def stored_named(module: nn.Module, kind: str, remove_duplicate: bool = True) -> list[tuple[str, torch.Tensor]]:
    """``module.named_parameters()`` / ``named_buffers()`` (``kind``), with the stored tensor where a
    slot shows a pending value (``remove_duplicate=False``: a tensor under each of its names)."""
    items = list(getattr(module, f"named_{kind}")(remove_duplicate=remove_duplicate))
    if not routing.anything_open():
        return items
    journals = routing.live_journals(routing.PROCESS)
    return [(n, routing.stored(t, journals)) for n, t in items]


def rule_died(_ref: Any) -> None:
    """What a rule belongs to was collected: the registry drops the rule at its next use
    (``rules.base.purge``), never later than the next declaration or commit."""
    process = getattr(state, "process", None)  # (None at interpreter shutdown: module globals are cleared)
    if process is not None:
        process.rules_dead = True
        process.moves += 1


def follow_in(rule: Any, root: nn.Module | None) -> None:
    """Note that ``rule`` follows its tensors by name in ``root``: if ``root`` is replaced in its parent
    (``model[2] = nn.Linear(...)``), ``rule.rebase`` makes it follow them there
    (``guards.on_module_registration``)."""
    if root is None:
        return
    roots = state.process.rule_roots
    followers = roots.get(root)
    if followers is None:
        followers = roots[root] = weakref.WeakSet()
    followers.add(rule)


class WeakList:
    """The tensors a rule covers, in declaration order; held weakly (a rule must not keep a model alive).

    Declared on a module (``root``, with the tensors' qualified names), the list follows the module's
    tensors **by name**: :meth:`resync` reads every named slot of ``root`` again and takes whatever
    tensor the module holds there now, whether or not anything still holds the one it replaced (a layer
    replaced between steps, ``load_state_dict(assign=True)``, ``fully_shard``'s DTensor parameters). A
    name the module no longer has is *lost*: the next commit of its model raises, naming it. Tensors
    given without their module are held by identity until a model that paramupdates indexes is found to
    hold them (:meth:`adopt`); from then on they are followed by name there.
    """

    def __init__(
        self, tensors: list[torch.Tensor], root: nn.Module | None = None, names: list[str] | None = None
    ) -> None:
        died = self._died = [False]  # set when a held tensor is collected (no pass over them per commit)

        def on_death(_ref: Any, _tell: Any = rule_died) -> None:
            died[0] = True
            _tell(_ref)  # (bound at definition: module globals are gone at interpreter shutdown)

        self._on_death = on_death
        self._refs = [weakref.ref(t, on_death) for t in tensors]
        self._root = weakref.ref(root, rule_died) if root is not None else None
        self._names = names
        self._stale = False  # the names were rebased: read the slots again before the next use
        self.meta = [(tuple(t.shape), t.dtype) for t in tensors]  # what a lost tensor was (for errors)
        self.lost: list[int] = []  # positions whose name the root module no longer has (by the last resync)

    @property
    def root(self) -> nn.Module | None:
        """The module the tensors are followed in (``None``: held by identity only)."""
        return self._root() if self._root is not None else None

    @property
    def names(self) -> list[str] | None:
        """The qualified names in :attr:`root` (``None``: held by identity only)."""
        return self._names

    def lost_names(self) -> list[str]:
        """The qualified names that :attr:`root` no longer has (read again after a held tensor died or
        the names were rebased)."""
        if (self._died[0] or self._stale) and self._names is not None and self.root is not None:
            self.resync()
        if not self.lost or self._names is None:
            return []
        return [self._names[i] for i in self.lost]

    def adopt(self, root: nn.Module, names: list[str | None]) -> bool:
        """Tensors given without their module, found in ``root`` under ``names``: from now on they are
        followed there by name, as if the rule had been declared on ``root``. True if adopted."""
        if self._root is None and all(n is not None for n in names):
            self._root = weakref.ref(root, rule_died)
            self._names = list(names)  # type: ignore[arg-type]
            return True
        return False

    def rebase(self, parent: nn.Module, name: str) -> None:
        """:attr:`root` is being replaced in ``parent`` under ``name``: follow the same names under the
        module that takes its place (``name.<qualified name>`` in ``parent``)."""
        self._root = weakref.ref(parent, rule_died)
        self._names = [f"{name}.{n}" for n in self._names or ()]
        self._stale = True
        state.process.moves += 1

    def current(self) -> list[torch.Tensor | None]:
        """Each declared tensor (None where its name is lost, or where it died unfollowed)."""
        if self._stale or (self._died[0] and self._root is not None):
            self.resync()
        out = [r() for r in self._refs]
        for i in self.lost:
            out[i] = None
        return out

    def resync(self) -> bool:
        """Take the tensor each named slot of :attr:`root` holds now where it is another object than the
        one held; note the names ``root`` no longer has in :attr:`lost`. True if any changed. One lookup
        per tensor: run when the model's structure or the rules changed, or a full check is due, never
        per commit."""
        root = self._root() if self._root is not None else None
        self._stale = False
        if root is None or self._names is None:
            return False
        self._died[0] = False
        changed = False
        lost = []
        for i, name in enumerate(self._names):
            t = slot_tensor(root, name)
            if t is None:
                lost.append(i)
                continue
            old = self._refs[i]()
            if t is not old:
                if old is not None and sharding.is_sharded(old) and not sharding.is_sharded(t):
                    continue  # inside FSDP's forward/backward: its temporary unsharded parameter, not a successor
                self._refs[i] = weakref.ref(t, self._on_death)
                changed = True
        changed = changed or lost != self.lost
        self.lost = lost
        return changed

    def keep(self, idx: list[int]) -> None:
        """Keep only the tensors at positions ``idx`` (in order)."""
        self._refs = [self._refs[i] for i in idx]
        self.meta = [self.meta[i] for i in idx]
        if self._names is not None:
            self._names = [self._names[i] for i in idx]
        self.lost = []
        self._stale = self._names is not None

    def live(self) -> list[torch.Tensor]:
        return [t for t in self.current() if t is not None]

    def alive(self) -> bool:
        """Declared on a module: while the module it follows lives. Else: while a tensor does."""
        if self._root is not None:
            return self._root() is not None
        for r in self._refs:  # (the first is alive in the common case: no pass over all of them)
            if r() is not None:
                return True
        return False


class OnTensorList:
    """What a rule declared on a list of tensors shares (``self._tensors``, a :class:`WeakList`, and
    ``self.names`` in the same order): following them by name in the model it applies to, and
    dropping the ones a later rule of the same kind took over. A mixin listed before ``Rule``."""

    _tensors: WeakList
    names: list[str]
    _key: Any

    def adopt(self, index: Any) -> None:
        if self._tensors.root is None and self._tensors.adopt(
            index.model, [None if t is None else index.name_of(t) for t in self._tensors.current()]
        ):
            follow_in(self, index.model)

    def rebase(self, old: nn.Module, parent: nn.Module, name: str) -> None:
        """The module this rule follows its tensors in is being replaced in ``parent`` under ``name``."""
        if self._tensors.root is old:
            self._tensors.rebase(parent, name)
            self._key = None
            follow_in(self, parent)

    def lost_names(self) -> list[str]:
        return self._tensors.lost_names()

    def root(self) -> Any:
        return self._tensors.root

    def held_tensors_only(self) -> bool:
        return self._tensors.names is None

    def names_of(self, ids: set[int]) -> list[str]:
        """The covered tensors whose ``id()`` is in ``ids``, by their qualified names where the rule follows
        them in a module (else as declared)."""
        names = self._tensors.names or self.names
        return [n for n, t in zip(names, self._tensors.current()) if t is not None and id(t) in ids]

    def keep_except(self, ids: set[int]) -> list[int]:
        """Keep the tensors whose ``id()`` is not in ``ids``; the positions kept (the plan is made again)."""
        keep = [i for i, t in enumerate(self._tensors.current()) if t is None or id(t) not in ids]
        self.keep_positions(keep)
        return keep

    def keep_positions(self, keep: list[int]) -> None:
        """Keep only the tensors at positions ``keep`` (in order; the plan is made again). A rule with a
        list of its own beside the tensors (weight decay's rates) extends it."""
        self.names = [self.names[i] for i in keep]
        self._tensors.keep(keep)
        self._key = None

    def forget_lost(self) -> bool:
        """Stop covering the names the module no longer has (:meth:`lost_names`); True if none is left."""
        lost = set(self._tensors.lost) if self._tensors.lost_names() else set()
        keep = [i for i in range(len(self.names)) if i not in lost]
        self.keep_positions(keep)
        return not keep


_data_ptr = torch._C.TensorBase.data_ptr


def storage_key(ts: list[torch.Tensor], sub: bool = True, sharded: bool = True) -> tuple[int, ...]:
    """Identity of the storage behind each tensor: changes when ``.data`` is replaced (``model.to()``).

    ``sub``: some tensor may be a ``pu.Parameter`` (then skip its ``__torch_function__``). A DTensor
    is keyed by its local shard (the DTensor itself has no storage: its ``data_ptr()`` is 0);
    ``sharded=False``: the caller knows none of ``ts`` is one (no pass over their types).
    """
    if sharded:
        ts = sharding.locals_of(ts)
    if torch.compiler.is_compiling():
        # dynamo cannot compare data pointers. What a traced plan depends on is what dynamo guards per
        # tensor (dtype, device, shape): a change retraces, and the retrace compares this key. The graph
        # reads each tensor's storage as it is at the call. One hash, not a tuple: dynamo guards a
        # constant the trace compares element by element (thousands of guards, run at every call).
        return (hash(tuple((t.dtype, t.device, t.shape) for t in ts)),)
    if not sub:
        return tuple(map(_data_ptr, ts))
    with no_subclass():
        return tuple(map(_data_ptr, ts))


def where(t: torch.Tensor) -> str:
    return f"{t.device}/{str(t.dtype).removeprefix('torch.')}/{tuple(t.shape)}"
