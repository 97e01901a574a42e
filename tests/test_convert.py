"""pu.convert and pu.recompute_batchnorm_stats against torch."""

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import update_bn

import paramupdates as pu

from conftest import assert_same, bits, snapshot


def _net():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(4, 4, 1), nn.SyncBatchNorm(4, momentum=None)),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
        nn.BatchNorm1d(5, affine=False),
    )
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.num_batches_tracked.fill_(2)
    return net


def test_convert_replaces_every_batchnorm_and_keeps_state():
    net = _net()
    ref = copy.deepcopy(net)
    weight, stats = net[1].weight, net[1].running_mean
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.eval()
    out = pu.convert(net)
    assert out is net
    assert type(net[1]) is pu.nn.BatchNorm2d and type(net[3][1]) is pu.nn.SyncBatchNorm
    assert type(net[6]) is pu.nn.BatchNorm1d
    assert net[1].weight is weight and net[1].running_mean is stats  # same tensors: the optimizer still holds them
    assert opt.param_groups[0]["params"][2] is net[1].weight
    assert net[3][1].momentum is None and net[6].affine is False and not net[1].training
    assert [n for n, _ in net.named_modules()] == [n for n, _ in ref.named_modules()]
    assert_same(snapshot(ref), snapshot(net))
    # state_dict round trip: converted -> original class -> converted
    back = copy.deepcopy(ref)
    back.load_state_dict(net.state_dict())
    net.load_state_dict(back.state_dict())
    assert_same(snapshot(ref), snapshot(back))
    # and it trains exactly like the original (SyncBatchNorm without a process group = BatchNorm)
    net.train()
    ref.train()
    x = torch.randn(6, 3, 6, 6)
    for m in (ref, net):
        m(x).square().sum().backward()
    assert_same(snapshot(ref), snapshot(net))
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(bits(p.grad), bits(q.grad))


def test_convert_a_bare_batchnorm_and_shared_modules():
    bn = nn.BatchNorm1d(3)
    conv = pu.convert(bn)
    assert type(conv) is pu.nn.BatchNorm1d and conv.running_mean is bn.running_mean
    shared = nn.BatchNorm1d(3)
    net = nn.Sequential(shared, nn.ReLU(), shared)
    pu.convert(net, sync_stats=True)
    assert net[0] is net[2] and type(net[0]) is pu.nn.BatchNorm1d and net[0].sync_stats
    assert pu.convert(net) is net and net[0] is net[2]  # idempotent


def _loader():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(6, 3, 6, 6, generator=g), torch.zeros(6)) for _ in range(4)]


def test_recompute_batchnorm_stats_equals_update_bn_bitwise():
    ref = _net()
    net = pu.convert(copy.deepcopy(ref))
    net.eval()
    ref.eval()
    update_bn(_loader(), ref)
    n = pu.recompute_batchnorm_stats(net, _loader())
    assert n == 4
    assert_same(snapshot(ref), snapshot(net))
    assert int(net[1].num_batches_tracked) == 4
    assert not net.training and not net[1].training  # modes restored
    assert net[1].momentum == 0.1 and net[3][1].momentum is None  # momenta restored


def test_recompute_batchnorm_stats_is_atomic():
    net = pu.convert(_net())
    before = snapshot(net)

    def bad():
        yield from _loader()[:2]
        raise KeyboardInterrupt  # interrupted in the middle of the pass

    with pytest.raises(KeyboardInterrupt):
        pu.recompute_batchnorm_stats(net, bad())
    assert_same(before, snapshot(net))  # update_bn would have left reset, half-averaged statistics
    assert net[1].momentum == 0.1


def test_update_bn_interrupted_leaves_half_done_statistics():
    """The contrast: swa_utils.update_bn writes in place as it goes."""
    net = _net()
    before = net[1].running_mean.clone()

    def bad():
        yield from _loader()[:2]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        update_bn(bad(), net)
    assert not torch.equal(before, net[1].running_mean) and int(net[1].num_batches_tracked) == 2
    assert net[1].momentum is None  # and the momentum is left changed


def test_recompute_batchnorm_stats_refuses_torch_batchnorm_and_steps():
    with pytest.raises(TypeError, match="pu.convert"):
        pu.recompute_batchnorm_stats(_net(), _loader())
    net = pu.convert(_net())
    with pytest.raises(pu.UpdateError, match="outside a step"), pu.step(net):
        pu.recompute_batchnorm_stats(net, _loader())
