"""Rule 9 in one process: sync is the identity, its arguments are checked, the stated BN rule.

The two-process tests are in ``test_distributed.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import paramupdates as pu
from dist_models import MOMENTUM, C, Ema, Net, Two, batch, reference_stats, same, state_of, stats_update
from paramupdates.rules.base import register

from conftest import bits


def test_synced_statistics_versus_global_batch():
    """The stated rule, against a global-batch BatchNorm1d that sees both ranks' data concatenated.

    With equal per-rank batch sizes n (R ranks, N = R n), one step from (0, 1):
      running_mean = m * mean_r(mu_r)           = m * mu_global            (the same number)
      running_var  = (1-m) + m * mean_r(s2_r)   where s2_r is rank r's unbiased variance, and
      mean_r(s2_r) = n/(n-1) * (V_global - Var_r(mu_r))   (V biased; Var_r the spread of rank means)
    so the synced variance misses the between-rank spread of the means, which a
    global-batch BN (SyncBatchNorm) would count.
    """
    rm, rv = reference_stats(1, 2)
    xs = [batch(0, r) for r in range(2)]
    glob = nn.BatchNorm1d(C, momentum=MOMENTUM)
    glob(torch.cat(xs))
    torch.testing.assert_close(rm, glob.running_mean, rtol=0, atol=1e-6)
    n = xs[0].shape[0]
    mus = torch.stack([x.mean(0) for x in xs])
    v_global = torch.cat(xs).var(0, unbiased=False)
    predicted = (1 - MOMENTUM) + MOMENTUM * n / (n - 1) * (v_global - mus.var(0, unbiased=False))
    torch.testing.assert_close(rv, predicted, rtol=1e-5, atol=1e-5)
    # the gap to the global batch is the between-rank spread (the ranks' means differ by about 2)
    big_n = 2 * n
    gap = MOMENTUM * (big_n / (big_n - 1) * v_global - n / (n - 1) * (v_global - mus.var(0, unbiased=False)))
    torch.testing.assert_close(glob.running_var - rv, gap, rtol=1e-4, atol=1e-5)
    assert gap.min() > 0.04


def test_single_process_sync_is_identity():
    net = Net()
    ref = copy.deepcopy(net)
    ref.bn.sync = None
    x = batch(0, 0)
    with pu.step(net):
        net(x)
    with pu.step(ref):
        ref(x)
    assert same(state_of(net), state_of(ref))
    rm, rv = stats_update(torch.zeros(C), torch.ones(C), x)
    assert torch.equal(bits(net.bn.running_mean), bits(rm)) and torch.equal(bits(net.bn.running_var), bits(rv))


def test_sync_argument_errors():
    m = Two()
    m.register_buffer("flag", torch.zeros(2, dtype=torch.bool))
    lin = nn.Linear(2, 2)
    m.lin = lin
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = state_of(m)
    cases = [
        (lambda: pu.assign(m.a, torch.ones(2), sync="max"), "sync must be None, 'mean' or 'sum'"),
        (lambda: pu.assign(m.flag, torch.ones(2, dtype=torch.bool), sync="sum"), "bool"),
        (lambda: pu.assign(lin.weight, torch.ones(2, 2), phase="after_grad", sync="mean"), "trainable"),
        (lambda: (pu.assign(m.a, torch.ones(2), sync="mean"), pu.assign_add(m.a, 1.0, sync="sum")), "one reduction"),
        (
            lambda: (pu.assign(m.a, torch.ones(2), sync="mean"), pu.assign_add(m.a, 1.0, phase="after_step")),
            "two phases",
        ),
        (
            lambda: (pu.assign(m.a, torch.ones(2), phase="after_step"), pu.assign_add(m.a, 1.0, sync="sum")),
            "two phases",
        ),
    ]
    for fn, msg in cases:
        with pytest.raises(pu.UpdateError, match=msg) as info:
            with pu.step(m, opt):
                fn()
        assert "test_sync.py:" in str(info.value)
        assert same(before, state_of(m))


def test_rule_writing_a_synced_target_is_an_error():
    net = Net()
    register(Ema([net.lin.bias], [net.bn.running_mean], 0.5))  # a rule that writes a synced buffer
    before = state_of(net)
    with pytest.raises(pu.UpdateError, match="also written by the ema rule"):
        with pu.step(net):
            net(batch(0, 0))
    assert same(before, state_of(net))


def test_process_group_without_init_and_bad_timeout():
    net = Net()
    with pytest.raises(pu.UpdateError, match="init_process_group"):
        pu.Stepper(net, process_group=object())
    with pytest.raises(ValueError, match="sync_timeout"):
        pu.Stepper(net, sync_timeout=0)


def test_fingerprint_ignores_device_index_but_not_layout_or_step():
    """Under NCCL rank r's statistics live on cuda:r: the layout check must not see the index."""
    from types import SimpleNamespace

    from paramupdates.integrations.distributed import layout_fingerprint

    def plan(device, name="bn.running_mean", shape=(4,)):
        value = SimpleNamespace(shape=shape, dtype=torch.float32, device=torch.device(device))
        return [((device, "torch.float32"), [SimpleNamespace(name=name, value=value, sync="mean")])]

    fp = layout_fingerprint(plan("cuda:0"), 1, 2)
    assert fp == layout_fingerprint(plan("cuda:1"), 1, 2)
    assert fp != layout_fingerprint(plan("cuda:0", name="bn.running_var"), 1, 2)
    assert fp != layout_fingerprint(plan("cuda:0", shape=(5,)), 1, 2)
    assert fp != layout_fingerprint(plan("cuda:0"), 2, 2)
    assert all(0 <= x < 2**11 for x in fp)  # 2 ranks: 11-bit chunks, R * sum(x**2) exact in float32


def test_eager_sync_single_process_and_its_checks():
    """Outside a step, without a process group, a synced update is the plain eager update; bad sync still raises."""
    m = Two()
    m.register_buffer("flag", torch.zeros(2, dtype=torch.bool))
    pu.assign_add(m.a, torch.ones(2), sync="mean")
    assert torch.equal(m.a, torch.ones(2))
    with pytest.raises(pu.UpdateError, match="sync must be None"):
        pu.assign(m.a, torch.zeros(2), sync="avg")
    with pytest.raises(pu.UpdateError, match="bool"):
        pu.assign(m.flag, torch.ones(2, dtype=torch.bool), sync="sum")
    assert torch.equal(m.a, torch.ones(2)) and not m.flag.any()
