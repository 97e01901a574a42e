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


def _fit(model, callbacks=(), *, ckpt_path=None, **kwargs):
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
        trainer.fit(model, _data(), ckpt_path=ckpt_path)
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
    assert not pu.context.attachments  # detached in teardown


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
    assert not pu.context.attachments  # on_exception detached
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
    assert cb.attachments[0] is not first and not pu.context.attachments
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
