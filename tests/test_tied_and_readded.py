"""Rule 12 ("accounted for"), three ordinary programs that used to lose something without a word:

1. weights tied after the rules were declared (``model.out.weight = model.emb.weight``, what Hugging
   Face's ``tie_weights()`` does after init or ``resize_token_embeddings``): a rule runs once per tensor
   per optimizer update, never once per name (it decayed the tied weight twice: ``p * (1 - lr*wd)**2``);
2. a layer popped and re-added under its name (``old = model.heads.pop("a"); model.heads["a"] = ...``):
   the rule declared on the layer follows its place in the model, whether or not the user still holds
   the old layer (it applied to the held old layer, or raised once it was collected);
3. a ``torch.amp.GradScaler`` under ``pu.attach`` without ``scaler=``: a step the scaler skips drops its
   batch's updates, as with ``scaler=`` (they used to carry into the next, good step).

Each against plain PyTorch: AdamW, a constraint applied by hand, the plain GradScaler loop.
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
