"""torch.func with pu batch norm in train mode: updates come back as values (pu.func)."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

import paramupdates as pu

from conftest import bits


def _net(bn=pu.nn.BatchNorm1d):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), bn(4), nn.ReLU(), nn.Linear(4, 1))


def _state(net):
    return {k: v.detach().clone() for k, v in net.named_parameters()}, {k: v.clone() for k, v in net.named_buffers()}


def test_functional_call_returns_updates_and_writes_nothing():
    net, ref = _net(), _net(nn.BatchNorm1d)
    params, buffers = _state(net)
    before = {k: v.clone() for k, v in buffers.items()}
    x = torch.randn(8, 3)
    out, new = pu.func.functional_call(net, {**params, **buffers}, (x,))
    assert sorted(new) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    for k in buffers:  # neither the tensors passed in nor the module's own were written
        assert torch.equal(buffers[k], before[k]) and torch.equal(dict(net.named_buffers())[k], before[k])
    y = ref(x)  # torch's in-place version, same numbers (bitwise: the plain path is torch's kernel)
    assert torch.equal(bits(out), bits(y))
    for k, v in ref.named_buffers():
        assert torch.equal(bits(new[k]), bits(v))
    pu.func.commit(net, new)  # the caller commits (eagerly here: no step in progress)
    for k, v in ref.named_buffers():
        assert torch.equal(bits(dict(net.named_buffers())[k]), bits(v))


def test_commit_inside_a_step_is_pending_until_commit():
    net = _net()
    params, buffers = _state(net)
    _, new = pu.func.functional_call(net, {**params, **buffers}, (torch.randn(8, 3),))
    committed = net[1].running_mean.clone()
    with pu.step(net) as s:
        pu.func.commit(net, new)
        assert torch.equal(net[1]._buffers["running_mean"], new["1.running_mean"])  # read-your-writes
        assert torch.equal(s.model[1].running_mean, new["1.running_mean"])
    assert not torch.equal(committed, net[1].running_mean)
    assert torch.equal(net[1].running_mean, new["1.running_mean"])


def test_grad_in_train_mode_returns_gradients_and_updates():
    net, ref = _net(), _net(nn.BatchNorm1d)
    params, buffers = _state(net)
    x = torch.randn(8, 3)

    def loss(p, b, x):
        out, new = pu.func.functional_call(net, {**p, **b}, (x,))
        return out.square().mean(), new

    grads, new = grad(loss, has_aux=True)(params, buffers, x)
    ref(x).square().mean().backward()
    for k, p in ref.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-6, atol=1e-7)
    for k, v in ref.named_buffers():
        torch.testing.assert_close(new[k], v, rtol=1e-6, atol=1e-7)


def test_vmap_over_an_ensemble_in_train_mode():
    """torch.func's documented case: vmap over models (stack_module_state) with batch norm.

    torch.nn.BatchNorm1d mutates the stacked buffers passed in (a side effect
    inside a transform); pu returns each member's statistics as an output."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(3, 4), pu.nn.BatchNorm1d(4)) for _ in range(3)]
    refs = [nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)) for _ in range(3)]
    for r, m in zip(refs, members):
        r.load_state_dict(m.state_dict())
    params, buffers = stack_module_state(members)
    base = members[0]
    x = torch.randn(3, 8, 3)

    def f(p, b, x):
        return pu.func.functional_call(base, {**p, **b}, (x,))

    out, new = vmap(f)(params, buffers, x)
    assert new["1.running_mean"].shape == (3, 4) and new["1.num_batches_tracked"].tolist() == [1, 1, 1]
    for i, r in enumerate(refs):
        torch.testing.assert_close(out[i], r(x[i]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new["1.running_mean"][i], r[1].running_mean, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(new["1.running_var"][i], r[1].running_var, rtol=1e-6, atol=1e-7)

    assert torch.equal(buffers["1.running_mean"], torch.zeros(3, 4))  # inputs untouched: a pure function
    # the contrast: torch's batch norm writes into the stacked buffers it was given
    tparams, tbuffers = stack_module_state(refs)
    vmap(lambda p, b, x: functional_call(refs[0], {**p, **b}, (x,)))(tparams, tbuffers, x)
    assert not torch.equal(tbuffers["1.running_mean"], torch.zeros(3, 4))


def test_vmap_over_data_with_shared_statistics():
    """vmap over micro-batches with one set of buffers: one update per micro-batch comes back."""
    net = _net()
    params, buffers = _state(net)
    xs = torch.randn(4, 8, 3)
    out, new = vmap(lambda x: pu.func.functional_call(net, {**params, **buffers}, (x,)))(xs)
    assert new["1.running_mean"].shape == (4, 4)
    for i in range(4):
        ref = _net(nn.BatchNorm1d)
        ref(xs[i])
        torch.testing.assert_close(new["1.running_mean"][i], ref[1].running_mean, rtol=1e-6, atol=1e-7)


def test_torch_batchnorm_under_vmap_raises():
    net = _net(nn.BatchNorm1d)
    params, buffers = _state(net)
    with pytest.raises(RuntimeError):
        vmap(lambda x: functional_call(net, {**params, **buffers}, (x,)))(torch.randn(4, 8, 3))


def test_torch_func_functional_call_with_buffers_inside_a_step_names_pu_func():
    """``torch.func.functional_call`` with the buffers passed in, inside a step of the model: the
    batch norm's updates target the tensors passed in, which the step does not own. Refused at the
    update's call site, naming ``pu.func.functional_call`` (which returns them as values); the step
    is discarded, nothing written."""
    net = pu.convert(_net(nn.BatchNorm1d))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    params, buffers = dict(net.named_parameters()), _state(net)[1]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(pu.UpdateError, match=r"pu\.func\.functional_call") as e:
        with pu.step(net, opt):
            functional_call(net, {**params, **buffers}, (torch.randn(8, 3),)).sum().backward()
    assert "'1.num_batches_tracked'" in str(e.value) and "test_func.py" in str(e.value)  # the target, the step
    for k, v in net.state_dict().items():
        assert torch.equal(bits(v), bits(before[k])), k
    # the advice works: the updates come back as values and commit with the step
    with pu.step(net, opt):
        out, new = pu.func.functional_call(net, {**params, **buffers}, (torch.randn(8, 3),))
        pu.func.commit(net, new)
        out.sum().backward()
    assert int(net[1].num_batches_tracked) == 1


def test_torch_func_functional_call_with_parameters_only_inside_a_step():
    """Parameters passed in, the module's own buffers: the statistics are the model's, and commit with
    the step as plain torch updates them."""
    net, ref = pu.convert(_net(nn.BatchNorm1d)), _net(nn.BatchNorm1d)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(8, 3)
    with pu.step(net, opt):
        functional_call(net, {k: v * 1 for k, v in net.named_parameters()}, (x,)).sum().backward()
    functional_call(ref, _state(ref)[0], (x,))
    for k, v in ref.named_buffers():
        assert torch.equal(bits(dict(net.named_buffers())[k]), bits(v)), k


@pytest.mark.parametrize("buffers", ["none", "copies", "own"])
@pytest.mark.parametrize("forward_first", [False, True])
def test_a_look_ahead_after_the_steps_own_forward_returns_its_updates_and_writes_nothing(forward_first, buffers):
    """A look-ahead with fast weights (MAML style) inside a step: ``pu.func.functional_call`` after the step's
    own forward returns its updates, computed from the statistics that forward left pending, and writes
    nothing, as without that forward: the step commits its own forward's statistics only. With the model's
    buffers (``"none"``), copies of them or the buffers themselves (``"own"``, which show the pending values)
    passed in. Against plain ``torch.func.functional_call`` with ``torch.nn.BatchNorm1d``, bitwise (its
    look-ahead statistics written into copies of the buffers passed, or into the model's own, then put back
    to what its own forward left). (Before, after the step's forward it returned no updates and the step
    committed the look-ahead's statistics, or, with the buffers themselves passed, the commit raised that
    they were converted or replaced.)"""
    net, ref = pu.convert(_net(nn.BatchNorm1d)), _net(nn.BatchNorm1d)
    opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref))
    x, y = torch.randn(8, 3), torch.randn(8, 3)

    def look_ahead(model, call, kind):
        loss = model(x).square().mean() if forward_first else 0
        fast = {k: v - 0.1 for k, v in model.named_parameters()}
        own = dict(model.named_buffers())
        passed = {"none": {}, "copies": {k: v.clone() for k, v in own.items()}, "own": own}[kind]
        out, new = call(model, {**fast, **passed}, (y,))
        return loss + out.square().mean(), passed if new is None else new

    with pu.step(net, opt):
        loss, new = look_ahead(net, pu.func.functional_call, buffers)
        loss.backward()
    # (plain torch writes into the buffers passed: given copies where pu.func is given the model's own)
    plain = {"own": "copies"}.get(buffers, buffers)
    rloss, rnew = look_ahead(ref, lambda m, d, a: (functional_call(m, d, a), None), plain)
    if buffers == "none":
        rnew = {k: v.clone() for k, v in ref.named_buffers()}
    rloss.backward()
    ropt.step()
    if buffers == "none":
        with torch.no_grad():
            for v, own in zip(ref.buffers(), _forward_only(x, forward_first).buffers()):
                v.copy_(own)
    assert sorted(new) == sorted(rnew) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    for k in rnew:
        assert torch.equal(bits(new[k]), bits(rnew[k])), k
    assert int(net[1].num_batches_tracked) == int(forward_first)
    for (k, v), (rk, rv) in zip(net.state_dict().items(), ref.state_dict().items()):
        assert k == rk and torch.equal(bits(v), bits(rv)), k


def _forward_only(x, forward_first):
    """A plain ``_net`` after the step's own forward (if any) only: the statistics that step commits."""
    m = _net(nn.BatchNorm1d)
    if forward_first:
        m(x)
    return m
