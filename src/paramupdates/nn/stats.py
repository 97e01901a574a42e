"""``pu.recompute_batchnorm_stats``: the job of ``torch.optim.swa_utils.update_bn``, as one step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .. import routing
from ..attach import refuse_pending_attachment
from ..errors import UpdateError
from ..step import Stepper
from .batchnorm import UpdateSafeBatchNorm


def _refuse(model: nn.Module) -> None:
    """``TypeError`` for torch.nn batch norms in ``model``; ``UpdateError`` inside a step."""
    plain = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, UpdateSafeBatchNorm)
    ]
    if plain:
        raise TypeError(
            f"pu.recompute_batchnorm_stats: {plain[:3]} are torch.nn batch norms, which write their "
            "statistics in place. Call model = pu.convert(model) first (weights and statistics are kept)."
        )
    if routing.explicit():
        raise UpdateError(
            f"pu.recompute_batchnorm_stats: {routing.explicit()[-1].label} is in progress. "
            "Call it outside a step (it runs as a step of its own)."
        )


def recompute_batchnorm_stats(model: nn.Module, loader: Iterable[Any], device: Any = None) -> int:
    """Recompute the running statistics of every ``pu.nn`` batch norm of ``model`` from ``loader``.

    The same computation as ``torch.optim.swa_utils.update_bn(loader, model, device)``
    (and bitwise the same result on CPU): each batch norm is reset
    (``running_mean <- 0``, ``running_var <- 1``, ``num_batches_tracked <- 0``),
    then, in train mode with ``momentum=None``, one pass over ``loader`` makes
    the running statistics the cumulative average over its batches:
    ``running_mean = (1/K) sum_k mean_k`` (``running_var`` likewise with the
    unbiased batch variances). A batch is a tensor or a list/tuple whose first
    element is the model's input; ``device`` moves it there first.

    Unlike ``update_bn`` it runs as one step without an optimizer: the reset
    and the K updates are pending until the pass is over and then commit
    together (phase ``auxiliary``), so an exception in the middle of the
    pass (a bad batch, a KeyboardInterrupt) leaves every statistic as it was.
    Forwards run under ``torch.no_grad()``. Momenta and train flags are
    restored afterwards. Returns the number of batches seen.

    Raises ``TypeError`` if the model still has ``torch.nn`` batch norms
    (convert them with ``pu.convert(model)``) and :class:`~paramupdates.UpdateError`
    when called inside a step, or while an attachment of the model has updates pending
    (``flush()`` or ``discard()`` them first).
    """
    _refuse(model)
    bns = [m for m in model.modules() if isinstance(m, UpdateSafeBatchNorm) and m.track_running_stats]
    if not bns:
        return 0
    refuse_pending_attachment(model, "pu.recompute_batchnorm_stats")
    momenta = {m: m.momentum for m in bns}
    was_training = {m: m.training for m in model.modules()}
    seen = 0
    try:
        with Stepper(model, None), torch.no_grad():
            for m in bns:
                m.reset_running_stats()
                m.momentum = None
            model.train()
            for batch in loader:
                if isinstance(batch, list | tuple):
                    batch = batch[0]
                if device is not None:
                    batch = batch.to(device)
                model(batch)
                seen += 1
    finally:
        for m, mom in momenta.items():
            m.momentum = mom
        for m, flag in was_training.items():
            m.training = flag
    return seen
