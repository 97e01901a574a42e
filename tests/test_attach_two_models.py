"""Two attached models (a GAN's generator and discriminator): each update goes to its own model's step.

Routing must neither cross over (an update of D committed by G's optimizer
step) nor cost a walk of G's module tree per update of D.
"""

import pytest
import torch
from torch import nn

import paramupdates as pu
from paramupdates import targets

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
