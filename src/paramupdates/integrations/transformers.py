"""``paramupdates.transformers.ParamUpdates``: paramupdates in a Hugging Face ``Trainer``, as one callback.

::

    import paramupdates as pu
    from paramupdates.transformers import ParamUpdates

    model = pu.convert(MyModel(config))                 # update-safe batch norms
    ema = pu.ema(model, 0.999)                          # the averaged copy
    args = TrainingArguments("out", weight_decay=0.0)   # the decay is pu's (AdamW's would decay twice)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[ParamUpdates()],
                      optimizer_cls_and_kwargs=(torch.optim.Adam, {"lr": args.learning_rate, "fused": True}))
    decay = set(trainer.get_decay_parameter_names(model))        # the Trainer's own rule: no bias, no norms
    pu.weight_decay([(n, p) for n, p in model.named_parameters() if n in decay], 0.01, exclude=None)
    trainer.train()                                     # or train(resume_from_checkpoint=...)

What it does, hook by hook:

* ``on_train_begin`` (the Trainer has built its optimizer, wrapped it in accelerate's
  ``AcceleratedOptimizer``, made the LR scheduler and, resuming, loaded the model, the
  optimizer and the scheduler): ``pu.attach(model, optimizer)`` (the torch optimizer inside
  the wrapper). Every optimizer update then commits inside ``optimizer.step()`` in the fixed
  phase order of rule 4: ``before_grad`` (weight decay), the optimizer, ``after_grad``
  (constraints), ``auxiliary`` (batch-norm statistics), ``after_step`` (EMA). Resuming
  (the Trainer's ``state.global_step`` is the checkpoint's), the attachment's state is then
  loaded from the checkpoint's ``paramupdates.pt`` (see below). An attachment of the same
  model left by an earlier ``train()`` that raised (the Trainer has no exception hook) is
  detached first.
* ``on_evaluate``: commit what the evaluation issued (:meth:`paramupdates.Attachment.flush`,
  no gradient update), so that a checkpoint saved right after it holds it, as plain PyTorch's
  in-place writes would be. (The Trainer's evaluation runs in ``eval()`` mode, where batch norms
  issue nothing; a model that counts or updates in eval mode does.)
* ``on_save`` (after the Trainer wrote ``checkpoint-<global_step>``): the attachment's
  ``state_dict()`` (EMA copies and their counters, steps, skipped steps) goes to
  ``checkpoint-<global_step>/paramupdates.pt`` (``torch.save``; ``torch.load(weights_only=True)``
  reads it), with the Trainer state it belongs to. Updates still pending then (issued since the
  last update, e.g. by a forward in another callback's ``on_step_end``) are not in the
  checkpoint: a warning names them.
* ``on_train_end``: commit what is still pending (``flush``), then detach; a later ``train()``
  attaches again.

How the Trainer (transformers 5.x) drives the optimizer, and what that means here:

* ``_inner_training_loop`` -> ``_run_epoch``: per optimizer update, the
  ``gradient_accumulation_steps`` micro-batches run ``training_step`` (forward, backward) one
  after the other; after the last one, gradient clipping (``max_grad_norm``), then
  ``optimizer.step()`` on the ``AcceleratedOptimizer``, which calls the torch optimizer's
  ``step`` (gradients synced: the Trainer sets ``sync_gradients`` for the last micro-batch),
  then ``lr_scheduler.step()``, ``model.zero_grad()``, ``on_step_end``, and logging,
  evaluation, saving. So the updates of the first micro-batches (their batch-norm
  statistics) are pending, read-your-writes, and commit with the last one's; declared rules
  run once per real update. An epoch always ends with an update.
* Checkpoints are saved after an update (and after the evaluation that follows it), so no
  micro-batch's updates are pending in them.
* Resuming (``train(resume_from_checkpoint=...)``), the Trainer loads the model, its
  buffers (batch-norm statistics) and the optimizer from the checkpoint, and its
  ``TrainerState``; the callbacks are not told from where. This callback looks for
  ``paramupdates.pt`` in ``TrainingArguments.resume_from_checkpoint`` (when it names a
  folder), then in ``<output_dir>/checkpoint-<global_step>`` (the folder
  ``resume_from_checkpoint=True`` picks, and where this run saves), and takes the one saved
  with the same Trainer state (step, epoch, FLOs, log history). None: an
  :class:`~paramupdates.UpdateError` that says what to do (``restore=False`` starts
  paramupdates' state afresh, for a checkpoint saved without this callback).

The rules (``pu.weight_decay``, ``pu.ema``, ``pu.constrain``) are declared before
``trainer.train()``; resuming, declare the same ones (their saved state is matched by kind
and order). An EMA copy is not part of the model the Trainer saves: its weights travel in
``paramupdates.pt``; to export them, ``model.load_state_dict(pu.rules.ema.weights(ema))`` and
``model.save_pretrained(...)``.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from typing import Any, Unpack

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..attach import Attachment, attach
from ..errors import UpdateError, listed
from ..options import StepOptionsDict, make_options
from ..origin import call_site

__all__ = ["STATE_NAME", "ParamUpdates"]

STATE_NAME = "paramupdates.pt"
"""The file this callback writes into each checkpoint folder."""

_FORMAT = 1


# attachments made by a ParamUpdates: one left attached by a train() that raised is detached
# by the next on_train_begin for the same model
class _Made:
    """The attachments made by a ``ParamUpdates`` (held weakly)."""

    def __init__(self) -> None:
        self.attachments: weakref.WeakSet[Attachment] = weakref.WeakSet()


_OURS = _Made()


class ParamUpdates(TrainerCallback):
    """Attach paramupdates to a ``transformers.Trainer``'s optimizer; keep its state in checkpoints.

    Args:
        restore: resuming (``trainer.train(resume_from_checkpoint=...)``), load the state saved
            in the checkpoint's ``paramupdates.pt``, and raise :class:`~paramupdates.UpdateError`
            if there is none. ``False``: start paramupdates' state afresh (a checkpoint saved
            without this callback).
        **options: the step options, passed to :func:`paramupdates.attach` (``on_nonfinite``,
            ``copy_for_rollback``, ``process_group``, ``sync_timeout``; the framework drives its own
            GradScaler).

    After training starts, :attr:`attachment` is the :class:`paramupdates.Attachment`
    (``.schedule()``, ``.steps``, ``.skipped_steps``); it stays readable after training ends
    (detached).
    """

    def __init__(self, *, restore: bool = True, **options: Unpack[StepOptionsDict]) -> None:
        super().__init__()
        make_options(dict(options), "ParamUpdates")  # refuse a bad option now, not at train()
        self.options = options
        self.restore = bool(restore)
        self.origin = call_site(2)
        self.attachment: Attachment | None = None
        self._attached = False

    # --- attaching ---------------------------------------------------------
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        """Attach to the Trainer's optimizer (built by now); resuming, load the checkpoint's state."""
        self._detach()
        if model is None or optimizer is None:
            raise UpdateError(
                f"ParamUpdates (created at {self.origin}): on_train_begin got no "
                f"{'model' if model is None else 'optimizer'}; add it to a transformers.Trainer's "
                "callbacks (Trainer(..., callbacks=[ParamUpdates()])), which passes both."
            )
        for stale in [a for a in _OURS.attachments if a.model is model]:
            stale.detach()  # left attached by a train() that raised: its step in progress is dropped
        self.attachment = attach(model, optimizer, **self.options)
        _OURS.attachments.add(self.attachment)
        self._attached = True
        if state.global_step > 0 and self.restore:
            try:
                self._load(args, state)
            except BaseException:
                self._detach()
                raise

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Commit what the evaluation issued (no gradient update), before a checkpoint is saved."""
        if self._attached:
            self.attachment.flush()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Commit what is pending (no gradient update), then detach; a later ``train()`` attaches again."""
        if self._attached:
            self.attachment.flush()
        self._detach()

    def _detach(self) -> None:
        if self._attached:
            self.attachment.detach()
            self._attached = False

    # --- checkpoints -------------------------------------------------------
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Write the attachment's ``state_dict()`` into the checkpoint the Trainer has just saved."""
        if not self._attached:
            return
        journal = self.attachment.journal
        pending = journal.pending_names() if journal is not None else []
        if pending:
            warnings.warn(
                f"ParamUpdates (created at {self.origin}): updates of {listed(pending)} are pending at the "
                f"checkpoint of step {state.global_step} (issued since the last optimizer step, e.g. by a forward "
                "in a callback's on_step_end), so they are not in it; they commit with the next optimizer step. "
                "To have them in the checkpoint, call attachment.flush() after that forward.",
                stacklevel=2,
            )
        if not args.should_save:
            return
        folders = _checkpoint_folders(args, state)
        folder = next((f for f in folders if os.path.isdir(f)), None)
        if folder is None:
            raise UpdateError(
                f"ParamUpdates (created at {self.origin}): the Trainer saved a checkpoint at step "
                f"{state.global_step}, but none of {folders} is a folder, so paramupdates' state (EMA copies, "
                "counters) has nowhere to go. Keep the Trainer's checkpoint naming (checkpoint-<step> under "
                "output_dir)."
            )
        saved = {
            "format": _FORMAT,
            "trainer_state": _fingerprint(state),
            "attachment": self.attachment.state_dict(),
        }
        torch.save(saved, os.path.join(folder, STATE_NAME))

    def _load(self, args: TrainingArguments, state: TrainerState) -> None:
        """Load the ``paramupdates.pt`` saved with the Trainer state being resumed."""
        want = _fingerprint(state)
        candidates = []
        if isinstance(args.resume_from_checkpoint, str):
            candidates.append(args.resume_from_checkpoint)
        candidates.extend(_checkpoint_folders(args, state))
        looked = []
        for folder in dict.fromkeys(candidates):
            path = os.path.join(folder, STATE_NAME)
            if not os.path.isfile(path):
                looked.append(f"{path} (none)")
                continue
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if saved.get("trainer_state") != want:
                looked.append(f"{path} (saved with another Trainer state)")
                continue
            self.attachment.load_state_dict(saved["attachment"])
            return
        raise UpdateError(
            f"ParamUpdates (created at {self.origin}): the Trainer resumed at global step {state.global_step}, "
            f"but no {STATE_NAME} saved at that point of this training was found: {'; '.join(looked)}. "
            f"ParamUpdates saves its state (EMA copies, their counters, steps) as checkpoint-<step>/{STATE_NAME}. "
            "Resuming from a checkpoint folder outside output_dir, name it in "
            "TrainingArguments(resume_from_checkpoint=<folder>) too; for a checkpoint saved without "
            "ParamUpdates, pass ParamUpdates(restore=False) to start paramupdates' state afresh."
        )


def _checkpoint_folders(args: TrainingArguments, state: TrainerState) -> list[str]:
    """Where the Trainer puts the checkpoint of ``state.global_step``: ``<output_dir>[/<trial>]/checkpoint-<step>``."""
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    out = [os.path.join(args.output_dir, state.trial_name, name)] if state.trial_name else []
    return [*out, os.path.join(args.output_dir, name)]


def _fingerprint(state: TrainerState) -> str:
    """What identifies the Trainer state a checkpoint was saved with (its ``trainer_state.json`` holds the same)."""
    return json.dumps(
        {
            "global_step": state.global_step,
            "epoch": state.epoch,
            "total_flos": state.total_flos,
            "log_history": state.log_history,
        },
        sort_keys=True,
    )
