"""Rule 12 ("accounted for"): what a lost-name error tells the user to do works, as written.

A rule followed by name in a model raises at the next commit when a name it covers is gone (a LoRA-style
wrapper put in a layer's place, a parametrization registered on a weight, a layer removed). Each such
message gives fixes; each test here follows one fix exactly as the message words it, then trains, and
compares with plain PyTorch and the rule applied by hand (the formulas of the rules' reference paths,
``foreach=False``: ``p.mul_(1 - lr * rate)`` before ``optimizer.step()``, ``p.copy_(c(p))`` with the
same constraint object after it, ``a.lerp_(p, 1 - decay)`` last), bitwise.

``pu.rules_of(model)`` is the public list of the rules declared on a model (each with ``.remove()``).
"""

from __future__ import annotations

import copy
import gc
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import paramupdates as pu

from conftest import assert_same, snapshot

LR, RATE, BOUND, DECAY = 0.1, 0.5, 0.3, 0.5


class Wrapped(nn.Module):
    """A LoRA-style wrapper: the layer's ``weight`` is now ``inner.weight``, beside a new parameter."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.a = nn.Parameter(torch.full((inner.out_features, inner.in_features), 0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + x @ self.a.t()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))


def _change(m: nn.Sequential, how: str) -> list[nn.Parameter]:
    """Change the model as the user does; returns the new parameters (for the optimizer)."""
    if how == "lora":
        m[2] = Wrapped(m[2])
        return [m[2].a]
    weight_norm(m[2])
    return list(m[2].parametrizations.parameters())


def _declare(m: nn.Module, rule: str, c: pu.max_norm) -> None:
    """The declaration, as the user wrote it (the same call is made again when the message says so)."""
    if rule == "weight_decay":
        pu.weight_decay(m, RATE, foreach=False)
    elif rule == "constrain-model":
        pu.constrain(m, c, foreach=False)
    else:
        pu.constrain(m[2], c, foreach=False)  # (on the layer: followed in the model once it is replaced)


def _by_hand(m: nn.Module, rule: str | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What the declaration covers on ``m`` as it is: (decayed, constrained)."""
    if rule == "weight_decay":
        return [p for p in m.parameters() if p.ndim > 1], []
    if rule == "constrain-model":
        return [], list(m.parameters())
    if rule == "constrain-layer":
        return [], list(m[2].parameters())
    return [], []


def _ref_step(ref: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, rule: str | None, c: pu.max_norm) -> None:
    opt.zero_grad()
    ref(x).square().sum().backward()
    decayed, constrained = _by_hand(ref, rule)
    with torch.no_grad():
        for p in decayed:
            if p.grad is not None:
                p.mul_(1 - LR * RATE)
        opt.step()
        for p in constrained:
            p.copy_(c(p))


def _pu_step(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, driver: str) -> None:
    opt.zero_grad()
    if driver == "attach":
        m(x).square().sum().backward()
        opt.step()
    else:
        with pu.step(m, opt):
            m(x).square().sum().backward()


def _lost_error(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, driver: str) -> str:
    before = snapshot(m)
    with pytest.raises(pu.UpdateError) as ei:
        _pu_step(m, opt, x, driver)
    assert_same(before, snapshot(m))  # nothing written
    return str(ei.value)


def _named_in(msg: str, model: nn.Module) -> pu.Rule:
    """The rule a message names ("<kind> declared at <file:line>"), found as the message says: in
    ``pu.rules_of(model)``."""
    found = [r for r in pu.rules_of(model) if f"{r.describe()} declared at {r.origin}" in msg]
    assert len(found) == 1, (msg, pu.rules_of(model))
    return found[0]


@pytest.mark.parametrize("driver", ["attach", "step"])
@pytest.mark.parametrize("fix", ["declare-again", "remove"])
@pytest.mark.parametrize("rule", ["weight_decay", "constrain-model", "constrain-layer"])
@pytest.mark.parametrize("how", ["lora", "weight_norm"])
def test_each_fix_of_the_lost_name_error_works_as_written(how, rule, fix, driver):
    """A LoRA wrap (or weight norm) after a rule was declared: the commit raises. Declaring the rule again
    with the same call makes it cover the model as it is now (before: the old rule kept raising); removing
    the rule through ``pu.rules_of(model)`` trains without it. Bitwise plain PyTorch with the rule by hand."""
    c = pu.max_norm(BOUND)
    ref, m = _model(), _model()
    _declare(m, rule, c)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    if driver == "attach":
        pu.attach(m, opt)
    xs = torch.randn(4, 4, 3)
    _ref_step(ref, ref_opt, xs[0], rule, c)
    _pu_step(m, opt, xs[0], driver)
    assert_same(snapshot(ref), snapshot(m))
    opt.add_param_group({"params": _change(m, how)})
    ref_opt.add_param_group({"params": _change(ref, how)})
    msg = _lost_error(m, opt, xs[1], driver)
    if fix == "declare-again":
        assert "Declare the rule again on the model as it is now (the same call" in msg
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (the fix is quiet: the new declaration takes the old one's place)
            _declare(m, rule, c)
        after: str | None = rule
    else:
        assert "pu.rules_of(model) lists the rules declared on the model, each with .remove()" in msg
        _named_in(msg, m).remove()
        after = None
    assert all(not r.lost_names() for r in pu.rules_of(m))
    for x in xs[1:]:
        _ref_step(ref, ref_opt, x, after, c)
        _pu_step(m, opt, x, driver)
        assert_same(snapshot(ref), snapshot(m))


def test_declared_again_on_the_new_names_the_old_rule_keeps_the_names_it_still_has():
    """The re-declaration takes the lost names' place only: a rule declared on the model keeps covering
    what the model still has under its names when it is declared again on the wrapped layer alone."""
    c = pu.max_norm(BOUND)
    m = _model()
    first = pu.constrain(m, c, foreach=False)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    _pu_step(m, opt, torch.randn(4, 3), "step")
    opt.add_param_group({"params": _change(m, "lora")})
    msg = _lost_error(m, opt, torch.randn(4, 3), "step")
    assert "'2.weight', '2.bias'" in msg
    second = pu.constrain(m[2], c, foreach=False)
    rules = pu.rules_of(m)
    assert rules == [first, second]
    assert re.search(r"on '0.weight', '0.bias'>$", repr(first)), repr(first)
    assert ", lost" not in repr(first) and "'2.inner.weight'" in repr(second)  # (its place in the model)
    _pu_step(m, opt, torch.randn(4, 3), "step")
    assert (m[0].weight.norm(dim=1) <= BOUND * (1 + 1e-6)).all()
    assert (m[2].inner.weight.norm(dim=1) <= BOUND * (1 + 1e-6)).all()


def test_rules_of_lists_the_rules_of_a_model_its_layers_and_its_averaged_copy():
    m = _model()
    wd = pu.weight_decay(m, RATE)
    on_layer = pu.constrain(m[2], pu.max_norm(BOUND))
    on_tensor = pu.constrain([m[0].weight], pu.non_neg())
    avg = pu.ema(m, DECAY)
    other = pu.weight_decay(nn.Linear(2, 2), RATE)
    (ema_rule,) = pu.rules_of(avg)
    assert pu.rules_of(m) == [wd, on_layer, on_tensor, ema_rule]
    assert pu.rules_of(m[2]) == [wd, on_layer, ema_rule]  # (the model's rules cover its layers' tensors)
    assert other not in pu.rules_of(m)
    assert repr(on_layer).startswith("<pu.constrain(max_norm) declared at tests/test_lost_names.py:")
    on_layer.remove()
    assert pu.rules_of(m) == [wd, on_tensor, ema_rule]
    with pytest.raises(TypeError, match=r"pu.rules_of\(\) takes a torch.nn.Module"):
        pu.rules_of(m[0].weight)  # type: ignore[arg-type]


class _ByHandEMA:
    def __init__(self, model: nn.Module) -> None:
        self.avg = copy.deepcopy(model).requires_grad_(False)

    def update(self, model: nn.Module) -> None:
        avg = dict(self.avg.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                avg[name].lerp_(p, 1 - DECAY)


@pytest.mark.parametrize("fix", ["declare-again", "remove"])
@pytest.mark.parametrize("change", ["lora", "new-layer"])
def test_each_fix_of_the_ema_lost_name_errors_works_as_written(change, fix):
    """pu.ema of a model that lost a name (a LoRA wrap) or gained one (a layer appended): the commit
    raises; declaring pu.ema again (the same call) averages the model as it is now from there, and
    removing the rule found with pu.rules_of(ema_copy) trains without it."""
    ref, m = _model(), _model()
    avg = pu.ema(m, DECAY, foreach=False)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    by_hand = _ByHandEMA(ref)
    xs = torch.randn(4, 4, 3)
    _ref_step(ref, ref_opt, xs[0], None, pu.max_norm(BOUND))
    by_hand.update(ref)
    _pu_step(m, opt, xs[0], "step")
    assert_same(snapshot(ref, by_hand.avg), snapshot(m, avg))
    for model, o in ((m, opt), (ref, ref_opt)):
        if change == "lora":
            o.add_param_group({"params": _change(model, "lora")})
        else:
            torch.manual_seed(5)
            model.append(nn.Linear(2, 2))
            o.add_param_group({"params": list(model[3].parameters())})
    msg = _lost_error(m, opt, xs[1], "step")
    assert "Declare pu.ema again on the model as it is now (the same call" in msg
    assert "pu.rules_of(ema_copy) lists it" in msg
    if fix == "declare-again":
        with pytest.warns(UserWarning, match="replaces the pu.ema"):  # (its averages start again: said)
            avg = pu.ema(m, DECAY, foreach=False)
        by_hand = _ByHandEMA(ref)
    else:
        (rule,) = pu.rules_of(avg)
        rule.remove()
    for x in xs[1:]:
        _ref_step(ref, ref_opt, x, None, pu.max_norm(BOUND))
        _pu_step(m, opt, x, "step")
        if fix == "declare-again":
            by_hand.update(ref)
            assert_same(snapshot(ref, by_hand.avg), snapshot(m, avg))
        else:
            assert_same(snapshot(ref), snapshot(m))


@pytest.mark.parametrize("fix", ["declare-again", "remove"])
def test_each_fix_of_the_error_about_a_rule_whose_layer_was_removed_and_collected_works(fix):
    """``del model[2]`` (a layer a rule was declared on, then collected): the commit raises. Declaring
    the rule again on the model as it is now takes the dead rule's place; so does removing it, found with
    pu.rules_of(model)."""
    c = pu.max_norm(BOUND)
    ref, m = _model(), _model()
    pu.constrain(m[2], c, foreach=False)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    xs = torch.randn(4, 4, 3)
    _ref_step(ref, ref_opt, xs[0], "constrain-layer", c)
    _pu_step(m, opt, xs[0], "step")
    del m[2], ref[2]
    opt = torch.optim.SGD(m.parameters(), lr=LR)  # (the old one held the layer's parameters)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    gc.collect()
    msg = _lost_error(m, opt, xs[1], "step")
    assert "Declare the rule again on the model as it is now" in msg
    if fix == "declare-again":
        pu.constrain(m, c, foreach=False)
        after: str | None = "constrain-model"
    else:
        assert "pu.rules_of(model) lists the rules declared on the model, each with .remove()" in msg
        _named_in(msg, m).remove()
        after = None
    for x in xs[1:]:
        _ref_step(ref, ref_opt, x, after, c)
        _pu_step(m, opt, x, "step")
        assert_same(snapshot(ref), snapshot(m))
