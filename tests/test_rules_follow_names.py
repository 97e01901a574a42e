"""Rule 12 ("accounted for"), the cases of declared rules: a rule covers what the model holds under its
names at each step, whatever still holds the tensors it covered before; a name it can no longer find
raises; rules on tensors no model holds apply where an optimizer steps them; rules of models dropped
unstepped go with them.

The hand-written side applies the same formulas as the rules' reference paths (``foreach=False``):
``p.mul_(1 - lr * rate)`` before ``optimizer.step()``, ``w.copy_(c(w))`` with the same constraint
object after it, ``a.lerp_(p, 1 - decay)`` last.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import paramupdates as pu
from paramupdates import state

from conftest import assert_same, bits, snapshot

LR, RATE, BOUND, DECAY = 0.1, 0.5, 0.3, 0.5


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))


def _fresh_head() -> nn.Linear:
    g = torch.Generator().manual_seed(7)
    lin = nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(2, 3, generator=g))
        lin.bias.copy_(torch.randn(2, generator=g))
    return lin


class ByHand:
    """The plain-torch side: weight decay on the 2-dim weights, max-norm on every parameter, an EMA of
    every parameter, all by name on what ``model`` holds at each step."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)
        self.avg = copy.deepcopy(model).requires_grad_(False)
        self.c = pu.max_norm(BOUND)

    def step(self, x: torch.Tensor) -> None:
        self.opt.zero_grad()
        self.model(x).square().sum().backward()
        stepped = {id(p) for g in self.opt.param_groups for p in g["params"]}
        with torch.no_grad():
            for p in self.model.parameters():
                if p.ndim > 1 and id(p) in stepped and p.grad is not None:
                    p.mul_(1 - LR * RATE)
            self.opt.step()
            for p in self.model.parameters():
                p.copy_(self.c(p))
            avg = dict(self.avg.named_parameters())
            for name, p in self.model.named_parameters():
                avg[name].lerp_(p, 1 - DECAY)


def _declare(model: nn.Module, on_layer: bool = False) -> tuple[nn.Module, pu.max_norm]:
    c = pu.max_norm(BOUND)
    pu.weight_decay(model, RATE, foreach=False)
    if on_layer:
        pu.constrain(model[0], c, foreach=False)
        pu.constrain(model[2], c, foreach=False)
    else:
        pu.constrain(model, c, foreach=False)
    return pu.ema(model, DECAY, foreach=False), c


def _pu_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, driver: str) -> None:
    opt.zero_grad()
    if driver == "attach":
        model(x).square().sum().backward()
        opt.step()
    else:
        with pu.step(model, opt):
            model(x).square().sum().backward()


@pytest.mark.parametrize("driver", ["attach", "step"])
@pytest.mark.parametrize("on_layer", [False, True], ids=["on-model", "on-layer"])
@pytest.mark.parametrize("keep_old", [True, False], ids=["old-held", "old-dropped"])
def test_rules_and_the_ema_follow_a_replaced_layer_by_name(driver, on_layer, keep_old):
    """``model[2] = nn.Linear(...)`` between steps: weight decay, the constraint (declared on the model or
    on the layer itself) and the EMA cover the new layer, whether or not the user, the old optimizer's
    param group and the EMA rule still hold the old one. The old layer is left as it was."""
    ref, m = _model(), _model()
    by_hand = ByHand(ref)
    avg, _ = _declare(m, on_layer)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    if driver == "attach":
        pu.attach(m, opt)
    xs = torch.randn(3, 4, 3)
    by_hand.step(xs[0])
    _pu_step(m, opt, xs[0], driver)
    kept = [m[2]] if keep_old else []
    old_w = m[2].weight.detach().clone()
    m[2] = _fresh_head()
    ref[2] = _fresh_head()
    opt.add_param_group({"params": list(m[2].parameters())})  # (the old head stays in the first group)
    by_hand.opt.add_param_group({"params": list(ref[2].parameters())})
    for x in xs[1:]:
        by_hand.step(x)
        _pu_step(m, opt, x, driver)
        assert_same(snapshot(ref, by_hand.avg), snapshot(m, avg))
    assert (m[2].weight.norm(dim=1) <= BOUND * (1 + 1e-6)).all()
    if keep_old:
        assert torch.equal(bits(kept[0].weight), bits(old_w))  # (no grad: SGD skips it; no rule touches it)


def test_a_wrapper_that_renames_a_covered_name_makes_the_next_commit_raise_naming_it():
    """A LoRA-style wrap (``model[2] = Wrapped(model[2])``): ``2.weight`` is now ``2.inner.weight``. The next
    commit raises, naming each rule, where it was declared and the name it lost; nothing is written."""

    class Wrapped(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.a = inner, nn.Parameter(torch.zeros(2, 3))

        def forward(self, x):
            return self.inner(x) + x @ self.a.t()

    m = _model()
    pu.weight_decay(m, RATE)  # MARK: decay
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    pu.attach(m, opt)
    _pu_step(m, opt, torch.randn(4, 3), "attach")
    m[2] = Wrapped(m[2])
    opt.add_param_group({"params": [m[2].a]})
    before = snapshot(m, opt)
    opt.zero_grad()
    m(torch.randn(4, 3)).square().sum().backward()
    with pytest.raises(pu.UpdateError) as ei:
        opt.step()
    msg = str(ei.value)
    assert "pu.weight_decay declared at tests/test_rules_follow_names.py:" in msg and "'2.weight'" in msg
    assert "Nothing of this step was written" in msg and ".remove()" in msg
    assert_same(before, snapshot(m, opt))


def test_an_ema_whose_model_lost_a_name_raises_naming_it():
    m = _model()
    avg = pu.ema(m, DECAY)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    _pu_step(m, opt, torch.randn(4, 3), "step")
    del m[2]  # (Sequential writes its dict with no hook: the container's size says it)
    before = snapshot(m, avg)
    with pytest.raises(
        pu.UpdateError, match=r"pu.ema \(declared at tests/test_rules_follow_names.py:\d+\).*'2.weight'"
    ):
        _pu_step(m, opt, torch.randn(4, 3), "step")
    assert_same(before, snapshot(m, avg))


@pytest.mark.parametrize("rebuild", [True, False], ids=["new-optimizer", "param-group-added"])
def test_weight_decay_applies_to_tensors_loaded_with_assign_while_an_ema_holds_the_old_ones(rebuild):
    """``load_state_dict(sd, assign=True)`` mid-training with ``pu.ema`` declared (its pairs hold the old
    tensors): the rules cover the new tensors (before, weight decay silently skipped them)."""
    ref, m = _model(), _model()
    by_hand = ByHand(ref)
    avg, _ = _declare(m)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    xs = torch.randn(3, 4, 3)
    by_hand.step(xs[0])
    _pu_step(m, opt, xs[0], "step")
    torch.manual_seed(3)
    sd = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    m.load_state_dict(sd, assign=True)
    ref.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
    if rebuild:
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        by_hand.opt = torch.optim.SGD(ref.parameters(), lr=LR)
    else:
        opt.add_param_group({"params": list(m.parameters())})
        by_hand.opt.add_param_group({"params": list(ref.parameters())})
    for x in xs[1:]:
        by_hand.step(x)
        _pu_step(m, opt, x, "step")
        assert_same(snapshot(ref, by_hand.avg), snapshot(m, avg))


@pytest.mark.parametrize("driver", ["attach", "step"])
def test_a_rule_on_a_tensor_the_optimizer_steps_but_no_model_holds_is_applied(driver):
    """CLIP's ``logit_scale``, kept by the training script: the optimizer steps it, the model does not hold
    it. Rules declared on it apply at the commits of that optimizer's steps."""
    m = _model()
    logit_scale = nn.Parameter(torch.tensor(2.0))
    scale_ref = nn.Parameter(torch.tensor(2.0))
    ref = _model()
    opt = torch.optim.SGD([*m.parameters(), logit_scale], lr=LR)
    ref_opt = torch.optim.SGD([*ref.parameters(), scale_ref], lr=LR)
    pu.weight_decay([logit_scale], RATE, exclude=None, foreach=False)
    clamp = pu.clamp(max=1.5)
    pu.constrain(logit_scale, clamp, foreach=False)
    if driver == "attach":
        pu.attach(m, opt)
    for x in torch.randn(3, 4, 3):
        opt.zero_grad()
        ref_opt.zero_grad()
        (ref(x).square().sum() * scale_ref).backward()
        with torch.no_grad():
            scale_ref.mul_(1 - LR * RATE)
            ref_opt.step()
            scale_ref.copy_(clamp(scale_ref))
        if driver == "attach":
            (m(x).square().sum() * logit_scale).backward()
            opt.step()
        else:
            with pu.step(m, opt) as s:
                (m(x).square().sum() * logit_scale).backward()
        assert torch.equal(bits(logit_scale), bits(scale_ref))
    shown = str(s.schedule() if driver == "step" else pu.Attachment.of(m).schedule())
    assert "weight_decay" in shown and "constrain:clamp" in shown


def test_models_dropped_without_a_step_are_collected_with_their_rules_and_ema_copies():
    """An evaluation sweep, a re-run notebook cell: 500 models that declared rules and were never stepped.
    Each is collected, with its EMA copy, as soon as it is dropped (before, all were kept until some commit
    happened anywhere); the registry holds the live ones only."""
    gc.collect()
    models, copies = [], []
    for _ in range(500):
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        pu.weight_decay(m, 0.1)
        pu.constrain(m, pu.max_norm(1.0))
        avg = pu.ema(m, 0.9)
        models.append(weakref.ref(m))
        copies.append(weakref.ref(avg))
        del m, avg
    assert sum(r() is not None for r in models) == 0
    # the last model's rules (its EMA copy) are dropped at the next declaration or commit, the others were
    assert sum(r() is not None for r in copies) <= 1 and len(state.process.rules) <= 3
    m = nn.Linear(2, 2)
    pu.weight_decay(m, 0.1)
    assert len(state.process.rules) == 1 and sum(r() is not None for r in copies) == 0


@pytest.mark.parametrize("driver", ["attach", "stepper", "step"])
@pytest.mark.parametrize("rule", ["constrain", "weight_decay"])
def test_a_rule_on_bare_tensors_covers_what_load_state_dict_assign_puts_under_their_names(rule, driver):
    """``pu.constrain([m[0].weight, m[2].weight], c)`` on bare tensors, then ``pu.attach`` or a
    ``pu.Stepper`` (or a first ``pu.step``), then ``load_state_dict(sd, assign=True)``: the library knew the
    model, so the rule follows the tensors by name in it and covers the loaded ones (before, the old ones
    died and the rule silently disappeared). Bitwise the rule applied by hand on the plain model."""
    ref, m = _model(), _model()
    c = pu.max_norm(BOUND)
    if rule == "constrain":
        pu.constrain([m[0].weight, m[2].weight], c, foreach=False)
    else:
        pu.weight_decay([m[0].weight, m[2].weight], RATE, foreach=False)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    xs = torch.randn(4, 4, 3)

    def by_hand(x: torch.Tensor) -> None:
        ref_opt.zero_grad()
        ref(x).square().sum().backward()
        with torch.no_grad():
            if rule == "weight_decay":
                for p in (ref[0].weight, ref[2].weight):
                    p.mul_(1 - LR * RATE)
            ref_opt.step()
            if rule == "constrain":
                for p in (ref[0].weight, ref[2].weight):
                    p.copy_(c(p))

    owner = pu.attach(m, opt) if driver == "attach" else pu.Stepper(m, opt) if driver == "stepper" else None

    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        if driver == "attach":
            m(x).square().sum().backward()
            opt.step()
        elif driver == "stepper":
            assert isinstance(owner, pu.Stepper)
            owner.run(lambda: m(x).square().sum().backward())
        else:
            with pu.step(m, opt):
                m(x).square().sum().backward()

    if driver == "step":  # (the library knows the model from its first step)
        by_hand(xs[0])
        step(xs[0])
    torch.manual_seed(3)
    sd = {k: torch.randn_like(v) * 4 for k, v in m.state_dict().items()}
    m.load_state_dict(sd, assign=True)
    ref.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
    opt.add_param_group({"params": list(m.parameters())})  # (the old tensors stay in the first group)
    ref_opt.add_param_group({"params": list(ref.parameters())})
    gc.collect()  # (nothing but the optimizers holds the old tensors)
    for x in xs[1:]:
        by_hand(x)
        step(x)
        assert_same(snapshot(ref), snapshot(m))
    assert [r.names_of({id(m[0].weight), id(m[2].weight)}) for r in pu.rules_of(m)] == [["0.weight", "2.weight"]]
