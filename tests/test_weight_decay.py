"""pu.weight_decay: decoupled decay in phase before_grad, checked against torch.optim.AdamW."""

import copy
import inspect

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


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW, torch.optim.Adam])
def test_a_group_that_decays_by_itself_is_refused(opt_cls):
    """Its own weight_decay and pu.weight_decay on the same parameters would decay them twice (SGD's
    coupled L2 or AdamW's decoupled decay, whichever): refused before anything is written."""
    m = _net()
    opt = opt_cls(m.parameters(), lr=0.1, weight_decay=1e-3)
    pu.weight_decay(m, 0.1)
    before = snapshot(m, opt)
    with pytest.raises(pu.UpdateError) as ei:
        _zero_grad_step(m, opt)
    msg = str(ei.value)
    assert "'0.weight'" in msg and "weight_decay=0" in msg and "decayed twice" in msg
    assert f"{opt_cls.__name__}(weight_decay=...)" in msg and "test_weight_decay.py" in msg
    assert_same(before, snapshot(m, opt))


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


# --- the optimizer's own kernel: where the optimizer has the same update built in ----------------------
def _kernel_case(opt_name, impl, dtype, steps=3):
    """``opt_name`` + ``pu.weight_decay(exclude=None)`` against the same optimizer with its decoupled
    decay set (AdamW; Adam/NAdam/RAdam with decoupled_weight_decay=True), through ``pu.step``."""
    torch.manual_seed(0)
    ref = _net().to(dtype)
    m = copy.deepcopy(ref)
    kw = {"foreach": impl == "foreach", "fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    if impl == "fused":
        kw.pop("foreach")
    cls = getattr(torch.optim, opt_name)
    decoupled = {} if opt_name == "AdamW" else {"decoupled_weight_decay": True}
    ref_opt = cls(ref.parameters(), lr=0.05, weight_decay=0.1, **decoupled, **kw)
    opt = cls(m.parameters(), lr=0.05, weight_decay=0.0, **kw)
    pu.weight_decay(m, 0.1, exclude=None)
    for x in _data(steps):
        x = x.to(dtype)
        _loss(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with pu.step(m, opt) as s:
            _loss(m, x).backward()
        opt.zero_grad()
        assert all(g["weight_decay"] == 0.0 for g in opt.param_groups)  # its own settings, restored
        if opt_name != "AdamW":
            assert all(g["decoupled_weight_decay"] is False for g in opt.param_groups)
    assert_same(snapshot(ref), snapshot(m))
    return s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_adam_fused_with_pu_weight_decay_is_adamw_fused_bitwise(impl, dtype):
    """The decay runs in the optimizer's own kernel (one pass over memory): ``Adam(fused=True)`` +
    ``pu.weight_decay`` is ``AdamW(fused=True)`` bitwise in bfloat16 too (a separate pass rounds once
    more), and the schedule still shows the rule in its phase."""
    s = _kernel_case("Adam", impl, dtype)
    assert [(r.phase, r.op) for r in s.schedule()][:2] == [("before_grad", "weight_decay"), ("grad", "Adam.step")]


@pytest.mark.parametrize("opt_name", ["AdamW", "NAdam", "RAdam"])
def test_the_other_decoupled_optimizers_decay_in_their_own_kernel(opt_name):
    _kernel_case(opt_name, "foreach", torch.bfloat16)


def test_the_optimizers_settings_are_restored_when_its_step_raises():
    m = _net()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    pu.weight_decay(m, 0.1, exclude=None)
    att = pu.attach(m, opt)
    _loss(m, torch.randn(4, 5)).backward()
    opt.param_groups[0]["betas"] = "broken"  # Adam raises inside its step
    with pytest.raises(Exception):  # noqa: B017 - whatever Adam raises
        opt.step()
    g = opt.param_groups[0]
    assert g["weight_decay"] == 0.0 and g["decoupled_weight_decay"] is False
    att.detach()


def test_groups_the_rule_does_not_cover_whole_take_the_separate_pass():
    """The default exclude skips biases, which Adam's one group steps too: the group cannot decay by
    itself, so pu's pass decays the weights (bitwise the hand-written decoupled decay, then Adam)."""
    torch.manual_seed(0)
    ref = _net()
    m = copy.deepcopy(ref)
    ref_opt, opt = torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(m.parameters(), lr=0.05)
    pu.weight_decay(m, 0.1)
    for x in _data(3):
        _loss(ref, x).backward()
        with torch.no_grad():
            for p in (ref[0].weight, ref[2].weight):
                p.mul_(1 - 0.05 * 0.1)
        ref_opt.step()
        ref_opt.zero_grad()
        with pu.step(m, opt):
            _loss(m, x).backward()
            assert opt.param_groups[0]["weight_decay"] == 0.0
        opt.zero_grad()
    assert_same(snapshot(ref), snapshot(m))


def test_a_before_grad_update_of_a_decayed_parameter_keeps_the_order():
    """Rules come first in their phase: a ``phase="before_grad"`` update of a parameter the optimizer
    would decay in its kernel sees the decayed value, so that step decays it in pu's own pass."""
    torch.manual_seed(0)
    m = _net()
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    pu.weight_decay(m, 0.1, exclude=None)
    w = m[0].weight
    with pu.step(m, opt):
        _loss(m, torch.randn(4, 5)).backward()
        pu.assign(w, torch.zeros_like(w), phase="before_grad")
        expect_before_adam = torch.zeros_like(w)  # decayed first, then assigned: zero
    ref = torch.nn.Parameter(expect_before_adam)
    ref.grad = w.grad.clone()
    torch.optim.Adam([ref], lr=0.05).step()
    assert torch.equal(bits(w), bits(ref))


class _TwoBranches(torch.nn.Module):
    """``a`` is used every step; ``b`` only from the second step on (a branch, an expert)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 3, bias=False)
        self.b = torch.nn.Linear(5, 3, bias=False)
        self.use_b = False

    def forward(self, x):
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


def test_a_parameter_of_the_group_that_gets_a_gradient_later_is_not_decayed_by_the_kernel():
    """Step 1: the group's only stepped parameter is covered, so Adam decays in its own kernel. Step 2:
    an uncovered parameter of the same group has a gradient now: the plan must change (a separate pass),
    or Adam's own decay would decay it too. Reference: torch's AdamW with that parameter in a group of
    ``weight_decay=0``."""
    torch.manual_seed(0)
    m = _TwoBranches()
    ref = copy.deepcopy(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(
        [{"params": [ref.a.weight], "weight_decay": 0.1}, {"params": [ref.b.weight], "weight_decay": 0.0}], lr=0.05
    )
    pu.weight_decay([m.a.weight], 0.1)
    for i, x in enumerate(_data(3)):
        m.use_b = ref.use_b = i > 0
        _loss(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with pu.step(m, opt):
            _loss(m, x).backward()
        opt.zero_grad()
    assert_same(snapshot(ref), snapshot(m))


class _Shift(pu.Rule):
    """A user rule in ``before_grad``, declared after the decay: ``p <- p + 0.5`` (its order with the
    decay matters: ``(p * f) + 0.5`` is not ``(p + 0.5) * f``)."""

    phase = "before_grad"
    kind = "test_shift"

    def __init__(self, t):
        super().__init__("test")
        self.t = t

    def tensors(self):
        return [self.t]

    def apply(self, ctx):
        self.t.add_(0.5)


def test_a_later_before_grad_rule_sees_the_decayed_parameter():
    """Rules run in declaration order inside their phase: a ``before_grad`` rule declared after the
    decay reads the decayed value, so the decay of the tensors it writes cannot wait for the optimizer's
    kernel. Reference: the same order by hand, then torch's Adam."""
    torch.manual_seed(0)
    ref = _net()
    m = copy.deepcopy(ref)
    ref_opt, opt = torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(m.parameters(), lr=0.05)
    pu.weight_decay(m, 0.1, exclude=None)
    pu.rules.base.register(_Shift(m[0].weight))
    for x in _data(3):
        _loss(ref, x).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(1 - 0.05 * 0.1)
            ref[0].weight.add_(0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        with pu.step(m, opt):
            _loss(m, x).backward()
        opt.zero_grad()
    assert_same(snapshot(ref), snapshot(m))


def _sgd_with_schedule(m, lr):
    """SGD over two param groups (lr and lr / 2) with a schedule that changes the lr every step."""
    groups = [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters()), "lr": lr / 2}]
    opt = torch.optim.SGD(groups, lr=lr)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))


def _by_hand(ref, opt, sched, rates, x):
    """The reference step: p.mul_(1 - lr * rate) with the lr p's group has now, then torch's own SGD step."""
    _loss(ref, x).backward()
    with torch.no_grad():
        for g in opt.param_groups:
            for p in g["params"]:
                if rates[p]:
                    p.mul_(1 - g["lr"] * rates[p])
    opt.step()
    opt.zero_grad()
    sched.step()


def _train_both(m, opt, sched, ref, ref_opt, ref_sched, rates):
    """Train ``m`` with pu.step and ``ref`` by hand (:func:`_by_hand`), the schedules stepped alike; then
    the two are bitwise the same."""
    for x in _data():
        with pu.step(m, opt):
            _loss(m, x).backward()
        opt.zero_grad()
        sched.step()
        _by_hand(ref, ref_opt, ref_sched, rates, x)
    assert_same(snapshot(ref), snapshot(m))


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float lr", "tensor lr"])
def test_a_learning_rate_schedule_is_followed_every_step(tensor_lr):
    """The factors 1 - lr * rate are made at each commit from the learning rate the group has then: a
    schedule (a new float each step, or a tensor lr that the scheduler fills in place) decays by each
    step's lr, bitwise the hand-written decay before torch's SGD. (With a tensor lr filled in place, the
    first step's factors were kept before.)"""
    torch.manual_seed(0)
    m = _net()
    ref = copy.deepcopy(m)
    lr = (lambda: torch.tensor(0.2)) if tensor_lr else (lambda: 0.2)
    opt, sched = _sgd_with_schedule(m, lr())
    ref_opt, ref_sched = _sgd_with_schedule(ref, lr())
    pu.weight_decay(m, 0.05)
    _train_both(m, opt, sched, ref, ref_opt, ref_sched, {p: 0.05 if p.ndim > 1 else 0.0 for p in ref.parameters()})
    assert float(opt.param_groups[0]["lr"]) < 0.2  # the schedule moved it


def test_per_parameter_rates_in_one_group_follow_the_schedule():
    """Several (param group, rate) combinations in one foreach group: each tensor gets its own factor."""
    torch.manual_seed(0)
    m = _net()
    m[2].weight = pu.Parameter(m[2].weight.detach().clone(), weight_decay=0.3)
    ref = copy.deepcopy(m)
    opt, sched = _sgd_with_schedule(m, 0.2)
    ref_opt, ref_sched = _sgd_with_schedule(ref, 0.2)
    pu.weight_decay(m, 0.05)
    rates = {p: 0.05 if p.ndim > 1 else 0.0 for p in ref.parameters()}
    rates[ref[2].weight] = 0.3
    _train_both(m, opt, sched, ref, ref_opt, ref_sched, rates)
