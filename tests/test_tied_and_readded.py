"""Rule 12 ("accounted for"), three ordinary programs that used to lose something without a word:

1. weights tied after the rules were declared (``model.out.weight = model.emb.weight``, what Hugging
   Face's ``tie_weights()`` does after init or ``resize_token_embeddings``): a rule runs once per tensor
   per optimizer update, never once per name (it decayed the tied weight twice: ``p * (1 - lr*wd)**2``);
2. a layer popped and re-added under its name (``old = model.heads.pop("a"); model.heads["a"] = ...``):
   the rule declared on the layer follows its place in the model, whether or not the user still holds
   the old layer (it applied to the held old layer, or raised once it was collected);
(the third, a ``torch.amp.GradScaler`` under ``pu.attach`` without ``scaler=``, is
``tests/test_step_owns_its_optimizer.py::test_gradscaler_under_attach_drops_the_step_it_skips_whole``).

Each against plain PyTorch: AdamW, the rules applied by hand by name.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import assert_same, snapshot

LR, RATE, DECAY = 0.05, 0.3, 0.5


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4, bias=False)
        self.out = nn.Linear(4, 7, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.emb(ids))))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten())


def _tie(model: TinyLM) -> None:
    model.out.weight = model.emb.weight  # (what transformers' tie_weights() does)


def _untie(model: TinyLM) -> None:
    model.out.weight = nn.Parameter(model.emb.weight.detach().clone())


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list:
    """Every tensor of ``model`` and ``opt``'s state, by name and parameter index."""
    st = opt.state_dict()["state"]
    return snapshot(model) + [(f"{i}.{k}", v.clone()) for i, s in st.items() for k, v in s.items()]


def _train(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, driver: str | None) -> None:
    opt.zero_grad()
    if driver == "step":
        with pu.step(model, opt):
            _loss(model, ids).backward()
    else:  # plain PyTorch, or pu.attach
        _loss(model, ids).backward()
        opt.step()


@pytest.mark.parametrize("driver", ["attach", "step"])
def test_weights_tied_after_declaring_weight_decay_decay_once_like_adamw(driver):
    """``pu.weight_decay`` declared, then the weights tied, then the optimizer made (the order of a
    Hugging Face model's init and its Trainer): ``Adam + pu.weight_decay`` is bitwise ``AdamW``; then
    untied again and trained on (two optimizers made anew), still bitwise AdamW."""
    ref, m = TinyLM(), TinyLM()
    pu.weight_decay(m, RATE)  # (every weight is 2-D: the default exclude skips nothing here)
    _tie(ref), _tie(m)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=RATE)
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    att = pu.attach(m, opt) if driver == "attach" else None
    ids = torch.randint(0, 7, (4, 2, 5))
    for x in ids[:2]:
        _train(ref, ref_opt, x, None)
        _train(m, opt, x, driver)
        assert_same(_state(ref, ref_opt), _state(m, opt))
    assert m.out.weight is m.emb.weight
    _untie(ref), _untie(m)
    if att is not None:
        att.detach()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=RATE)
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    if driver == "attach":
        pu.attach(m, opt)
    for x in ids[2:]:
        _train(ref, ref_opt, x, None)
        _train(m, opt, x, driver)
        assert_same(_state(ref, ref_opt), _state(m, opt))


def _halve(w: torch.Tensor) -> torch.Tensor:
    return w * 0.5  # (not idempotent: applied twice it would quarter)


@pytest.mark.parametrize("driver", ["attach", "step"])
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "reference"])
def test_a_constraint_and_the_ema_on_weights_tied_after_declaring_run_once_per_tensor(driver, foreach):
    """``pu.constrain`` and ``pu.ema`` declared, then the weights tied (the EMA's copy too, by the user):
    the constraint writes the tied weight once per step, and each copy tensor is averaged once, as the
    rules applied by hand by name to what each model holds."""
    ref, m = TinyLM(), TinyLM()
    pu.constrain(m, _halve, foreach=foreach)
    avg = pu.ema(m, DECAY, foreach=foreach)
    ref_avg = copy.deepcopy(ref).requires_grad_(False)
    _tie(ref), _tie(m)
    ref_avg.out.weight = ref_avg.emb.weight
    avg.out.weight = avg.emb.weight
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    if driver == "attach":
        pu.attach(m, opt)
    for x in torch.randint(0, 7, (3, 2, 5)):
        _train(ref, ref_opt, x, None)
        with torch.no_grad():
            for p in ref.parameters():  # (each tensor once: parameters() yields a tied one once)
                p.copy_(_halve(p))
            for a, p in zip(ref_avg.parameters(), ref.parameters()):
                a.lerp_(p, 1 - DECAY)
        _train(m, opt, x, driver)
        assert_same(snapshot(ref, ref_avg), snapshot(m, avg))


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Linear(3, 3)
        self.heads = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return sum(head(h).square().sum() for head in self.heads.values())


def _fresh(seed: int) -> nn.Linear:
    torch.manual_seed(100 + seed)
    return nn.Linear(3, 2)


def _readd(model: Heads, how: str, seed: int, keep: list) -> None:
    """The user's code between steps: the head ``a`` taken out (held on to or not) and a new one put under
    its name."""
    if how == "pop":
        old = model.heads.pop("a")
    else:
        old = model.heads["a"]
        del model.heads["a"]
    if keep is not None:
        keep.append(old)
    del old
    gc.collect()
    model.heads["a"] = _fresh(seed)


@pytest.mark.parametrize("driver", ["attach", "step"])
@pytest.mark.parametrize("how", ["pop", "del"])
@pytest.mark.parametrize("held", [True, False], ids=["old-held", "old-dropped"])
@pytest.mark.parametrize("declared", ["before", "after"], ids=["declared-first", "attached-first"])
def test_a_constraint_on_a_layer_popped_and_re_added_follows_its_name(driver, how, held, declared):
    """``old = model.heads.pop("a"); model.heads["a"] = nn.Linear(...)`` (or ``del`` then re-add) between
    steps: the constraint declared on ``model.heads["a"]`` covers the new head, whether or not the user still
    holds the old one (it used to apply to the held old layer, or raise once it was collected), as the
    constraint applied by hand by name; the old head is left as it was."""
    ref, m = Heads(), Heads()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    if declared == "after" and driver == "attach":
        pu.attach(m, opt)
    pu.constrain(m.heads["a"], _halve)
    if declared == "before" and driver == "attach":
        pu.attach(m, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    keep: list | None = [] if held else None
    xs = torch.randn(4, 5, 3)
    for k, x in enumerate(xs):
        if k in (1, 3):  # (again after a step on the new head: the rule follows the name, not an object)
            _readd(ref, how, k, None)
            _readd(m, how, k, keep)
            for o in (opt, ref_opt):
                o.add_param_group({"params": list((m if o is opt else ref).heads["a"].parameters())})
            kept = [(t, t.detach().clone()) for old in keep or () for t in old.parameters()]
        _train_heads(ref, ref_opt, x, None)
        with torch.no_grad():
            for p in ref.heads["a"].parameters():
                p.copy_(_halve(p))
        _train_heads(m, opt, x, driver)
        assert_same(snapshot(ref), snapshot(m))
        if k >= 1 and held:
            assert all(torch.equal(t, v) for t, v in kept)  # (no rule touched the old head)


def _train_heads(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, driver: str | None) -> None:
    opt.zero_grad()
    if driver == "step":
        with pu.step(model, opt):
            model(x).backward()
    else:
        model(x).backward()
        opt.step()


@pytest.mark.parametrize("driver", ["attach", "step"])
@pytest.mark.parametrize("held", [True, False], ids=["old-held", "old-dropped"])
def test_a_layer_popped_and_not_re_added_raises_naming_the_rule_whoever_holds_it(driver, held):
    """The head popped for good: the next commit raises the same error whether or not the old head was
    collected (rule 12: never depending on when Python collects an object), naming the rule, its
    declaration site and the name it lost, with nothing written."""
    m = Heads()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    pu.constrain(m.heads["a"], _halve)  # MARK: the head's constraint
    if driver == "attach":
        pu.attach(m, opt)
    _train_heads(m, opt, torch.randn(5, 3), driver)
    old = m.heads.pop("a")
    keep = [old] if held else []
    del old
    gc.collect()
    before = snapshot(m)
    with pytest.raises(pu.UpdateError) as ei:
        _train_heads(m, opt, torch.randn(5, 3), driver)
    msg = str(ei.value)
    assert "test_tied_and_readded.py:" in msg and "'heads.a.weight'" in msg, msg
    assert_same(before, snapshot(m))
    assert len(keep) == int(held)


@pytest.mark.parametrize("driver", ["attach", "step"])
@pytest.mark.parametrize("held", [True, False], ids=["old-held", "old-dropped"])
def test_a_sequential_layer_deleted_and_another_inserted_in_its_place_is_covered(driver, held):
    """``del model[1]; model.insert(1, nn.Linear(...))``: torch writes the Sequential's dict with no
    registration hook and the number of layers is the same; the constraint declared on ``model[1]`` covers
    the inserted layer (also where it is made at the address of the collected one)."""

    def build() -> nn.Sequential:
        torch.manual_seed(2)
        return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))

    ref, m = build(), build()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    pu.constrain(m[1], _halve)
    if driver == "attach":
        pu.attach(m, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    keep = []
    for k, x in enumerate(torch.randn(3, 5, 3)):
        if k:
            for model, o in ((ref, ref_opt), (m, opt)):
                if held and model is m:
                    keep.append(model[1])
                del model[1]
                gc.collect()
                torch.manual_seed(10 + k)
                model.insert(1, nn.Linear(3, 3))
                o.add_param_group({"params": list(model[1].parameters())})
        for model, o, drv in ((ref, ref_opt, None), (m, opt, driver)):
            o.zero_grad()
            if drv == "step":
                with pu.step(model, o):
                    model(x).square().sum().backward()
            else:
                model(x).square().sum().backward()
                o.step()
        with torch.no_grad():
            for p in ref[1].parameters():
                p.copy_(_halve(p))
        assert_same(snapshot(ref), snapshot(m))
