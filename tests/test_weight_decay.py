"""pu.weight_decay: decoupled decay in phase before_grad, checked against torch.optim.AdamW."""

import copy
import inspect
import warnings

import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import assert_same, bits, snapshot


def _net():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _data(n=6):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 5, generator=g) for _ in range(n)]


def _loss(m, x):
    return (m(x) ** 2).mean()


@pytest.mark.parametrize("how", ["step", "attach"])
def test_adam_plus_pu_weight_decay_is_adamw_bitwise(how):
    """AdamW decays by lr*wd before the Adam update: that is phase before_grad with scale_by_lr."""
    ref = _net()
    m = copy.deepcopy(ref)
    groups = lambda net: [  # noqa: E731 - two groups with different lr
        {"params": net[0].parameters(), "lr": 0.05},
        {"params": net[2].parameters(), "lr": 0.01},
    ]
    opt_ref = torch.optim.AdamW(groups(ref), weight_decay=0.1)
    opt = torch.optim.Adam(groups(m), weight_decay=0.0)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, 2, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)  # lr read at each commit
    pu.weight_decay(m, 0.1, exclude=None)  # AdamW decays biases too
    att = pu.attach(m, opt) if how == "attach" else None
    for x in _data():
        _loss(ref, x).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        sched_ref.step()
        if att is None:
            with pu.step(m, opt):
                _loss(m, x).backward()
        else:
            _loss(m, x).backward()
            opt.step()
        opt.zero_grad()
        sched.step()
    assert_same(snapshot(ref), snapshot(m))


def test_still_adamw_bitwise_after_the_model_is_cast_to_float64():
    """The cached factors are per dtype (0-dim float32 on CPU for float32): model.double() rebuilds them."""
    ref = _net()
    m = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.3)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    pu.weight_decay(m, 0.3, exclude=None)
    stepper = pu.Stepper(m, opt)
    for i, x in enumerate(_data(4)):
        if i == 2:
            for net, o in ((ref, opt_ref), (m, opt)):
                net.double()
                for st in o.state.values():
                    st.update({k: v.double() for k, v in st.items() if k != "step"})
        x = x.double() if i >= 2 else x
        _loss(ref, x).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with stepper:
            _loss(m, x).backward()
        opt.zero_grad()
    assert m[0].weight.dtype == torch.float64
    assert_same(snapshot(ref), snapshot(m))


def test_sgd_plus_pu_weight_decay_equals_handwritten_decoupled_decay():
    m = _net()
    ref = copy.deepcopy(m)
    lr, wd = 0.1, 0.05
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    pu.weight_decay(m, wd)
    for x in _data():
        with pu.step(m, opt):
            _loss(m, x).backward()
        opt.zero_grad()
        _loss(ref, x).backward()
        with torch.no_grad():
            for p in ref.parameters():
                if p.ndim > 1:  # default exclude: 1-D tensors are not decayed
                    p.mul_(1 - lr * wd)
                p.add_(p.grad, alpha=-lr)
                p.grad = None
    assert_same(snapshot(ref), snapshot(m))


def _zero_grad_step(m, opt):
    with pu.step(m, opt):
        (0.0 * sum(p.sum() for p in m.parameters())).backward()  # zero gradients: only decay moves


def test_default_exclude_skips_1d_and_scale_by_lr_false():
    m = _net()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    pu.weight_decay(m, 0.1, scale_by_lr=False)
    _zero_grad_step(m, opt)
    sd = m.state_dict()
    assert torch.equal(bits(sd["0.weight"]), bits(before["0.weight"] * (1 - 0.1)))
    assert torch.equal(bits(sd["2.weight"]), bits(before["2.weight"] * (1 - 0.1)))
    assert torch.equal(bits(sd["0.bias"]), bits(before["0.bias"]))
    assert torch.equal(bits(sd["2.bias"]), bits(before["2.bias"]))


def test_exclude_callable_gets_qualified_names():
    m = _net()
    seen = []

    def exclude(name, t):
        seen.append(name)
        return name.startswith("2.")

    w0, w2, b0 = m[0].weight.detach().clone(), m[2].weight.detach().clone(), m[0].bias.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    pu.weight_decay(m, 0.1, exclude=exclude)
    _zero_grad_step(m, opt)
    assert seen == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert torch.equal(m[0].weight, w0 * (1 - 0.5 * 0.1))
    assert torch.equal(m[2].weight, w2)
    assert torch.equal(m[0].bias, b0 * (1 - 0.5 * 0.1))  # the callable replaces the 1-D default


class WithOwnRates(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = pu.Parameter(torch.randn(3, 3), weight_decay=0.5)  # own rate wins over the global one
        self.b = pu.Parameter(torch.randn(3), weight_decay=0.2)  # explicit rate on a 1-D tensor: decayed
        self.c = pu.Parameter(torch.randn(3, 3), weight_decay=0.0)  # exempt
        self.d = nn.Parameter(torch.randn(3, 3))  # global rate


def test_per_parameter_rate_wins():
    m = WithOwnRates()
    before = {k: v.detach().clone() for k, v in m.named_parameters()}
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pu.weight_decay(m, 0.01)
    _zero_grad_step(m, opt)
    for name, rate in [("a", 0.5), ("b", 0.2), ("c", 0.0), ("d", 0.01)]:
        expect = before[name] * (1 - 0.1 * rate) if rate else before[name]
        assert torch.equal(bits(getattr(m, name)), bits(expect)), name


def test_only_parameters_the_optimizer_updates_are_decayed():
    m = _net()
    m[2].weight.requires_grad_(False)  # frozen: no gradient
    extra = nn.Linear(5, 5)  # not in the optimizer
    m.add_module("extra", extra)
    w2, we = m[2].weight.detach().clone(), extra.weight.detach().clone()
    opt = torch.optim.SGD(list(m[0].parameters()) + [m[2].bias], lr=0.1)
    pu.weight_decay(m, 0.1)
    _zero_grad_step(m, opt)
    assert torch.equal(m[2].weight, w2) and torch.equal(extra.weight, we)


def test_double_decay_warns_once():
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=1e-3)
    pu.weight_decay(m, 0.1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            _zero_grad_step(m, opt)
    msgs = [str(x.message) for x in w if "decayed twice" in str(x.message)]
    assert len(msgs) == 1
    assert "'0.weight'" in msgs[0] and "weight_decay=0" in msgs[0]


@pytest.mark.parametrize("how", ["one_step", "micro_steps", "attach"])
def test_gradient_accumulation_decays_once_per_optimizer_update(how):
    m = _net()
    ref = copy.deepcopy(m)
    lr, wd = 0.1, 0.2
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    pu.weight_decay(m, wd)
    att = pu.attach(m, opt) if how == "attach" else None
    data = _data(6)
    for k in range(2):
        micro = data[3 * k : 3 * k + 3]
        if how == "one_step":
            with pu.step(m, opt):
                for x in micro:
                    _loss(m, x).backward()
        elif how == "micro_steps":  # a step per micro-batch, the optimizer in the last only
            for i, x in enumerate(micro):
                with pu.step(m, opt if i == len(micro) - 1 else None):
                    _loss(m, x).backward()
        else:
            for x in micro:
                _loss(m, x).backward()
            opt.step()
        opt.zero_grad()
        for x in micro:
            _loss(ref, x).backward()
        with torch.no_grad():
            for p in ref.parameters():
                if p.ndim > 1:
                    p.mul_(1 - lr * wd)
                p.add_(p.grad, alpha=-lr)
                p.grad = None
    assert_same(snapshot(ref), snapshot(m))
    if att is not None:
        assert att.steps == 2


def test_declared_after_the_stepper_and_shown_in_schedule():
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    stepper = pu.Stepper(m, opt)
    line = inspect.currentframe().f_lineno + 1
    pu.weight_decay(m, 0.1)
    w0 = m[0].weight.detach().clone()
    with stepper:
        (0.0 * m[0].weight.sum() + 0.0 * m[2].weight.sum()).backward()
    assert torch.equal(m[0].weight, w0 * (1 - 0.1 * 0.1))
    rows = [r for r in stepper.schedule() if r.op == "weight_decay"]
    assert len(rows) == 1 and rows[0].phase == "before_grad"
    assert rows[0].origin.endswith(f"test_weight_decay.py:{line}")
    assert "0.weight" in rows[0].target
    assert stepper.schedule().phases().index("before_grad") < stepper.schedule().phases().index("grad")


def test_schedule_row_follows_what_each_commit_decays():
    """The rule's schedule rows are cached between commits, and rebuilt when what it decays changes."""
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pu.weight_decay(m, 0.1)
    stepper = pu.Stepper(m, opt)

    def target(loss_of):
        with stepper:
            loss_of().backward()
        opt.zero_grad(set_to_none=True)
        return [r.target for r in stepper.schedule() if r.op == "weight_decay"]

    both = lambda: m[0].weight.sum() + m[2].weight.sum()  # noqa: E731
    assert target(both) == ["2 tensors (0.weight, 2.weight)"]
    assert target(both) == ["2 tensors (0.weight, 2.weight)"]
    assert target(lambda: m[2].weight.sum()) == ["2.weight"]  # 0.weight has no gradient: not decayed
    assert target(both) == ["2 tensors (0.weight, 2.weight)"]


def test_bad_arguments():
    m = _net()
    with pytest.raises(ValueError, match="rate must be >= 0"):
        pu.weight_decay(m, -1.0)
    with pytest.raises(TypeError, match="exclude"):
        pu.weight_decay(m, 0.1, exclude=3)
    with pytest.raises(pu.UpdateError, match="inside pu.step at .* a step of the model it is declared on"):
        with pu.step(m):
            pu.weight_decay(m, 0.1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_match_handwritten_decay_bitwise(dtype):
    """Equal to Tensor.mul_(1 - lr * rate), which AdamW's single-tensor path uses, in every dtype."""
    m = nn.Linear(4, 4).to(dtype)
    w0 = m.weight.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    pu.weight_decay(m, 0.1)
    _zero_grad_step(m, opt)
    expect = w0.clone()
    expect.mul_(1 - 0.5 * 0.1)
    assert torch.equal(bits(m.weight), bits(expect))
    assert not torch.equal(m.weight.detach(), w0)


def test_where_pytorch_is_wrong_cpu_foreach_mul_rounds_the_scalar_in_bfloat16():
    """CPU torch._foreach_mul_(ts, scalar) rounds the scalar to bfloat16 first; Tensor.mul_ computes in float32.

    pu.weight_decay gives Tensor.mul_'s (and AdamW's) result.
    """
    w = torch.randn(1000).bfloat16()
    by_mul, by_foreach = w.clone(), w.clone()
    by_mul.mul_(1 - 1e-3)
    torch._foreach_mul_([by_foreach], 1 - 1e-3)
    assert torch.equal(by_mul, (w.float() * (1 - 1e-3)).bfloat16())  # float opmath
    assert torch.equal(by_foreach, w)  # 1 - 1e-3 rounded to bfloat16 is 1.0: no decay at all
    m = nn.Module()
    m.w = nn.Parameter(w.clone().view(10, 100))
    opt = torch.optim.SGD([m.w], lr=1.0)
    pu.weight_decay(m, 1e-3)
    _zero_grad_step(m, opt)
    assert torch.equal(m.w.detach().view(-1), by_mul)
