"""The one-pass re-check of declared rules (rules/base.py, RuleSet): taken when nothing changed,
and never when something did: every change below must reach the full checks."""

import copy

import pytest
import torch
from torch import nn

import paramupdates as pu
from paramupdates.owner import commit_caches
from paramupdates.rules import constraints, ema, weight_decay

from conftest import assert_same, snapshot


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _declare(m):
    pu.weight_decay(m, 0.1)
    pu.constrain([m[0].weight, m[2].weight], pu.max_norm(0.4))
    return pu.ema(m, 0.8)


@pytest.fixture
def full_checks(monkeypatch):
    """How many times each rule ran its full check."""
    counts = {"weight_decay": 0, "constrain": 0, "ema": 0}
    for name, cls in (
        ("weight_decay", weight_decay.WeightDecay),
        ("constrain", constraints.Constrain),
        ("ema", ema.EMA),
    ):
        real = cls.check

        def check(self, ctx, real=real, name=name):
            counts[name] += 1
            return real(self, ctx)

        monkeypatch.setattr(cls, "check", check)
    return counts


def _step(m, opt, stepper, seed):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    with stepper:
        m(x).pow(2).sum().backward()
    opt.zero_grad()


def _reference(steps, change=None):
    """The same training with the cache emptied before every commit: every commit runs the full checks."""
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5)
    averaged = _declare(m)
    for i in range(steps):
        if change is not None and i == 2:
            change(m, opt)
        stepper = pu.Stepper(m, opt)
        commit_caches(stepper.index, opt).ruleset.clear()
        _step(m, opt, stepper, i)
    return m, opt, averaged


def test_steady_state_takes_the_one_pass_path_and_equals_the_full_checks(full_checks):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5)
    averaged = _declare(m)
    stepper = pu.Stepper(m, opt)
    for i in range(5):
        _step(m, opt, stepper, i)
    assert full_checks == {"weight_decay": 1, "constrain": 1, "ema": 1}
    ref, ref_opt, ref_avg = _reference(5)
    assert_same(snapshot(ref, ref_avg), snapshot(m, averaged))


def test_a_fresh_pu_step_per_iteration_shares_the_cache(full_checks):
    """The usual loop opens pu.step(model, opt) per iteration: the cache (and, with
    copy_for_rollback, the kept rollback copies) belong to the model and optimizer, not to the
    step object."""
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5)
    averaged = _declare(m)
    copies = []
    for i in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        with pu.step(m, opt, copy_for_rollback=True) as s:
            m(x).pow(2).sum().backward()
        opt.zero_grad()
        copies.append(
            [id(c) for plan in commit_caches(s.index, opt).pool._plans.values() for _, kept in plan for c in kept]
        )
    assert full_checks == {"weight_decay": 1, "constrain": 1, "ema": 1}
    assert copies[1] == copies[2] == copies[3] and copies[1]  # the same kept buffers every step
    ref, ref_opt, ref_avg = _reference(4)
    assert_same(snapshot(ref, ref_avg), snapshot(m, averaged))


def _lr(m, opt):
    opt.param_groups[0]["lr"] = 0.02


def _no_grad_for_first_layer(m, opt):
    m[0].requires_grad_(False)


def _no_grad_for_an_uncovered_bias(m, opt):
    m[0].bias.requires_grad_(False)  # (weight decay skips 1-D tensors: SGD's decay is pu's separate pass)


def _new_storage(m, opt):
    m[2].weight.data = m[2].weight.data.clone()


def _cast(m, opt):
    m.double()
    for st in opt.state.values():
        st.update({k: v.double() for k, v in st.items() if torch.is_tensor(v)})


@pytest.mark.parametrize(
    ("change", "replans"),
    [(_no_grad_for_first_layer, True), (_new_storage, True), (_lr, False), (_no_grad_for_an_uncovered_bias, False)],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_a_change_between_commits_reaches_the_full_checks(full_checks, change, replans):
    """A change the plans depend on runs the full checks at the next commit. A new learning rate (a
    schedule changes it every step) does not: weight decay makes its factors from the learning rate
    at each commit. Nor does a gradient that appears or goes on a parameter weight decay does not
    cover, where the decay is a separate pass (SGD): only the covered parameters' gradients decide it.
    Either way the result is that of the full checks at every commit."""
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5)
    averaged = _declare(m)
    stepper = pu.Stepper(m, opt)
    for i in range(5):
        if i == 2:
            change(m, opt)
        _step(m, opt, stepper, i)
    if replans:
        assert full_checks["weight_decay"] >= 2  # the first commit and the one after the change
    else:
        assert full_checks == {"weight_decay": 1, "constrain": 1, "ema": 1}
    ref, ref_opt, ref_avg = _reference(5, change)
    assert_same(snapshot(ref, ref_avg), snapshot(m, averaged))


def test_cast_model_rebuilds_the_plans_and_a_moved_copy_is_still_refused(full_checks):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5)
    averaged = _declare(m)
    stepper = pu.Stepper(m, opt)
    _step(m, opt, stepper, 0)
    _step(m, opt, stepper, 1)
    _cast(m, opt)  # the model: its EMA copy follows it
    _step_double(m, opt, stepper, 2)
    assert m[0].weight.dtype == averaged[0].weight.dtype == torch.float64
    averaged.float()  # the copy alone: its pairs no longer match
    before = snapshot(m, opt, averaged)
    with pytest.raises(pu.UpdateError, match="Move or cast the copy"):
        _step_double(m, opt, stepper, 3)
    assert_same(before, snapshot(m, opt, averaged))


def _step_double(m, opt, stepper, seed):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    with stepper:
        m(x).pow(2).sum().backward()
    opt.zero_grad()


def test_a_rule_declared_or_removed_between_commits_is_seen(full_checks):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    stepper = pu.Stepper(m, opt)
    wd = pu.weight_decay(m, 0.1)
    _step(m, opt, stepper, 0)
    _step(m, opt, stepper, 1)
    rule = pu.constrain(m[0].weight, pu.max_norm(0.1))
    _step(m, opt, stepper, 2)
    assert torch.linalg.vector_norm(m[0].weight, dim=1).max() <= 0.1 + 1e-6
    rule.remove()
    wd.remove()
    w = m[0].weight.detach().clone()
    with stepper:
        pass  # no gradient: SGD leaves the weight alone, and no rule is left to touch it
    assert torch.equal(m[0].weight, w)
    assert full_checks["constrain"] == 1


def test_replaced_module_is_followed(full_checks):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    pu.weight_decay(m, 0.5, scale_by_lr=False)
    stepper = pu.Stepper(m, opt)
    _step(m, opt, stepper, 0)
    old = m[2]
    m[2] = copy.deepcopy(old)  # a new module (not in the optimizer, not covered by the rule)
    w = m[2].weight.detach().clone()
    _step(m, opt, stepper, 1)
    assert torch.equal(m[2].weight, w)  # nothing decays a tensor the rule was not declared on
    # the rule's tensors (the old module's) lost their gradients: the full check, which drops them
    assert full_checks["weight_decay"] == 2
