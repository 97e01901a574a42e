"""Who owns a tensor, and what is remembered about it: nothing keyed by an identity that can die.

A rule belongs to the model it is declared on; its plan and caches live as long as that model and
optimizer do, and are found from them, never from an ``id()`` a later object may reuse. Checked the
way a notebook or a hyper-parameter sweep runs: models and optimizers made, trained and collected
in a loop, two models with their own optimizers (a GAN), with and without Lightning.
"""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import bits

DECAY = 0.8


def _gan(bn):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 4), bn(4))
    dis = nn.Sequential(nn.Linear(4, 4), bn(4), nn.Linear(4, 1))
    return gen, dis


def _ema_reference(avg: nn.Module, model: nn.Module) -> None:
    """What ``pu.ema(model, DECAY)`` computes after an optimizer step, tensor by tensor:
    floating tensors ``a.lerp_(p, 1 - DECAY)`` (the rule's formula), the others copied."""
    with torch.no_grad():
        for (_, a), (_, p) in zip(avg.state_dict(keep_vars=True).items(), model.state_dict(keep_vars=True).items()):
            if a.is_floating_point():
                a.lerp_(p, 1.0 - DECAY)
            else:
                a.copy_(p)


def _gan_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 4, generator=g) for _ in range(n)]


def _gan_step(gen, dis, opt_g, opt_d, x):
    """The generator's step first, then the discriminator's: the discriminator's step runs a forward of
    the generator, whose statistics stay pending on the generator's attachment while the
    discriminator commits."""
    opt_g.zero_grad()
    (-dis(gen(x)).mean()).backward()
    opt_g.step()
    opt_d.zero_grad()
    dis(gen(x).detach()).mean().backward()
    opt_d.step()


def _plain_gan(steps):
    gen, dis = _gan(nn.BatchNorm1d)
    avg = copy.deepcopy(gen)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(dis.parameters(), lr=0.1)
    for x in _gan_batches(steps):
        opt_g.zero_grad()
        (-dis(gen(x)).mean()).backward()
        opt_g.step()
        _ema_reference(avg, gen)
        opt_d.zero_grad()
        dis(gen(x).detach()).mean().backward()
        opt_d.step()
    return gen, avg


def _assert_ema_equal(ref_avg, avg):
    ref_state = ref_avg.state_dict()
    state = {k: v for k, v in avg.state_dict().items() if k in ref_state}
    assert state.keys() == ref_state.keys()
    for k, v in ref_state.items():
        assert torch.equal(bits(v), bits(state[k])), k


def test_an_ema_follows_its_model_while_another_attachment_commits():
    """The discriminator's commit must not re-pair the generator's EMA with the pending statistics
    the generator's batch norm shows at that moment (they are gone after the generator's next commit,
    and the copy would follow them no more)."""
    steps = 6
    ref_gen, ref_avg = _plain_gan(steps)
    gen, dis = _gan(pu.nn.BatchNorm1d)
    avg = pu.ema(gen, DECAY)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(dis.parameters(), lr=0.1)
    atts = [pu.attach(gen, opt_g), pu.attach(dis, opt_d)]
    for x in _gan_batches(steps):
        _gan_step(gen, dis, opt_g, opt_d, x)
    atts[0].flush()  # the generator's forward of the last discriminator step
    _assert_ema_equal(ref_avg, avg)
    assert int(avg[1].num_batches_tracked) == 2 * steps - 1
    assert int(gen[1].num_batches_tracked) == int(ref_gen[1].num_batches_tracked) == 2 * steps


def _sweep_trial(seed, how):
    """One trial of a sweep: a fresh model and optimizer with weight decay, a constraint and an EMA,
    three steps, against the same math written by hand."""
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    net = pu.convert(copy.deepcopy(ref))
    ref_avg = copy.deepcopy(ref)
    lr, wd = 0.05 * (1 + seed % 3), 0.1
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    pu.weight_decay(net, wd, exclude=None)
    pu.constrain(net[2].weight, pu.clamp(-0.2, 0.2))
    avg = pu.ema(net, DECAY)
    att = pu.attach(net, opt) if how == "attach" else None
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x = torch.randn(8, 3, generator=g)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        with torch.no_grad():
            ref[2].weight.clamp_(-0.2, 0.2)
        _ema_reference(ref_avg, ref)
        opt.zero_grad()
        if att is None:
            with pu.step(net, opt):
                net(x).square().mean().backward()
        else:
            net(x).square().mean().backward()
            opt.step()
    for k, v in ref.state_dict().items():
        assert torch.equal(bits(v), bits(net.state_dict()[k])), (seed, k)
    _assert_ema_equal(ref_avg, avg)


@pytest.mark.parametrize("how", ["step", "attach"])
def test_a_sweep_of_collected_models_and_optimizers(how):
    """Each trial's model, optimizer, attachment and rules are collected before the next is made (a
    hyper-parameter sweep in one process): the next trial's objects may reuse their memory, and so
    their ``id()``, and must still get plans and caches of their own."""
    for seed in range(5):
        _sweep_trial(seed, how)
        gc.collect()


def test_lightning_gan_with_an_ema_after_another_fit(tmp_path):
    """The issue's report: Lightning, manual optimization, ``pu.ema(self.gen)``,
    ``ParamUpdates(modules=["gen", "dis"])``, after one ordinary ``fit`` of another model and a
    ``gc.collect()``: the EMA copy follows the generator as a hand-written EMA does."""
    from frameworks import import_or_skip

    L = import_or_skip("lightning.pytorch", "lightning")
    from paramupdates.lightning import ParamUpdates

    class GAN(L.LightningModule):
        def __init__(self, bn, with_pu):
            super().__init__()
            self.gen, self.dis = _gan(bn)
            self.with_pu = with_pu
            self.avg = pu.ema(self.gen, DECAY) if with_pu else copy.deepcopy(self.gen)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            (x,) = batch
            opt_g, opt_d = self.optimizers()
            opt_g.zero_grad()
            self.manual_backward(-self.dis(self.gen(x)).mean())
            opt_g.step()
            if not self.with_pu:
                _ema_reference(self.avg, self.gen)
            opt_d.zero_grad()
            self.manual_backward(self.dis(self.gen(x).detach()).mean())
            opt_d.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.gen.parameters(), lr=0.1), torch.optim.SGD(self.dis.parameters(), lr=0.1)

    class Other(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = pu.convert(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))
            self.avg = pu.ema(self.net, 0.5)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.1)

    def fit(module, callbacks):
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(_gan_batches(5))), batch_size=6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = L.Trainer(
                callbacks=callbacks,
                accelerator="cpu",
                devices=1,
                max_epochs=1,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
                num_sanity_val_steps=0,
                default_root_dir=tmp_path,
            )
            trainer.fit(module, data)

    fit(Other(), [ParamUpdates()])
    gc.collect()
    ref = GAN(nn.BatchNorm1d, with_pu=False)
    fit(ref, [])
    ours = GAN(pu.nn.BatchNorm1d, with_pu=True)
    fit(ours, [ParamUpdates(modules=["gen", "dis"])])
    _assert_ema_equal(ref.avg, ours.avg)


def test_one_model_with_its_rules_and_a_new_optimizer_per_run():
    """A notebook re-runs its training cell: the same model and declared rules, a new optimizer each
    run, its param groups laid out differently (here: weights and biases grouped one way, then the
    other, at the same learning rates). The old optimizer is collected first, so the new one and its
    group lists may reuse its memory: the rules' plans must still follow the new groups."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    net = copy.deepcopy(ref)
    pu.weight_decay(net, 0.1, exclude=None)

    def groups(m, run):
        (w1, b1), (w2, b2) = (m[0].weight, m[0].bias), (m[1].weight, m[1].bias)
        if run % 2:
            return [{"params": [w1, b1], "lr": 0.1}, {"params": [w2, b2], "lr": 0.01}]
        return [{"params": [w1, w2], "lr": 0.1}, {"params": [b1, b2], "lr": 0.01}]

    g = torch.Generator().manual_seed(0)
    for run in range(8):
        ref_opt = torch.optim.AdamW(groups(ref, run), weight_decay=0.1)
        opt = torch.optim.Adam(groups(net, run))
        for _ in range(2):
            x = torch.randn(5, 3, generator=g)
            ref_opt.zero_grad()
            ref(x).square().mean().backward()
            ref_opt.step()
            opt.zero_grad()
            with pu.step(net, opt):
                net(x).square().mean().backward()
        del ref_opt, opt
        gc.collect()
        for k, v in ref.state_dict().items():
            assert torch.equal(bits(v), bits(net.state_dict()[k])), (run, k)
