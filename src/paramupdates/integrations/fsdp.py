"""FSDP2 (``torch.distributed.fsdp.fully_shard``) support; FSDP1 and DeepSpeed ZeRO refused.

How FSDP2 lays out a model (torch 2.13, ``torch/distributed/fsdp/_fully_shard/``)
    * ``fully_shard(module)`` replaces every parameter of ``module`` (not yet
      managed by another ``fully_shard``) with a *new* ``nn.Parameter`` holding
      a ``DTensor`` (``FSDPParam._init_sharded_param`` in ``_fsdp_param.py``):
      ``Shard(0)`` over the mesh, chunked as ``torch.chunk`` (uneven shards;
      ranks past the last chunk hold an empty shard). It writes the slot
      directly (``unsafe_setattr_param``), and changes the module's class in
      place to ``FSDP<Class>`` (whose ``__deepcopy__`` raises). Buffers are not
      sharded. ``model.parameters()`` and the optimizer then see the DTensors.
    * Around forward and backward the module slots hold other objects:
      ``to_unsharded`` puts a plain ``nn.Parameter`` over the all-gather output
      there, ``to_sharded`` puts the DTensor back and frees the unsharded
      data by resizing its storage to 0 bytes (``free_storage``). The root
      keeps its parameters unsharded from forward until the end of backward.
    * The optimizer steps the DTensors: elementwise ops on DTensors with equal
      placements run on the local shards, with no communication.

What paramupdates does with it
    * Every elementwise write of a commit goes through the local shard
      (``paramupdates.sharding``); norm constraints over a sharded dim
      all-reduce their partial sums of squares once per rule
      (``rules/_sharded.py``).
    * An update of an FSDP-managed parameter issued while its slot holds the
      temporary unsharded parameter (inside forward) is refused at its call
      site (:meth:`FSDPHooks.check_update`), and a commit refuses to write any
      target whose memory is gone (``Commit._guard_storage``).
    * The ranks of a sharded model decide on non-finite pending values
      together (:meth:`FSDPHooks.agree_nonfinite`, one small all-reduce per
      commit with pending values, none when ``sync=`` already carried it).
    * ``pu.ema`` of a sharded model returns a copy sharded the same way
      (:func:`sharded_copy`): each rank averages its own shards, and the copy
      evaluates (FSDP all-gathers it in forward) and saves (a DTensor
      ``state_dict``) like the model.
    * ``sync=`` on a target with a ``Shard`` placement is refused; over the
      ``Replicate`` mesh dims of HSDP it reduces among the replicas
      (:func:`sync_dtensor`).

FSDP1 (``FullyShardedDataParallel``) and DeepSpeed ZeRO keep flat 1-D
parameters (or 1-D views of them): weight decay would skip them as 1-D, a
max-norm would clip single elements, an EMA would average flat slices. They
are refused with an :class:`~paramupdates.UpdateError` naming the engine, at
``pu.attach`` / ``pu.Stepper`` and at a rule's declaration.

Nothing here imports ``torch.distributed.fsdp`` (0.8 s): a model is FSDP2
only if that module is already loaded.
"""

from __future__ import annotations

import copy
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import hooks, sharding
from ..errors import UpdateError

_FSDP2 = "torch.distributed.fsdp._fully_shard._fully_shard"
_FSDP1 = "torch.distributed.fsdp.fully_sharded_data_parallel"

_SUPPORTED = (
    "paramupdates supports FSDP2: shard with torch.distributed.fsdp.fully_shard (DTensor parameters) "
    "instead, or use DistributedDataParallel."
)


# ----------------------------------------------------------------------------
# finding FSDP2 in a model
# ----------------------------------------------------------------------------
def _fsdp_module_type() -> type | None:
    mod = sys.modules.get(_FSDP2)
    return None if mod is None else getattr(mod, "FSDPModule", None)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to, in ``model.modules()`` order."""
    cls = _fsdp_module_type()
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls)]


def _states(model: nn.Module) -> list[Any]:
    out, seen = [], set()
    for m in fsdp_modules(model):
        st = m._get_fsdp_state()
        if id(st) not in seen:
            seen.add(id(st))
            out.append(st)
    return out


def fsdp_params(model: nn.Module) -> Iterator[Any]:
    """Every ``FSDPParam`` of ``model``'s FSDP2 states."""
    for st in _states(model):
        for group in st._fsdp_param_groups:
            yield from group.fsdp_params


# ----------------------------------------------------------------------------
# FSDP1 and DeepSpeed: refused
# ----------------------------------------------------------------------------
def _flat(t: Any) -> str | None:
    """The engine that owns ``t`` as a flat parameter, or None."""
    if getattr(t, "_fsdp_flattened", False) or type(t).__name__ == "FlatParameter":
        return "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1)"
    if hasattr(t, "ds_id") or hasattr(t, "ds_status"):
        return "DeepSpeed ZeRO-3"
    return None


def engine_of(model: nn.Module | None, optimizer: Any = None, tensors: Sequence[Any] = ()) -> str | None:
    """The name of an engine whose flat parameters paramupdates cannot update correctly, or None."""
    fsdp1 = sys.modules.get(_FSDP1)
    fsdp1_cls = getattr(fsdp1, "FullyShardedDataParallel", None) if fsdp1 is not None else None
    if model is not None:
        if type(model).__module__.split(".")[0] == "deepspeed":
            return f"DeepSpeed ({type(model).__name__})"
        for m in model.modules():
            if fsdp1_cls is not None and isinstance(m, fsdp1_cls):
                return "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1)"
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate / Lightning wrappers
        for o in (optimizer, inner):
            if type(o).__module__.split(".")[0] == "deepspeed":
                return f"DeepSpeed ZeRO ({type(o).__name__})"
    for t in tensors:
        what = _flat(t)
        if what is not None:
            return what
    return None


def _refusal(where_: str, engine: str) -> UpdateError:
    if "FSDP1" in engine:
        why = (
            "its parameters are flat 1-D shards of a FlatParameter (with use_orig_params=True, 1-D views of "
            "one): weight decay would skip them as 1-D, a norm constraint would rescale single elements, an EMA "
            "would average flat slices, and an update would not reach the parameter FSDP all-gathers."
        )
    else:
        why = (
            "ZeRO keeps flat fp32 partitions of the parameters in its optimizer and copies them into the "
            "parameters at every step: an update of a parameter would be overwritten, or applied to flat slices."
        )
    return UpdateError(f"{where_}: the model is sharded by {engine}; {why} {_SUPPORTED}")


# ----------------------------------------------------------------------------
# the hooks
# ----------------------------------------------------------------------------
class FSDPHooks(sharding.ShardingHooks):
    """The core's sharding hooks for FSDP2 (see the module docstring)."""

    def __init__(self) -> None:
        self._checked: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()

    # --- refusals ----------------------------------------------------------------
    def check_model(self, model: nn.Module, optimizer: Any, label: str) -> None:
        if _FSDP1 not in sys.modules and "deepspeed" not in sys.modules:
            return  # neither engine is loaded: nothing can be flat
        if self._checked.get(model) == id(optimizer):
            return  # pu.step(model, opt) makes a Stepper per step: walk the model once
        engine = engine_of(model, optimizer, list(model.parameters()))
        if engine is not None:
            what = "pu.attach" if label == "Attachment" else "pu.step / pu.Stepper"
            raise _refusal(f"{what}({type(model).__name__})", engine)
        self._checked[model] = id(optimizer)

    def check_declared(self, tensors: Sequence[tuple[str, torch.Tensor]], root: Any, fn: str, origin: str) -> None:
        engine = engine_of(root if isinstance(root, nn.Module) else None, None, [t for _, t in tensors])
        if engine is not None:
            raise _refusal(f"{fn} at {origin}", engine)

    def check_update(self, journal: Any, e: Any, fn: str, origin: str) -> None:
        info = e.info
        if info is not None and info.kind == "parameter":
            owner = info.owner
            if owner is not None and owner.__dict__.get("_is_fsdp_managed_module", False):  # set by fully_shard
                self._refuse_unsharded(journal, e, owner, info.attr, fn, origin)
        if e.sharded and fn == "pu.assign_key" and any(p.is_shard() for p in e.target.placements):
            raise UpdateError(
                f"{fn} on {e.name!r} at {origin}: the target is sharded ({tuple(e.target.placements)}), and a key "
                "indexes the whole tensor, not this rank's shard. Compute the new whole value (a DTensor op, e.g. "
                "torch.where(mask, value, target)) and pu.assign it."
            )

    def _refuse_unsharded(self, journal: Any, e: Any, owner: nn.Module, attr: str, fn: str, origin: str) -> None:
        model = journal.index.model
        for fp in fsdp_params(model) if model is not None else ():
            info = fp._module_info
            if info.module is owner and info.param_name == attr:
                if e.target is fp.sharded_param:
                    return
                break
        else:
            return  # not an FSDP2 parameter (e.g. ignored_params)
        raise UpdateError(
            f"{fn} on {e.name!r} at {origin}: while this module runs forward, fully_shard (FSDP2) puts a temporary "
            f"unsharded parameter in {e.name!r} (all-gathered for forward and backward, its memory freed after "
            "them), so an update of it would be lost or write freed memory. Issue the update from outside forward "
            f"(after backward, with phase='before_grad' or 'after_grad'), where {e.name!r} is the sharded DTensor "
            "parameter that the optimizer steps; keep state that forward itself updates in a buffer (FSDP does not "
            "shard buffers). Nothing was recorded."
        )

    # --- operands of sharded targets --------------------------------------------------
    def operand(self, e: Any, operand: Any, fn: str, origin: str) -> Any:
        if isinstance(operand, torch.Tensor) and (operand.ndim > 0 or sharding.is_sharded(operand)):
            from ..rules._sharded import like

            return like(e.target, operand)
        return operand

    def conform(self, e: Any, value: torch.Tensor) -> torch.Tensor:
        from ..rules._sharded import like

        return like(e.target, value)

    # --- the commit ----------------------------------------------------------------------
    def _layout(self, index: Any) -> tuple[bool, Any]:
        hit = index.sharded_layout
        if hit is not None and hit[0] == index.generation:
            return hit[1], hit[2]
        model = index.model
        mesh = None
        if model is not None:
            # FSDP2's sharded parameters first: inside forward and backward the module holds the unsharded
            # ones (plain tensors), and the answer is kept for the index's generation
            for fp in fsdp_params(model):
                mesh = fp.sharded_param.device_mesh
                break
            else:
                for p in model.parameters():  # (other DTensor parameters: tensor parallelism)
                    if sharding.is_sharded(p):
                        mesh = p.device_mesh
                        break
        index.sharded_layout = (index.generation, mesh is not None, mesh)
        return mesh is not None, mesh

    def model_sharded(self, index: Any) -> bool:
        return self._layout(index)[0]

    def agree_nonfinite(self, commit: Any, local_bad: bool) -> int:
        from .distributed import all_reduce_sum, incomplete

        timeout = commit.options.sync_timeout
        _, mesh = self._layout(commit.journal.index)
        group = mesh_group(mesh)
        flag = torch.tensor([int(local_bad)], dtype=torch.int64, device=torch.device(mesh.device_type))
        try:
            all_reduce_sum([flag], group, timeout)
        except RuntimeError as err:
            raise incomplete(
                f"{commit.label}: deciding on non-finite values with the other ranks of the sharded model",
                err,
                timeout,
                "this commit",
            ) from err
        return int(flag.item())

    def lost_rules(self, index: Any, rules: list[Any]) -> None:
        if not self.model_sharded(index):
            return
        model = index.model
        shapes = {(tuple(p.shape), p.dtype) for p in model.parameters()} if model is not None else set()
        for rule in rules:
            held = getattr(rule, "_tensors", None)
            meta = getattr(held, "meta", None)
            if meta and all(m in shapes for m in meta):
                raise UpdateError(
                    f"pu.{rule.kind.split(':')[0]} declared at {rule.origin} holds {len(meta)} tensor(s) that no "
                    "longer exist, of the shapes of this sharded model's parameters: fully_shard (FSDP2) replaced "
                    "every parameter with a new sharded DTensor parameter after the rule was declared. Declare "
                    "the rule after fully_shard, or declare it on the module (pu.weight_decay(model, ...), "
                    "pu.constrain(model[i], ...)), which follows the module's parameters by name. "
                    "(rule.remove() drops it.)"
                )

    # --- EMA ---------------------------------------------------------------------------------
    def copy_module(self, model: nn.Module) -> nn.Module | None:
        if not fsdp_modules(model):
            return None
        return sharded_copy(model)

    def follow_copy(self, copy_: nn.Module, model: nn.Module) -> None:
        if fsdp_modules(model) and not fsdp_modules(copy_):
            _mirror(copy_, model)


def mesh_group(mesh: Any) -> Any:
    """A process group of every rank of ``mesh`` (None: the default group)."""
    if mesh.size() == dist.get_world_size():
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    return mesh._flatten().get_group()


# ----------------------------------------------------------------------------
# pu.ema of a sharded model: a copy sharded the same way
# ----------------------------------------------------------------------------
_INTERNAL = frozenset(nn.Module().__dict__) | {
    "__composable_api_registry",
    "_is_fsdp_managed_module",
    "_fsdp_use_orig_params",
}


def _orig_class(m: nn.Module) -> type:
    cls = _fsdp_module_type()
    if cls is not None and isinstance(m, cls):
        return type(m).__mro__[type(m)._orig_cls_mro_index]
    return type(m)


def _skeleton(model: nn.Module) -> tuple[nn.Module, dict[int, Any]]:
    """The module tree of ``model`` with its own classes (FSDP's removed), no hooks, parameters on the
    meta device (whole shapes), buffers copied; ``memo`` maps the model's objects to the copy's."""
    memo: dict[int, Any] = {}
    mods = list(model.modules())
    for m in mods:
        cls = _orig_class(m)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        memo[id(m)] = new
    for m in mods:
        new = memo[id(m)]
        new.training = m.training
        new._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
        for k, v in m.__dict__.items():
            if k not in _INTERNAL and not k.startswith("__composable_api_"):  # FSDP's state keys
                new.__dict__[k] = copy.deepcopy(v, memo)
        for name, p in m._parameters.items():
            if p is None:
                new._parameters[name] = None
            elif id(p) in memo:
                new._parameters[name] = memo[id(p)]
            else:
                q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
                memo[id(p)] = q
                new._parameters[name] = q
        for name, b in m._buffers.items():
            if b is None:
                new._buffers[name] = None
            elif id(b) in memo:
                new._buffers[name] = memo[id(b)]
            else:
                memo[id(b)] = new._buffers[name] = b.detach().clone()
        for name, child in m._modules.items():
            new._modules[name] = None if child is None else memo[id(child)]
    return memo[id(model)], memo


def _mirror(copy_root: nn.Module, model: nn.Module) -> None:
    """Apply ``fully_shard`` to ``copy_root`` as it was applied to ``model``: the same modules (by
    name), children first, the same mesh, placements, mixed-precision and offload policies."""
    from torch.distributed.fsdp import fully_shard

    names = {id(m): n for n, m in model.named_modules()}
    copy_mods = dict(copy_root.named_modules())
    placement: dict[int, Any] = {}
    todo = []
    for st in _states(model):
        groups = st._fsdp_param_groups
        mods = [copy_mods[names[id(m)]] for m in st._modules]
        for g in groups:
            for fp in g.fsdp_params:
                mi = fp._module_info
                cp = copy_mods[names[id(mi.module)]]._parameters[mi.param_name]
                placement[id(cp)] = fp.fsdp_placement
        kwargs: dict[str, Any] = {}
        if groups:
            kwargs = {
                "mesh": groups[0].mesh_info.mesh,
                "mp_policy": groups[0].mp_policy,
                "offload_policy": groups[0].offload_policy,
            }
        depth = min(names[id(m)].count(".") + (names[id(m)] != "") for m in st._modules)
        todo.append((depth, mods, kwargs))
    for _depth, mods, kwargs in sorted(todo, key=lambda x: -x[0]):  # children first, as fully_shard wants
        fully_shard(
            mods if len(mods) > 1 else mods[0],
            shard_placement_fn=lambda p: placement.get(id(p)),
            reshard_after_forward=True,
            **kwargs,
        )


def sharded_copy(model: nn.Module) -> nn.Module:
    """A copy of an FSDP2 model, sharded as the model is, holding this rank's shards of its values.

    Built without materialising the whole model: the copy's parameters start
    on the meta device, ``fully_shard`` shards them, ``to_empty`` allocates the
    local shards, and each rank copies its own shards (no communication).
    """
    copy_root, memo = _skeleton(model)
    _mirror(copy_root, model)
    device = next((sharding.local(p).device for p in model.parameters()), torch.device("cpu"))
    copy_root.to_empty(device=device)
    with torch.no_grad():
        cps = dict(copy_root.named_parameters())
        for name, p in model.named_parameters():
            sharding.local(cps[name]).copy_(sharding.local(p))
        cbs = dict(copy_root.named_buffers())
        for name, b in model.named_buffers():
            cbs[name].copy_(b)
    return copy_root


HOOKS = FSDPHooks()


def install() -> list[RemovableHandle]:
    """Register the sharding support (``paramupdates/__init__.py`` calls it)."""
    return [hooks.register_sharding_support(HOOKS)]
