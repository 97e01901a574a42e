"""Batch normalization whose running statistics are updated through ``pu.assign``.

``pu.nn.BatchNorm1d/2d/3d`` (and ``pu.nn.SyncBatchNorm``) are drop-in
subclasses of their ``torch.nn`` counterparts: the constructor arguments of
the installed torch's class (passed through as given, ``bias=`` included), plus ``sync_stats``;
same parameters, buffers and ``state_dict`` keys, same outputs and gradients.
Only the way the running statistics change differs. In train mode with
``track_running_stats=True`` a forward issues (in the ``pu.when`` conditions in force):

* ``num_batches_tracked <- num_batches_tracked + 1``
* ``running_mean <- (1 - a) * running_mean + a * mean_B(x)``
* ``running_var  <- (1 - a) * running_var  + a * var_B(x) * n / (n - 1)``

with ``a = momentum``, or ``a = 1 / num_batches_tracked`` (the value after
the increment: a cumulative average) when ``momentum=None`` (under a ``pu.when(tensor)`` condition
the factor stays on the device, so that neither the condition nor a count it left pending is read on
the host, with the same arithmetic as PyTorch's kernel). ``mean_B`` and
``var_B`` are the statistics of the batch over every dimension but the
channel one, ``n`` the number of values per channel.

The updates are auxiliary (phase ``auxiliary``: after the gradient update,
in the commit's fixed phase order). Inside a step they are recorded and nothing is written before
commit (deferred commit, rule 2); later forwards in the same step (gradient accumulation, a
module called twice, a checkpoint recomputation under ``pu.checkpoint``)
read the pending statistics (read-your-writes, rule 1). Outside a step they apply at once, in
place, exactly like ``torch.nn.BatchNorm*d`` (eager outside a step, rule 8).

On CPU the statistics are computed by PyTorch's own kernel (``torch.batch_norm``,
as ``F.batch_norm`` calls it, on copies of the running buffers), so outputs, gradients and running
statistics are bitwise those of ``torch.nn.BatchNorm*d``. Under a
``torch.func`` transform (``vmap``, ``grad``, ...) an out-of-place path
computes the same formulas with ``torch.var_mean`` (equal to rounding).

``sync_stats=True`` issues the two statistics updates with ``sync="mean"``:
at commit every rank's pending statistics are averaged across the default
process group (distributed sync, rule 9), so all ranks commit the same running statistics
instead of DDP's ``broadcast_buffers`` keeping rank 0's. The normalization
itself still uses the local batch (use ``pu.nn.SyncBatchNorm`` for global
batch statistics).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import hooks, routing
from ..conditions import current as current_condition
from ..origin import Origin, capture
from ..updates import assign, issue_computed

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "UpdateSafeBatchNorm"]


@functools.cache
def _updated_by(cls: type) -> str:
    """What a batch norm of class ``cls`` updates, in the user's terms (``Origin.by``)."""
    return f"{cls.__name__} running statistics"


def _device_factor(count: Tensor) -> Tensor:
    """``1 / count`` as torch's cumulative average takes it (``1.0 / float(count)``: a double), computed on
    the count's device (at least 1: a count the user set below zero gives no division by zero)."""
    return 1.0 / count.clamp_min(1).double()


class UpdateSafeBatchNorm:
    """Mixin over ``torch.nn.modules.batchnorm._BatchNorm``: the forward issues updates.

    Subclasses list it first so that its ``forward`` and ``reset_running_stats`` win.
    """

    sync_stats: bool
    momentum: float | None
    eps: float
    training: bool
    track_running_stats: bool
    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None
    weight: Tensor | None
    bias: Tensor | None

    def _init_sync(self, sync_stats: bool) -> None:
        if not isinstance(sync_stats, bool):
            raise TypeError(f"sync_stats must be a bool, got {type(sync_stats).__name__}")
        self.sync_stats = sync_stats

    def extra_repr(self) -> str:  # noqa: D102 - as torch, plus sync_stats
        s = super().extra_repr()  # type: ignore[misc]
        return s + (", sync_stats=True" if self.sync_stats else "")

    def reset_running_stats(self) -> None:
        """``running_mean <- 0``, ``running_var <- 1``, ``num_batches_tracked <- 0`` through assign.

        Inside a step the reset is pending like any other update (later
        forwards of the step read the reset values); outside, it applies at once.
        """
        if self.track_running_stats:
            assign(self.running_mean, 0.0)
            assign(self.running_var, 1.0)
            assign(self.num_batches_tracked, 0)

    # ------------------------------------------------------------------
    def _train_with_stats(self, input: Tensor, origin: Origin | str | None = None) -> Tensor:
        """Normalize with the batch statistics and issue the three running-statistics updates
        (``origin``: the call site they show, if the caller knows it; else the caller's line)."""
        compiling = torch.compiler.is_compiling()
        if compiling:
            rm, rv, nbt = self.running_mean, self.running_var, self.num_batches_tracked
        else:  # the slots themselves: Module.__getattr__'s slow path costs ~0.6 us a read
            b = self._buffers
            rm, rv, nbt = b.get("running_mean"), b.get("running_var"), b.get("num_batches_tracked")
        assert rm is not None and rv is not None  # (pending values inside a step: rule 1)
        factor: float | Tensor = 0.0 if self.momentum is None else float(self.momentum)
        counted: list[tuple[Tensor, str, Any, Tensor]] = []
        if nbt is not None:
            new_nbt = nbt + 1
            counted.append((nbt, "assign_add", 1, new_nbt))
            if self.momentum is None:
                # the cumulative average uses the incremented count, as torch's (1 / float(count), on the
                # host). Under a tensor condition the factor stays on the device (the count may hold a
                # pending conditional value: reading it would read the condition, rule 6); the increment
                # is taken whatever the condition: where it is False the statistics are not kept anyway
                factor = _device_factor(new_nbt) if isinstance(current_condition(), Tensor) else 1.0 / float(new_nbt)
        if not compiling and torch._C._functorch.maybe_current_level() is not None:  # under torch.func
            out, new_mean, new_var = self._functional_stats(input, rm, rv, factor)
        elif isinstance(factor, Tensor):
            new_mean, new_var, out = self._batch_stats_by(input, rm, rv, factor)
        else:
            new_mean, new_var, out = self._batch_stats(input, rm, rv, factor)
        sync = "mean" if self.sync_stats else None
        if sync is None:
            issue_computed(
                [*counted, (rm, "assign", new_mean, new_mean), (rv, "assign", new_var, new_var)], None, 3, origin, self
            )
        else:  # the statistics are synced across ranks; the counter is not (every rank counts alike)
            issue_computed(counted, None, 3, origin, self)
            issue_computed(
                [(rm, "assign", new_mean, new_mean), (rv, "assign", new_var, new_var)], sync, 3, origin, self
            )
        return out

    def _batch_stats(self, input: Tensor, rm: Tensor, rv: Tensor, factor: float) -> tuple[Tensor, Tensor, Tensor]:
        """PyTorch's kernel updates copies of the running buffers in place; the copies become the
        pending values (bitwise torch's result)."""
        new_mean = rm.clone()
        new_var = rv.clone()
        # (weight, bias) from _parameters eagerly where they are there (a parametrized weight is a
        # property of the module's class: read as an attribute)
        p = self._parameters
        if torch.compiler.is_compiling() or "weight" not in p or "bias" not in p:
            weight, bias = self.weight, self.bias
        else:
            weight, bias = p["weight"], p["bias"]
        # F.batch_norm's own two steps, called directly: its check (torch's own function), then
        # torch.batch_norm (the same kernel; __torch_function__ overrides are still found, by
        # torch.batch_norm). Its Python wrapper costs 2.3 us a call where the kernel of a small layer
        # costs 16.
        F._verify_batch_size(input.size())
        out = torch.batch_norm(
            input, weight, bias, new_mean, new_var, True, factor, self.eps, torch.backends.cudnn.enabled
        )
        return new_mean, new_var, out

    def _batch_stats_by(self, input: Tensor, rm: Tensor, rv: Tensor, factor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The statistics with a factor on the device (``momentum=None`` under a tensor condition): the
        kernel gives the batch's mean and unbiased variance (momentum 1 into zeroed copies: exactly those
        values), then they are averaged in with the kernel's own arithmetic (ATen's CPU update of the
        running statistics: the factor rounded to the statistics' dtype, the mean averaged in that dtype,
        the variance summed in double). Bitwise torch's statistics on CPU (contiguous and channels_last
        inputs); equal to rounding where torch's kernel rounds otherwise (CUDA, a strided input)."""
        mean, unbiased, out = self._batch_stats(input, torch.zeros_like(rm), torch.zeros_like(rv), 1.0)
        a = factor.to(rm.dtype)
        new_mean = a * mean + (1 - a) * rm
        b = factor.to(rv.dtype)
        new_var = (b.double() * unbiased.double() + ((1 - b) * rv).double()).to(rv.dtype)
        return new_mean, new_var, out

    def _functional_stats(
        self, input: Tensor, rm: Tensor, rv: Tensor, factor: float | Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Out-of-place statistics for ``torch.func`` (vmap cannot write into unbatched copies)."""
        dims = [0, *range(2, input.dim())]
        x = input.detach()
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        n = x.numel() // x.size(1)
        unbiased = var * (n / max(n - 1, 1))
        new_mean = rm * (1.0 - factor) + mean.to(rm.dtype) * factor
        new_var = rv * (1.0 - factor) + unbiased.to(rv.dtype) * factor
        out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        return out, new_mean, new_var

    def _eager_in_place(self, input: Tensor) -> Tensor:
        """What eager ``assign`` would do (eager outside a step, rule 8), without its per-call cost: PyTorch's own
        in-place update of the buffers. Used only when nothing could record or replay it."""
        rm, rv, nbt = self.running_mean, self.running_var, self.num_batches_tracked
        factor = 0.0 if self.momentum is None else float(self.momentum)
        if nbt is not None:
            with torch.no_grad():
                nbt.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(nbt)
        return F.batch_norm(input, rm, rv, self.weight, self.bias, True, factor, self.eps)

    def forward(self, input: Tensor) -> Tensor:
        """As ``torch.nn.BatchNorm*d.forward``; running statistics change through assign."""
        self._check_input_dim(input)  # type: ignore[attr-defined]
        if self.training and self.track_running_stats:
            if routing.nothing_records() and not (self.sync_stats and hooks.sync_active()):
                return self._eager_in_place(input)
            # the statistics' origin: the user's line that called this module (the frames of pu.nn and torch.nn
            # between are skipped; the verdict per file cached), naming what it updates (Origin.by); while
            # dynamo traces, the tracing support gives that line as a trace-time constant
            origin = None if torch.compiler.is_compiling() else capture(2, False, _updated_by(type(self)))
            return self._train_with_stats(input, origin)
        # train mode without tracking, or eval mode: nothing is updated
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_buffers = not self.training
        return F.batch_norm(
            input,
            self.running_mean if use_buffers else None,
            self.running_var if use_buffers else None,
            self.weight,
            self.bias,
            bn_training,
            0.0,
            self.eps,
        )


def _with_sync_stats(torch_cls: type[nn.Module]) -> inspect.Signature:
    """The signature of ``torch_cls`` (the installed torch's), plus the keyword-only ``sync_stats=False``."""
    sig = inspect.signature(torch_cls)
    extra = inspect.Parameter("sync_stats", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool)
    params = list(sig.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    return sig.replace(parameters=[*params[:at], extra, *params[at:]])


class _BatchNormNd(UpdateSafeBatchNorm):
    """The constructor shared by BatchNorm1d/2d/3d: every argument of the installed torch's class
    (passed through as given: ``bias=`` since torch 2.x, whatever a later torch adds), plus ``sync_stats``."""

    def __init__(self, *args: Any, sync_stats: bool = False, **kwargs: Any) -> None:
        # super() is the torch.nn.BatchNorm{1,2,3}d that follows this class in the MRO.
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._init_sync(sync_stats)


class BatchNorm1d(_BatchNormNd, nn.BatchNorm1d):
    """``torch.nn.BatchNorm1d`` with running statistics updated through ``pu.assign``.

    Same arguments and ``state_dict`` as ``torch.nn.BatchNorm1d``, plus
    ``sync_stats`` (average the statistics across ranks at commit). See the
    module docstring for the math and the ordering rule (phase ``auxiliary``).
    """


class BatchNorm2d(_BatchNormNd, nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` with running statistics updated through ``pu.assign``.

    Same arguments and ``state_dict`` as ``torch.nn.BatchNorm2d``, plus
    ``sync_stats`` (average the statistics across ranks at commit). See the
    module docstring for the math and the ordering rule (phase ``auxiliary``).
    """


class BatchNorm3d(_BatchNormNd, nn.BatchNorm3d):
    """``torch.nn.BatchNorm3d`` with running statistics updated through ``pu.assign``.

    Same arguments and ``state_dict`` as ``torch.nn.BatchNorm3d``, plus
    ``sync_stats`` (average the statistics across ranks at commit). See the
    module docstring for the math and the ordering rule (phase ``auxiliary``).
    """


class SyncBatchNorm(UpdateSafeBatchNorm, nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` with running statistics updated through ``pu.assign``.

    When a process group with more than one rank is initialized and the
    module trains, the batch statistics are gathered across ranks by
    PyTorch's own ``SyncBatchNorm`` function (on copies of the running
    buffers), so every rank issues the same running-statistics update.
    Otherwise it behaves as :class:`BatchNorm2d` for inputs of any rank >= 2.
    ``sync_stats=True`` additionally averages the pending statistics at
    commit (useful only when ranks could differ).
    """

    def __init__(self, *args: Any, sync_stats: bool = False, **kwargs: Any) -> None:
        nn.SyncBatchNorm.__init__(self, *args, **kwargs)  # every argument of the installed torch's class
        self._init_sync(sync_stats)

    def _world(self) -> tuple[Any, int] | None:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group or dist.group.WORLD
        world = dist.get_world_size(group)
        return (group, world) if world > 1 else None

    def _batch_stats(self, input: Tensor, rm: Tensor, rv: Tensor, factor: float) -> tuple[Tensor, Tensor, Tensor]:
        """With more than one rank: the batch statistics of every rank's batch, by PyTorch's own
        ``SyncBatchNorm`` function on copies of the running buffers."""
        world = self._world()
        if world is None:
            return super()._batch_stats(input, rm, rv, factor)
        from torch.nn.modules._functions import SyncBatchNorm as _SyncFn

        new_mean, new_var = rm.clone(), rv.clone()
        out = _SyncFn.apply(input, self.weight, self.bias, new_mean, new_var, self.eps, factor, world[0], world[1])
        return new_mean, new_var, out

    def forward(self, input: Tensor) -> Tensor:  # noqa: D102 - see class docstring
        self._check_non_zero_input_channels(input)
        return super().forward(input)


# inspect.signature / help() show torch's arguments (of the installed version) and sync_stats
for _cls, _torch_cls in (
    (BatchNorm1d, nn.BatchNorm1d),
    (BatchNorm2d, nn.BatchNorm2d),
    (BatchNorm3d, nn.BatchNorm3d),
    (SyncBatchNorm, nn.SyncBatchNorm),
):
    _cls.__signature__ = _with_sync_stats(_torch_cls)  # type: ignore[attr-defined]


# a whole model saved with torch.save loads with torch.load(weights_only=True) (its other classes allowed)
torch.serialization.add_safe_globals([BatchNorm1d, BatchNorm2d, BatchNorm3d, SyncBatchNorm])
