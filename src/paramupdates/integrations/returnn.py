"""RETURNN's frontend (``rf``) on its PyTorch backend, with paramupdates' semantics.

::

    import paramupdates.returnn as pur
    pur.enable()        # before the model is built (in a RETURNN config: at its top)

While enabled (:func:`disable` restores RETURNN's own functions; both are idempotent):

* the raw tensor RETURNN makes for a new ``rf.Parameter`` is a
  ``pu.Parameter`` (a ``torch.nn.Parameter`` subclass), so every read of the
  parameter inside a step sees its pending value (read-your-writes, in
  program order), and nothing is written before commit;
* ``rf.Parameter.assign`` / ``assign_add`` / ``assign_key`` are
  ``pu.assign`` / ``pu.assign_add`` / ``pu.assign_key`` of that raw tensor,
  in the phase of the innermost :func:`phase` block (rule 4);
* ``rf.BatchNorm``'s running statistics are such updates, in both its
  paths (masked: ``assign_add``; fused: ``F.batch_norm`` on copies, then ``assign``);
* RETURNN's ``gradient_checkpoint_scope`` replays its recorded ops on the
  very tensors the forward read.

Outside a step every update applies at once, in place, under ``no_grad``
(rule 8): bitwise what RETURNN writes without the bridge. Inside a step
(``pu.step(pt_model, opt)``, ``pu.attach(pt_model, opt)``, or RETURNN's
``Engine`` through :func:`optimizer`; ``pt_model`` is
``rf_module_to_pt_module(model)``) updates are recorded and committed in
the fixed phase order: ``before_grad`` (:func:`weight_decay`, then
updates), ``optimizer.step()``, ``after_grad`` (:func:`constrain`, then
updates), auxiliary updates (statistics, counters), ``after_step``. Under
``torch.utils.checkpoint(use_reentrant=False)`` and
``rf.gradient_checkpoint_scope`` the recomputation sees the values at
segment entry and re-issued updates are dropped (rule 3): counters and
running statistics equal the run without checkpointing, bitwise on CPU.

RETURNN's ``Engine`` from the config alone (all three lines are needed)::

    import paramupdates.returnn as pur
    pur.enable()
    optimizer = pur.optimizer({"class": "adam", "epsilon": 1e-8})   # commits inside optimizer.step()
    epoch_end = pur.epoch_end                                        # flushes what no optimizer step committed

``enable()`` alone commits nothing: at the first ``step()`` of an optimizer
that steps ``pu.Parameter`` objects and that no paramupdates attachment or step
commits, declared rules on its parameters raise ``UpdateError`` (they would
never run) and rf updates applied at once in training warn, both naming the
fix (a global optimizer step pre-hook, registered by :func:`enable`). A
parameter decayed by both ``pur.weight_decay`` and the optimizer's own
``weight_decay`` is refused. Under ``torch_distributed`` (DDP), :func:`sync`
makes the rf updates synced (docs/distributed.md, rule 9).

The RETURNN versions tested are :data:`RETURNN_TESTED` (the ``returnn`` extra
pins them; :func:`enable` warns outside); tests/test_returnn.py's contract tests
check what each patched function does.

Patched by :func:`enable` (class or module attributes, restored by :func:`disable`):

========================================================  ==========================================
``TorchBackend.create_parameter_raw``                     a ``pu.Parameter`` (reads see pending values)
``TorchBackend.parameter_assign``                         ``pu.assign`` / ``pu.assign_add``
``TorchBackend.parameter_assign_key``                     ``pu.assign_key``
``TorchBackend.batch_norm``                               statistics on copies, then ``pu.assign``
``TorchBackend.parameter_move_to``                        keeps a ``pu.Parameter`` one
``RFModuleAsPTModule._apply``                             keeps ``pu.Parameter`` raw tensors on ``.to()``
``gradient_checkpoint._Graph.maybe_recompute``            replay with subclass dispatch disabled
``gradient_checkpoint._custom_saved_tensors_hooks_exit``  tolerates its own cleanup (a RETURNN bug)
========================================================  ==========================================

Built on the public API (``pu.Parameter``, ``pu.assign*``, ``pu.read``,
``pu.attach``, ``pu.weight_decay``, ``pu.constrain``) and two internals, each
in one marked function near the end: ``paramupdates.targets.owner_anywhere``
(a target's qualified name, for an error message) and
``paramupdates.hooks.register_internal_files`` (call sites skip RETURNN's
plumbing).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Unpack

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

try:
    import returnn.frontend as rf
    import returnn.torch.frontend._backend as _rt_backend
    import returnn.torch.frontend.bridge as _rt_bridge
    import returnn.torch.util.gradient_checkpoint as _rt_gcs
    from returnn.frontend import _utils as _rf_utils
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "paramupdates.returnn needs RETURNN with its PyTorch backend: pip install 'paramupdates[returnn]' "
        f"(or: pip install returnn dm-tree). ({_e})"
    ) from _e

from ..attach import Attachment
from ..attach import attach as _pu_attach
from ..errors import AmbiguousOrderError, UpdateError
from ..options import StepOptionsDict, make_options
from ..parameter import Parameter
from ..phases import ISSUE_PHASES
from ..rules.constraints import constrain as _pu_constrain
from ..rules.weight_decay import weight_decay as _pu_weight_decay
from ..updates import assign as _pu_assign
from ..updates import assign_add as _pu_assign_add
from ..updates import assign_key as _pu_assign_key
from ..updates import read as _pu_read

__all__ = [
    "assign",
    "assign_add",
    "assign_key",
    "attachment",
    "constrain",
    "disable",
    "enable",
    "epoch_end",
    "flush",
    "is_enabled",
    "optimizer",
    "phase",
    "sync",
    "weight_decay",
]


_TorchBackend = _rt_backend.TorchBackend
_RFModuleAsPTModule = _rt_bridge.RFModuleAsPTModule

# ---------------------------------------------------------------------------
# phases and sync: rf has neither notion (paramupdates.returnn.phase / .sync push here)
# ---------------------------------------------------------------------------


class _BridgeState:
    """What the bridge keeps while the process runs (one object: ``_STATE``)."""

    def __init__(self) -> None:
        self.phase_stack: list[str | None] = [None]  # pur.phase(...) blocks, innermost last
        self.sync_stack: list[str | None] = [None]  # pur.sync(...) blocks, innermost last
        self.orig: dict[str, Callable[..., Any]] = {}  # RETURNN's functions, as found, by patch name
        self.saved: dict[str, Any] = {}  # the class attributes as found (descriptors), restored by uninstall()
        self.hook: list[Any] = []  # the global optimizer step pre-hook, while enabled
        self.checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers already checked
        self.eager_in_training: list[str] = []  # the first rf update applied at once in a train step
        # model / rf model / optimizer -> the attachment made for them (weakly both ways)
        self.attached: weakref.WeakKeyDictionary[Any, weakref.ref[Attachment]] = weakref.WeakKeyDictionary()


_STATE = _BridgeState()
_SYNC_KINDS = (None, "mean", "sum")


def _check_phase(name: str | None, fn: str) -> None:
    if name not in ISSUE_PHASES:
        raise ValueError(f"{fn}: unknown phase {name!r}; use one of {', '.join(map(repr, ISSUE_PHASES))}")


def _check_sync(how: str | None, fn: str) -> None:
    if how not in _SYNC_KINDS:
        raise ValueError(f"{fn}: unknown sync {how!r}; use None, 'mean' or 'sum'")


# ---------------------------------------------------------------------------
# routing rf updates to pu
# ---------------------------------------------------------------------------
_PU_FNS: Mapping[str, Callable[..., None]] = MappingProxyType({"assign": _pu_assign, "assign_add": _pu_assign_add})


def _issue(raw: Any, op: str, value: Any, key: Any = None, ph: str | None = None, sy: str | None = None) -> None:
    """``pu.<op>(raw, value)`` with the phase and the sync in force; rf-specific advice on errors."""
    if not isinstance(raw, torch.Tensor):
        raise UpdateError(
            f"paramupdates.returnn: an rf.Parameter has a raw tensor of type {type(raw).__name__}; "
            "on the PyTorch backend it must be a torch.nn.Parameter (rf.select_backend_torch())."
        )
    if ph is None:
        ph = _STATE.phase_stack[-1]
    if sy is None:
        sy = _STATE.sync_stack[-1]
    if op != "assign_key" and isinstance(value, torch.Tensor) and value.dim() and value.shape != raw.shape:
        # rf gives the value in the parameter's dims, possibly broadcast (size-1 axes): RETURNN's
        # copy_/add_ broadcast it; pu takes the target's shape or a scalar.
        with contextlib.suppress(RuntimeError):
            value = value.expand(raw.shape)
    try:
        if op == "assign_key":
            _pu_assign_key(raw, key, value, phase=ph, sync=sy)
        else:
            _PU_FNS[op](raw, value, phase=ph, sync=sy)
    except AmbiguousOrderError as e:
        raise AmbiguousOrderError(
            f"{e} In rf code: issue it inside `with paramupdates.returnn.phase('after_grad'):` (or "
            "'before_grad'), or call paramupdates.returnn.assign(param, value, phase='after_grad')."
        ) from None
    except UpdateError as e:
        if sy is None or f"sync={sy!r}" not in str(e):
            raise
        raise UpdateError(f"{e} {_sync_advice(str(e), sy)}") from None
    if not _STATE.eager_in_training and _pu_read(raw) is raw and _in_training():
        _STATE.eager_in_training.append(f"{_name_of(raw)} at {_call_site()}")
    if not isinstance(raw, Parameter) and _pu_read(raw) is not raw:
        # Recorded in a step, but rf reads the raw tensor itself: the pending value would be invisible.
        raise UpdateError(
            f"paramupdates.returnn: rf.Parameter {_name_of(raw)} was updated inside a step, but its raw tensor "
            "is a plain torch.nn.Parameter (made before paramupdates.returnn.enable()), so rf code would not "
            "see the pending value. Call paramupdates.returnn.enable() before the model is built (in a RETURNN "
            "config: at its top). The step must be discarded (pu.step does that; under pu.attach call "
            "attachment.discard())."
        )


def _sync_advice(msg: str, sy: str) -> str:
    """What to do, in rf terms, about a refused synced update (``msg``: the core's error)."""
    if "broadcasts buffers" in msg:
        return (
            "With RETURNN's Engine (torch_distributed, whose DistributedDataParallel broadcasts buffers by "
            "default, and rf auxiliary parameters are buffers of the torch module): set torch_distributed = "
            "{'options': {'forward_sync_buffers': False}} in the config ({'broadcast_buffers': False} on "
            "torch < 2.13)."
        )
    return (
        f"In rf code the sync came from paramupdates.returnn.sync({sy!r}) or sync={sy!r}: issue this update "
        "inside `with paramupdates.returnn.sync(None):` (or without sync=)."
    )


def _in_training() -> bool:
    """Whether a RETURNN train step with the train flag on is running (``rf.init_train_step_run_ctx``)."""
    ctx = rf.get_run_ctx()
    return ctx.stage == "train_step" and ctx.train_flag is True


def _parameter_assign(param: Any, value: Any, *, op: str = "assign") -> None:
    """``TorchBackend.parameter_assign``, routed: ``op="assign"``: ``pu.assign``; ``"add"``: ``pu.assign_add``."""
    if rf.is_static_traceable():  # RETURNN's own tracing (functional substitutes): its semantics
        return _STATE.orig["parameter_assign"](param, value, op=op)
    raw = param.raw_tensor
    value_raw = value.copy_compatible_to_dims_raw(param.dims)
    if op == "assign":
        _issue(raw, "assign", value_raw)
    elif op == "add":
        _issue(raw, "assign_add", value_raw)
    else:
        raise ValueError(f"Parameter {param} assign: Unsupported op: {op}")
    return None


def _parameter_assign_key(
    param: Any, key: Any, value: Any, *, op: str = "assign", axis: Any = None, key_dim: Any = None
) -> None:
    """``TorchBackend.parameter_assign_key``, routed: ``raw[key] <- value`` (``op="add"``: ``raw[key] + value``,
    the read seeing the pending value) through ``pu.assign_key``."""
    if rf.is_static_traceable():
        return _STATE.orig["parameter_assign_key"](param, key, value, op=op, axis=axis, key_dim=key_dim)
    raw = param.raw_tensor
    key_raw, res_dims = _rf_utils.strided_slice_raw_key(param, axis, key, key_dim)
    value_raw = value.copy_compatible_to_dims_raw(res_dims)
    if op == "add":
        value_raw = _pu_read(raw)[key_raw] + value_raw
    elif op != "assign":
        raise ValueError(f"Parameter {param} assign: Unsupported op: {op}")
    _issue(raw, "assign_key", value_raw, key_raw)
    return None


def _batch_norm(source: Any, **kwargs: Any) -> Any:
    """``TorchBackend.batch_norm`` with its running statistics as updates.

    In training with tracked statistics, RETURNN's fused path runs on copies
    ``m, v`` of the running mean and variance as the step sees them (pending
    values included), which ``F.batch_norm`` updates in place as usual
    (``m <- (1 - momentum) m + momentum mean_batch``, likewise ``v`` with the
    unbiased batch variance); then ``pu.assign(running_mean, m)``,
    ``pu.assign(running_variance, v)``. Bitwise RETURNN's values; eval mode
    (reads only) is RETURNN's code unchanged.
    """
    orig = _STATE.orig["batch_norm"]
    rm, rv = kwargs.get("running_mean"), kwargs.get("running_variance")
    if rm is None or rv is None or rf.is_static_traceable():
        return orig(source, **kwargs)
    train = rf.get_run_ctx().is_train_flag_enabled(func=rf.BatchNorm.__call__)
    if not (isinstance(train, bool) and train):
        return orig(source, **kwargs)
    rm_raw, rv_raw = rm.raw_tensor, rv.raw_tensor
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        m = _pu_read(rm_raw).detach().clone()
        v = _pu_read(rv_raw).detach().clone()
    rm_copy, rv_copy = rm.copy_template(), rv.copy_template()
    rm_copy.raw_tensor, rv_copy.raw_tensor = m, v
    out = orig(source, **{**kwargs, "running_mean": rm_copy, "running_variance": rv_copy})
    _issue(rm_raw, "assign", m)
    _issue(rv_raw, "assign", v)
    return out


def _create_parameter_raw(tensor: Any, *, device: str | None = None) -> torch.nn.Parameter:
    """``TorchBackend.create_parameter_raw``, returning a ``pu.Parameter`` (same data and ``requires_grad``)."""
    p = _STATE.orig["create_parameter_raw"](tensor, device=device)
    return Parameter(p.detach(), requires_grad=p.requires_grad)


def _parameter_move_to(param: Any, *, device: str | None = None, dtype: str | None = None) -> None:
    """``TorchBackend.parameter_move_to`` (``rf.Parameter.to``): RETURNN's new parameter (``raw.to(device,
    dtype)`` wrapped anew), a ``pu.Parameter`` when the old one was."""
    raw = param.raw_tensor
    if not isinstance(raw, Parameter):
        return _STATE.orig["parameter_move_to"](param, device=device, dtype=dtype)
    dev = torch.device(device) if device else None
    dt = _TorchBackend.as_dtype_raw(dtype) if dtype else None
    with torch._C.DisableTorchFunctionSubclass():
        moved = raw.detach().to(dev, dt)
    param.raw_tensor = Parameter(moved, requires_grad=raw.requires_grad)
    return None


def _module_apply(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``RFModuleAsPTModule._apply`` (``pt_module.to(...)``), keeping ``pu.Parameter`` raw tensors.

    RETURNN re-wraps a moved auxiliary parameter (a buffer) in a new
    ``torch.nn.Parameter``; here it becomes a ``pu.Parameter``, and the
    module's slot and the ``rf.Parameter`` hold that same object again.
    """
    rf_mod = self._rf_module
    was_pu = {n for n, p in rf_mod.named_parameters(recurse=False) if isinstance(p.raw_tensor, Parameter)}
    out = _STATE.orig["_apply"](self, *args, **kwargs)
    for name, rf_param in rf_mod.named_parameters(recurse=False):
        raw = rf_param.raw_tensor
        if name not in was_pu or type(raw) is not torch.nn.Parameter:
            continue  # RETURNN made no new torch.nn.Parameter for it (a moved buffer it keeps plain stays plain)
        new = Parameter(raw.detach(), requires_grad=raw.requires_grad)
        rf_param.raw_tensor = new
        for table in (self._buffers, self._parameters):
            if name in table and table[name] is not None:
                table[name] = new
    return out


def _maybe_recompute(self: Any) -> Any:
    """``gradient_checkpoint_scope``'s recomputation with torch-function subclass dispatch disabled.

    The scope records aten ops in forward with the tensors they got, and
    replays them in backward. An op that read a ``pu.Parameter`` read its
    committed value (nothing is written before commit) or, through
    ``__torch_function__``, the pending value at that moment, which is what
    was recorded. Replayed with subclass dispatch on, ``__torch_function__``
    would substitute the *latest* pending value instead.
    """
    with torch._C.DisableTorchFunctionSubclass():
        return _STATE.orig["maybe_recompute"](self)


def _saved_tensors_hooks_exit(self: Any, *exc: Any) -> Any:
    """RETURNN's ``saved_tensors_hooks.__exit__`` while a ``gradient_checkpoint_scope`` outlives its block,
    made tolerant of its own cleanup.

    While such a scope waits for its recorded tensors to die, RETURNN replaces
    ``saved_tensors_hooks.__enter__/__exit__``; the ``__enter__`` of the next
    ``with saved_tensors_hooks(...)`` (``torch.utils.checkpoint``'s) may find them
    dead and restore the originals, but ``with`` bound the replaced ``__exit__``
    before ``__enter__`` ran, and that one raises "saved_tensors_hooks __exit__
    mismatch". RETURNN alone hits it when the last recorded tensor of a scope
    was never saved for backward; with the bridge that is common (pending
    values are made in the scope and dropped at commit). Such an exit is now
    the original one.
    """
    tls = _rt_gcs._custom_saved_tensors_hooks_tls_ctx
    if not getattr(tls, "active", False) and self not in (getattr(tls, "stack", None) or ()):
        return _rt_gcs._orig_saved_tensors_hooks_exit(self, *exc)
    return _STATE.orig["saved_tensors_hooks_exit"](self, *exc)


# ---------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------
_PATCHES: tuple[tuple[Any, str, str, Callable[..., Any], bool], ...] = (
    # (owner, attribute, key in _STATE.orig, replacement, staticmethod)
    (_TorchBackend, "create_parameter_raw", "create_parameter_raw", _create_parameter_raw, True),
    (_TorchBackend, "parameter_assign", "parameter_assign", _parameter_assign, True),
    (_TorchBackend, "parameter_assign_key", "parameter_assign_key", _parameter_assign_key, True),
    (_TorchBackend, "parameter_move_to", "parameter_move_to", _parameter_move_to, True),
    (_TorchBackend, "batch_norm", "batch_norm", _batch_norm, True),
    (_RFModuleAsPTModule, "_apply", "_apply", _module_apply, False),
    (_rt_gcs._Graph, "maybe_recompute", "maybe_recompute", _maybe_recompute, False),
    (_rt_gcs, "_custom_saved_tensors_hooks_exit", "saved_tensors_hooks_exit", _saved_tensors_hooks_exit, False),
)
_lock = threading.Lock()


def _install() -> None:
    """Apply the patches (see the module docstring); idempotent. Refuses a RETURNN that lacks one."""
    with _lock:
        if _STATE.saved:
            return
        for owner, attr, key, repl, static in _PATCHES:
            if attr not in owner.__dict__:
                _restore()
                raise RuntimeError(
                    f"paramupdates.returnn.enable(): {_qualname(owner)}.{attr} does not exist in this RETURNN "
                    "version; the bridge is tested with RETURNN 1.20261022. Disable the bridge or pin that "
                    "RETURNN version."
                )
            found = owner.__dict__[attr]
            _STATE.saved[f"{_qualname(owner)}.{attr}"] = (owner, attr, found)
            _STATE.orig[key] = getattr(owner, attr)
            setattr(owner, attr, staticmethod(repl) if static else repl)
        _swap_live_saved_tensors_hooks_exit(_STATE.orig["saved_tensors_hooks_exit"], _saved_tensors_hooks_exit)
        _STATE.hook.append(register_optimizer_step_pre_hook(_first_step_check))
    _warn_untested_returnn()


def _uninstall() -> None:
    """Restore RETURNN's own attributes; idempotent."""
    with _lock:
        _restore()


def _installed() -> bool:
    return bool(_STATE.saved)


def _restore() -> None:
    if "saved_tensors_hooks_exit" in _STATE.orig:
        _swap_live_saved_tensors_hooks_exit(_saved_tensors_hooks_exit, _STATE.orig["saved_tensors_hooks_exit"])
    for owner, attr, found in _STATE.saved.values():
        setattr(owner, attr, found)
    _STATE.saved.clear()
    while _STATE.hook:
        _STATE.hook.pop().remove()
    _STATE.checked.clear()
    _STATE.eager_in_training.clear()


def _swap_live_saved_tensors_hooks_exit(old: Any, new: Any) -> None:
    """RETURNN installs its ``__exit__`` on ``saved_tensors_hooks`` while a scope waits; swap that one too."""
    hooks = torch.autograd.graph.saved_tensors_hooks
    if hooks.__dict__.get("__exit__") is old:
        hooks.__exit__ = new


def _qualname(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or owner.__name__


# ---------------------------------------------------------------------------
# the RETURNN versions the bridge is tested with
# ---------------------------------------------------------------------------
RETURNN_TESTED = ("1.20261022", "1.20261022.211313")
"""The RETURNN versions the bridge is tested with, ``(lowest, highest)``, inclusive: the ``returnn`` extra of
pyproject.toml pins this range, and ``.ci/run`` installs (so tests) the highest. Widen it only after
``tests/test_returnn.py`` (whose contract tests check what each patched RETURNN function does) passes with
the new release."""


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"1.20261022.211313"`` (a git checkout may append ``+...``): its leading integers."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _warn_untested_returnn() -> None:
    import returnn

    version = getattr(returnn, "__version__", "?")
    low, high = (_version_tuple(v) for v in RETURNN_TESTED)
    got = _version_tuple(version)
    if not (low <= got[: len(low)] and got[: len(high)] <= high):
        warnings.warn(
            f"paramupdates.returnn patches private RETURNN functions (see paramupdates.returnn's docstring) and is "
            f"tested with RETURNN {RETURNN_TESTED[0]} to {RETURNN_TESTED[1]}; this is RETURNN {version}. Run "
            "paramupdates' tests/test_returnn.py with it (its contract tests check each patched function) before "
            "relying on the bridge, or install the tested version: pip install 'paramupdates[returnn]'.",
            stacklevel=3,
        )


# ---------------------------------------------------------------------------
# the first optimizer step: is what the model declared (and issued) committed by paramupdates?
# ---------------------------------------------------------------------------


def _first_step_check(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Run at the first ``step()`` of every optimizer while the bridge is enabled (a global step pre-hook,
    before the optimizer's own hooks), once per optimizer; nothing for one that steps no ``pu.Parameter``.

    * Not committed by paramupdates (no ``pur.optimizer`` / ``pu.attach`` on it, no ``pu.step`` commit
      running it): declared rules on its parameters (``pur.weight_decay``, ``pur.constrain``, ``pu.ema``,
      ...) would never run: ``UpdateError``, nothing written. rf updates applied at once in training
      (counters and statistics as without the bridge, doubled under checkpointing): a warning.
    * Attached by :func:`optimizer`: a parameter decayed both by ``pur.weight_decay`` and by the
      optimizer's ``weight_decay``: ``UpdateError``.
    """
    if opt in _STATE.checked:
        return
    _STATE.checked.add(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    if not any(isinstance(p, Parameter) for p in params):
        return
    name = type(opt).__name__
    if _committed_by_paramupdates(opt):
        if _attachment_of(opt) is not None:
            _refuse_double_decay(opt, f"{name}.step() at {_call_site()}")
        return
    ids = {id(p) for p in params}
    rules = [r for r in _declared_rules() if r.alive() and any(id(t) in ids for t in r.tensors())]
    fix = (
        "In a RETURNN config: optimizer = paramupdates.returnn.optimizer({...}) (RETURNN's optimizer dict, "
        "wrapped) and epoch_end = paramupdates.returnn.epoch_end; in a loop of your own: "
        "pu.attach(pt_model, optimizer), or `with pu.step(pt_model, optimizer):` around the step."
    )
    if rules:
        shown = "; ".join(f"{r.describe()} declared at {r.origin} on {_rule_targets(r, ids)}" for r in rules[:4])
        raise UpdateError(
            f"paramupdates.returnn: {name}.step() at {_call_site()} updates parameters with declared rules ({shown}), "
            "but no paramupdates step or attachment commits this optimizer's steps, so those rules would never "
            f"run. {fix} Nothing was written."
        )
    if _STATE.eager_in_training:
        warnings.warn(
            f"paramupdates.returnn is enabled, but no paramupdates step or attachment commits {name}.step(): the rf "
            f"updates of training (the first: {_STATE.eager_in_training[0]}) apply at once, as RETURNN does without the "
            "bridge: no phase order, no transaction, and rf.gradient_checkpoint_scope's recomputation updates "
            f"counters and batch-norm statistics a second time. {fix}",
            UserWarning,
            stacklevel=2,
        )


def _rule_targets(rule: Any, ids: set[int]) -> str:
    names = rule.names_of({id(t) for t in rule.tensors() if id(t) in ids})
    return ", ".join(map(repr, names[:4])) + (", ..." if len(names) > 4 else "")


def _refuse_double_decay(opt: torch.optim.Optimizer, where: str) -> None:
    """``UpdateError`` if a weight-decay rule covers a parameter that a param group of ``opt`` decays too."""
    rate_of = {id(p): g["weight_decay"] for g in opt.param_groups if g.get("weight_decay", 0) for p in g["params"]}
    if not rate_of:
        return
    for r in _declared_rules():
        if r.kind != "weight_decay" or not r.alive():
            continue
        both = {id(t) for t in r.tensors() if id(t) in rate_of}
        if not both:
            continue
        names = r.names_of(both)
        rate = rate_of[next(iter(both))]
        raise UpdateError(
            f"paramupdates.returnn.optimizer: {where}: {', '.join(map(repr, names[:4]))}"
            f"{', ...' if len(names) > 4 else ''} would be decayed twice, by {r.describe()} (declared at {r.origin}, "
            f"e.g. paramupdates.returnn.weight_decay) and by {type(opt).__name__}'s own weight_decay={rate:g} (the "
            "optimizer options' 'weight_decay', or the optimizer's default: AdamW's is 0.01). Keep one: drop "
            "'weight_decay' from the optimizer options and use 'class': 'adam' (Adam + paramupdates.returnn."
            "weight_decay is AdamW, with each rf.Parameter's own rate), or remove the paramupdates.returnn."
            "weight_decay(...) call. Nothing was written."
        )


# ---------------------------------------------------------------------------
# helpers of the public functions
# ---------------------------------------------------------------------------
def _raw_and_value(param: Any, value: Any) -> tuple[torch.Tensor, Any]:
    if not isinstance(param, rf.Parameter):
        raise TypeError(f"expected an rf.Parameter, got {type(param).__name__}")
    value = rf.convert_to_tensor(value, _backend=param._raw_backend, device=param.device)
    return param.raw_tensor, value


def _key_raw(param: Any, axis: Any, key: Any, key_dim: Any) -> tuple[Any, Any]:
    """The raw index of ``param[key]`` along ``axis`` and the dims of that slice (as RETURNN computes them)."""
    return _rf_utils.strided_slice_raw_key(param, axis, key, key_dim)


def _named_rf_params(params: Any) -> list[tuple[str, Any]]:
    """``(qualified name, rf.Parameter)`` of an rf module, its torch wrapper, one parameter, or an iterable."""
    if isinstance(params, _RFModuleAsPTModule):
        params = params.rf_module
    if isinstance(params, rf.Module):
        return list(params.named_parameters())
    if isinstance(params, rf.Parameter):
        return [(_name_of(params.raw_tensor), params)]
    if isinstance(params, Iterable):
        out: list[tuple[str, Any]] = []
        for item in params:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], rf.Parameter):
                out.append((str(item[0]), item[1]))
            elif isinstance(item, rf.Parameter):
                out.append((_name_of(item.raw_tensor), item))
            else:
                raise TypeError(f"expected rf.Parameter or (name, rf.Parameter), got {type(item).__name__}")
        return out
    raise TypeError(
        f"expected an rf.Module, its torch module, an rf.Parameter or an iterable of them, got {type(params).__name__}"
    )


# ---------------------------------------------------------------------------
# RETURNN's Engine: config entries
# ---------------------------------------------------------------------------


class _Setup:
    """What the Updater hands over before it builds the optimizer (``param_groups_custom``)."""

    def __init__(self, attach_opts: dict[str, Any], user_groups: Callable[..., Any] | None) -> None:
        self.attach_opts = attach_opts
        self.user_groups = user_groups
        self.model: torch.nn.Module | None = None
        self.rf_model: Any = None

    def __call__(
        self,
        *,
        model: torch.nn.Module,
        rf_model: Any = None,
        optimizer_class: Any = None,
        optimizer_opts: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        if not _installed():
            raise UpdateError(
                "paramupdates.returnn.optimizer: the bridge is not enabled, so the model's rf updates would write "
                "in place, unseen by the attachment. Call paramupdates.returnn.enable() at the top of the config "
                "(before get_model builds the model)."
            )
        _check_engine_config()
        self.model, self.rf_model = model, rf_model
        if self.user_groups is not None:
            return self.user_groups(
                model=model, rf_model=rf_model, optimizer_class=optimizer_class, optimizer_opts=optimizer_opts, **kwargs
            )
        return _returnn_default_param_groups(
            model, optimizer_class, optimizer_opts if optimizer_opts is not None else {}
        )

    def __repr__(self) -> str:
        return "paramupdates.returnn.optimizer(...).param_groups_custom"


class _OptimizerClass:
    """The ``"class"`` entry: RETURNN calls it for the optimizer class, a subclass that attaches on creation."""

    def __init__(self, base: Any, setup: _Setup) -> None:
        self.base = base
        self.setup = setup

    def __call__(self) -> type:
        from returnn.torch.updater import get_optimizer_class

        base = get_optimizer_class(self.base)
        setup = self.setup

        def __init__(opt: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the subclass's __init__
            base.__init__(opt, *args, **kwargs)
            _attach_engine_optimizer(setup, opt)

        return type(
            base.__name__,
            (base,),
            {"__init__": __init__, "__module__": base.__module__, "__qualname__": base.__qualname__},
        )

    def __repr__(self) -> str:
        return f"paramupdates.returnn.optimizer({self.base!r})"


def _engine_optimizer_opts(opts: str | type | dict[str, Any], attach_opts: dict[str, Any]) -> dict[str, Any]:
    """The body of ``paramupdates.returnn.optimizer``."""
    if isinstance(opts, dict):
        opts = dict(opts)
    else:
        opts = {"class": opts}
    if "class" not in opts:
        raise ValueError("paramupdates.returnn.optimizer: the optimizer options need a 'class' (e.g. 'adam')")
    setup = _Setup(attach_opts, opts.pop("param_groups_custom", None))
    opts["class"] = _OptimizerClass(opts["class"], setup)
    opts["param_groups_custom"] = setup
    return opts


def _check_engine_config() -> None:
    from returnn.config import get_global_config

    config = get_global_config(raise_exception=False)
    if config is None:
        return
    for key, why in (
        (
            "torch_optimizer_step",
            "it replays a compiled, CUDA-graph-captured optimizer step, which runs no "
            "optimizer step hooks, so nothing would ever commit",
        ),
        (
            "torch_cuda_graph",
            "a captured train step replays kernels: the rf code that issues updates does not run "
            "again, and a captured optimizer step runs no step hooks",
        ),
    ):
        if config.typed_value(key, None) is not None:
            raise UpdateError(
                f"paramupdates.returnn.optimizer: the config sets {key}, which paramupdates cannot support: {why}. "
                f"Remove {key} from the config, or use RETURNN's optimizer without paramupdates."
            )
    accum = config.typed_dict.get("accum_grad_multiple_step", config.int("accum_grad_multiple_step", 1))
    if accum != 1 and config.typed_value("epoch_end", None) is None:
        warnings.warn(
            "paramupdates.returnn.optimizer with accum_grad_multiple_step: the updates of the micro-batches after "
            "the last optimizer step of an epoch are committed only by epoch_end = paramupdates.returnn.epoch_end "
            "(before RETURNN saves the model). Add it to the config.",
            stacklevel=2,
        )


def _attach_engine_optimizer(setup: _Setup, opt: torch.optim.Optimizer) -> None:
    model = setup.model
    if model is None:
        raise UpdateError(
            "paramupdates.returnn.optimizer: the optimizer was created without RETURNN calling its "
            "param_groups_custom, so the model is unknown. Use the dict pur.optimizer(...) returns as the config's "
            "optimizer, unchanged."
        )
    _refuse_double_decay(opt, f"the optimizer the Engine creates ({type(opt).__name__})")
    att = _pu_attach(model, opt, **setup.attach_opts)
    for key in (model, setup.rf_model, opt):
        if key is not None:
            _STATE.attached[key] = weakref.ref(att)
    setup.model = setup.rf_model = None  # the attachment holds them; this config entry does not


def _returnn_default_param_groups(model: torch.nn.Module, optimizer_class: Any, optimizer_opts: dict[str, Any]) -> Any:
    """RETURNN's own param groups (``Updater._get_optimizer_param_groups``: weight-decay groups, blacklist),
    computed with a stand-in for the Updater (it reads only ``network`` and ``config``)."""
    from returnn.config import Config, get_global_config
    from returnn.torch.updater import Updater

    view = types.SimpleNamespace(network=model, config=get_global_config(raise_exception=False) or Config())
    groups = list(Updater._get_optimizer_param_groups(view, optimizer_class, optimizer_opts))
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return groups


def _attachment_of(obj: Any) -> Attachment | None:
    """The attachment made for an Engine, its torch optimizer, torch model or rf model."""
    if hasattr(obj, "get_pt_optimizer"):
        obj = obj.get_pt_optimizer()
    try:
        ref = _STATE.attached.get(obj)
    except TypeError:  # not weak-referenceable
        return None
    return None if ref is None else ref()


# ---------------------------------------------------------------------------
# paramupdates internals used here (one marked function each)
# ---------------------------------------------------------------------------
def _register_returnn_call_sites() -> None:
    """RETURNN's files between a user's ``param.assign(...)`` and pu (``rf.Parameter.assign``, the torch
    backend): call sites (``file:line`` in errors and schedules) skip them and name the user's line.
    INTERNAL: ``paramupdates.hooks.register_internal_files`` (added for this bridge)."""
    from .. import hooks

    hooks.register_internal_files(rf.Parameter.assign.__code__.co_filename, _rt_backend.__file__)


_register_returnn_call_sites()


def _declared_rules() -> list[Any]:
    """Every declared rule, in declaration order. INTERNAL: ``paramupdates.rules.base.declared``."""
    from ..rules.base import declared

    return declared()


def _committed_by_paramupdates(opt: torch.optim.Optimizer) -> bool:
    """Whether an attachment commits inside ``opt.step()``, or a ``pu.step`` commit is running it.
    INTERNAL: ``paramupdates.routing``."""
    from .. import routing

    return routing.committing_optimizer(opt) or any(att.optimizer is opt for att in routing.attachments())


def _call_site() -> str:
    """``file:line`` of the user's (or RETURNN's) frame that led here. INTERNAL: ``paramupdates.origin``."""
    from ..origin import call_site

    return call_site(2)


def _name_of(raw: torch.Tensor) -> str:
    """The qualified name of ``raw`` in a model paramupdates has indexed, for messages.
    INTERNAL: ``paramupdates.targets.owner_anywhere``."""
    from ..targets import owner_anywhere

    owner = owner_anywhere(raw)
    return repr(owner[0]) if owner is not None else f"(shape {tuple(raw.shape)}, dtype {raw.dtype})"


# ---------------------------------------------------------------------------
# the public functions
# ---------------------------------------------------------------------------
def enable() -> None:
    """Route rf parameter updates and rf batch-norm statistics on the torch backend through paramupdates.

    Idempotent. Patches RETURNN's ``TorchBackend.create_parameter_raw`` /
    ``parameter_assign`` / ``parameter_assign_key`` / ``parameter_move_to`` /
    ``batch_norm``, ``RFModuleAsPTModule._apply`` and two functions of its
    gradient-checkpoint scope (the list and the reasons: the module
    docstring). Parameters created before
    this call keep plain ``torch.nn.Parameter`` raw tensors: their updates
    stay eager outside a step and raise ``pu.UpdateError`` inside one, so
    enable before the model is built. Raises ``RuntimeError`` (and patches
    nothing) on a RETURNN without one of those functions.
    """
    _install()


def disable() -> None:
    """Restore RETURNN's own functions (idempotent). Raw tensors already made stay ``pu.Parameter``\\ s,
    which behave as plain parameters outside a step."""
    _uninstall()


def is_enabled() -> bool:
    """Whether rf parameter updates go through paramupdates now."""
    return _installed()


@contextlib.contextmanager
def phase(name: str | None) -> Iterator[None]:
    """The phase of the rf updates issued inside the block: where in the commit's fixed order they apply
    (``before_grad``, the optimizer's step, ``after_grad``, the auxiliary phase, ``after_step``).

    ``rf.Parameter.assign`` has no phase argument. An update of a trainable
    parameter (one the optimizer also updates) inside a step must say whether
    it applies before or after ``optimizer.step()``; without a phase it raises
    ``pu.AmbiguousOrderError`` naming the parameter and the line::

        with pur.phase("before_grad"):
            self.weight.assign_add(noise)      # the optimizer then updates weight + noise

    ``name``: ``"before_grad"``, ``"after_grad"``, ``"after_step"``, or ``None``
    (the ``auxiliary`` phase of non-trainable targets). The innermost block
    wins. ``assign_add``/``assign_key`` compose with the optimizer's update;
    ``assign(v)`` sets ``v``, computed when issued (in ``after_grad`` it
    overwrites the optimizer's update). A projection of the updated weight
    (a constraint, a renormalization) is a declared rule: :func:`constrain`.
    Outside a step the phase is irrelevant: updates apply at once.
    """
    _check_phase(name, "paramupdates.returnn.phase")
    _STATE.phase_stack.append(name)
    try:
        yield
    finally:
        _STATE.phase_stack.pop()


@contextlib.contextmanager
def sync(how: str | None) -> Iterator[None]:
    """Distributed sync for the rf updates issued inside the block: every rank commits the same value.

    Every update issued inside (``rf.Parameter.assign`` / ``assign_add`` /
    ``assign_key``, ``rf.BatchNorm``'s running statistics, :func:`assign` & co.
    without ``sync=``) is ``pu.assign(..., sync=how)``: at commit, every rank's
    pending value ``v_r`` of the target is replaced on every rank by

        how="mean":  (sum_r v_r) / R        (integers: floored)
        how="sum":   sum_r v_r

    so every rank commits the same statistics, and none is lost (plain
    RETURNN under DDP keeps rank 0's). ``None`` switches sync off inside an
    enclosing block; the innermost block wins. What synced updates
    require (docs/distributed.md) holds: only non-trainable targets (auxiliary ``rf.Parameter``\\ s,
    batch-norm statistics), all updates of a synced target of one step in one
    phase, every rank commits together (under RETURNN's Engine: inside
    ``optimizer.step()``, which every rank calls), and no DDP that broadcasts
    buffers (RETURNN's ``torch_distributed`` default: set ``"options":
    {"forward_sync_buffers": False}``). Outside a step a synced update is
    reduced at once (one blocking all-reduce each, so every rank must issue
    it): keep evaluation, which RETURNN runs on rank 0 only, out of the block,
    e.g. ``with pur.sync("mean" if rf.get_run_ctx().train_flag else None):``.
    """
    _check_sync(how, "paramupdates.returnn.sync")
    _STATE.sync_stack.append(how)
    try:
        yield
    finally:
        _STATE.sync_stack.pop()


def assign(param: Any, value: Any, *, phase: str | None = None, sync: str | None = None) -> None:
    """``param <- value``: ``rf.Parameter.assign`` with a phase (see :func:`phase`) and a sync (see :func:`sync`).

    ``value``: an rf ``Tensor`` (in a subset of ``param``'s dims, broadcast) or a
    Python number. Inside a step the update is recorded and committed in
    ``phase`` (``None``: the enclosing :func:`phase` block's); outside, applied at once.
    ``sync``: ``"mean"`` / ``"sum"`` across ranks (``None``: the enclosing :func:`sync` block's).
    """
    _check_phase(phase, "paramupdates.returnn.assign")
    _check_sync(sync, "paramupdates.returnn.assign")
    raw, value = _raw_and_value(param, value)
    _issue(raw, "assign", value.copy_compatible_to_dims_raw(param.dims), ph=phase, sy=sync)


def assign_add(param: Any, value: Any, *, phase: str | None = None, sync: str | None = None) -> None:
    """``param <- param + value``: ``rf.Parameter.assign_add`` with a phase (see :func:`phase`) and a sync
    (see :func:`sync`; the sum of the ranks' values ``param + value_r``, not of the deltas)."""
    _check_phase(phase, "paramupdates.returnn.assign_add")
    _check_sync(sync, "paramupdates.returnn.assign_add")
    raw, value = _raw_and_value(param, value)
    _issue(raw, "assign_add", value.copy_compatible_to_dims_raw(param.dims), ph=phase, sy=sync)


def assign_key(
    param: Any,
    axis: Any,
    key: Any,
    key_dim: Any,
    value: Any,
    *,
    phase: str | None = None,
    sync: str | None = None,
) -> None:
    """``param[key] <- value`` along ``axis``: ``rf.Parameter.assign_key`` with a phase (see :func:`phase`)
    and a sync (see :func:`sync`)."""
    _check_phase(phase, "paramupdates.returnn.assign_key")
    _check_sync(sync, "paramupdates.returnn.assign_key")
    raw, value = _raw_and_value(param, value)
    key_raw, res_dims = _key_raw(param, axis, key, key_dim)
    _issue(raw, "assign_key", value.copy_compatible_to_dims_raw(res_dims), key_raw, ph=phase, sy=sync)


def weight_decay(params: Any, *, scale_by_lr: bool = True) -> list[Any]:
    """Honour ``rf.Parameter.weight_decay``: ``pu.weight_decay`` with each parameter's own rate (RETURNN #1439).

    For every trainable ``rf.Parameter`` ``p`` of ``params`` (an rf module, its
    torch module, a parameter, or an iterable of parameters or ``(name,
    parameter)`` pairs) with ``p.weight_decay = r > 0``, before
    ``optimizer.step()`` (phase ``before_grad``, once per optimizer update, for
    parameters with a gradient)::

        p <- p * (1 - lr * r)      (scale_by_lr=False: p <- p * (1 - r))

    ``lr`` is ``p``'s param group's learning rate at commit (RETURNN's learning
    rate control sets it). That is AdamW's decoupled decay: ``Adam`` plus this
    is ``AdamW`` bitwise. (RETURNN's TF backend with ``decouple_constraints``
    instead subtracts ``2 r p`` times ``decouple_constraints_factor * lr / lr_0``.)
    The rates are read now; one ``pu.weight_decay`` rule is declared per
    distinct rate, in order of first appearance. Declare it before training
    (e.g. in the config's ``get_model``). Returns the rules (``.remove()``).
    """
    by_rate: dict[float, list[tuple[str, Any]]] = {}
    for name, p in _named_rf_params(params):
        rate = float(p.weight_decay or 0.0)
        if rate < 0.0:
            raise ValueError(f"paramupdates.returnn.weight_decay: {name!r} has weight_decay={rate}; it must be >= 0")
        if rate > 0.0 and p.raw_tensor.requires_grad:
            by_rate.setdefault(rate, []).append((name, p.raw_tensor))
    return [_pu_weight_decay(named, rate, exclude=None, scale_by_lr=scale_by_lr) for rate, named in by_rate.items()]


def constrain(params: Any, constraint: Any) -> Any:
    """``pu.constrain`` on rf parameters (RETURNN #1214): ``p <- constraint(p)`` after each ``optimizer.step()``.

    Phase ``after_grad``, once per optimizer update, for every ``rf.Parameter``
    of ``params`` (an rf module, its torch module, a parameter, or an iterable).
    ``constraint``: ``pu.max_norm``, ``pu.unit_norm``, ``pu.min_max_norm``,
    ``pu.non_neg``, ``pu.clamp`` or a callable ``tensor -> tensor``. The norm
    constraints' ``dim`` is an axis of the raw tensor, whose axes are the
    parameter's ``dims`` in order: ``rf.Linear.weight`` is ``(in, out)``, so a
    max-norm per output unit (Keras') is ``pu.max_norm(v, dim=1)``. Returns the
    rule (``.remove()``).
    """
    named = [(name, p.raw_tensor) for name, p in _named_rf_params(params)]
    return _pu_constrain(named, constraint)


def optimizer(opts: str | type | dict[str, Any] = "adam", **options: Unpack[StepOptionsDict]) -> dict[str, Any]:
    """The value of a RETURNN config's ``optimizer``: RETURNN's Engine with paramupdates, config only.

    ``opts`` is what ``optimizer`` would be without the bridge (a dict with
    ``"class"``, or the class or its name). The optimizer RETURNN builds from
    it is attached (``pu.attach``) to the model: the updates the model's rf
    code issues after an ``optimizer.step()`` form one step, committed inside
    the next ``optimizer.step()`` in the fixed phase order. With
    ``accum_grad_multiple_step = N`` RETURNN calls ``optimizer.step()`` once
    per N micro-batches: the updates of all N are one step (each read sees
    the ones before, rule 1) and declared rules run once per real update.
    Set ``epoch_end = paramupdates.returnn.epoch_end`` too: it commits what
    no ``optimizer.step()`` followed (the micro-batches of an incomplete
    accumulation), before RETURNN saves the model. ``**options`` (``on_nonfinite``,
    ``copy_for_rollback``, ``process_group``, ``sync_timeout``): as for ``pu.attach``.

    The returned dict sets ``param_groups_custom`` (RETURNN hands it the
    model); a ``param_groups_custom`` in ``opts`` is called from it, else
    RETURNN's own grouping applies (``weight_decay``,
    ``weight_decay_modules_blacklist``, ...). Not supported, with a
    ``pu.UpdateError`` when the Engine creates the optimizer:
    ``torch_optimizer_step`` and ``torch_cuda_graph`` (a replayed, captured
    optimizer step runs no step hooks; a captured forward issues no updates),
    and a parameter that both a declared ``pur.weight_decay`` and a param group
    with ``weight_decay > 0`` decay (AdamW's default is 0.01): decayed twice.
    """
    make_options(dict(options), "paramupdates.returnn.optimizer")  # refuse a bad option now
    return _engine_optimizer_opts(opts, dict(options))


def attachment(obj: Any) -> Attachment | None:
    """The ``pu.Attachment`` that :func:`optimizer` made for ``obj`` (an Engine, its torch optimizer, its torch
    model or rf model), or None: ``.schedule()``, ``.flush()``, ``.discard()``, ``.detach()``, ``.state_dict()``."""
    return _attachment_of(obj)


def flush(obj: Any) -> None:
    """Commit now the pending updates of ``obj``'s attachment (see :func:`attachment`), without a gradient
    update (declared rules, which run once per optimizer update, do not run)."""
    att = _attachment_of(obj)
    if att is not None:
        att.flush()


def epoch_end(*, model: Any = None, **_kwargs: Any) -> None:
    """A RETURNN config's ``epoch_end``: commit what no ``optimizer.step()`` followed.

    RETURNN's Engine calls it after each epoch's last step, before saving the
    model (and after each evaluation), with the model. What is pending then
    (the micro-batches of an incomplete gradient accumulation, updates issued
    in evaluation) is committed as by ``attachment.flush()``. To keep an
    ``epoch_end`` of your own, call this from it:
    ``def epoch_end(**kwargs): pur.epoch_end(**kwargs); ...``.
    """
    if model is not None:
        flush(model)
