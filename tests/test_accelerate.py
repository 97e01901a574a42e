"""The accelerate recipe with real accelerate on CPU: gradient accumulation, checkpoints, the prepared optimizer.

Recipe (README, "accelerate"): declare the rules, ``accelerator.prepare``, ``pu.attach(model, optimizer)``
(the torch optimizer inside accelerate's ``AcceleratedOptimizer``), ``accelerator.register_for_checkpointing(attachment)``,
and the usual ``with accelerator.accumulate(model):`` loop. accelerate's ``optimizer.step()`` calls the torch
optimizer's step only when gradients sync (every ``gradient_accumulation_steps`` micro-batches), so the
attachment commits once per real update.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramupdates as pu
from paramupdates.rules.ema import rule_of

from conftest import assert_same, bits, snapshot
from frameworks import import_or_skip

accelerate = import_or_skip("accelerate", "accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402 - after the skip

WD, DECAY = 0.1, 0.9


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    """accelerate keeps process-wide state (the accumulation setting among it): each test starts anew."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _accelerator(steps=2):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=steps)


def _loader(n=16):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, generator=g)
    y = x[:, :1] - 2 * x[:, 2:3]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


class Plain:
    """The reference: plain accelerate, torch batch norm, AdamW, a hand-written EMA after each real update."""

    def __init__(self, accelerator):
        self.acc = accelerator
        net = _net()
        opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=WD)
        self.model, self.opt, self.dl = accelerator.prepare(net, opt, _loader())
        self.avg = [t.detach().clone() for t in self.model.state_dict().values()]

    def epoch(self):
        for x, y in self.dl:
            with self.acc.accumulate(self.model):
                self.acc.backward(F.mse_loss(self.model(x), y))
                self.opt.step()
                self.opt.zero_grad()
                if self.acc.sync_gradients:
                    with torch.no_grad():
                        for a, p in zip(self.avg, self.model.state_dict().values()):
                            a.lerp_(p, 1 - DECAY) if a.is_floating_point() else a.copy_(p)


class Ours:
    """The recipe: pu batch norm, Adam + pu.weight_decay, pu.ema, pu.attach to the prepared optimizer."""

    def __init__(self, accelerator, attach_to="prepared"):
        self.acc = accelerator
        net = pu.convert(_net())
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        pu.weight_decay(net, WD, exclude=None)  # AdamW decays biases and norm scales too
        self.ema = pu.ema(net, DECAY)
        self.model, self.opt, self.dl = accelerator.prepare(net, opt, _loader())
        self.att = pu.attach(self.model, self.opt.optimizer if attach_to == "inner" else self.opt)
        accelerator.register_for_checkpointing(self.att)

    def epoch(self):
        for x, y in self.dl:
            with self.acc.accumulate(self.model):
                self.acc.backward(F.mse_loss(self.model(x), y))
                self.opt.step()
                self.opt.zero_grad()


def test_recipe_with_gradient_accumulation_equals_plain_accelerate_bitwise():
    ref = Plain(_accelerator())
    ref.epoch()
    ref.epoch()
    ours = Ours(_accelerator())
    ours.epoch()
    ours.epoch()
    assert_same(snapshot(ref.model), snapshot(ours.model))  # weights (AdamW) and batch-norm statistics
    assert ours.att.steps == rule_of(ours.ema).updates == 4  # 16 samples / 4 per batch / 2 micro-batches, x2
    for a, r in zip(ours.ema.state_dict().values(), ref.avg):
        assert torch.equal(bits(a), bits(r))


def test_save_state_and_load_state_resume_bitwise(tmp_path):
    full = Ours(_accelerator())
    full.epoch()
    full.epoch()
    expect = snapshot(full.model, full.ema)
    pu.testing.reset()

    first = Ours(_accelerator())
    first.epoch()
    first.acc.save_state(str(tmp_path))  # model, optimizer, RNG, and the attachment's state_dict()
    pu.testing.reset()  # a fresh process: nothing attached, no rule declared yet

    torch.manual_seed(77)
    resumed = Ours(_accelerator())
    with torch.no_grad():
        for p in resumed.model.parameters():
            p.add_(1.0)
    resumed.acc.load_state(str(tmp_path))
    assert resumed.att.steps == 2 and rule_of(resumed.ema).updates == 2
    resumed.epoch()
    assert_same(expect, snapshot(resumed.model, resumed.ema))


def test_attach_accepts_the_prepared_optimizer():
    """Today: AttributeError: 'AcceleratedOptimizer' object has no attribute '_optimizer_step_pre_hooks'.
    Wanted: attach unwraps it (its .optimizer) and behaves as the recipe."""
    ref = Ours(_accelerator(), attach_to="inner")
    ref.epoch()
    expect = snapshot(ref.model, ref.ema)
    pu.testing.reset()
    ours = Ours(_accelerator(), attach_to="prepared")
    assert ours.att.optimizer is ours.opt.optimizer
    ours.epoch()
    assert_same(expect, snapshot(ours.model, ours.ema))
