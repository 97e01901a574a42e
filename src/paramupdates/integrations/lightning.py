"""``paramupdates.lightning.ParamUpdates``: paramupdates in a Lightning ``Trainer``, as one callback.

::

    import lightning as L, paramupdates as pu
    from paramupdates.lightning import ParamUpdates

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = pu.convert(make_net())                # update-safe batch norms
            self.ema = pu.ema(self.net, 0.999, warmup="timm")  # a submodule: in Lightning's checkpoints
        def configure_optimizers(self):
            pu.weight_decay(self.net, 0.05)                 # Adam + pu.weight_decay == AdamW
            return torch.optim.Adam(self.net.parameters(), lr=1e-3)

    L.Trainer(callbacks=[ParamUpdates()]).fit(Lit(), data)

What it does, hook by hook:

* ``on_fit_start`` (after ``configure_optimizers``): ``pu.attach`` to each of
  the trainer's optimizers (the torch optimizers inside Lightning's
  ``LightningOptimizer``), for the whole ``LightningModule``, or for the
  submodule named in ``modules=`` (one per optimizer, required with several
  optimizers: ``ParamUpdates(modules=["generator", "discriminator"])``).
  Every step then commits inside ``optimizer.step()`` in the fixed phase
  order of rule 4: ``before_grad`` (weight decay), the optimizer,
  ``after_grad`` (constraints), ``auxiliary`` (batch-norm statistics),
  ``after_step`` (EMA).
* ``state_dict`` / ``load_state_dict``: the attachments' ``state_dict()``
  (EMA copies and their counters, steps, skipped steps) go into Lightning's
  checkpoints under this callback's ``state_key``, and come back on
  ``trainer.fit(..., ckpt_path=...)``: Lightning restores callbacks before
  ``on_fit_start``, so the state is kept and loaded right after attaching
  (the rules must be declared by then: in ``__init__``, ``setup`` or
  ``configure_optimizers``).
* ``on_train_batch_end``, ``on_validation_start``, ``on_validation_end``:
  :meth:`paramupdates.Attachment.flush` for each attachment with updates
  still pending (no optimizer step; declared rules do not run), e.g. a
  GAN's discriminator statistics from the generator's step, which no
  discriminator step follows in that batch. So between batches every tensor
  is plain Lightning's: for validation, other callbacks, and
  ``ModelCheckpoint`` (which Lightning runs after the other callbacks). Not
  inside an accumulation window: there the pending updates belong to the
  window's coming ``optimizer.step()``. Each flush counts in ``steps``.
* ``on_save_checkpoint``: Lightning took the module's ``state_dict`` before
  this hook; a save with updates still pending between steps (by a callback
  listed before this one) flushes them and takes the ``state_dict`` and this
  callback's state again.
* ``on_train_end`` / ``teardown``: flush everything pending (no step
  follows), then detach; a later ``fit`` attaches again.
* ``on_exception``: detach (the step in progress is discarded).

Rules declared in ``configure_optimizers`` are declared again by every
later ``fit``: the same rule again (same kind, tensors and settings) takes
the earlier one's place quietly; another rule on those tensors warns.

How Lightning drives the optimizer, and what that means here (Lightning 2.x):

* automatic optimization calls ``LightningModule.optimizer_step``, which calls
  ``LightningOptimizer.step(closure)``, which calls the strategy and precision
  plugin, which call ``optimizer.step(closure=...)`` on the torch optimizer
  with a closure that runs ``training_step``, ``zero_grad`` (first micro-batch
  only), ``backward``, ``on_before_optimizer_step`` and gradient clipping. So
  the forward, its updates and the gradients all happen *inside*
  ``optimizer.step``: the commit begins after the closure's first call (the
  gradients exist, so weight decay decays the parameters that have one), and
  the updates the forward issued join that step.
* ``accumulate_grad_batches=N``: the first ``N - 1`` micro-batches run the
  closure without ``optimizer.step``; their updates are pending (a step opens
  at the first one) and commit with the ``N``-th, whose ``optimizer.step``
  runs the last closure. Declared rules run once per real update.
* manual optimization: ``self.optimizers().step()`` also reaches the torch
  optimizer as ``optimizer.step(closure=...)``, the closure only calling
  ``on_before_optimizer_step``; the gradients exist before the step.
* LR schedulers from ``configure_optimizers`` are created before the
  attachment (they wrap ``optimizer.step`` first; the attachment keeps their
  mark) and stepped by Lightning after ``optimizer.step``.

Checkpoints are taken between optimizer steps (Lightning's
``ModelCheckpoint`` saves at the end of a batch, an epoch or a validation),
with what is pending flushed. One saved inside an accumulation window (at a
validation that ``val_check_interval`` places there, or on a timer) holds
the stored values without the window's pending updates, as it holds none of
its accumulated gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

import lightning.pytorch as pl
from torch import nn

from ..attach import Attachment, attach
from ..errors import UpdateError
from ..options import StepOptionsDict, make_options

__all__ = ["ParamUpdates"]


class ParamUpdates(pl.Callback):
    """Attach paramupdates to a Lightning ``Trainer``'s optimizers; keep its state in checkpoints.

    Args:
        modules: for each optimizer (in ``trainer.optimizers`` order) the
            dotted attribute path of the submodule of the ``LightningModule``
            it updates (``""`` or ``None``: the whole module). A single string
            or ``None`` (the default) is for one optimizer. Two attachments
            cannot share a module, so with several optimizers name disjoint
            submodules.
        **options: the step options, passed to :func:`paramupdates.attach` (``on_nonfinite``,
            ``copy_for_rollback``, ``process_group``, ``sync_timeout``; the framework drives its own
            GradScaler).

    After ``fit`` starts, :attr:`attachments` holds the
    :class:`paramupdates.Attachment` of each optimizer (``.schedule()``,
    ``.steps``, ``.skipped_steps``); they stay readable after ``fit`` ends
    (detached).
    """

    def __init__(
        self,
        modules: str | Sequence[str | None] | None = None,
        **options: Unpack[StepOptionsDict],
    ) -> None:
        super().__init__()
        self.modules = modules
        make_options(dict(options), "ParamUpdates")  # refuse a bad option now, not at fit
        self.options = options
        self.attachments: list[Attachment] = []
        self._attached = False
        self._pending: dict[str, Any] | None = None

    # --- attaching ---------------------------------------------------------
    def _targets(self, pl_module: pl.LightningModule, n: int) -> list[nn.Module]:
        names = self.modules
        if names is None or isinstance(names, str):
            if n != 1:
                raise UpdateError(
                    f"ParamUpdates: {type(pl_module).__name__}.configure_optimizers returned {n} optimizers; "
                    "say which submodule each one updates (two attachments cannot share a module), e.g. "
                    "ParamUpdates(modules=['generator', 'discriminator'])."
                )
            names = [names]
        names = list(names)
        if len(names) != n:
            raise UpdateError(
                f"ParamUpdates(modules={names!r}): {len(names)} module names for {n} optimizers of "
                f"{type(pl_module).__name__}; give one per optimizer, in configure_optimizers order."
            )
        out = []
        for name in names:
            if not name:
                out.append(pl_module)
                continue
            try:
                m = pl_module.get_submodule(name)
            except AttributeError as e:
                raise UpdateError(
                    f"ParamUpdates(modules=...): {type(pl_module).__name__} has no submodule {name!r} ({e})"
                ) from e
            out.append(m)
        return out

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Attach to every optimizer (Lightning has called ``configure_optimizers``), then load a resumed state."""
        self._detach()
        optimizers = list(trainer.optimizers)  # (attach unwraps a LightningOptimizer)
        if not optimizers:
            return
        targets = self._targets(pl_module, len(optimizers))
        self.attachments = [attach(m, o, **self.options) for m, o in zip(targets, optimizers)]
        self._attached = True
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._load(state)

    # --- between steps: what plain Lightning would have written by now ------------
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Commit what is still pending after the batch's last ``optimizer.step()`` (the discriminator's
        statistics from the generator's step), unless an accumulation window is open. Runs before
        ``ModelCheckpoint``'s hook (Lightning calls checkpoint callbacks last)."""
        self._flush(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Commit what is pending before validation reads the model (outside an accumulation window)."""
        self._flush(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Commit what validation issued (plain PyTorch writes at once) before a checkpoint is saved."""
        self._flush(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Commit everything pending: no optimizer step follows."""
        self._flush(trainer, in_window=True)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint saved with updates pending between steps (by a callback listed before this one,
        or from a hook that runs after a forward): Lightning took the module's ``state_dict`` before
        this hook, so commit them and take it again, and this callback's state with it."""
        if self._flush(trainer):
            checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()
            checkpoint.setdefault("callbacks", {})[self.state_key] = self.state_dict()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Commit what is pending, then detach; a later ``fit`` attaches again."""
        self._flush(trainer, in_window=True)
        self._detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Lightning does not call ``teardown`` on an exception: detach here (the step in progress is discarded)."""
        self._detach()

    def _flush(self, trainer: pl.Trainer, *, in_window: bool = False) -> bool:
        """``Attachment.flush()`` each attachment with updates pending (no optimizer step; declared
        rules do not run), except inside an accumulation window unless ``in_window``: there the
        pending updates belong to the window's coming ``optimizer.step()``. True if any committed."""
        if not self._attached:
            return False
        # Lightning's own (private) test of "no optimizer step after this batch", in its 2.x epoch loop
        if not in_window and trainer.fit_loop.epoch_loop._should_accumulate():
            return False
        flushed = False
        for a in self.attachments:
            j = a.journal
            if a.commit is None and j is not None and j.pending_names():  # (not inside optimizer.step())
                a.flush()
                flushed = True
        return flushed

    def _detach(self) -> None:
        if self._attached:
            for a in self.attachments:
                a.detach()
            self._attached = False

    # --- checkpoints -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"attachments": [each attachment's state_dict()]}``: EMA copies, counters, skipped steps."""
        if self._pending is not None:
            return self._pending  # loaded but not attached yet: pass it on unchanged
        return {"attachments": [a.state_dict() for a in self.attachments]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state, now if attached, else right after attaching in ``on_fit_start``."""
        if self._attached:
            self._load(state_dict)
        else:
            self._pending = state_dict

    def _load(self, state: dict[str, Any]) -> None:
        saved = state.get("attachments", [])
        if len(saved) != len(self.attachments):
            raise UpdateError(
                f"ParamUpdates.load_state_dict: the checkpoint holds the state of {len(saved)} attachments, this "
                f"fit has {len(self.attachments)} optimizers; resume with the same configure_optimizers."
            )
        for a, s in zip(self.attachments, saved):
            a.load_state_dict(s)
