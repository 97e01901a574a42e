"""Two attached models (a GAN's generator and discriminator): each update goes to its own model's step.

Routing must neither cross over (an update of D committed by G's optimizer
step) nor cost a walk of G's module tree per update of D.
"""

import pytest
import torch
from torch import nn

import paramupdates as pu
from misuse_helpers import line_of
from paramupdates import targets

from conftest import assert_same, snapshot
from models import Counter


def _pair():
    torch.manual_seed(0)
    g, d = Counter(), Counter()
    og = torch.optim.SGD(g.parameters(), lr=0.1)
    od = torch.optim.SGD(d.parameters(), lr=0.1)
    return g, d, og, od, pu.attach(g, og), pu.attach(d, od)


def test_each_update_commits_with_its_own_optimizer_step():
    g, d, og, od, ag, ad = _pair()
    x = torch.randn(4, 3)
    gc, dc = g.count, d.count  # the buffers themselves (module attributes show pending values)
    d(x).sum().backward()
    g(x).sum().backward()
    assert int(gc) == 0 and int(dc) == 0  # nothing written before commit (deferred commit, rule 2)
    assert int(d.count) == 1  # reads see the pending value (read-your-writes, rule 1)
    og.step()  # commits G's step only
    assert int(gc) == 1 and int(dc) == 0
    assert ad.journal is not None and ad.journal.find(dc, create=False) is not None
    od.step()
    assert int(dc) == 1 and int(gc) == 1
    assert any(r.target == "count" for r in ag.schedule()) and any(r.target == "count" for r in ad.schedule())


@pytest.fixture
def count_builds(monkeypatch):
    """``count_builds()``: a list that gets every model whose index is (re)built from then on."""

    def start():
        seen = []
        real = targets.ModelIndex.build

        def counting(self):
            seen.append(self.model)
            return real(self)

        monkeypatch.setattr(targets.ModelIndex, "build", counting)
        return seen

    return start


def test_updates_of_the_second_model_do_not_rebuild_the_first_index(count_builds):
    g, d, og, od, ag, ad = _pair()
    builds = count_builds()
    x = torch.randn(4, 3)
    for _ in range(3):
        d(x).sum().backward()
        od.step()
    assert int(d.count) == 3
    assert not any(m is g for m in builds), f"G's index was rebuilt {sum(m is g for m in builds)} times"


def test_pending_values_of_the_second_model_do_not_rebuild_the_first_index(count_builds):
    """Gradient accumulation with both models in the step: D's later micro-batches update its pending
    values (new tensors, in no index). Asked first, G must see they are D's, not rebuild its index
    (mid-step its buffer slots show pending values, which a rebuild would take for its buffers)."""
    g, d, og, od, ag, ad = _pair()
    builds = count_builds()
    x = torch.randn(4, 3)
    for _ in range(2):
        for _ in range(3):  # micro-batches
            g(x).sum().backward()
            d(x).sum().backward()
        og.step()
        od.step()
    assert int(g.count) == 6 and int(d.count) == 6
    assert not any(m is g for m in builds), f"G's index was rebuilt {sum(m is g for m in builds)} times"
    assert not any(m is d for m in builds), f"D's index was rebuilt {sum(m is d for m in builds)} times"


def test_tensor_of_no_model_still_applies_eagerly():
    g, d, og, od, ag, ad = _pair()
    holder = nn.Module()
    holder.register_buffer("b", torch.zeros(2))
    pu.assign(holder.b, torch.ones(2))  # owned by no attached model: eager (eager outside a step, rule 8)
    assert torch.equal(holder.b, torch.ones(2))
    assert ag.journal is None and ad.journal is None


def _task_models():
    """One encoder (with a batch norm) shared by two task models, one optimizer each."""
    torch.manual_seed(0)
    enc = pu.convert(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    a, b = nn.Sequential(enc, nn.Linear(4, 1)), nn.Sequential(enc, nn.Linear(4, 1))
    return enc, a, b, torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)


def test_attaching_a_model_that_shares_a_module_with_an_attached_one_is_refused():
    """Two task models over one encoder: under two attachments an update of the shared batch norm would
    belong to the first attachment only, and the second model's steps would not commit it (before: silently
    so). Refused at pu.attach, naming the shared tensors, both call sites and what to do."""
    enc, a, b, oa, ob = _task_models()
    pu.attach(a, oa)  # MARK: first
    with pytest.raises(pu.UpdateError) as ei:
        pu.attach(b, ob)
    msg = str(ei.value)
    assert "share '0.0.weight', '0.0.bias', '0.1.weight', '0.1.bias' and 3 more" in msg
    assert f"tests/test_attach_two_models.py:{line_of('MARK: first')}" in msg
    assert "pu.step(model, optimizer)" in msg and "disjoint modules" in msg


def test_a_module_shared_after_attaching_refuses_the_next_commit_with_nothing_written():
    enc, a, _, oa, _ = _task_models()
    b = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    pu.attach(a, oa)
    pu.attach(b, ob)
    b[0] = enc  # shared from now on
    ob.add_param_group({"params": list(enc.parameters())})
    ob.zero_grad()
    b(torch.randn(8, 4)).sum().backward()
    before = snapshot(a, b, ob)
    with pytest.raises(pu.UpdateError, match=r"share '0.0.weight'.*\(a module in both models\)"):
        ob.step()
    assert_same(before, snapshot(a, b, ob))


def test_two_task_models_sharing_an_encoder_step_with_pu_step_like_plain_pytorch():
    """The way the refusal names: explicit steps, whose updates belong to the step's model. The shared
    batch norm's statistics are committed by the step whose forward issued them, as plain PyTorch
    updates them in place during that forward."""
    enc, a, b, oa, ob = _task_models()
    ref_enc = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ref_enc.load_state_dict(enc.state_dict())
    ra, rb = nn.Sequential(ref_enc, nn.Linear(4, 1)), nn.Sequential(ref_enc, nn.Linear(4, 1))
    ra[1].load_state_dict(a[1].state_dict())
    rb[1].load_state_dict(b[1].state_dict())
    roa, rob = torch.optim.SGD(ra.parameters(), lr=0.1), torch.optim.SGD(rb.parameters(), lr=0.1)
    for x in torch.randn(3, 8, 4):
        for model, opt, ref, ref_opt in ((a, oa, ra, roa), (b, ob, rb, rob)):
            opt.zero_grad()
            ref_opt.zero_grad()
            with pu.step(model, opt):
                model(x).sum().backward()
            ref(x).sum().backward()
            ref_opt.step()
    assert_same(snapshot(ra, rb), snapshot(a, b))
