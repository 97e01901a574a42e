"""pu.convert never silently changes behaviour: batch norm subclasses with their own forward, the converter registry."""

import copy
import warnings

import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import assert_same, assert_trains_like, bits, snapshot


class NormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in small: a BatchNorm2d subclass whose forward adds an activation."""

    def __init__(self, c):
        super().__init__(c)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(super().forward(x))


class SafeNormAct(pu.nn.BatchNorm2d, NormAct):
    """Its update-safe version: pu's statistics first in the MRO, then the same activation."""

    def forward(self, x):
        return self.act(pu.nn.BatchNorm2d.forward(self, x))


class Tagged(nn.BatchNorm2d):
    """A subclass that keeps BatchNorm2d's forward."""

    tag = "mine"


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), NormAct(4), nn.Conv2d(4, 4, 1), Tagged(4), nn.Flatten(), nn.Linear(4 * 16, 2)
    )


def _x():
    return torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def test_subclass_with_its_own_forward_is_left_alone_with_a_warning():
    """Failed before the fix: NormAct became pu.nn.BatchNorm2d and its ReLU was silently dropped."""
    net = _net()
    ref = copy.deepcopy(net)
    x = _x()
    with pytest.warns(
        pu.nn.ConvertWarning, match=r"^pu.convert: 1 \(.*NormAct\) is a BatchNorm2d whose forward is its own"
    ):
        pu.convert(net)
    assert type(net[1]) is NormAct  # left alone
    assert type(net[3]) is pu.nn.BatchNorm2d  # forward unchanged: converted
    net.train()
    ref.train()
    assert torch.equal(bits(net(x)), bits(ref(x)))
    assert_same(snapshot(ref), snapshot(net))
    assert bool((net[:2](x) >= 0).all())  # the ReLU still runs


def test_a_registered_converter_keeps_the_extra_behaviour_and_its_handle_removes_it():
    handle = pu.nn.register_converter(
        NormAct, lambda m, *, sync_stats: pu.nn.convert_module(m, SafeNormAct, sync_stats=sync_stats)
    )
    net = _net()
    ref = copy.deepcopy(net)
    weight, act = net[1].weight, net[1].act
    with warnings.catch_warnings():
        warnings.simplefilter("error", pu.nn.ConvertWarning)
        pu.convert(net)
    assert type(net[1]) is SafeNormAct and isinstance(net[1], NormAct) and net[1].weight is weight
    assert net[1].act is act  # the same submodules
    # training: outputs, gradients, weights and running statistics bitwise the unconverted model's
    g = torch.Generator().manual_seed(2)
    assert_trains_like(net, ref, [torch.randn(5, 3, 6, 6, generator=g) for _ in range(3)])
    assert int(net[1].num_batches_tracked) == 3
    handle.remove()
    with pytest.warns(pu.nn.ConvertWarning, match="NormAct"):
        pu.convert(_net())


def test_subclass_keeping_the_forward_is_converted_without_warning_and_overrides_win():
    with warnings.catch_warnings():
        warnings.simplefilter("error", pu.nn.ConvertWarning)
        assert type(pu.convert(Tagged(3))) is pu.nn.BatchNorm2d
    seen = []

    def leave(m, *, sync_stats):
        seen.append(type(m))
        return None  # a converter may decline

    handle = pu.nn.register_converter(nn.BatchNorm2d, leave)  # overrides the built-in one
    bn = nn.BatchNorm2d(3)
    assert pu.convert(bn) is bn and seen == [nn.BatchNorm2d]
    handle.remove()
    assert type(pu.convert(nn.BatchNorm2d(3))) is pu.nn.BatchNorm2d  # the built-in again


def test_a_batch_norm_no_converter_knows_is_named_in_a_warning():
    class Raw(nn.modules.batchnorm._BatchNorm):
        def _check_input_dim(self, input):
            pass

    net = nn.Sequential(nn.Linear(2, 3), nn.Sequential(Raw(3)))
    with pytest.warns(pu.nn.ConvertWarning, match=r"1\.0 \(.*Raw\) is a batch norm that no converter knows"):
        pu.convert(net)
    assert type(net[1][0]) is Raw
    with pytest.warns(pu.nn.ConvertWarning, match="the model itself"):
        assert type(pu.convert(NormAct(3))) is NormAct


def test_register_converter_checks_its_arguments():
    with pytest.raises(TypeError, match="nn.Module subclass"):
        pu.nn.register_converter(int, lambda m, *, sync_stats: m)
    with pytest.raises(TypeError, match="callable"):
        pu.nn.register_converter(NormAct, "SafeNormAct")
