"""paramupdates.transformers.ParamUpdates with the real Hugging Face Trainer on CPU, against the plain Trainer.

Models are built from configs (no download): a tiny BERT (LayerNorms, biases, embeddings: the Trainer's
no-decay rule has something to exclude) and a tiny ``PreTrainedModel`` with a ``BatchNorm1d``. The
references are the Trainer's own AdamW, ``torch.nn.BatchNorm1d`` and ``torch.optim.swa_utils.AveragedModel``
(the same lerp as ``pu.ema``), and the Trainer's own ``resume_from_checkpoint``.
"""

import re
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramupdates as pu
from paramupdates.rules.ema import rule_of

from conftest import assert_same, snapshot
from frameworks import import_or_skip

transformers = import_or_skip("transformers", "transformers")
from transformers import (  # noqa: E402 - after the skip
    BertConfig,
    BertForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from paramupdates.transformers import STATE_NAME, ParamUpdates  # noqa: E402

WD, LR = 0.1, 0.05


# --- models and data --------------------------------------------------------
class TinyConfig(PretrainedConfig):
    model_type = "paramupdates_tiny"

    def __init__(self, n_in=4, hidden=8, count_evals=None, **kwargs):
        super().__init__(**kwargs)
        self.n_in, self.hidden, self.count_evals = n_in, hidden, count_evals


class Tiny(PreTrainedModel):
    """Linear, BatchNorm1d, ReLU, Linear; regression loss. ``count_evals``: ``"torch"`` counts the eval-mode
    forwards in a buffer in place, ``"pu"`` with ``pu.assign_add`` (an update issued outside training)."""

    config_class = TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.net = nn.Sequential(
            nn.Linear(config.n_in, config.hidden), nn.BatchNorm1d(config.hidden), nn.ReLU(), nn.Linear(config.hidden, 1)
        )
        self.register_buffer("evals", torch.zeros((), dtype=torch.int64))
        self.post_init()

    def forward(self, x, labels=None):
        out = self.net(x)
        if not self.training and self.config.count_evals == "torch":
            self.evals.add_(1)
        elif not self.training and self.config.count_evals == "pu":
            pu.assign_add(self.evals, 1)
        return {"loss": F.mse_loss(out, labels), "logits": out}


class Regression(torch.utils.data.Dataset):
    def __init__(self, n=24, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x[:, :1] * 2 - self.x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, seq=6, vocab=32, seed=5):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _tiny(seed=0, *, convert=False, **config):
    torch.manual_seed(seed)
    model = Tiny(TinyConfig(**config))
    return pu.convert(model) if convert else model


def _bert():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=32,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def _args(out, **kwargs):
    kw = dict(
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=LR,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kw.update(kwargs)
    return TrainingArguments(str(out), **kw)


def _adam(args):
    """torch Adam with the Trainer's AdamW settings (lr, betas, eps, fused for "adamw_torch_fused")."""
    kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    return torch.optim.Adam, {**kwargs, "fused": args.optim == "adamw_torch_fused"}


def _ours(model, args, data, callbacks=(), **kwargs):
    """The recipe: the Trainer with torch Adam, pu.weight_decay on the parameters the Trainer would decay."""
    trainer = Trainer(model, args, train_dataset=data, callbacks=list(callbacks), optimizer_cls_and_kwargs=_adam(args))
    decay = set(trainer.get_decay_parameter_names(model))
    trainer.pu_decay = pu.weight_decay([(n, p) for n, p in model.named_parameters() if n in decay], WD, exclude=None)
    return trainer


class AveragedReference(TrainerCallback):
    """``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn``, updated after each real update."""

    def __init__(self, model, decay):
        swa = torch.optim.swa_utils
        self.avg = swa.AveragedModel(model, multi_avg_fn=swa.get_ema_multi_avg_fn(decay), use_buffers=True)
        self.avg.update_parameters(model)  # its first update copies: align it with pu.ema's start
        self.model, self.updates = model, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.avg.update_parameters(self.model)
        self.updates += 1


def _floats(state):
    return [(k, v) for k, v in state.items() if v.is_floating_point()]


# --- weight decay -------------------------------------------------------------
@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_adam_with_pu_weight_decay_equals_the_trainers_adamw(tmp_path, optim):
    """The Trainer's AdamW (its default, fused, and the per-tensor one) decays every parameter but biases and
    LayerNorm weights; Adam + pu.weight_decay on the Trainer's get_decay_parameter_names is that, bitwise."""
    ref_model = _bert()
    ref = Trainer(ref_model, _args(tmp_path / "ref", optim=optim, weight_decay=WD), train_dataset=Tokens())
    ref.train()
    model = _bert()
    cb = ParamUpdates()
    trainer = _ours(model, _args(tmp_path / "ours", optim=optim, weight_decay=0.0), Tokens(), [cb])
    trainer.train()
    assert_same(snapshot(ref_model), snapshot(model))
    # the same rule: pu decayed what the Trainer's AdamW put in its weight-decay group, nothing else
    names = {id(p): n for n, p in ref_model.named_parameters()}
    by_adamw = sorted(names[id(p)] for g in ref.optimizer.param_groups if g["weight_decay"] for p in g["params"])
    assert by_adamw == sorted(trainer.pu_decay.names)
    assert "bert.embeddings.word_embeddings.weight" in by_adamw
    assert not any("LayerNorm" in n or n.endswith("bias") for n in by_adamw)
    assert len(by_adamw) < len(names)
    assert type(trainer.optimizer.optimizer) is torch.optim.Adam
    assert cb.attachment.steps == trainer.state.global_step == ref.state.global_step == 8
    assert "before_grad" in cb.attachment.schedule().phases()
    assert not pu.routing.attachments()  # detached at on_train_end


# --- batch norm, EMA, gradient accumulation -------------------------------------
def test_batchnorm_and_ema_under_gradient_accumulation_equal_the_plain_trainer(tmp_path):
    """gradient_accumulation_steps=2: the first micro-batch's batch-norm statistics are pending and commit with
    the second's optimizer.step; weight decay and the EMA run once per real update."""
    ref_model = _tiny()
    reference = AveragedReference(ref_model, 0.9)
    ref = Trainer(
        ref_model,
        _args(tmp_path / "ref", weight_decay=WD, gradient_accumulation_steps=2),
        train_dataset=Regression(),
        callbacks=[reference],
    )
    ref.train()

    model = _tiny(convert=True)
    ema = pu.ema(model, 0.9)
    cb = ParamUpdates()
    trainer = _ours(
        model, _args(tmp_path / "ours", weight_decay=0.0, gradient_accumulation_steps=2), Regression(), [cb]
    )
    trainer.train()

    assert type(model.net[1]) is pu.nn.BatchNorm1d
    assert_same(snapshot(ref_model), snapshot(model))  # weights, running statistics, num_batches_tracked
    assert int(model.net[1].num_batches_tracked) == 12  # every micro-batch's statistics, 2 epochs x 6
    averaged = pu.rules.ema.weights(ema)
    assert_same(_floats(reference.avg.module.state_dict()), _floats(averaged))
    assert torch.equal(averaged["net.1.num_batches_tracked"], model.net[1].num_batches_tracked)  # copied
    assert cb.attachment.steps == rule_of(ema).updates == trainer.state.global_step == reference.updates == 6
    assert {"before_grad", "grad", "auxiliary", "after_step"} <= set(cb.attachment.schedule().phases())


# --- checkpoints and resume ---------------------------------------------------------
def _resumable(out, seed=0, *, callbacks=None, **args):
    """The BN model, pu.ema with a (counter-driven) warmup, Adam + pu.weight_decay, accumulation 2,
    a checkpoint every 2 updates (6 in all, 3 per epoch: checkpoint-2 is in the middle of epoch 0)."""
    model = _tiny(seed, convert=True)
    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # a fresh process: everything must come from the checkpoint
    ema = pu.ema(model, 0.9, warmup=True)
    kw = dict(weight_decay=0.0, gradient_accumulation_steps=2, save_strategy="steps", save_steps=2)
    kw.update(args)
    cb = ParamUpdates()
    trainer = _ours(model, _args(out, **kw), Regression(), [cb] if callbacks is None else callbacks)
    return model, ema, cb, trainer


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One uninterrupted run (its checkpoints kept): the state at its end, and where it saved."""
    out = tmp_path_factory.mktemp("straight")
    model, ema, cb, trainer = _resumable(out)
    trainer.train()
    expect = snapshot(model, ema)
    steps = cb.attachment.steps
    pu.testing.reset()
    return out, expect, steps


def test_resume_from_checkpoint_is_bitwise_with_the_pu_state(straight, tmp_path):
    out, expect, steps = straight
    ckpt = out / "checkpoint-2"
    saved = torch.load(ckpt / STATE_NAME, weights_only=True)
    assert saved["attachment"]["steps"] == 2
    model, ema, cb, trainer = _resumable(out, seed=7)
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert_same(expect, snapshot(model, ema))  # the model, its statistics, the EMA copy and its counter
    assert cb.attachment.steps == steps == 6 and rule_of(ema).updates == 6
    assert pu.rules.ema.rule_of(ema).updates == 6


def test_resume_from_the_last_checkpoint(straight, tmp_path):
    """resume_from_checkpoint=True: the Trainer picks the newest checkpoint-<step> of output_dir."""
    out, expect, _ = straight
    moved = tmp_path / "run"
    shutil.copytree(out / "checkpoint-4", moved / "checkpoint-4")
    model, ema, cb, trainer = _resumable(moved, seed=7)
    trainer.train(resume_from_checkpoint=True)
    assert_same(expect, snapshot(model, ema))
    assert cb.attachment.steps == 6


def test_resume_from_a_checkpoint_outside_output_dir(straight, tmp_path):
    """The Trainer does not tell callbacks where it resumed from: a checkpoint outside output_dir is named in
    TrainingArguments(resume_from_checkpoint=...) as well, or the callback refuses (nothing left attached)."""
    out, expect, _ = straight
    moved = tmp_path / "elsewhere" / "checkpoint-2"
    shutil.copytree(out / "checkpoint-2", moved)
    model, ema, cb, trainer = _resumable(tmp_path / "new", seed=7)
    with pytest.raises(
        pu.UpdateError, match=r"resumed at global step 2, but no paramupdates.pt .*resume_from_checkpoint"
    ):
        trainer.train(resume_from_checkpoint=str(moved))
    assert not pu.routing.attachments()
    pu.testing.reset()
    model, ema, cb, trainer = _resumable(tmp_path / "new", seed=7, resume_from_checkpoint=str(moved))
    trainer.train(resume_from_checkpoint=str(moved))
    assert_same(expect, snapshot(model, ema))


def test_a_paramupdates_pt_of_another_step_is_refused(straight, tmp_path):
    out, _, _ = straight
    moved = tmp_path / "checkpoint-2"
    shutil.copytree(out / "checkpoint-2", moved)
    shutil.copy(out / "checkpoint-4" / STATE_NAME, moved / STATE_NAME)
    _, _, _, trainer = _resumable(tmp_path, seed=7)
    with pytest.raises(pu.UpdateError, match="saved with another Trainer state"):
        trainer.train(resume_from_checkpoint=str(moved))


def test_a_checkpoint_saved_without_the_callback_needs_restore_false(tmp_path):
    model, _, _, trainer = _resumable(tmp_path, callbacks=[], max_steps=2)
    with pytest.warns(pu.AccountingWarning, match=r"declared at .* did not run"):
        trainer.train()  # (no callback: the EMA and the weight decay are left out, and it says so)
    assert not (tmp_path / "checkpoint-2" / STATE_NAME).exists()
    pu.testing.reset()
    _, _, _, trainer = _resumable(tmp_path, seed=7)
    with pytest.raises(pu.UpdateError, match=r"ParamUpdates\(restore=False\)"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    pu.testing.reset()
    cb = ParamUpdates(restore=False)
    _, ema, _, trainer = _resumable(tmp_path, seed=7, callbacks=[cb])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert cb.attachment.steps == rule_of(ema).updates == 4  # paramupdates' state started afresh


# --- updates outside training steps ----------------------------------------------------
def test_updates_issued_by_an_evaluation_are_in_the_next_checkpoint(tmp_path):
    """A model that updates a buffer in eval mode: plain PyTorch writes in place, so the checkpoint saved after
    the evaluation holds it; ParamUpdates commits the evaluation's updates at on_evaluate, before the save."""
    kw = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, per_device_eval_batch_size=4)
    ref_model = _tiny(count_evals="torch")
    Trainer(ref_model, _args(tmp_path / "ref", **kw), train_dataset=Regression(), eval_dataset=Regression(8)).train()
    model = _tiny(convert=True, count_evals="pu")
    trainer = Trainer(
        model,
        _args(tmp_path / "ours", **kw),
        train_dataset=Regression(),
        eval_dataset=Regression(8),
        callbacks=[ParamUpdates()],
    )
    trainer.train()
    assert int(model.evals) == int(ref_model.evals) == 6 * 2  # 12 updates: 6 evaluations of 2 batches
    for step in (2, 8, 12):
        ours = transformers.modeling_utils.load_state_dict(str(tmp_path / f"ours/checkpoint-{step}/model.safetensors"))
        ref = transformers.modeling_utils.load_state_dict(str(tmp_path / f"ref/checkpoint-{step}/model.safetensors"))
        assert int(ours["evals"]) == int(ref["evals"]) == step


class Probe(TrainerCallback):
    """Runs the model on a probe batch in eval mode after every update (an update issued between steps)."""

    def __init__(self, model):
        self.model, self.x = model, Regression(4, seed=9)[:]

    def on_step_end(self, args, state, control, **kwargs):
        self.model.eval()
        with torch.no_grad():
            self.model(**self.x)
        self.model.train()


def test_updates_pending_at_the_end_of_training_are_committed(tmp_path):
    """The probe's last update follows the last optimizer step: on_train_end commits it (detaching would drop
    it); at each checkpoint the probe's update is pending, and on_save says so."""
    ref_model = _tiny(count_evals="torch")
    Trainer(ref_model, _args(tmp_path / "ref"), train_dataset=Regression(), callbacks=[Probe(ref_model)]).train()
    model = _tiny(convert=True, count_evals="pu")
    cb = ParamUpdates()
    Trainer(model, _args(tmp_path / "ours"), train_dataset=Regression(), callbacks=[Probe(model), cb]).train()
    assert int(model.evals) == int(ref_model.evals) == 12
    assert_same(snapshot(ref_model), snapshot(model))
    pu.testing.reset()
    model = _tiny(convert=True, count_evals="pu")
    trainer = Trainer(
        model,
        _args(tmp_path / "warn", save_strategy="steps", save_steps=3),
        train_dataset=Regression(),
        callbacks=[Probe(model), ParamUpdates()],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if "are pending at the checkpoint" in str(w.message)]
    assert [re.search(r"updates of evals are pending at the checkpoint of step (\d+)", m)[1] for m in said] == [
        "3",
        "6",
        "9",
        "12",
    ]


# --- lifecycle -------------------------------------------------------------------------
class Boom(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise RuntimeError("boom")


def test_a_train_that_raised_leaves_no_attachment_in_the_way(tmp_path):
    """The Trainer has no exception hook: the attachment stays; the next train() of the same model detaches it."""
    model = _tiny(convert=True)
    first = ParamUpdates()
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(model, _args(tmp_path), train_dataset=Regression(), callbacks=[first, Boom()]).train()
    assert pu.routing.attachments() == [first.attachment]
    cb = ParamUpdates()
    trainer = Trainer(model, _args(tmp_path), train_dataset=Regression(), callbacks=[cb])
    trainer.train()
    assert cb.attachment.steps == trainer.state.global_step == 12
    assert not pu.routing.attachments()


def test_a_second_train_attaches_again(tmp_path):
    model = _tiny(convert=True)
    cb = ParamUpdates()
    trainer = Trainer(model, _args(tmp_path, num_train_epochs=1), train_dataset=Regression(), callbacks=[cb])
    trainer.train()
    first = cb.attachment
    trainer.train()
    assert cb.attachment is not first and first.steps == cb.attachment.steps == 6
    assert not pu.routing.attachments()


def test_bad_options_are_refused_at_construction():
    with pytest.raises((TypeError, ValueError, pu.UpdateError), match="on_nonfinite"):
        ParamUpdates(on_nonfinite="sometimes")
