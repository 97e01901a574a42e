"""Updates of tensors produced by ``torch.nn.utils.parametrize`` (transformed parameters, rule 10).

A parametrized ``module.weight`` is not stored: every read computes it from
the originals (``module.parametrizations.weight.original``, or
``original0``, ``original1``, ... when the first parametrization's
``right_inverse`` returns several tensors, as weight norm's does). An update
of such a tensor therefore goes through the parametrizations'
``right_inverse`` methods, in reverse registration order, exactly as
``module.weight = value`` does in PyTorch, but out of place:

    new_weight   = op(weight, operand)            (assign, assign_add, ...)
    originals    = right_inverse_1(... right_inverse_k(new_weight))
    assign(original_i, originals[i], phase=phase, sync=sync)   for each i

so the originals take the update in the phase given (they are usually
trainable: ``phase="before_grad"`` or ``"after_grad"`` is required, ambiguity is an error (rule 5)),
and nothing is written before commit. A parametrization without
``right_inverse`` raises :class:`~paramupdates.UpdateError` naming the
weight, the parametrization and the call site.

A tensor is recognised as a parametrization's output by a forward hook on
its ``ParametrizationList``, put there when ``register_parametrization`` adds
the list to its module (torch's global module registration hook fires then),
so from registration on, before paramupdates ever saw the model: an eager
``pu.assign(layer.weight, v)`` before the first step goes through
``right_inverse`` as one inside a step does. Parametrizations registered
before paramupdates was imported are hooked when a model that holds them is
indexed (a ``pu.step``, ``pu.Stepper`` or ``pu.attach`` on it, ``pu.convert``,
a rule declared on it); until then an update of their output, a computed
tensor, is refused (``updates.issue``), never written into a temporary.

Registered into the core as a module visitor (which hooks each
``ParametrizationList`` of an indexed model and gives it its qualified name),
a target resolver (which maps an update of its output to updates of the
originals) and a computed-tensor source (what a rule declared on the output
should be declared on: ``rules.common.check_declared``):
``hooks.register_module_visitor``, ``hooks.register_target_resolver``,
``hooks.register_computed_source``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .. import hooks, state
from ..errors import UpdateError
from ..ops import apply_op

_OUTPUTS = state.process.parametrized
"""A parametrization's output tensor (held weakly) -> (its ``ParametrizationList``, held weakly, and
the parametrized tensor's display name)."""
_NAME_ATTR = "_pu_parametrized_name"


def _record(plist: nn.Module, _inputs: Any, output: Any) -> None:
    """The forward hook of a ``ParametrizationList``: remember which list made ``output`` (the list
    the hook runs on, so that a deep copy of a hooked module records its own outputs). Not while
    dynamo traces: it cannot trace the weakly keyed dictionary (a graph break in every compiled
    forward of a parametrized model, ``fullgraph=True`` raising), and the output of a traced
    forward is a graph tensor, not what an eager update is given."""
    if isinstance(output, torch.Tensor) and not torch.compiler.is_compiling():
        _OUTPUTS[output] = (weakref.ref(plist), plist.__dict__.get(_NAME_ATTR, "?"))
        _resolve_from_now_on()


def _resolve_from_now_on() -> None:
    """Register the target resolver once a parametrization has made an output: until then no update
    is asked about (a model with no parametrization pays nothing for this integration). Not after
    ``install()``'s handles were removed (the module visitor is gone then)."""
    resolvers = hooks.target_resolvers.values()
    if resolve not in resolvers and track in hooks.module_visitors.values():
        hooks.register_target_resolver(resolve)


class _ResolverHandle:
    """``install()``'s handle of the target resolver, registered later (:func:`_resolve_from_now_on`)."""

    def remove(self) -> None:
        for key, fn in list(hooks.target_resolvers.items()):
            if fn is resolve:
                del hooks.target_resolvers[key]


def _hook(plist: parametrize.ParametrizationList, shown: str) -> None:
    """Name ``plist``'s output ``shown`` and register (once) the hook that records its outputs."""
    plist.__dict__[_NAME_ATTR] = shown
    if not any(h is _record for h in plist._forward_hooks.values()):
        plist.register_forward_hook(_record)


def track(module: nn.Module, qualified_name: str) -> None:
    """The module visitor (called for every submodule of an indexed model): hook a
    ``ParametrizationList`` and name its output by its qualified name in the model."""
    if not isinstance(module, parametrize.ParametrizationList):
        return
    # "lin.parametrizations.weight" -> "lin.weight"
    parts = qualified_name.split(".")
    shown = ".".join(parts[:-2] + parts[-1:]) if len(parts) >= 2 and parts[-2] == "parametrizations" else qualified_name
    _hook(module, shown)


def _on_registration(_parent: nn.Module, name: str, module: nn.Module | None) -> None:
    """torch's global module registration hook: ``register_parametrization`` adds a
    ``ParametrizationList`` to its module's ``parametrizations`` under the parametrized tensor's
    name; hook it from then on (named by that attribute until a model holding it is indexed)."""
    if isinstance(module, parametrize.ParametrizationList) and _NAME_ATTR not in module.__dict__:
        _hook(module, name)


def source(t: torch.Tensor) -> tuple[parametrize.ParametrizationList, str] | None:
    """The ``ParametrizationList`` that produced ``t`` and the parametrized tensor's name, if any."""
    if not _OUTPUTS.data:  # no parametrized tensor alive: nothing to look up (and nothing dynamo cannot trace)
        return None
    rec = _OUTPUTS.get(t)
    if rec is None:
        return None
    plist = rec[0]()
    if plist is None:
        return None
    return plist, rec[1]


def originals(plist: parametrize.ParametrizationList) -> list[torch.Tensor]:
    """The stored tensors a parametrization is computed from, in ``right_inverse`` order."""
    if plist.is_tensor:
        return [plist.original]
    return [getattr(plist, f"original{i}") for i in range(plist.ntensors)]


def inverse(
    plist: parametrize.ParametrizationList,
    name: str,
    op: str,
    current: torch.Tensor,
    operand: Any,
    key: Any,
    origin: str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(original_i, new value)]`` for the update ``op(current, operand)`` of the parametrized tensor."""
    for p in plist:
        if not hasattr(p, "right_inverse"):
            raise UpdateError(
                f"pu.{op} on {name!r} at {origin}: {name!r} is computed by the parametrization "
                f"{type(p).__name__} (torch.nn.utils.parametrize), which has no right_inverse, so the "
                f"update cannot be mapped back to the stored tensor(s) {_orig_names(plist, name)}. "
                f"Give {type(p).__name__} a right_inverse(value) method, or update the original(s) directly."
            )
    with torch.no_grad():
        value = apply_op(
            op, current.detach(), operand.detach() if isinstance(operand, torch.Tensor) else operand, key, None
        )
        for p in reversed(plist):
            value = p.right_inverse(value)
    origs = originals(plist)
    values = [value] if plist.is_tensor else list(value)
    if len(values) != len(origs):
        raise UpdateError(
            f"pu.{op} on {name!r} at {origin}: right_inverse returned {len(values)} tensors for {len(origs)} originals."
        )
    return list(zip(origs, values))


def _orig_names(plist: parametrize.ParametrizationList, name: str) -> str:
    base = name.rsplit(".", 1)
    prefix = f"{base[0]}.parametrizations.{base[-1]}" if len(base) == 2 else f"parametrizations.{name}"
    if plist.is_tensor:
        return f"'{prefix}.original'"
    return ", ".join(f"'{prefix}.original{i}'" for i in range(plist.ntensors))


def resolve(
    target: torch.Tensor, op: str, operand: Any, key: Any, origin: str
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The target resolver: ``[(original_i, new value)]`` when ``target`` is a parametrization's output."""
    src = source(target)
    if src is None:
        return None
    plist, name = src
    return inverse(plist, name, op, target, operand, key, origin)


def computed_source(t: torch.Tensor) -> tuple[str, str] | None:
    """The computed-tensor source: ``(name, what to declare instead)`` when ``t`` is a
    parametrization's output."""
    src = source(t)
    if src is None:
        return None
    plist, name = src
    kinds = ", ".join(type(p).__name__ for p in plist)
    return (
        f"{name!r} (the output of the parametrization {kinds}, torch.nn.utils.parametrize)",
        f"the stored tensor(s) it is computed from, {_orig_names(plist, name)}, or the module that holds it "
        "(its parameters are those originals)",
    )


def install() -> list[Any]:
    """Register the module visitor, the computed-tensor source, and torch's global module registration
    hook (``paramupdates/__init__.py`` calls it); the target resolver is registered by the first
    parametrization output (:func:`_resolve_from_now_on`), so that updates do not ask it before."""
    return [
        hooks.register_module_visitor(track),
        _ResolverHandle(),
        hooks.register_computed_source(computed_source),
        nn.modules.module.register_module_module_registration_hook(_on_registration),
    ]
