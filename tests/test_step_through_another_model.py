"""A step through a model it does not hold (issue 37, case m): a GAN's generator step runs the discriminator.

``with pu.step(gen, opt_g): loss(dis(gen(z))).backward()`` with ``dis`` converted and in train mode:
the discriminator's batch norm issues updates of its running statistics, which the generator's step
does not hold, so they would have no commit. The semantics chosen: refuse, naming the statistics by
their qualified names in their own model, the user's line that called the module, and three fixes,
each tested here to work: a step over a module holding both (bitwise plain PyTorch's in-place
statistics), an attachment of the discriminator (held for its own next optimizer step: the whole
GAN loop bitwise plain PyTorch's), or eval mode for that pass.
"""

import inspect

import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import assert_same, snapshot


class Generator(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))


class Discriminator(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 1))


def _models(convert: bool):
    """The generator and discriminator (the same weights every call), their optimizers, and data."""
    torch.manual_seed(0)
    gen, dis = Generator(), Discriminator()
    if convert:
        gen, dis = pu.convert(gen), pu.convert(dis)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1, momentum=0.9)
    opt_d = torch.optim.SGD(dis.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 2, generator=g), torch.randn(6, 4, generator=g)) for _ in range(3)]
    return gen, dis, opt_g, opt_d, batches


def _line_before() -> str:
    f = inspect.currentframe().f_back
    return f"test_step_through_another_model.py:{f.f_lineno - 1}"


def test_a_generator_step_through_an_unseen_discriminator_names_its_statistics_and_the_users_line():
    gen, dis, opt_g, _opt_d, batches = _models(convert=True)
    z, _real = batches[0]
    before = snapshot(gen), snapshot(dis)
    with pytest.raises(pu.UpdateError) as ei, pu.step(gen, opt_g):
        dis(gen(z)).mean().backward()
    site = _line_before()
    msg = str(ei.value)
    # the statistics by their qualified names in their own model (pu.convert indexed it), in the user's terms
    assert "'1.running_mean', '1.running_var' of Discriminator (BatchNorm1d running statistics)" in msg, msg
    assert "'1.num_batches_tracked'" in msg
    assert "by the call of the module at " in msg and f"{site}:" in msg  # the user's line, not paramupdates'
    assert "paramupdates/" not in msg and "<unnamed" not in msg and "Register it on" not in msg
    # the fixes that work (each tested below)
    assert "pu.step(nn.ModuleList([model, other]), optimizer)" in msg
    assert "pu.attach(other, other_optimizer)" in msg and "eval mode" in msg
    assert_same(before[0], snapshot(gen))  # nothing written (the step was discarded)
    assert_same(before[1], snapshot(dis))


def test_a_module_no_model_paramupdates_saw_is_named_by_its_class_and_attributes():
    """A pu.nn batch norm built directly (no pu.convert, no step or attachment of its model)."""
    gen = nn.Linear(2, 4)
    norm = pu.nn.BatchNorm1d(4)
    with pytest.raises(pu.UpdateError) as ei, pu.step(gen, torch.optim.SGD(gen.parameters(), lr=0.1)):
        norm(gen(torch.randn(5, 2))).sum().backward()
    site = _line_before()
    msg = str(ei.value)
    assert "'running_mean', 'running_var' of a BatchNorm1d that belongs to no model paramupdates has seen" in msg
    assert "(BatchNorm1d running statistics)" in msg and f"{site}:" in msg and "paramupdates/" not in msg
    assert int(norm.num_batches_tracked) == 0


def _plain_generator_steps(gen, dis, opt_g, batches):
    """Plain PyTorch: the discriminator's batch norm updates its statistics in place in the generator's pass."""
    for z, _real in batches:
        opt_g.zero_grad()
        dis(gen(z)).mean().backward()
        opt_g.step()


def test_a_step_over_a_module_holding_both_commits_the_statistics_as_plain_pytorch():
    ref = _models(convert=False)
    _plain_generator_steps(*ref[:3], ref[4])
    gen, dis, opt_g, _opt_d, batches = _models(convert=True)
    both = nn.ModuleList([gen, dis])
    for z, _real in batches:
        opt_g.zero_grad()
        with pu.step(both, opt_g):
            dis(gen(z)).mean().backward()
    assert_same(snapshot(ref[0]), snapshot(gen))  # bitwise: weights and statistics
    assert_same(snapshot(ref[1]), snapshot(dis))
    assert int(dis[1].num_batches_tracked) == len(batches)


def _plain_gan(gen, dis, opt_g, opt_d, batches, step_g=None):
    """The GAN loop: the generator's step through the discriminator, then the discriminator's step
    (``step_g``: how the generator's step is opened, ``None``: plain PyTorch)."""
    for z, real in batches:
        opt_g.zero_grad()
        if step_g is None:
            fake = gen(z)
            dis(fake).mean().backward()
            opt_g.step()
        else:
            with step_g():
                fake = gen(z)
                dis(fake).mean().backward()
        opt_d.zero_grad()
        (dis(real).mean() - dis(fake.detach()).mean()).backward()
        opt_d.step()


def test_an_attached_discriminator_holds_its_statistics_for_its_own_optimizer_step():
    ref = _models(convert=False)
    _plain_gan(*ref)
    gen, dis, opt_g, opt_d, batches = _models(convert=True)
    att = pu.attach(dis, opt_d)
    stored = dis[1].running_mean  # the buffer itself (its module attribute shows pending values)
    kept = stored.clone()
    z, _real = batches[0]
    with pu.step(gen, opt_g):
        dis(gen(z)).mean().backward()
    # held for the discriminator's own next optimizer step, not committed by the generator's
    assert torch.equal(stored, kept) and att.journal is not None
    assert "1.running_mean" in att.journal.pending_names()
    att.discard()
    gen, dis, opt_g, opt_d, batches = _models(convert=True)
    pu.attach(dis, opt_d)
    _plain_gan(gen, dis, opt_g, opt_d, batches, step_g=lambda: pu.step(gen, opt_g))
    assert_same(snapshot(ref[0]), snapshot(gen))  # the whole loop bitwise plain PyTorch's
    assert_same(snapshot(ref[1]), snapshot(dis))
    assert int(dis[1].num_batches_tracked) == 3 * len(batches)


def test_the_discriminator_in_eval_mode_for_the_generators_pass_updates_nothing():
    gen, dis, opt_g, _opt_d, batches = _models(convert=True)
    before = snapshot(dis)
    z, _real = batches[0]
    dis.eval()
    with pu.step(gen, opt_g):
        dis(gen(z)).mean().backward()
    dis.train()
    assert_same(before, snapshot(dis))
    assert int(gen[1].num_batches_tracked) == 1  # the generator's own step committed
