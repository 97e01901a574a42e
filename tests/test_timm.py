"""timm's models through pu.convert: BatchNormAct2d keeps its activation; outputs and statistics equal timm's.

Skipped, with the reason, where timm cannot be imported (see tests/frameworks.py).
"""

import copy
import warnings

import pytest
import torch

import paramupdates as pu

from conftest import assert_same, assert_trains_like, bits, snapshot
from frameworks import import_timm


@pytest.fixture(scope="module")
def timm():
    return import_timm()


@pytest.mark.parametrize("name", ["efficientnet_b0", "mobilenetv3_small_050"])
def test_converted_timm_model_equals_timm_bitwise(timm, name):
    """Failed before the fix: BatchNormAct2d became pu.nn.BatchNorm2d, the activation was dropped
    (efficientnet_b0's and mobilenetv3's outputs changed by up to 24)."""
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, num_classes=5, drop_rate=0.0)
    net = copy.deepcopy(ref)
    n_act = sum(isinstance(m, BatchNormAct2d) for m in net.modules())
    assert n_act > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", pu.nn.ConvertWarning)  # every batch norm has a converter
        pu.convert(net)
    assert not any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, pu.nn.UpdateSafeBatchNorm)
        for m in net.modules()
    )
    assert sum(type(m) is pu.nn.timm_layers.BatchNormAct2d for m in net.modules()) == n_act
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, 32, generator=g)
    ref.eval()
    net.eval()
    assert torch.equal(bits(net(x)), bits(ref(x)))
    # a training step: outputs, gradients, weights and running statistics bitwise timm's
    ref.train()
    net.train()
    assert_trains_like(net, ref, [x])


def test_timm_sync_batchnorm_act_is_converted_too(timm):
    from timm.layers import convert_sync_batchnorm

    torch.manual_seed(0)
    ref = convert_sync_batchnorm(timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=3))
    net = pu.convert(copy.deepcopy(ref))
    kinds = {type(m) for m in net.modules()}
    assert pu.nn.timm_layers.SyncBatchNormAct in kinds
    assert isinstance(
        next(m for m in net.modules() if type(m) is pu.nn.timm_layers.SyncBatchNormAct),
        timm.layers.norm_act.SyncBatchNormAct,
    )
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    ref.train()
    net.train()
    assert torch.equal(bits(net(x)), bits(ref(x)))  # one process: SyncBatchNorm is a batch norm
    assert_same(snapshot(ref), snapshot(net))
