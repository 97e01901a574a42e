"""``pu.ema``: an exponential moving average of a model's weights, phase ``after_step``.

Math, once per optimizer update, for each floating tensor ``a`` of the
averaged copy and its source ``p`` in the model (parameters, and buffers when
``include_buffers``)::

    a <- a + (1 - d_t) * (p - a)          # torch._foreach_lerp_(a, p, 1 - d_t)
    t  = the number of EMA updates before this one (0, 1, 2, ...)

    warmup=None                d_t = decay
    warmup=W (a number;        d_t = min(decay, (1 + t) / (W + t))
      True means 10)                 (TensorFlow's ExponentialMovingAverage num_updates)
    warmup="timm" or           d_0 = 0 (a copy), then
      TimmWarmup(gamma,        d_t = max(m, min(decay, 1 - (1 + t / gamma) ** -power))
      power, min_decay=m)            (timm's ModelEmaV3(use_warmup=True); defaults
                                      gamma=1, power=2/3, m=0)
    warmup=f (a callable)      d_t = f(t)

The two warmups: TensorFlow's ``(1 + t) / (W + t)`` reaches 0.9 after ``9W - 10``
updates whatever ``decay`` is; timm's ``1 - (1 + t/gamma)^(-power)`` starts with a
copy (``d_0 = 0``) and grows as a power law: with ``power=2/3`` it reaches 0.999 at
about 31.6K updates, with ``power=3/4`` at 10K. timm's ``get_decay(step)`` is
called with the number of updates *including* this one, so ``t = step - 1``; the
Python float expression is timm's, so an EMA with ``warmup="timm"`` equals
``timm.utils.ModelEmaV3(model, decay, use_warmup=True)`` updated with
``step = t + 1``, bitwise (tested where timm imports).

Non-floating buffers (``num_batches_tracked``) are copied, not averaged; with
``include_buffers=False`` every buffer is copied, so the copy evaluates with the
model's current statistics.

``dtype=`` / ``device=`` keep the copy's floating tensors in another dtype (a
float32 average of a bfloat16 model) or on another device (a CPU average of a
GPU model). Then ``a <- a * d_t + p * (1 - d_t)`` (``_foreach_mul_`` then
``_foreach_add_``, promoting ``p`` inside the kernel, as timm does) where the
dtypes differ, and ``p`` is first copied to ``a``'s device where the devices
differ (one temporary per tensor, freed after the commit).

It runs in phase ``after_step``, after every other phase of the commit, so it
averages the values just committed: the new weights and the running statistics
of this step. Under gradient accumulation it runs once per optimizer update.

The copy starts as ``copy.deepcopy(model)`` at declaration (``requires_grad``
off, ``eval()`` mode); its tensors belong to no step's model. Its parameters and
buffers are the model's, name for name and nothing more, so, as with
``AveragedModel(...).module``, ``model.load_state_dict(copy.state_dict())``
loads strictly and ``zip(copy.buffers(), model.buffers())`` pairs them.

The rule (:class:`EMA`) is a ``DeclaredRule``, as weight decay and the constraints are: the model's
tensors, followed by name in the model (a layer replaced between steps is averaged under its name),
and the copy's, followed by name in the copy; a plan made when their storage changes (the pairs
checked and grouped per device and dtype); at each commit ``d_t`` (:meth:`EMA.ready`, before anything
is written), then the math above (:meth:`EMA.run`). The commit's ``RuleSet`` re-checks the plan in its
one pass over the storage of every rule's tensors, with no Python work per tensor.

Where ``t`` lives (the choice). ``t`` must travel with whatever saves
the copy (a Lightning checkpoint of a module that holds it, timm's
``CheckpointSaver``, ``torch.save(copy.state_dict())``), or a resumed warmup
restarts at 0; and it must not be a tensor of the copy, or the copy's
``state_dict`` no longer loads into the model. So ``t`` is a Python int beside
the copy, written by a ``state_dict`` post-hook of the copy's root module into
the state_dict's metadata, ``state_dict._metadata[prefix]["pu_ema_updates"]``
(``prefix`` the copy's, ``""`` for the copy itself, ``"ema"`` for
``module.ema``), which ``torch.save`` / ``torch.load`` keep (``weights_only=True``
too), and read back by a ``load_state_dict`` pre-hook (PyTorch hands each module
its metadata there). What rebuilds the state_dict as a plain dict
(``dict(sd)``, a comprehension, safetensors, ``torch.distributed.checkpoint``)
drops the metadata and with it ``t``: a load without ``t`` leaves ``t`` as it
is, and so does a state_dict the copy made itself handed back to it (DCP loads a
``Stateful`` into the state_dict it made, and the recipe
``st = {"ema": copy.state_dict(), ...}; dcp.load(st, ...); copy.load_state_dict(st["ema"])``
loads the copy's own dict: that ``t`` is the copy's from then, not the
checkpoint's; one of its last few state_dicts, not only the last: DCP takes the
state_dict of the attachment beside it, which holds another); where such a load brings weights without their ``t`` into an EMA
with a warmup, it warns. The ``state_dict()`` of every Stepper or attachment
whose model owns the averaged tensors also holds ``t`` (``"updates"``), as a
plain entry: checkpoint it (or the rule, ``rule_of(copy)``) with the copy. A
state_dict saved by earlier versions, when ``t`` was the copy's buffer
``pu_ema_updates``, still loads (strictly): the pre-hook takes ``t`` from it.
The alternatives: a buffer (the layout before: strict loading into the model
fails, the buffers do not pair), a non-persistent buffer (``buffers()`` still
misaligned, and not saved), ``get_extra_state`` (an ``_extra_state`` key the
model refuses). ``pu.rules.ema.rule_of(copy).updates`` reads and sets ``t``.

Under a step's device-side verdict ``ok`` (``on_nonfinite="skip"`` decided on the device, rule 7)
the new average is computed out of place and selected, ``a <- where(ok, lerp(a, p, w), a)`` (a
temporary per group of pairs: ``lerp(a, p, 0)`` is not ``a`` bitwise, it turns ``-0.0`` into
``+0.0``), and ``t`` counts the skipped update on the device (:class:`Counter`). An EMA with a warmup
needs ``t`` on the host for ``d_t``: its steps are decided on the host (one sync).

``torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay),
use_buffers=True)`` computes the same floating-point average bitwise, except:
its first ``update_parameters`` copies instead of averaging (call it once at
creation to align), and it "averages" integer buffers in float and truncates
(``num_batches_tracked`` stops growing), where this copies them.
"""

from __future__ import annotations

import collections
import copy
import itertools
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType, MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import hooks, sharding, state
from ..errors import UpdateError, listed
from ..ops import select_
from ..origin import call_site, is_internal
from ..phases import AFTER_STEP
from ..schedule import ScheduleEntry
from .base import register
from .common import (
    WeakList,
    aliases,
    check_declared,
    has_subclass,
    no_subclass,
    plain_if,
    refuse_inside_step,
    stored_named,
    where,
)
from .declared import DeclaredRule

if TYPE_CHECKING:
    from ..targets import ModelIndex
    from .base import CommitContext

COUNTER = "pu_ema_updates"
"""The key of ``t`` (the number of EMA updates so far) in the copy's ``state_dict`` metadata
(``state_dict._metadata[prefix][COUNTER]``); in earlier versions, the name of a buffer of the copy."""
HANDED = 8
"""How many of the copy's last ``state_dict`` metadata entries :class:`LoadCounter` knows as its own."""


class Counter:
    """``t``, the number of EMA updates so far: kept beside the averaged copy, not as one of its tensors.

    Two hooks on the copy's root module carry it through the copy's ``state_dict``: :class:`SaveCounter`
    writes it into the state_dict's metadata for the copy (``state_dict._metadata[prefix]``, which
    ``torch.save`` keeps and ``load_state_dict`` hands the module back as its ``local_metadata``), and
    :class:`LoadCounter` reads it back. A plain Python int, no sync to read it; after updates whose
    verdict was taken on the device, ``skipped`` (a 0-dim int64 tensor there) counts those of them that
    were skipped, and :meth:`value` reads it once (a wait for the device, made by whoever reads ``t``).
    """

    def __init__(self, t: int = 0, origin: str = "", warmup: bool = False) -> None:
        self.t = t
        self.skipped: torch.Tensor | None = None
        self.origin = origin  # (for the warning of :class:`LoadCounter`)
        self.warmup = warmup  # d_t depends on t
        self.quiet = False  # loading through the rule's own state, which carries t as a plain entry
        # the metadata entry of each of the last state_dicts the copy made (``load_state_dict`` copies the
        # dict but passes its metadata on), the copy's version counters and t then: a load of one of those
        # very state_dicts, its tensors written in place since while t was not, loads weights without their
        # t. Several: between making the dict it loads into and loading it, the DCP recipe has the copy make
        # others (the state_dict of the attachment or Stepper beside it holds one)
        self.handed: collections.deque[tuple[dict, tuple[int, ...], int]] = collections.deque(maxlen=HANDED)

    def value(self) -> int:
        """``t``: the updates counted, less those skipped on the device."""
        if self.skipped is not None:
            self.t -= int(self.skipped)
            self.skipped = None
        return self.t

    def set(self, t: int) -> None:
        self.t, self.skipped = int(t), None

    def count(self, ok: torch.Tensor | None) -> None:
        """One more update: applied (``ok`` None), or applied where the device verdict ``ok`` holds."""
        self.t += 1
        if ok is not None:
            if self.skipped is None or self.skipped.device != ok.device:
                self.skipped = (~ok).to(torch.int64) + (0 if self.skipped is None else self.skipped.to(ok.device))
            else:
                self.skipped.add_(~ok)


class SaveCounter:
    """The copy's ``state_dict`` post-hook: ``local_metadata[COUNTER] = t`` (no tensor is added)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def __call__(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: dict[str, Any]) -> None:
        c = self.counter
        local_metadata[COUNTER] = c.value()
        c.handed.append((local_metadata, _versions(module), c.t))


def _versions(module: nn.Module) -> tuple[int, ...]:
    """The version counters of the copy's tensors (their local shards): what an in-place load moves."""
    return tuple(sharding.local(t)._version for t in itertools.chain(module.parameters(), module.buffers()))


class LoadCounter:
    """The copy's ``load_state_dict`` pre-hook: ``t`` from the metadata for the copy, if it has it.

    A state_dict saved by an earlier version holds ``t`` as the tensor ``prefix + "pu_ema_updates"``: it is
    taken (and removed, so that strict loading passes). A state_dict that carries no ``t`` (the
    model's own, or one rebuilt as a plain dict, which drops the metadata) leaves ``t`` as it is, as
    does one of the copy's own last state_dicts handed back (``torch.distributed.checkpoint`` loads a
    ``Stateful`` into the state_dict it made, and its recipe loads ``copy.state_dict()`` in place, then
    into the copy: its ``t`` is the copy's from then). Where such a load
    brings weights without their ``t`` (a plain dict with no metadata at all: safetensors,
    ``dict(sd)``; the copy's own state_dict written in place since, while ``t`` was not: DCP) into the
    copy of an EMA with a warmup, it warns (:class:`~paramupdates.AccountingWarning`): the averaged
    weights are those loaded, but the warmup goes on from this ``t``, not the saved one.
    """

    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def __call__(
        self,
        module: nn.Module,
        state_dict: Any,
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        old = state_dict.pop(prefix + COUNTER, None)  # the earlier layout: a 0-dim int64 buffer
        c = self.counter
        handed = next((h for h in c.handed if h[0] is local_metadata), None)
        if handed is not None:
            # the copy's own state_dict handed back: torch.distributed.checkpoint loads a Stateful into the
            # state_dict it made, in place. The t in its metadata is the copy's from then, not the
            # checkpoint's: never taken (a Stepper's state loaded since may have set t already)
            if c.warmup and not c.quiet and _written_in_place(c, module, handed):
                _warn_counter_lost(c, type(module).__name__)
            return
        t = local_metadata.get(COUNTER)
        if t is None and old is not None:
            t = int(old)
        if t is not None:
            c.set(int(t))
        elif not local_metadata and c.warmup and not c.quiet:
            _warn_counter_lost(c, type(module).__name__)


def _written_in_place(c: Counter, module: nn.Module, handed: tuple[dict, tuple[int, ...], int]) -> bool:
    """Whether the copy's tensors were written since it made the state_dict handed back (``handed``),
    while ``t`` was not: weights loaded from elsewhere (a checkpoint), with no ``t`` of theirs."""
    _metadata, versions, t = handed
    return c.value() == t and _versions(module) != versions


def _warn_counter_lost(counter: Counter, what: str) -> None:
    """:class:`~paramupdates.AccountingWarning`: a copy loaded from a state_dict that dropped its ``t``."""
    from ..errors import AccountingWarning

    site = call_site(2)
    warnings.warn(
        f"pu.ema (declared at {counter.origin}): its averaged copy ({what}) was loaded at {site} from a state_dict that "
        "does not carry the EMA's update counter t (torch.distributed.checkpoint, safetensors and a dict rebuilt "
        "from a state_dict drop the state_dict's metadata, where the copy keeps t). The averaged weights are the "
        f"loaded ones, but t stays {counter.value()}, and the warmup's decay d_t follows t. Checkpoint the "
        "state_dict() of the pu.Stepper or attachment (or pu.rules.ema.rule_of(copy), which DCP takes as a "
        "Stateful) with the copy: it carries t as a plain entry. Or set pu.rules.ema.rule_of(copy).updates "
        "after loading.",
        AccountingWarning,
        stacklevel=_outside_stacklevel(),
    )


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of a warning that points at the first frame outside paramupdates and torch (the
    user's ``load_state_dict`` or ``dcp.load`` call, not torch's hook runner)."""
    frame: FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level


def counter_of(module: nn.Module) -> Counter | None:
    """The :class:`Counter` that ``module``'s ``state_dict`` carries (``module`` an averaged copy), else None."""
    for hook in module._state_dict_hooks.values():
        if isinstance(hook, SaveCounter):
            return hook.counter
    return None


@dataclass(frozen=True)
class TimmWarmup:
    """timm's EMA warmup (``timm.utils.ModelEmaV3(use_warmup=True)``) as a ``warmup=`` preset.

    ``d_0 = 0`` (the first update copies), then
    ``d_t = max(min_decay, min(decay, 1 - (1 + t / gamma) ** -power))``,
    ``t`` the number of updates before this one. ``warmup="timm"`` is
    ``TimmWarmup()``: ``gamma=1``, ``power=2/3`` (0.999 at about 31.6K updates;
    ``power=3/4``: at 10K).
    """

    gamma: float = 1.0
    power: float = 2 / 3
    min_decay: float = 0.0

    def decay_at(self, t: int, decay: float) -> float:
        """``d_t`` for the ``t``-th update (0-based) of an EMA declared with ``decay``."""
        if t <= 0:
            return 0.0
        # timm's expression, term for term (bitwise the same float)
        d = 1 - (1 + t / self.gamma) ** -self.power
        return max(min(d, decay), self.min_decay)


Warmup = bool | float | int | str | TimmWarmup | Callable[[int], float] | None

_PRESETS: Mapping[str, Any] = MappingProxyType({"timm": TimmWarmup()})


class EMA(DeclaredRule):
    """The averaging rule behind :func:`ema` (see the module docstring for the math).

    A :class:`~paramupdates.rules.declared.DeclaredRule`: it holds the averaged model's parameters and
    buffers, followed by name in that model (rule 12: a layer replaced between steps is averaged under
    its name, into the averages kept so far), and the copy's, followed by name in the copy. Its ``live``
    tensors are the model's ``n``, then the copy's ``n``, pair ``i`` being ``(live[i], live[n + i])``.
    :meth:`make_plan` checks the pairs and groups them; :meth:`ready` takes ``d_t``; :meth:`run` averages.
    """

    phase = AFTER_STEP
    kind = "ema"
    infallible = True  # foreach lerp/copy on pairs validated by make_plan
    per_optimizer_update = True

    def __init__(
        self,
        model: nn.Module,
        module: nn.Module,
        decay: float,
        warmup: Warmup,
        include_buffers: bool,
        origin: str,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(origin)
        self.module = module
        self.decay = decay
        self.warmup = _PRESETS[warmup] if isinstance(warmup, str) else warmup
        self.include_buffers = include_buffers
        self._path = ""  # where the averaged model is in the module its tensors are followed in (rebase)
        named, copies, self._buffer = _paired(model, module, str(origin))
        self.hold(named, model)
        self._copies = WeakList([t for _, t in copies], module, [n for n, _ in copies])
        src, dst = [t for _, t in named], [t for _, t in copies]
        self._sub = has_subclass(src + dst)
        self._avg = self._averaged(src)
        # declared with dtype=/device=: the copy's floats stay in that dtype, the copy on that device
        # (normalized: "cuda" -> "cuda:0"); otherwise the copy must be as the model is at each commit
        self._dtype = dtype
        self._device = dst[0].device if device is not None and dst else device
        self._weight = 1.0 - decay
        # t: beside the copy, carried by the copy's state_dict metadata (no tensor: the copy's
        # parameters and buffers are the model's, name for name)
        self._counter = Counter(origin=str(origin), warmup=not (warmup is None or warmup is False))
        module.register_state_dict_post_hook(SaveCounter(self._counter))
        module.register_load_state_dict_pre_hook(LoadCounter(self._counter))
        # the model's tensors as the copy was last made for (dtype, device): the copy follows the model
        self._where = [(t.dtype, t.device) for t in src]

    def _averaged(self, src: list[torch.Tensor]) -> list[bool]:
        """Per pair: averaged (a floating parameter, or buffer if ``include_buffers``), else copied."""
        return [
            (t.is_floating_point() or t.is_complex()) and (not b or self.include_buffers)
            for t, b in zip(src, self._buffer)
        ]

    # --- following the model and its copy by name ----------------------------------------------
    def current(self) -> list[Any]:
        return [*self._tensors.current(), *self._copies.current()]

    def follow(self) -> bool:
        changed = self._tensors.resync()
        return self._copies.resync() or changed

    def untie(self, live: list[Any]) -> int:
        """Nothing left out: the model's tensors are read (one under two names is read twice), and a copy
        tensor under two names is written once by the plan (:meth:`make_plan`)."""
        return 0

    def resync(self) -> None:
        """Follow the model's and the copy's tensors by name (``fully_shard`` replaces every parameter by a
        sharded ``DTensor`` in the same slot: the copy is then sharded the same way, its averages kept);
        raise where the model's names and the copy's no longer agree (a layer added, removed, renamed)."""
        model = self._followed()
        if model is not None:
            _paired(model, self.module, str(self.origin))
        super().resync()

    def _followed(self) -> nn.Module | None:
        """The averaged model: the module ``_path`` names in the module followed (itself, until a module
        it sat in replaced it: :meth:`rebase`); ``None`` if gone."""
        root = self._tensors.root
        if root is None or not self._path:
            return root
        try:
            return root.get_submodule(self._path)
        except AttributeError:
            return None

    def rebase(self, old: Any, parent: Any, name: str) -> None:
        """The averaged model (or a module it sits in) is being replaced in ``parent`` under ``name``:
        average what ``parent`` holds there from now on, by name (the copy keeps its averages)."""
        if self._tensors.root is old:
            self._path = f"{name}.{self._path}" if self._path else name
        super().rebase(old, parent, name)

    def lost_names(self) -> list[str]:
        if self._followed() is None and self._tensors.root is not None:
            return [self._path]  # the module averaged is gone from where it was
        return super().lost_names()

    def lost_error(self, model: str, lost: list[str]) -> UpdateError:
        if self._followed() is None:
            return super().lost_error(model, lost)
        at = self._tensors.lost
        gone = [self._copies.names[i] for i in at] if at and self._copies.names else lost
        return _gone_error(str(self.origin), gone, "buffers" if at and self._buffer[at[0]] else "parameters")

    # --- the step counter t ------------------------------------------------
    @property
    def updates(self) -> int:
        """``t``: the number of EMA updates so far (saved in the copy's ``state_dict`` metadata). After
        updates decided on the device, reading it waits for the device once."""
        return self._counter.value()

    @updates.setter
    def updates(self, value: int) -> None:
        self._counter.set(value)

    # --- ownership -------------------------------------------------------
    def same_kind(self) -> Any:
        # an EMA of the same model with the same settings (several EMAs of one model with other
        # decays are a pattern; an EMA of a submodule is another kind)
        w = self.warmup
        code = getattr(w, "__code__", None)
        warmup = (code.co_filename, code.co_firstlineno) if code is not None else w
        # the model itself (compared by identity; a key is made to compare, never kept)
        return ("ema", self._followed(), self.decay, warmup, self.include_buffers, self._dtype, self._device)

    def describe(self) -> str:
        return "pu.ema"

    def how_to_remove(self) -> str:
        # pu.ema returns the averaged copy, a module of the user's class: the rule is reached from it
        return (
            "pu.rules_of(ema_copy) lists it (ema_copy being the averaged copy that pu.ema returned; "
            "pu.rules_of(model) too), and .remove() undeclares it"
        )

    def forget_lost(self) -> bool:
        return True  # (the averaged copy is the model's whole: an EMA declared again takes its place whole)

    def names_of(self, ids: set[int]) -> list[str]:
        return [f"the {len(self.names)} tensors of {type(self._followed()).__name__}"]

    def tensors(self) -> list[torch.Tensor]:
        """What it writes: the copy's tensors (those this commit's check saw)."""
        live = self._live
        return live[len(self.names) :] if live else self._copies.live()

    def rows(self, index: ModelIndex) -> list[ScheduleEntry]:
        n = sum(self._avg)
        what = f"ema of {n} tensors" + (f" (+{len(self._avg) - n} copied)" if n < len(self._avg) else "")
        return [ScheduleEntry(self.phase, what, f"ema(decay={self.decay})", "-", str(self.origin))]

    # --- math --------------------------------------------------------------
    def decay_at(self, t: int) -> float:
        """``d_t`` for the ``t``-th update (0-based)."""
        w = self.warmup
        if w is None or w is False:
            return self.decay
        if isinstance(w, TimmWarmup):
            return w.decay_at(t, self.decay)
        if callable(w):
            d = float(w(t))
            if not 0.0 <= d <= 1.0:
                raise UpdateError(f"pu.ema (declared at {self.origin}): warmup({t}) returned {d}, not in [0, 1]")
            return d
        c = 10.0 if w is True else float(w)
        return min(self.decay, (1.0 + t) / (c + t))

    @property
    def gates(self) -> bool:  # type: ignore[override]
        """Applies under a device verdict (selected; ``t`` counted on the device) unless ``d_t`` needs ``t``
        on the host (a warmup)."""
        return self.warmup is None or self.warmup is False

    # --- the plan --------------------------------------------------------------------------------
    def make_plan(self, ctx: CommitContext, live: list[Any]) -> Any:
        """Storage changed (the first commit, the model or its copy moved or cast, ``fully_shard``): the copy
        follows the model (sharded like it, moved or cast with it: :meth:`_follow_model`), every pair is
        checked before anything is written, and the pairs are grouped: ``[(how, moved, positions)]`` per
        (averaged, devices, dtypes), ``how`` ``"lerp"`` (same dtype), ``"mixed"`` (dtypes differ) or
        ``"copy"`` (not averaged), ``moved`` where the copy is on another device. ``live``'s copy half is
        updated in place where the copy's tensors were made anew."""
        n = len(self.names)
        missing = [name for name, d in zip(self.names, live[n:]) if d is None]
        if missing:
            raise _new_name_error(str(self.origin), missing[0], "parameters")
        self._follow_copy(live)
        self._follow_model(live)
        src, dst = live[:n], live[n:]
        _refuse_mismatch(str(self.origin), self.names, src, dst, self._expected)
        self._sub = has_subclass(src + dst)
        self._avg = self._averaged(src)
        self._where = [(t.dtype, t.device) for t in src]
        groups: dict[tuple[Any, ...], list[int]] = {}
        written: set[int] = set()
        for i, (s, d, a) in enumerate(zip(src, dst, self._avg)):
            if id(d) in written:
                continue  # (the copy holds one tensor under two names, tied: averaged once, at the first)
            written.add(id(d))
            groups.setdefault((a, d.device, d.dtype, s.device, s.dtype), []).append(i)
        return [
            ("lerp" if a and dt == st else "mixed" if a else "copy", sd != dd, idx)
            for (a, dd, dt, sd, st), idx in groups.items()
        ]

    def bind(self, ctx: CommitContext, live: list[Any]) -> Any:
        """The foreach lists of plain aliases (``common.aliases``) of the pairs' local shards; ``None`` in a
        traced commit, which takes the tensors themselves (dynamo guards them already)."""
        return None if torch.compiler.is_compiling() else self._lists(live, aliases)

    def _lists(self, live: list[Any], alias: Callable[[list[torch.Tensor]], list[torch.Tensor]] = list) -> Any:
        """``(lerp, mixed, copied, moved)``, the arguments of :func:`_multi_tensor_ema`, from :attr:`plan`."""
        n = len(self.names)
        src, dst = sharding.locals_of(live[:n]), sharding.locals_of(live[n:])
        out: tuple[list, list, list, list] = ([], [], [], [])
        for how, moved, idx in self.plan:
            d, s = alias([dst[i] for i in idx]), alias([src[i] for i in idx])
            if moved:
                out[3].append((d, s, how))
            else:
                out[_HOW.index(how)].append((d, s))
        return out

    def ready(self, ctx: CommitContext) -> None:
        """``1 - d_t`` for this commit (``t`` is read only where ``d_t`` depends on it: a warmup); a user
        warmup callable fails here, before anything is written."""
        w = self.warmup
        self._weight = 1.0 - (self.decay if w is None or w is False else self.decay_at(self.updates))

    def run(self, ctx: CommitContext, live: list[Any], args: Any) -> None:
        ok = ctx.ok
        if args is not None and self.foreach and not torch.compiler.is_compiling():
            # the kept lists: plain aliases (no subclass to step around)
            if ok is not None:
                _gated_multi_tensor_ema(*args, self._weight, ok)
            else:
                _multi_tensor_ema(*args, self._weight)
            self._counter.count(ok)
            return
        with plain_if(self._sub):
            if not self.foreach:  # the reference path: one pair at a time (those of the plan: once per copy tensor)
                n = len(self.names)
                pos = sorted(i for _, _, idx in self.plan for i in idx)
                _single_tensor_ema(
                    [live[n + i] for i in pos], [live[i] for i in pos], [self._avg[i] for i in pos], self._weight, ok
                )
            else:
                lists = self._lists(live)
                if ok is not None:
                    _gated_multi_tensor_ema(*lists, self._weight, ok)
                else:
                    _multi_tensor_ema(*lists, self._weight)
        self._counter.count(ok)

    def _expected(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, torch.device]:
        """The dtype and device of the copy of a model tensor of ``dtype`` on ``device``."""
        floating = dtype.is_floating_point
        return (self._dtype if self._dtype is not None and floating else dtype), (
            self._device if self._device is not None else device
        )

    def _follow_copy(self, live: list[Any]) -> None:
        """The model was sharded (``fully_shard``) since the copy was made: shard the copy the same way (the
        sharding hook), and pair with its new tensors."""
        n = len(self.names)
        support = hooks.sharding_support()  # sharding hook: shard the copy like the model
        model = self._followed()
        if support is None or model is None or not sharding.any_sharded(live[:n]) or sharding.any_sharded(live[n:]):
            return
        support.follow_copy(self.module, model)
        self._copies.resync()
        live[n:] = self._copies.current()

    def _follow_model(self, live: list[Any]) -> None:
        """The copy follows the model's device and dtype (what ``dtype=`` / ``device=`` did not pin):
        when the *model* was moved or cast since the last commit (``model.to()``, ``.half()``,
        ``to_empty()``, ``load_state_dict(assign=True)``), the copy's tensors are moved or cast the
        same way (in place: they stay the same objects). A copy moved on its own (the model as
        before) is left as it is, and refused by :func:`_refuse_mismatch`. A copy made of a model on the
        ``meta`` device has no values: once the model has them, the copy starts as a copy of them
        (the average of no update), with its counter at 0."""
        n = len(self.names)
        src, dst = live[:n], live[n:]
        if self._followed() is None or not src or any(t.is_meta for t in src):
            return  # (a model on meta: refused by _refuse_mismatch)
        seen = self._where
        moved = [
            i
            for i, s in enumerate(src)
            if i < len(seen) and (s.dtype, s.device) != seen[i] and not sharding.is_sharded(s)
        ]
        if not moved:
            return
        with no_subclass(), torch.no_grad():
            if any(dst[i].is_meta for i in moved):
                self.module.to_empty(device=self._device if self._device is not None else src[0].device)
                self._copies.resync()
                live[n:] = dst = self._copies.current()
                for s, d in zip(src, dst):
                    if d is not None and s.shape == d.shape and not sharding.is_sharded(s):
                        d.copy_(s.detach().to(d.device))
                self._counter.set(0)
            for i in moved:
                s, d = src[i], dst[i]
                if s.shape != d.shape or sharding.is_sharded(d) or (d.dtype, d.device) != self._expected(*seen[i]):
                    continue  # (the copy was changed too: refused by _refuse_mismatch, with the reason)
                dtype, device = self._expected(s.dtype, s.device)
                d.data = d.detach().to(device=device, dtype=dtype)

    # --- state -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"module": the copy's state_dict (t in its metadata), "updates": t, "decay": decay}`` (tensors by reference)."""
        return {"module": self.module.state_dict(), "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        c = self._counter
        c.quiet = True  # (t is in state: a checkpoint that dropped the copy's metadata loses nothing)
        try:
            self.module.load_state_dict(state["module"])  # (a state saved by an earlier version: t as a tensor, taken)
        finally:
            c.quiet = False
        self.updates = int(state["updates"])

    def save(self) -> Any:
        c = self._counter
        return c.t, (None if c.skipped is None else c.skipped.clone())  # (not read: no wait)

    def restore(self, saved: Any) -> None:
        super().restore(saved)
        self._counter.t, self._counter.skipped = saved


_HOW = ("lerp", "mixed", "copy")


def _paired(
    model: nn.Module, module: nn.Module, origin: str
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]], list[bool]]:
    """Each tensor of ``model`` (its stored parameters, then buffers: not a pending value a slot shows,
    rule 1) and the tensor of the same name in its copy ``module``, and whether it is a buffer; raises
    where their names differ."""
    named: list[tuple[str, torch.Tensor]] = []
    copies: list[tuple[str, torch.Tensor]] = []
    buffer: list[bool] = []
    for kind in ("parameters", "buffers"):
        # every name, a tied tensor under each (the copy writes a tensor once: make_plan)
        a = dict(stored_named(model, kind, remove_duplicate=False))
        b = dict(getattr(module, f"named_{kind}")(remove_duplicate=False))
        gone = [n for n in b if n not in a and n != COUNTER]
        if gone:
            raise _gone_error(origin, gone, kind)
        for name, t in a.items():
            if name not in b:
                raise _new_name_error(origin, name, kind)
            named.append((name, t))
            copies.append((name, b[name]))
            buffer.append(kind == "buffers")
    return named, copies, buffer


def _gone_error(origin: str, gone: list[str], kind: str) -> UpdateError:
    """The copy has ``gone``, which the model no longer has."""
    return UpdateError(
        f"pu.ema (declared at {origin}): the averaged copy has {listed(list(map(repr, gone)))}, "
        f"which the model no longer has (its {kind} changed after the declaration: a layer removed, "
        "renamed or wrapped). Nothing of this step was written. Declare pu.ema again on the model as "
        "it is now (the same call: it takes this one's place, and this copy is no longer updated), or "
        "undeclare it: pu.rules_of(ema_copy) lists it (ema_copy being the averaged copy that pu.ema "
        "returned), and .remove() undeclares it."
    )


def _new_name_error(origin: str, name: str, kind: str) -> UpdateError:
    """The model has ``name``, which its copy has not."""
    return UpdateError(
        f"pu.ema (declared at {origin}): the model has {name!r}, which its averaged copy has "
        f"not (the model's {kind} changed after the declaration). Nothing of this step was written. "
        "Declare pu.ema again on the model as it is now (the same call: it takes this one's place, and "
        "this copy is no longer updated), or undeclare it: pu.rules_of(ema_copy) lists it (ema_copy "
        "being the averaged copy that pu.ema returned), and .remove() undeclares it."
    )


def _refuse_mismatch(origin: str, names: list[str], src: list[Any], dst: list[Any], expected: Callable) -> None:
    """Raise, before anything is written, where a pair cannot be averaged: the model on the meta device,
    or the copy not of the model's shape, sharding, and dtype and device (``expected``: as declared)."""
    with no_subclass():
        for name, s, d in zip(names, src, dst):
            dtype, device = expected(s.dtype, s.device)
            if s.is_meta:
                raise UpdateError(
                    f"pu.ema (declared at {origin}): {name!r} of the model is on the meta device (it has no "
                    "values). Materialize the model first (model.to_empty(device=...) and initialize it, or "
                    "load_state_dict(..., assign=True)); the averaged copy then starts as a copy of it."
                )
            if (
                s.shape != d.shape
                or d.dtype != dtype
                or d.device != device
                or sharding.is_sharded(s) != sharding.is_sharded(d)
                or (sharding.is_sharded(s) and tuple(s.placements) != tuple(d.placements))
            ):
                expect = (
                    where(s)
                    if (dtype, device) == (s.dtype, s.device)
                    else (f"{device}/{str(dtype).removeprefix('torch.')}/{tuple(s.shape)} (as declared)")
                )
                raise UpdateError(
                    f"pu.ema (declared at {origin}): {name!r} is {where(s)} in the model but {where(d)} in "
                    f"the averaged copy, which should be {expect}. Move or cast the copy the same way as the "
                    "model (ema_model.to(...)), or declare pu.ema again (dtype=/device= keep the copy in "
                    "another dtype or on another device). Nothing of this step was written."
                )


def _single_tensor_ema(
    avg: list[torch.Tensor], src: list[torch.Tensor], averaged: list[bool], w: float, ok: torch.Tensor | None = None
) -> None:
    """``a <- lerp(a, p, w)`` pair by pair, ``w = 1 - d_t`` (``a * (1 - w) + p * w`` where the dtypes
    differ; ``p`` first copied to ``a``'s device where the devices differ); a pair that is not
    averaged (a non-floating buffer) is copied. Under a device verdict ``ok``: ``a <- where(ok, new, a)``."""
    for d, s, a in zip(avg, src, averaged):
        if d.device != s.device:
            s = s.to(device=d.device)
        if ok is not None:
            new = s if not a else d.lerp(s, w) if d.dtype == s.dtype else d.mul(1.0 - w).add_(s, alpha=w)
            select_(ok, [d], [new])
        elif not a:
            d.copy_(s)
        elif d.dtype == s.dtype:
            d.lerp_(s, w)
        else:
            d.mul_(1.0 - w).add_(s, alpha=w)


Pairs = list[tuple[list[torch.Tensor], list[torch.Tensor]]]


def _multi_tensor_ema(lerp: Pairs, mixed: Pairs, copied: Pairs, moved: list[tuple[Any, Any, str]], w: float) -> None:
    """The same per group of pairs (one device and dtype each side): ``torch._foreach_lerp_`` where the
    dtypes match, ``_foreach_mul_`` + ``_foreach_add_`` where they differ, ``_foreach_copy_`` for the
    copied; ``moved`` groups (the copy on another device) take one temporary copy per tensor first."""
    for d, s in lerp:
        torch._foreach_lerp_(d, s, w)
    for d, s in mixed:
        _mixed_lerp_(d, s, w)
    for d, s in copied:
        torch._foreach_copy_(d, s)
    for d, s, how in moved:
        here = [t.to(device=d[0].device) for t in s]
        if how == "lerp":
            torch._foreach_lerp_(d, here, w)
        elif how == "mixed":
            _mixed_lerp_(d, here, w)
        else:
            torch._foreach_copy_(d, here)


def _gated_multi_tensor_ema(
    lerp: Pairs, mixed: Pairs, copied: Pairs, moved: list[tuple[Any, Any, str]], w: float, ok: torch.Tensor
) -> None:
    """:func:`_multi_tensor_ema` under a device verdict ``ok``: each group's new values out of place (the
    same kernels), then ``a <- where(ok, new, a)`` (``ops.select_``)."""
    for d, s in lerp:
        select_(ok, d, torch._foreach_lerp(d, s, w))
    for d, s in mixed:
        select_(ok, d, _mixed_lerp(d, s, w))
    for d, s in copied:
        select_(ok, d, s)
    for d, s, how in moved:
        here = [t.to(device=d[0].device) for t in s]
        new = torch._foreach_lerp(d, here, w) if how == "lerp" else _mixed_lerp(d, here, w) if how == "mixed" else here
        select_(ok, d, new)


def _mixed_lerp(d: list[torch.Tensor], s: list[torch.Tensor], w: float) -> list[torch.Tensor]:
    """``d * (1 - w) + s * w`` out of place (:func:`_mixed_lerp_`'s kernels)."""
    new = list(torch._foreach_mul(d, 1.0 - w))
    torch._foreach_add_(new, s, alpha=w)
    return new


def _mixed_lerp_(d: list[torch.Tensor], s: list[torch.Tensor], w: float) -> None:
    """``d <- d * (1 - w) + s * w`` for ``s`` of another dtype (promoted inside the kernel, as timm does)."""
    torch._foreach_mul_(d, 1.0 - w)
    torch._foreach_add_(d, s, alpha=w)


def weights(averaged: nn.Module) -> dict[str, torch.Tensor]:
    """The copy's ``state_dict``: ``averaged.state_dict()`` itself loads into the model (``t`` is in its metadata).

    ``model.load_state_dict(averaged.state_dict())`` puts the averaged weights
    into the model (strict loading; a copy kept in another dtype is cast by
    ``load_state_dict``). Kept for code written when the copy had a counter
    buffer; a ``pu_ema_updates`` key (a copy restored from such a state) is left out.
    """
    state = averaged.state_dict()
    state.pop(COUNTER, None)
    return state


def ema(
    model: nn.Module,
    decay: float,
    *,
    warmup: Warmup = None,
    include_buffers: bool = True,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    foreach: bool | None = None,
) -> nn.Module:
    """Declare an exponential moving average of ``model``; phase ``after_step``. Returns the averaged copy.

    After each optimizer update of a step whose model owns ``model``'s
    tensors, ``a <- lerp(a, p, 1 - d_t)`` for every floating parameter (and
    floating buffer if ``include_buffers``) ``p`` and its average ``a``; other
    buffers are copied. ``d_t``: ``decay``; with ``warmup=W`` (a number, or
    ``True`` for 10) ``min(decay, (1 + t) / (W + t))``; with ``warmup="timm"``
    (or a :class:`TimmWarmup`) timm's ``max(min_decay, min(decay,
    1 - (1 + t / gamma) ** -power))`` after a first copy; with a callable,
    ``warmup(t)``; ``t`` counts the EMA's updates from 0 and is saved in the
    metadata of the copy's ``state_dict`` (its tensors are the model's, name for
    name: ``model.load_state_dict(copy.state_dict())`` loads strictly).

    ``dtype``: keep the copy's floating tensors in this dtype (a float32
    average of a bfloat16 model); ``device``: keep the copy there (a CPU
    average of a GPU model). Both cost a little per commit (see the module
    docstring).

    The returned module is a deep copy of ``model`` (in ``eval()`` mode, no
    ``requires_grad``) to evaluate with; of a ``torch.compile(model)``, a copy
    of the module it compiles (its ``state_dict`` loads into the plain model). The model's tensors are
    followed by name (rule 12): a parameter, buffer or layer of ``model`` replaced later is averaged
    under its name, into the averages kept so far. ``pu.rules.ema.rule_of(copy)`` is
    the rule: ``.updates`` (``t``), and ``.remove()``, which undeclares the
    EMA (the copy stops being averaged). ``foreach=False`` runs the
    per-tensor reference path (``a.lerp_(p, 1 - d_t)`` pair by pair; bitwise the same result).
    """
    origin = call_site(2)
    if not isinstance(model, nn.Module):
        raise TypeError(f"pu.ema at {origin}: expected a torch.nn.Module, got {type(model).__name__}")
    model = _compiled_from(model)
    refuse_inside_step("pu.ema", origin, [*model.parameters(), *model.buffers()])
    decay = _checked_settings(model, float(decay), warmup, dtype, origin)
    dev = torch.device(device) if device is not None else None
    check_declared(list(model.named_parameters()), model, "pu.ema", origin)
    support = hooks.sharding_support()  # sharding hook: a sharded model gets a copy sharded the same way
    module = support.copy_module(model) if support is not None else None
    if module is None:
        module = copy.deepcopy(model)
    module.requires_grad_(False)
    module.eval()
    if dev is not None or dtype is not None:
        module.to(device=dev, dtype=dtype)
    rule = EMA(model, module, decay, warmup, bool(include_buffers), origin, dtype=dtype, device=dev)
    rule.foreach = foreach is not False
    register(rule)
    state.process.ema_copies[module] = weakref.ref(rule)
    return module


def _checked_settings(model: nn.Module, decay: float, warmup: Warmup, dtype: Any, origin: str) -> float:
    """``decay`` once :func:`ema`'s arguments are found valid: ``decay`` in [0, 1], ``warmup`` a preset,
    ``True``, a positive number, a :class:`TimmWarmup` or a callable, ``dtype`` floating, and ``model`` not
    an averaged copy."""
    if not 0.0 <= decay <= 1.0 or math.isnan(decay):
        raise ValueError(f"pu.ema at {origin}: decay must be in [0, 1], got {decay}")
    if isinstance(warmup, str):
        if warmup not in _PRESETS:
            raise ValueError(
                f"pu.ema at {origin}: warmup={warmup!r} is not a preset; use one of {sorted(_PRESETS)}, "
                "True, a positive number, a TimmWarmup or a callable"
            )
    elif warmup is not None and not isinstance(warmup, bool | TimmWarmup) and not callable(warmup):
        if not float(warmup) > 0:
            raise ValueError(f"pu.ema at {origin}: warmup must be None, True, a positive number or a callable")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"pu.ema at {origin}: dtype must be a floating torch.dtype (the copy's floats), got {dtype}")
    if counter_of(model) is not None or COUNTER in dict(model.named_buffers(recurse=False)):
        raise ValueError(
            f"pu.ema at {origin}: the model is an averaged copy (it carries an EMA counter); "
            "declare the EMA on the trained model"
        )
    return decay


def _compiled_from(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile(module)`` wraps, for an ``OptimizedModule`` (else ``model``).

    The wrapper holds the module as ``_orig_mod``: the same tensors, under names that start with
    ``_orig_mod.``. Its copy would not load into the plain model, so the EMA averages the module itself
    (the wrapper's steps still apply it: they own the same tensors)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (loaded by torch.compile; not imported here)
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    while wrapper is not None and isinstance(model, wrapper):
        model = model._orig_mod
    return model


def rule_of(averaged: nn.Module) -> EMA:
    """The :class:`EMA` rule that updates ``averaged`` (a module returned by :func:`ema`)."""
    ref = state.process.ema_copies.get(averaged)
    rule = ref() if ref is not None else None
    if rule is None:
        raise ValueError("not a module returned by pu.ema (or its model is gone)")
    return rule
