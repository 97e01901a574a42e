"""Each built-in rule's foreach path against its readable per-tensor reference path (``foreach=False``),
as ``torch/optim`` tests its foreach kernels against the single-tensor ones: the same training, one
run per path, compared bitwise (weight decay, EMA) or to the rounding of the norms (constraints)."""

import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import assert_same, snapshot


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).to(dtype)


def _train(declare, foreach, dtype=torch.float32, steps=4):
    m = pu.convert(_net(dtype))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    extra = declare(m, foreach)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(6, 4, generator=g).to(dtype)
        opt.zero_grad()
        with pu.step(m, opt):
            m(x).square().mean().backward()
    params = [p for grp in opt.param_groups for p in grp["params"]]
    out = snapshot(m) + [(f"opt{i}.{k}", v.clone()) for i, p in enumerate(params) for k, v in opt.state[p].items()]
    out += snapshot(extra) if extra is not None else []
    pu.testing.reset()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_weight_decay_paths_are_bitwise_equal(dtype):
    def declare(m, foreach):
        pu.weight_decay(m, 0.05, foreach=foreach)
        m[2].weight.grad = None  # one parameter without a gradient at the first commit: not decayed

    assert_same(_train(declare, True, dtype), _train(declare, False, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ema_paths_are_bitwise_equal(dtype):
    def declare(m, foreach):
        return pu.ema(m, 0.8, warmup=3, foreach=foreach)  # floating tensors averaged, the counter copied

    assert_same(_train(declare, True, dtype), _train(declare, False, dtype))


@pytest.mark.parametrize(
    "constraint",
    [
        pu.max_norm(0.3),
        pu.max_norm(0.5, dim=-1),
        pu.unit_norm(dim=None),
        pu.min_max_norm(0.2, 0.4, 0.5),
        pu.non_neg(),
        pu.clamp(-0.1, 0.1),
    ],
    ids=repr,
)
def test_constraint_paths_agree(constraint):
    def declare(m, foreach):
        pu.constrain([m[0].weight, m[2].weight, m[4].weight, m[4].bias], constraint, foreach=foreach)

    fast, ref = _train(declare, True), _train(declare, False)
    assert [k for k, _ in fast] == [k for k, _ in ref]
    for (k, a), (_, b) in zip(fast, ref):
        if torch.is_tensor(a):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    if isinstance(constraint, type(pu.clamp(0, 1))):  # elementwise: no norm to round differently
        assert_same(fast, ref)


def test_the_paths_really_differ_in_how_they_run(monkeypatch):
    """foreach=False makes no foreach call for the rule (the comparison above compares two paths)."""
    calls = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = nn.Linear(3, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, foreach=False)
    reference = pu.weight_decay(m, 0.1, foreach=False)
    with pu.step(m, opt):
        m(torch.randn(2, 3)).sum().backward()
    assert calls == []
    reference.remove()
    pu.weight_decay(m, 0.1)
    with pu.step(m, opt):
        m(torch.randn(2, 3)).sum().backward()
    assert calls


# --- the math itself: each rule's _single_tensor_ and _multi_tensor_ functions, side by side ------------
def _tensors(dtypes=(torch.float32, torch.float64, torch.bfloat16), seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5,), (2, 3, 2), (), (7, 1)]
    return [torch.randn(s, generator=g).to(dt) for dt in dtypes for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_weight_decay_functions_are_bitwise_equal(dtype):
    from paramupdates.rules.weight_decay import (
        Factors,
        _multi_tensor_weight_decay,
        _single_tensor_weight_decay,
    )

    ts = _tensors((dtype,))
    rates = (0.1, 0.2, 0.0, 0.5, 0.01)
    factors = [1.0 - 0.05 * r for r in rates]
    # the foreach path's factors as a commit makes them: one param group (lr 0.05), a rate per tensor
    made = Factors(torch.device("cpu"), dtype, [(0, r) for r in rates], list(range(len(ts))))
    single, multi = [t.clone() for t in ts], [t.clone() for t in ts]
    _single_tensor_weight_decay(single, factors)
    _multi_tensor_weight_decay([(multi, made.get([{"lr": 0.05}], True))])
    assert_same(snapshot(*single), snapshot(*multi))
    assert not torch.equal(single[0], ts[0])  # (it did something)
    # one combination (one rate): one 0-dim factor for the whole group, refilled when the lr changes
    one = Factors(torch.device("cpu"), dtype, [(0, 0.1)], [0] * len(ts))
    for lr in (0.05, 0.05, 0.02):
        single, multi = [t.clone() for t in ts], [t.clone() for t in ts]
        _single_tensor_weight_decay(single, [1.0 - lr * 0.1] * len(ts))
        _multi_tensor_weight_decay([(multi, one.get([{"lr": lr}], True))])
        assert_same(snapshot(*single), snapshot(*multi))


def test_ema_functions_are_bitwise_equal():
    from paramupdates.rules.ema import _multi_tensor_ema, _single_tensor_ema

    src = _tensors((torch.float32,), 1) + [torch.arange(3)]  # a floating group and an integer buffer
    avg32 = _tensors((torch.float32,), 2) + [torch.zeros(3, dtype=torch.long)]
    avg64 = [t.double() if t.is_floating_point() else t for t in avg32]  # a float64 copy: mixed dtypes
    averaged = [t.is_floating_point() for t in src]
    for avg in (avg32, avg64):
        single, multi = [a.clone() for a in avg], [a.clone() for a in avg]
        _single_tensor_ema(single, src, averaged, 0.1)
        fl = [i for i, a in enumerate(averaged) if a]
        pairs = ([multi[i] for i in fl], [src[i] for i in fl])
        same = avg is avg32
        _multi_tensor_ema([pairs] if same else [], [] if same else [pairs], [([multi[-1]], [src[-1]])], [], 0.1)
        assert_same(snapshot(*single), snapshot(*multi))
        assert torch.equal(single[-1], src[-1])


@pytest.mark.parametrize(
    "constraint", [pu.max_norm(0.5), pu.unit_norm(dim=None), pu.min_max_norm(0.2, 0.6, 0.5), pu.non_neg()], ids=repr
)
@pytest.mark.parametrize("norms", ["each", "concat", "segments"])
def test_constraint_functions_agree(constraint, norms):
    from paramupdates.rules.constraints import _multi_tensor_constraint, _single_tensor_constraint

    ts = [t for t in _tensors((torch.float32, torch.float64)) if t.ndim]
    single, multi = [t.clone() for t in ts], [t.clone() for t in ts]
    _single_tensor_constraint(constraint, single, [str(i) for i in range(len(ts))], "here")
    _multi_tensor_constraint(constraint, multi, constraint.plan(multi, norms))
    for a, b in zip(single, multi):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # (the norms' rounding)
