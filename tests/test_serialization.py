"""torch.load with its default weights_only=True loads what torch.save wrote for pu parameters and models."""

import contextlib
import io

import pytest
import torch
from torch import nn

import paramupdates as pu
from misuse_helpers import Mixed
from misuse_helpers import committed as _committed

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
    """Failed before the fix: 'Unsupported global: paramupdates.parameter._rebuild'."""
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


def test_a_stepped_model_saved_whole_loads_with_weights_only():
    """A model paramupdates has indexed (stepped, attached, or converted) carries the state_dict hooks
    that keep serialization on stored values; they are safe globals (failed before: 'Unsupported global:
    paramupdates.guards.committed_state', then torch's _WrappedHook of the load pre-hook)."""
    torch.manual_seed(0)
    net = pu.convert(Net())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 2, 5, 5)
    with pu.step(net, opt):
        net(x).sum().backward()
    with torch.serialization.safe_globals([Net, nn.Conv2d]):
        back = _round_trip(net)
    assert_same(snapshot(net), snapshot(back))
    with pu.step(back):  # the loaded model's hooks work: a state_dict inside its step holds stored values
        back(x)
        assert int(back.state_dict()["bn.num_batches_tracked"]) == 1
    assert int(back.bn.num_batches_tracked) == 2


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


def _stepped_once(use):
    """A ``Mixed`` model stepped once by ``pu.step`` or under ``pu.attach`` (``use``): ``(model, optimizer,
    attachment or None, its committed state)``; the next step's updates are pending in the caller's block."""
    m = Mixed()
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1)
    att = pu.attach(m, opt) if use == "attach" else None
    with pu.step(m, opt) if use == "step" else contextlib.nullcontext():
        m(torch.randn(8, 4)).square().sum().backward()
    return m, opt, att, _committed(m)


@pytest.mark.parametrize("use", ["step", "attach"])
def test_state_dict_and_deepcopy_inside_a_step_hold_committed_values(use):
    import copy

    m, opt, att, committed = _stepped_once(use)
    stored = {k: v for k, v in m.state_dict(keep_vars=True).items()}
    with pu.step(m, opt) if use == "step" else contextlib.nullcontext():
        m(torch.randn(8, 4)).square().sum().backward()
        # reads see the pending values ...
        assert int(m.net.calls) == 2 and torch.equal(pu.read(m.frozen), torch.full((4,), 2.0))
        assert torch.equal(m.scale, torch.full((4,), 0.25))
        # ... serialization never does
        assert_same(committed, list(m.state_dict().items()))
        kept = m.state_dict(keep_vars=True)
        assert all(kept[k] is stored[k] for k in stored)  # the stored tensors themselves
        sub = [(k, v) for k, v in committed if k.startswith("net.")]
        assert_same(sub, list(m.net.state_dict(prefix="net.").items()))  # a submodule's too
        twin = copy.deepcopy(m)
        assert_same(committed, list(twin.state_dict().items()))
        assert type(twin.scale) is pu.Parameter
        # a pending value read, then copied, is the pending value
        assert int(copy.deepcopy(m.net.calls)) == 2
        mean = m.net.bn.running_mean
        assert torch.equal(copy.deepcopy(mean), mean)
    if att is not None:
        opt.step()
    assert int(m.net.calls) == 2


def test_a_checkpoint_saved_inside_a_step_resumes_without_counting_the_batch_twice(tmp_path):
    xs = [torch.randn(8, 4) for _ in range(3)]
    torch.manual_seed(3)
    m = Mixed()
    init = copy_state(m)
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1)
    for i, x in enumerate(xs):
        with pu.step(m, opt):
            m(x).square().sum().backward()
            if i == 1:
                torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
        opt.zero_grad()
    # resume: the checkpoint holds the state before batch 1; batches 1 and 2 run again
    r = Mixed()
    r.load_state_dict(init)
    ropt = torch.optim.SGD(r.net.parameters(), lr=0.1)
    ckpt = torch.load(tmp_path / "ckpt.pt")
    r.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["opt"])
    for x in xs[1:]:
        with pu.step(r, ropt):
            r(x).square().sum().backward()
        ropt.zero_grad()
    assert_same(snapshot(m), snapshot(r))
    assert int(r.net.calls) == 3


def copy_state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _momenta(m, opt):
    return [(n, opt.state[p]["momentum_buffer"]) for n, p in m.net.named_parameters()]


def _train(m, opt, x):
    m(x).square().sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_whole_model_saved_inside_a_step_resumes_like_one_saved_between_steps(tmp_path):
    """torch.save(model) inside a step (under pu.attach, after the batch's forward and backward) saves
    the stored values: resumed, it trains bitwise like the checkpoint saved between steps and like the
    run that never stopped (the pending statistics, counter, pu.Parameter and plain parameter of the
    batch are not saved, so the batch is not counted twice)."""
    xs = [torch.randn(8, 4) for _ in range(3)]
    torch.manual_seed(3)
    m = Mixed()
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1, momentum=0.9)
    pu.attach(m, opt)
    _train(m, opt, xs[0])
    torch.save({"model": m, "opt": opt.state_dict()}, tmp_path / "between.pt")
    m(xs[1]).square().sum().backward()
    assert int(m.net.calls) == 2  # reads see the pending values ...
    torch.save({"model": m, "opt": opt.state_dict()}, tmp_path / "inside.pt")  # ... the checkpoint does not
    opt.step()
    opt.zero_grad()
    _train(m, opt, xs[2])
    for name in ("between.pt", "inside.pt"):
        ckpt = torch.load(tmp_path / name, weights_only=False)
        r = ckpt["model"]
        assert int(r.net.calls) == 1 and type(r.scale) is pu.Parameter
        ropt = torch.optim.SGD(r.net.parameters(), lr=0.1, momentum=0.9)
        ropt.load_state_dict(ckpt["opt"])
        pu.attach(r, ropt)
        for x in xs[1:]:
            _train(r, ropt, x)
        assert_same(snapshot(m), snapshot(r))
        assert_same(_momenta(m, opt), _momenta(r, ropt))
        assert int(r.net.calls) == 3


@pytest.mark.parametrize("use", ["step", "attach"])
def test_pickling_a_model_inside_a_step_holds_stored_values_and_copy_copy_shares_its_slots(use):
    """pickle.dumps(model) inside a step holds stored values (buffers, the pu.Parameter showing a pending
    value, the plain parameter); a pending value read and pickled on its own is the pending value;
    copy.copy(model) is torch's shallow copy: it shares the slots, so its reads see the pending values
    and the commit updates it."""
    import copy
    import pickle

    m, opt, att, committed = _stepped_once(use)
    with pu.step(m, opt) if use == "step" else contextlib.nullcontext():
        m(torch.randn(8, 4)).square().sum().backward()
        back = pickle.loads(pickle.dumps(m))
        assert_same(committed, list(back.state_dict().items()))
        assert type(back.scale) is pu.Parameter and torch.equal(back.scale, dict(committed)["scale"])
        assert int(pickle.loads(pickle.dumps(m.net.calls))) == 2  # a read, pickled: the pending value
        shallow, top = copy.copy(m.net), copy.copy(m)
        assert shallow._buffers is m.net._buffers and shallow.bn is m.net.bn and top.net is m.net
        assert int(shallow.calls) == 2 and torch.equal(top.scale, torch.full((4,), 0.25))
        assert int(m.net.calls) == 2  # pickling moved nothing
    if att is not None:
        opt.step()
    assert int(m.net.calls) == 2 and int(shallow.calls) == 2
    assert_same(_committed(m.net), list(shallow.state_dict().items()))
