"""torch.load with its default weights_only=True loads what torch.save wrote for pu parameters and models."""

import io

import torch
from torch import nn

import paramupdates as pu

from conftest import assert_same, snapshot


def _round_trip(obj, **kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **kwargs)  # weights_only=True: the default since torch 2.6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.scale = pu.Parameter(torch.ones(3), auxiliary=True)
        self.gain = pu.Parameter(torch.full((3,), 2.0), weight_decay=0.0)

    def forward(self, x):
        return self.bn(self.conv(x)) * self.gain.view(1, 3, 1, 1) + self.scale.view(1, 3, 1, 1)


def test_state_dict_with_keep_vars_loads_with_weights_only():
    """Failed before issue 17: 'Unsupported global: paramupdates.parameter._rebuild'."""
    net = pu.convert(Net())
    state = _round_trip(net.state_dict(keep_vars=True))
    assert type(state["scale"]) is pu.Parameter and state["scale"].auxiliary and not state["scale"].requires_grad
    assert state["gain"].weight_decay == 0.0 and state["gain"].requires_grad
    fresh = Net()
    fresh.load_state_dict(state)
    assert_same(snapshot(net), snapshot(fresh))


def test_a_whole_pu_model_loads_with_weights_only():
    """pu's classes are safe globals; the user allows their own (and torch.nn's) classes as for any model."""
    torch.manual_seed(0)
    net = pu.convert(Net())
    x = torch.randn(4, 2, 5, 5)
    net(x)  # running statistics move (eagerly: no step)
    net.eval()
    with torch.serialization.safe_globals([Net, nn.Conv2d]):
        back = _round_trip(net)
    assert type(back.bn) is pu.nn.BatchNorm2d and type(back.scale) is pu.Parameter
    assert_same(snapshot(net), snapshot(back))
    assert torch.equal(back(x), net(x))


def test_stepper_state_with_an_ema_round_trips_with_weights_only():
    m = pu.convert(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    averaged = pu.ema(m, 0.9, warmup="timm")
    stepper = pu.Stepper(m, opt)
    with stepper:
        m(torch.randn(5, 3)).sum().backward()
    state = _round_trip(stepper.state_dict())
    fresh = pu.Stepper(m, opt)
    fresh.load_state_dict(state)
    assert pu.rules.ema.rule_of(averaged).updates == 1 and fresh.steps == 1
