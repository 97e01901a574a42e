"""Gradient accumulation: K micro-batches, then one optimizer step.

The semantics (read-your-writes, rule 1 and phase order (rule 4)), stated and checked against an explicit reference:

* micro-batch k's forward reads the running statistics micro-batch k-1 left
  pending:  m_k = (1 - a) m_{k-1} + a mean(x_k),
            v_k = (1 - a) v_{k-1} + a var_unbiased(x_k),   n_k = n_{k-1} + 1;
  the step commits m_K, v_K, n_0 + K (the K updates compose in issue order);
* the gradient is the sum over micro-batches and the optimizer steps once:
  theta <- theta - lr * sum_k grad_k(theta)  (every micro-batch sees the same theta);
* declared rules (constraints, weight decay, EMA) run once per optimizer
  update, not once per micro-batch.
"""

import contextlib

import pytest
import torch
from torch import nn

import paramupdates as pu
from paramupdates.phases import AFTER_GRAD
from paramupdates.rules.base import Rule, register

from conftest import assert_same, bits, snapshot

K, MOM, LR = 4, 0.2, 0.05


class Net(nn.Module):
    def __init__(self, bn):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bn = bn(4, momentum=MOM)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        with pu.when(self.training):
            pu.assign_add(self.seen, x.shape[0])
        return self.bn(self.lin(x)).square().mean()


class CountApplications(Rule):
    phase = AFTER_GRAD
    kind = "count"

    def __init__(self, counter):
        super().__init__("test")
        self.t = [counter]

    def tensors(self):
        return self.t

    def apply(self, ctx):
        for t in self.t:
            t.add_(1)


def _micro_batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(6, 3, generator=g) * 2 + 1 for _ in range(K)]


@pytest.mark.parametrize("mode", ["step", "attach"])
def test_accumulation_matches_the_explicit_reference(mode):
    torch.manual_seed(0)
    model = Net(pu.nn.BatchNorm1d)
    theta0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    m0, v0 = model.bn.running_mean.clone(), model.bn.running_var.clone()
    counter = torch.zeros(())
    model.register_buffer("rule_count", counter)
    register(CountApplications(counter))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs = _micro_batches()

    if mode == "step":
        committed = model.bn.running_mean
        with pu.step(model, opt):
            for k, x in enumerate(xs, 1):
                model(x).backward()
                assert int(model.bn.num_batches_tracked) == k  # the next forward reads the pending value
                assert torch.equal(committed, m0)  # nothing written before commit
    else:
        pu.attach(model, opt)
        for x in xs:
            model(x).backward()
        opt.step()

    # --- the explicit reference --------------------------------------------------
    m, v = m0, v0
    grads = {k: torch.zeros_like(t) for k, t in theta0.items()}
    for x in xs:
        lin = nn.Linear(3, 4)
        with torch.no_grad():
            lin.weight.copy_(theta0["lin.weight"])
            lin.bias.copy_(theta0["lin.bias"])
        h = lin(x)
        var, mean = torch.var_mean(h.detach(), dim=0, correction=1)
        m = (1 - MOM) * m + MOM * mean
        v = (1 - MOM) * v + MOM * var
        w = theta0["bn.weight"].clone().requires_grad_(True)
        b = theta0["bn.bias"].clone().requires_grad_(True)
        mu, s2 = h.mean(0), h.var(0, unbiased=False)
        loss = (((h - mu) / torch.sqrt(s2 + 1e-5) * w + b) ** 2).mean()
        gl = torch.autograd.grad(loss, [lin.weight, lin.bias, w, b])
        for k, g in zip(["lin.weight", "lin.bias", "bn.weight", "bn.bias"], gl):
            grads[k] += g
    torch.testing.assert_close(model.bn.running_mean, m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.bn.running_var, v, rtol=1e-6, atol=1e-6)
    assert int(model.bn.num_batches_tracked) == K
    assert int(model.seen) == 6 * K  # K auxiliary updates composed in issue order
    assert float(counter) == 1.0  # the declared rule ran once, not K times
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), theta0[k] - LR * grads[k], rtol=1e-5, atol=1e-6)


def test_accumulation_equals_plain_pytorch_loop_bitwise():
    """Where PyTorch is right (no checkpointing), the pu step equals its eager loop bitwise."""
    torch.manual_seed(0)
    ref = Net(nn.BatchNorm1d)
    model = Net(pu.nn.BatchNorm1d)
    model.load_state_dict(ref.state_dict())
    ropt = torch.optim.SGD(ref.parameters(), lr=LR)
    mopt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(2):
        xs = _micro_batches()
        for x in xs:
            ref(x).backward()
        ropt.step()
        ropt.zero_grad()
        with pu.step(model, mopt):
            for x in xs:
                model(x).backward()
        mopt.zero_grad()
    assert_same(snapshot(ref), snapshot(model))  # ref's "seen" counts eagerly (no step): same value
    assert int(model.seen) == 2 * 6 * K and int(model.bn.num_batches_tracked) == 2 * K
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(bits(p), bits(q))


class LazyCounter(nn.Module):
    """Registers its buffer on its first forward (as lazy modules and some user code do)."""

    def forward(self, x):
        if not hasattr(self, "seen"):
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        pu.assign_add(self.seen, 1)
        return x


@pytest.mark.parametrize("mode", ["step", "attach"])
def test_buffer_registered_mid_step_after_pending_statistics(mode):
    """The new buffer makes the model's index rebuild mid-step, while the batch norm's buffer slots
    show its pending statistics (read-your-writes, rule 1). The index takes the stored buffers,
    not those values: micro-batch 2 updates the statistics, not a pending copy of them (before:
    AssertionError in the journal). Bitwise plain PyTorch over 2 steps x 2 micro-batches."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=MOM))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), pu.nn.BatchNorm1d(4, momentum=MOM), LazyCounter())
    ref_opt, opt = (torch.optim.SGD(n.parameters(), lr=LR) for n in (ref, m))
    att = pu.attach(m, opt) if mode == "attach" else None
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        xs = [torch.randn(8, 3, generator=g) for _ in range(2)]
        for x in xs:
            ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with pu.step(m, opt) if att is None else contextlib.nullcontext():
            for x in xs:
                m(x).square().mean().backward()
        if att is not None:
            opt.step()
        opt.zero_grad()
    if att is not None:
        att.detach()
    assert int(m[2].seen) == 4
    assert_same(snapshot(ref), [(k, v) for k, v in snapshot(m) if not k.startswith("2.")])
