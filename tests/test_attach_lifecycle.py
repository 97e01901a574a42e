"""The life of an attachment's step: it opens at the first update after an ``optimizer.step()`` and
ends inside the next one, whichever way that call ends.

``optimizer.step()`` may end with its own exception, with an exception of a step pre-hook (the
optimizer's own, registered before ``pu.attach``, or a global one), or with ``KeyboardInterrupt``.
Each ends the step as documented (README, "pu.attach without an optimizer step"): its pending
updates are dropped before the exception reaches the caller, so the next successful step commits
its own updates only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import paramupdates as pu
from misuse_helpers import BNNet
from misuse_helpers import line_of as _line_of

from conftest import assert_same, snapshot


class Boom(Exception):
    pass


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), pu.nn.BatchNorm1d(3))


def _raise_once(exc):
    raised = []

    def hook(*_args):
        if not raised:
            raised.append(True)
            raise exc

    return hook


def _register(where, opt, hook):
    if where == "optimizer hook before attach":
        return opt.register_step_pre_hook(hook)
    if where == "global hook":
        return register_optimizer_step_pre_hook(hook)
    raise AssertionError(where)


@pytest.mark.parametrize("exc", [Boom("hook"), KeyboardInterrupt()], ids=["exception", "KeyboardInterrupt"])
@pytest.mark.parametrize("where", ["optimizer hook before attach", "global hook"])
def test_a_step_pre_hook_that_raises_ends_the_step(where, exc):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = _register(where, opt, _raise_once(exc))
    try:
        att = pu.attach(model, opt)
        model(torch.randn(4, 3)).sum().backward()
        with pytest.raises(type(exc)):
            opt.step()
        assert att.pending_schedule().targets() == []  # the failed step is over: nothing pending
        assert int(model[1].num_batches_tracked) == 0
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        assert int(model[1].num_batches_tracked) == 1  # this step's forward only
        assert att.steps == 1
    finally:
        handle.remove()


def test_the_optimizers_own_exception_ends_the_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    att = pu.attach(model, opt)
    model(torch.randn(4, 3)).sum().backward()
    opt.param_groups[0]["lr"] = "0.1"  # SGD raises on a learning rate that is not a number
    with pytest.raises(TypeError):
        opt.step()
    opt.param_groups[0]["lr"] = 0.1
    assert att.pending_schedule().targets() == []
    opt.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert int(model[1].num_batches_tracked) == 1


def test_forgotten_attachments_are_collected_with_their_models():
    import gc
    import weakref

    from paramupdates import routing

    refs = []
    for trial in range(200):
        m = BNNet()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        pu.attach(m, opt, copy_for_rollback=trial % 2 == 0)  # never detached (a notebook, a loop over trials)
        m(torch.randn(8, 4)).square().sum().backward()
        opt.step()
        m(torch.randn(8, 4))  # and one with updates left pending
        refs.append(weakref.ref(m))
        del m, opt
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0 and not routing.attachments()


def test_a_forgotten_attachment_does_not_block_another_model():
    old = BNNet()
    old_opt = torch.optim.SGD(old.parameters(), lr=0.1)
    pu.attach(old, old_opt)
    old(torch.randn(8, 4))  # pending updates, never committed: the attachment is forgotten
    new = BNNet()
    pu.weight_decay(new, 0.1)  # another model: declared
    pu.constrain(new.lin.weight, pu.max_norm(1.0))
    pu.ema(new, 0.9)
    with pytest.raises(pu.UpdateError) as ei:
        pu.ema(old, 0.9)  # MARK: the same model
    msg = str(ei.value)
    assert f"pu.ema at tests/test_attach_lifecycle.py:{_line_of('MARK: the same model')}" in msg
    assert "pu.attach(BNNet) at tests/test_attach_lifecycle.py:" in msg and "'calls'" in msg
    assert "discard()" in msg and "flush()" in msg


def test_attaching_to_another_optimizer_names_the_first_attachment_and_the_way_out():
    """A model attached to an optimizer that is still alive: attaching it to another is refused, naming
    the first attachment and how to get it back (the handle may be lost: a re-run cell)."""
    m = BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pu.attach(m, opt)  # MARK: first
    other = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(
        pu.UpdateError,
        match=rf"already attached to another SGD \(pu.attach\(BNNet\) at tests/test_attach_lifecycle.py:"
        rf"{_line_of('MARK: first')}\).*pu.Attachment.of\(model\).detach\(\)",
    ):
        pu.attach(m, other)
    pu.Attachment.of(m).detach()  # what the message says
    assert pu.Attachment.of(m) is None
    att = pu.attach(m, other)
    assert pu.Attachment.of(m) is att and att.optimizer is other


@pytest.mark.parametrize("first", ["outer", "inner"])
def test_attaching_a_module_inside_an_attached_one_is_refused(first):
    """Nested attachments would give a tensor of the inner module two commits (ambiguity is an
    error, rule 5's spirit): refused at attach, naming the module and the other attachment."""
    m = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), pu.nn.BatchNorm1d(4)))
    o1, o2 = torch.optim.SGD(m[0].parameters(), lr=0.1), torch.optim.SGD(m[1].parameters(), lr=0.1)
    a, b = (m, m[1]) if first == "outer" else (m[1], m)
    pu.attach(a, o1)  # MARK: nested first
    with pytest.raises(pu.UpdateError) as ei:
        pu.attach(b, o2)
    msg = str(ei.value)
    assert "the Sequential at '1' of the Sequential would be attached twice" in msg
    assert f"pu.attach(Sequential) at tests/test_attach_lifecycle.py:{_line_of('MARK: nested first')}" in msg
    assert "pu.attach(model.encoder, opt_enc)" in msg
    assert len(o2._optimizer_step_pre_hooks) == 0  # nothing of the refused attachment stays


def test_two_optimizers_over_disjoint_submodules_equal_plain_pytorch():
    """What the refusal suggests: one attachment per optimizer, on the submodule it steps. With
    pu.weight_decay over the whole model and Adam, bitwise two AdamW and torch.nn.BatchNorm1d."""

    def make(bn):
        torch.manual_seed(0)
        return nn.ModuleDict(
            {"enc": nn.Sequential(nn.Linear(3, 4), bn(4)), "dec": nn.Sequential(nn.Linear(4, 2), bn(2))}
        )

    ref, m = make(nn.BatchNorm1d), make(pu.nn.BatchNorm1d)
    ref_opts = [
        torch.optim.AdamW(ref[k].parameters(), lr=lr, weight_decay=0.1) for k, lr in (("enc", 0.1), ("dec", 0.01))
    ]
    opts = [torch.optim.Adam(m[k].parameters(), lr=lr) for k, lr in (("enc", 0.1), ("dec", 0.01))]
    atts = [pu.attach(m["enc"], opts[0]), pu.attach(m["dec"], opts[1])]
    pu.weight_decay(m, 0.1, exclude=None)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        xs = [torch.randn(8, 3, generator=g) for _ in range(2)]  # two micro-batches
        for net, os in ((ref, ref_opts), (m, opts)):
            for o in os:
                o.zero_grad()
            for x in xs:
                net["dec"](net["enc"](x)).square().mean().backward()
            for o in os:
                o.step()
    for a in atts:
        a.detach()
    assert_same(snapshot(ref), snapshot(m))


@pytest.mark.parametrize("opener", ["pu.step", "recompute"])
def test_a_step_over_an_attached_model_with_pending_updates_is_refused(opener):
    """pu.step (or pu.recompute_batchnorm_stats, a step of its own) on a model whose attachment has
    updates pending since its last optimizer.step(): its reads would see them, its writes go into
    them (not into the buffers), and they would commit later on their own. Refused before anything
    is recorded, naming the attachment and what is pending; after flush() it runs, bitwise
    torch.optim.swa_utils.update_bn."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), pu.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    att = pu.attach(m, opt)  # MARK: pending attach
    x = torch.randn(8, 3)
    m(x).sum().backward()  # pending: the batch norm's statistics
    stored = [t.clone() for t in m.state_dict().values()]
    loader = [torch.randn(8, 3) for _ in range(3)]
    with pytest.raises(pu.UpdateError) as ei:
        if opener == "pu.step":
            with pu.step(m, opt):
                m(x).sum().backward()
        else:
            pu.recompute_batchnorm_stats(m, loader)
    msg = str(ei.value)
    assert f"pu.attach(Sequential) at tests/test_attach_lifecycle.py:{_line_of('MARK: pending attach')}" in msg
    assert "1.running_mean" in msg and "flush()" in msg and "discard()" in msg
    assert all(torch.equal(a, b) for a, b in zip(stored, m.state_dict().values()))  # nothing written
    assert att.journal is not None and att.journal.pending_names()  # the attachment's updates still pending
    att.flush()
    if opener == "recompute":
        pu.recompute_batchnorm_stats(m, loader)
        plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        plain.load_state_dict(m.state_dict())
        torch.optim.swa_utils.update_bn(loader, plain)
        assert_same(snapshot(plain), snapshot(m))


def test_an_attachment_whose_model_was_collected_lets_the_optimizer_step_alone():
    """The optimizer outlives the model (its parameters held elsewhere): the attachment's hooks stand
    aside and the step is plain SGD. They learn that the model is gone from a flag set when it is
    collected (``refs.WatchedRef.gone``), not by reading the model: a compiled ``optimizer.step``
    would wrap a module it reads (see tests/test_compile.py)."""
    import gc
    import weakref

    m = BNNet()
    params = list(m.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    att = pu.attach(m, opt)
    pu.weight_decay(m, 0.5)
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None and att.model is None and att._model_ref.gone
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    opt.step()
    for p, b in zip(params, before):
        # SGD's own formula (p.add_(grad, alpha=-lr)): no decay, no commit
        assert torch.equal(p.detach(), b.add(torch.ones_like(b), alpha=-0.1))


def test_a_watched_reference_is_a_weak_reference_with_a_flag():
    import gc

    from paramupdates.refs import WatchedRef

    class Obj:
        pass

    seen = []
    obj = Obj()
    ref = WatchedRef(obj, seen.append)
    assert ref() is obj and not ref.gone and not seen
    del obj
    gc.collect()
    assert ref() is None and ref.gone and len(seen) == 1  # the callback got the weak reference
