"""paramupdates.lightning.ParamUpdates with real Lightning on CPU, against plain Lightning and torch.

Lightning's automatic optimization calls ``optimizer.step(closure=...)`` and computes the gradients
inside it: gradient-gated ``before_grad`` rules (weight decay) must run after the closure's first call,
as the commit driver does. ``attach`` unwrapping a ``LightningOptimizer`` waits for the core (xfail).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramupdates as pu
from paramupdates.rules.ema import rule_of

from conftest import assert_same, bits, snapshot
from frameworks import import_or_skip

L = import_or_skip("lightning.pytorch", "lightning")
from paramupdates.lightning import ParamUpdates  # noqa: E402 - after the skip


def _data(n=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


class Lit(L.LightningModule):
    """A small regression model; ``pu_rules`` declares weight decay/EMA, ``convert`` makes its BN update-safe."""

    def __init__(self, *, opt="adam", wd=0.0, pu_wd=0.0, convert=False, ema=None, sched=False, manual=False):
        super().__init__()
        self.net = _net()
        if convert:
            pu.convert(self.net)
        self.ema = pu.ema(self.net, ema, warmup=True) if ema is not None else None
        self.opt_name, self.wd, self.pu_wd, self.sched = opt, wd, pu_wd, sched
        self.automatic_optimization = not manual
        self.lrs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        if self.pu_wd:
            pu.weight_decay(self.net, self.pu_wd, exclude=None)  # AdamW decays biases and norm scales too
        params = self.net.parameters()
        if self.opt_name == "adamw":
            opt = torch.optim.AdamW(params, lr=0.05, weight_decay=self.wd)
        elif self.opt_name == "adam":
            opt = torch.optim.Adam(params, lr=0.05, weight_decay=0.0)
        else:
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        if self.sched:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return opt

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])


def _fit(model, callbacks=(), *, ckpt_path=None, val=None, **kwargs):
    """One ``trainer.fit`` on CPU (``val``: a validation DataLoader)."""
    kw = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    kw.update(kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*GPU available.*")
        trainer = L.Trainer(callbacks=list(callbacks), **kw)
        trainer.fit(model, _data(), val, ckpt_path=ckpt_path)
    return trainer


def _state(model):
    return snapshot(model.net)


@pytest.mark.parametrize("accumulate,clip", [(1, None), (4, None), (2, 0.5)])
def test_adam_with_pu_weight_decay_equals_adamw(accumulate, clip):
    """Lightning computes the gradients inside optimizer.step(closure): weight decay must see them.
    Before the commit driver began the commit after the closure: 0.026 off after 5 steps (0.036 with
    accumulate_grad_batches=4)."""
    ref = Lit(opt="adamw", wd=0.1)
    _fit(ref, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    ours = Lit(opt="adam", pu_wd=0.1, convert=True)
    _fit(ours, [ParamUpdates()], accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    assert_same(_state(ref), _state(ours))


@pytest.mark.parametrize("accumulate,clip", [(1, None), (2, None), (3, 0.5)])
def test_batchnorm_statistics_equal_plain_lightning_with_torch_batchnorm(accumulate, clip):
    """pu.nn.BatchNorm1d + ParamUpdates == torch.nn.BatchNorm1d in plain Lightning, bitwise: weights,
    running statistics, num_batches_tracked; with an LR scheduler from configure_optimizers."""
    ref = Lit(opt="sgd", sched=True)
    _fit(ref, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    ours = Lit(opt="sgd", sched=True, convert=True)
    cb = ParamUpdates()
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error", UserWarning
        )  # e.g. the scheduler's "lr_scheduler.step() before optimizer.step()"
        trainer = _fit(ours, [cb], accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    assert type(ours.net[1]) is pu.nn.BatchNorm1d
    assert_same(_state(ref), _state(ours))
    assert ours.lrs == ref.lrs and len(set(ours.lrs)) > 1
    assert cb.attachments[0].steps == trainer.global_step == -(-6 // accumulate)
    assert "auxiliary" in cb.attachments[0].schedule().phases()
    assert not pu.routing.attachments()  # detached in teardown


class _ReferenceEMA(L.Callback):
    """Hand-written EMA after each real optimizer update (global_step moved), with the same warmup."""

    def __init__(self, decay):
        self.decay, self.t, self.step = decay, 0, 0

    def on_fit_start(self, trainer, pl_module):
        self.avg = [t.detach().clone() for t in pl_module.net.state_dict().values()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            return
        self.step = trainer.global_step
        d = min(self.decay, (1 + self.t) / (10 + self.t))
        with torch.no_grad():
            for a, p in zip(self.avg, pl_module.net.state_dict().values()):
                a.lerp_(p, 1 - d) if a.is_floating_point() else a.copy_(p)
        self.t += 1


@pytest.mark.parametrize("accumulate", [1, 3])
def test_ema_runs_once_per_real_update(accumulate):
    ours = Lit(opt="sgd", convert=True, ema=0.9)
    ref = _ReferenceEMA(0.9)
    trainer = _fit(ours, [ParamUpdates(), ref], accumulate_grad_batches=accumulate, max_epochs=2)
    assert rule_of(ours.ema).updates == trainer.global_step == 2 * 6 // accumulate == ref.t
    for a, r in zip(ours.ema.state_dict().values(), ref.avg):  # the copy's tensors are the model's, in order
        assert torch.equal(bits(a), bits(r))


def _resume_case(tmp_path, **lit):
    """Two epochs straight, against one epoch, a checkpoint, and a fresh Trainer, module and callback."""
    full = Lit(**lit)
    full_cb = ParamUpdates()
    _fit(full, [full_cb], max_epochs=2)
    first = Lit(**lit)
    ckpt = L.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1)
    _fit(first, [ParamUpdates(), ckpt], max_epochs=1, enable_checkpointing=True)
    path = next(tmp_path.glob("epoch=0*.ckpt"))
    torch.manual_seed(99)  # a fresh process: everything must come from the checkpoint
    resumed = Lit(**lit)
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    cb = ParamUpdates()
    _fit(resumed, [cb], max_epochs=2, ckpt_path=str(path))
    return full, full_cb, resumed, cb


def test_resume_is_bitwise_with_batchnorm_and_ema(tmp_path):
    full, full_cb, resumed, cb = _resume_case(tmp_path, opt="adam", convert=True, ema=0.9)
    assert_same(snapshot(full), snapshot(resumed))  # the net and the EMA copy (its counter included)
    assert cb.attachments[0].steps == 12 and full_cb.attachments[0].steps == 12  # the callback's state came back
    assert rule_of(resumed.ema).updates == 12
    ckpt = torch.load(next(tmp_path.glob("epoch=0*.ckpt")))  # weights_only=True
    assert ckpt["state_dict"]._metadata["ema"]["pu_ema_updates"] == 6  # Lightning's own checkpoint holds t
    assert "ema.pu_ema_updates" not in ckpt["state_dict"]  # (in the metadata of the copy, not as a tensor)
    assert ckpt["callbacks"]["ParamUpdates"]["attachments"][0]["steps"] == 6


def test_resume_is_bitwise_with_weight_decay(tmp_path):
    """Before the commit driver began the commit after the closure, the first resumed step had no stale
    gradients, so weight decay skipped it: never bitwise."""
    full, _, resumed, _ = _resume_case(tmp_path, opt="adam", pu_wd=0.1, convert=True, ema=0.9)
    assert_same(snapshot(full), snapshot(resumed))


def test_manual_optimization_weight_decay_equals_adamw():
    """Manual optimization: manual_backward before opt.step(); the step reaches the torch optimizer as
    optimizer.step(closure=<Lightning's wrapper>), with the gradients already there."""
    ref = Lit(opt="adamw", wd=0.1, manual=True)
    _fit(ref)
    ours = Lit(opt="adam", pu_wd=0.1, convert=True, manual=True)
    cb = ParamUpdates()
    _fit(ours, [cb])
    assert_same(_state(ref), _state(ours))
    assert cb.attachments[0].steps == 6


class GAN(L.LightningModule):
    """Two optimizers, manual optimization: one attachment per submodule."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gen = pu.convert(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
        self.dis = nn.Sequential(nn.Linear(4, 1))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        loss_d = self.dis(self.gen(x).detach()).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = -self.dis(self.gen(x)).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):
        pu.constrain(self.dis[0].weight, pu.max_norm(0.5))
        return torch.optim.SGD(self.gen.parameters(), lr=0.1), torch.optim.SGD(self.dis.parameters(), lr=0.1)


def test_two_optimizers_name_their_modules():
    with pytest.raises(pu.UpdateError, match="returned 2 optimizers; say which submodule"):
        _fit(GAN(), [ParamUpdates()])
    assert not pu.routing.attachments()  # on_exception detached
    gan = GAN()
    cb = ParamUpdates(modules=["gen", "dis"])
    _fit(gan, [cb])
    g, d = cb.attachments
    assert g.model is gan.gen and d.model is gan.dis
    # the generator's forward runs in both steps: its statistics commit with whichever step comes next
    assert g.steps == 6 and d.steps == 6 and int(gan.gen[1].num_batches_tracked) == 12
    assert float(gan.dis[0].weight.norm(dim=1).max()) <= 0.5 + 1e-6


def test_a_second_fit_works_and_continues():
    model = Lit(opt="sgd", convert=True, ema=0.9)
    cb = ParamUpdates()
    _fit(model, [cb])
    first = cb.attachments[0]
    _fit(model, [cb])  # a new Trainer: on_fit_start attaches again (the first attachment was detached)
    assert cb.attachments[0] is not first and not pu.routing.attachments()
    assert rule_of(model.ema).updates == 12 and int(model.net[1].num_batches_tracked) == 12


class SelfAttaching(Lit):
    """Manual optimization that attaches itself to ``self.optimizers()``, a LightningOptimizer."""

    def on_fit_start(self):
        self.att = pu.attach(self, self.optimizers())

    def on_fit_end(self):
        self.att.detach()


def test_attach_unwraps_the_lightning_optimizer():
    """Wanted: pu.attach(model, lightning_optimizer) attaches to its .optimizer, the torch optimizer that
    Lightning's strategy steps. Today the attachment holds the wrapper itself (its hooks reach the torch
    optimizer through LightningOptimizer.__getattr__, so the training itself is already right)."""
    ref = Lit(opt="adamw", wd=0.1, manual=True)
    _fit(ref)
    ours = SelfAttaching(opt="adam", pu_wd=0.1, convert=True, manual=True)
    trainer = _fit(ours)
    assert_same(_state(ref), _state(ours))
    assert ours.att.steps == 6
    assert ours.att.optimizer is trainer.optimizers[0]


# --- what is pending between steps commits where plain Lightning has it written -------
class GANWithNorms(L.LightningModule):
    """A GAN whose generator and discriminator both have a batch norm (manual optimization, two
    optimizers). The discriminator's forward inside the generator's step issues statistics that no
    discriminator step follows in that batch: they stay pending on the ``dis`` attachment.
    ``convert=False``: torch's BatchNorm1d and plain Lightning, the reference."""

    def __init__(self, convert=True):
        super().__init__()
        torch.manual_seed(0)
        self.gen = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.dis = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))
        if convert:
            pu.convert(self)
        self.automatic_optimization = False
        self.val_out = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        loss_d = self.dis(self.gen(x).detach()).mean() - self.dis(x).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = -self.dis(self.gen(x)).mean()  # the discriminator's statistics: pending until committed
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.val_out.append(self.dis(self.gen(x)).detach().clone())  # eval mode: reads the statistics

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), lr=0.05), torch.optim.Adam(self.dis.parameters(), lr=0.05)


def _gan_state(model, trainer):
    """Every tensor: weights, statistics, and each optimizer's state (Adam's moments and step)."""
    out = snapshot(model)
    for i, opt in enumerate(trainer.optimizers):
        for j, st in opt.state_dict()["state"].items():
            out.extend((f"opt{i}.{j}.{k}", v.clone()) for k, v in st.items())
    return out


@pytest.mark.parametrize("val", [None, 3, 1.0], ids=["no-val", "val-every-3-batches", "val-per-epoch"])
def test_gan_with_batch_norms_in_both_equals_plain_lightning(val):
    """Before: the discriminator's statistics of the last generator step stayed pending and were dropped
    at teardown (num_batches_tracked 17 vs plain's 18 after 6 batches, running_var 0.058 off)."""
    kw = {} if val is None else dict(val_check_interval=val, limit_val_batches=2)
    val_data = None if val is None else _data(8, seed=5)
    ref = GANWithNorms(convert=False)
    ref_trainer = _fit(ref, [], val=val_data, **kw)
    ours = GANWithNorms()
    cb = ParamUpdates(modules=["gen", "dis"])
    trainer = _fit(ours, [cb], val=val_data, **kw)
    assert type(ours.dis[1]) is pu.nn.BatchNorm1d
    assert_same(_gan_state(ref, ref_trainer), _gan_state(ours, trainer))
    assert len(ours.val_out) == len(ref.val_out) == {None: 0, 3: 4, 1.0: 2}[val]
    for a, b in zip(ref.val_out, ours.val_out):  # validation saw the statistics plain Lightning has
        assert torch.equal(bits(a), bits(b))
    assert not pu.routing.attachments()


@pytest.mark.parametrize("val", [False, True], ids=["saved-at-train-epoch-end", "saved-at-validation-end"])
def test_gan_checkpoint_and_resume_equal_plain_lightning(tmp_path, val):
    """The epoch-end checkpoint holds what plain Lightning's holds, and ``ckpt_path=`` resume is bitwise
    plain Lightning's uninterrupted run. Before: the checkpoint lacked the last discriminator statistics
    (num_batches_tracked 17 vs 18) and the resumed run ended one short (35 vs 36)."""
    val_data = _data(8, seed=5) if val else None
    kw = dict(limit_val_batches=2) if val else {}

    def ckpt(d):
        return L.callbacks.ModelCheckpoint(dirpath=d, save_top_k=-1, every_n_epochs=1)

    full = GANWithNorms(convert=False)  # plain Lightning, two epochs straight
    full_trainer = _fit(full, [], val=val_data, max_epochs=2, **kw)
    plain_first = GANWithNorms(convert=False)
    _fit(plain_first, [ckpt(tmp_path / "plain")], val=val_data, enable_checkpointing=True, **kw)
    first = GANWithNorms()
    _fit(
        first,
        [ParamUpdates(modules=["gen", "dis"]), ckpt(tmp_path / "pu")],
        val=val_data,
        enable_checkpointing=True,
        **kw,
    )
    plain_ckpt = torch.load(next((tmp_path / "plain").glob("epoch=0*.ckpt")))
    path = next((tmp_path / "pu").glob("epoch=0*.ckpt"))
    ours_ckpt = torch.load(path)
    assert_same(list(plain_ckpt["state_dict"].items()), list(ours_ckpt["state_dict"].items()))
    torch.manual_seed(99)
    resumed = GANWithNorms()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # everything must come from the checkpoint
    trainer = _fit(
        resumed, [ParamUpdates(modules=["gen", "dis"])], val=val_data, max_epochs=2, ckpt_path=str(path), **kw
    )
    assert int(resumed.dis[1].num_batches_tracked) == int(full.dis[1].num_batches_tracked) == 36
    assert_same(_gan_state(full, full_trainer), _gan_state(resumed, trainer))


class LitVal(Lit):
    """``Lit`` with a validation loop whose outputs are kept (eval mode: they read the statistics)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.val_out = []

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.val_out.append(self.net(x).detach().clone())


@pytest.mark.parametrize("accumulate", [2, 4])
def test_validation_inside_an_accumulation_window_commits_nothing(accumulate):
    """``val_check_interval=3`` runs validation inside an accumulation window: it reads the window's
    pending statistics (plain Lightning has them written), and nothing is committed there (they belong
    to the window's ``optimizer.step()``): one commit per optimizer step, every tensor as plain's."""
    val_data = _data(8, seed=5)
    kw = dict(accumulate_grad_batches=accumulate, val_check_interval=3, limit_val_batches=2)
    ref = LitVal(opt="sgd")
    _fit(ref, [], val=val_data, **kw)
    ours = LitVal(opt="sgd", convert=True)
    cb = ParamUpdates()
    trainer = _fit(ours, [cb], val=val_data, **kw)
    assert_same(_state(ref), _state(ours))
    assert len(ours.val_out) == len(ref.val_out) == 4
    for a, b in zip(ref.val_out, ours.val_out):
        assert torch.equal(bits(a), bits(b))
    assert cb.attachments[0].steps == trainer.global_step == -(-6 // accumulate)


class _SaveAtBatch(L.Callback):
    """Saves a checkpoint at the end of batch ``at``: listed before ``ParamUpdates``, it runs first."""

    def __init__(self, path, at=2):
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at:
            trainer.save_checkpoint(self.path)


def test_a_checkpoint_saved_before_the_callbacks_hook_holds_what_plain_lightning_holds(tmp_path):
    """Lightning takes the module's state_dict before any callback's on_save_checkpoint: a save by a
    callback listed before ParamUpdates (here at a batch end, the discriminator's statistics still
    pending) gets them committed there and the state_dict taken again. Before: 8 vs 9 batches tracked."""
    _fit(GANWithNorms(convert=False), [_SaveAtBatch(tmp_path / "plain.ckpt")])
    ours = GANWithNorms()
    _fit(ours, [_SaveAtBatch(tmp_path / "pu.ckpt"), ParamUpdates(modules=["gen", "dis"])])
    plain = torch.load(tmp_path / "plain.ckpt")["state_dict"]
    saved = torch.load(tmp_path / "pu.ckpt")
    assert int(saved["state_dict"]["dis.1.num_batches_tracked"]) == 9
    assert_same(list(plain.items()), list(saved["state_dict"].items()))
    assert saved["callbacks"]["ParamUpdates"]["attachments"][1]["steps"] == 6  # 3 optimizer steps, 3 flushes


# --- configure_optimizers run again by a later fit ------------------------------------
class LitConstrained(Lit):
    """Declares weight decay, a built-in constraint and a lambda in ``configure_optimizers``, as the docs show."""

    def configure_optimizers(self):
        pu.constrain(self.net[0].weight, pu.max_norm(1.0))
        pu.constrain(self.net[3].weight, lambda w: w.clamp(-0.5, 0.5))
        return super().configure_optimizers()


def _rules_of(module):
    from paramupdates.rules import base

    ids = {id(t) for t in module.parameters()}
    return [r for r in base.declared() if any(id(t) in ids for t in r.owner_tensors())]


def test_a_second_fit_declares_the_same_rules_again_quietly():
    """Before: every later fit warned "pu.weight_decay declared at ... replaces ..." (and once per
    constraint). The same declarations take their earlier places: quiet, and the second fit is plain
    Lightning's (AdamW) second fit."""
    ref = Lit(opt="adamw", wd=0.1)
    _fit(ref)
    _fit(ref)
    ours = Lit(opt="adam", pu_wd=0.1, convert=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _fit(ours, [ParamUpdates()])
        _fit(ours, [ParamUpdates()])
    assert_same(_state(ref), _state(ours))
    assert len(_rules_of(ours)) == 1
    constrained = LitConstrained(opt="adam", pu_wd=0.1, convert=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for _ in range(3):
            _fit(constrained, [ParamUpdates()])
    assert [r.kind for r in _rules_of(constrained)] == ["constrain:max_norm", "constrain:<lambda>", "weight_decay"]
    assert float(constrained.net[3].weight.abs().max()) <= 0.5
    with pytest.warns(UserWarning, match="pu.weight_decay declared at .* replaces the pu.weight_decay declared at"):
        pu.weight_decay(constrained.net, 0.2, exclude=None)  # another rate, e.g. from a notebook cell: said
