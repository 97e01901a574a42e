"""pu.attach: an unchanged loss.backward(); opt.step() loop gets the step semantics."""

import copy

import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import assert_same, bits, snapshot
from models import Counter

OPTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _data(n=4):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(5, 3, generator=g) for _ in range(n)]


@pytest.mark.parametrize("kind", sorted(OPTS))
def test_attach_equals_step(kind):
    torch.manual_seed(0)
    a = Counter()
    b = copy.deepcopy(a)
    oa, ob = OPTS[kind](a.parameters()), OPTS[kind](b.parameters())
    att = pu.attach(a, oa)
    for x in _data():
        a(x).pow(2).sum().backward()  # unchanged loop
        oa.step()
        oa.zero_grad()
        with pu.step(b, ob):
            b(x).pow(2).sum().backward()
        ob.zero_grad()
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(bits(va), bits(vb)), ka
    assert att.steps == 4 and len(att.schedule()) == 4  # grad + 3 auxiliary rows
    assert int(a.count) == 4


def test_attach_equals_hand_written_reference_sgd():
    torch.manual_seed(0)
    a = Counter()
    ref = copy.deepcopy(a)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    orf = torch.optim.SGD(ref.lin.parameters(), lr=0.1)
    pu.attach(a, oa)
    count, acc, scale = 0, torch.zeros(2), torch.ones(2)
    for x in _data():
        a(x).sum().backward()
        oa.step()
        oa.zero_grad()
        y = ref.lin(x)
        count += 1
        acc = acc + y.detach().mean(0)
        scale = scale * 0.5 + y.detach().abs().mean(0) * 0.5
        (y * scale).sum().backward()  # forward reads the scale it just updated (read-your-writes, rule 1)
        orf.step()
        orf.zero_grad()
    assert torch.equal(a.lin.weight, ref.lin.weight) and torch.equal(a.lin.bias, ref.lin.bias)
    assert int(a.count) == count and torch.equal(a.acc, acc) and torch.equal(a.scale.data, scale)


def test_attach_lbfgs_with_closure():
    torch.manual_seed(0)
    a = Counter()
    b = copy.deepcopy(a)
    oa = torch.optim.LBFGS(a.lin.parameters(), lr=0.5, max_iter=3)
    ob = torch.optim.LBFGS(b.lin.parameters(), lr=0.5, max_iter=3)
    att = pu.attach(a, oa)
    x = _data(1)[0]

    def closure_a():
        oa.zero_grad()
        loss = a(x).pow(2).sum()
        loss.backward()
        return loss

    # Reference: the same closure with the updates applied eagerly (no step open).
    def closure_b():
        ob.zero_grad()
        loss = b(x).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(2):
        a(x)  # a forward outside the closure issues updates too
        oa.step(closure_a)
    for _ in range(2):
        b(x)
        ob.step(closure_b)
    # LBFGS evaluates the closure several times per step; each evaluation's updates commit
    assert att.steps == 2
    assert int(a.count) == int(b.count) > 2
    assert torch.equal(a.lin.weight, b.lin.weight)


def test_attach_flush_and_discard():
    m = Counter()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    att = pu.attach(m, opt)
    m(torch.randn(2, 3))
    assert int(m.count) == 1  # pending, visible through the module
    assert att.pending_schedule().phases() == ["grad", "auxiliary", "auxiliary", "auxiliary"]
    att.discard()
    assert int(m.count) == 0
    m(torch.randn(2, 3))
    att.flush()  # commit without a gradient update
    assert int(m.count) == 1 and att.steps == 1
    assert "grad" not in att.schedule().phases()


def test_attach_skip_nonfinite_hides_gradients():
    m = Counter()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    att = pu.attach(m, opt, on_nonfinite="skip")
    w = m.lin.weight.detach().clone()
    m(torch.randn(2, 3)).sum().backward()
    pu.assign(m.acc, torch.tensor([float("nan"), 1.0]))
    opt.step()
    assert att.skipped_steps == 1 and torch.equal(m.lin.weight, w) and int(m.count) == 0
    assert m.lin.weight.grad is not None  # gradients restored for the user


def test_pu_step_on_an_attached_optimizer_commits_once():
    """A pu.step commit runs optimizer.step(); the attachment on that optimizer stands aside,
    so the declared rules apply once (they applied twice: weight decay 0.95**2)."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2, bias=False)
    ref = copy.deepcopy(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for net in (m, ref):
        pu.weight_decay(net, 0.5)
    att = pu.attach(m, opt)
    x = torch.randn(4, 3)
    for net, o in ((m, opt), (ref, ref_opt)):
        with pu.step(net, o):
            net(x).pow(2).sum().backward()
        o.zero_grad()
    assert_same(snapshot(ref), snapshot(m))
    assert att.steps == 0
    m(x).pow(2).sum().backward()  # the attachment still commits a plain optimizer.step()
    opt.step()
    assert att.steps == 1


def test_attachment_stands_aside_only_while_the_explicit_commit_runs():
    """An explicit commit whose optimizer raises leaves no stand-aside behind: the next plain
    optimizer.step() is the attachment's again."""

    class Boom(torch.optim.SGD):
        fail = True

        def step(self, closure=None):
            if self.fail:
                raise RuntimeError("optimizer failed")
            return super().step(closure)

    m = nn.Linear(3, 2)
    opt = Boom(m.parameters(), lr=0.1)
    att = pu.attach(m, opt)
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="optimizer failed"):
        with pu.step(m, opt):
            m(x).sum().backward()
    opt.zero_grad()
    opt.fail = False
    m(x).sum().backward()
    opt.step()
    assert att.steps == 1


def test_a_model_collected_at_interpreter_shutdown_is_forgotten_quietly(monkeypatch):
    """At shutdown Python clears module globals before the last objects die: the weakref callback
    that drops a collected model's attachment then finds ``context`` gone ("Exception ignored in
    _Owner._forget: 'NoneType' object has no attribute 'attachments'"). It returns quietly."""
    import importlib

    owner_module = importlib.import_module("paramupdates.owner")
    monkeypatch.setattr(owner_module, "routing", None)
    owner_module.Owner._forget(None)  # must not raise
