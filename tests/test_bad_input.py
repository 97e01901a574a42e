"""The bad-input catalogue: every misuse raises an error that names the target,
the call site (file:line of the offending line) and the fix, and changes nothing.

| bad input                                        | error                 | test |
|--------------------------------------------------|-----------------------|------|
| wrong shape                                      | UpdateError           | test_operand_errors[shape] |
| wrong dtype kind (float tensor / float into int) | UpdateError           | test_operand_errors[dtype-*] |
| wrong device (meta)                              | UpdateError           | test_operand_errors[device] |
| bad key / not a tensor or number                 | UpdateError           | test_operand_errors[key,type] |
| a tensor that belongs to no module               | UpdateError           | test_tensor_of_no_module |
| a computed tensor (an op's output) as a target    | UpdateError           | test_computed_tensor_as_target |
| an update issued during backward (hook)          | UpdateError           | test_update_from_backward_hook |
| a parameter of a model not registered with step  | UpdateError           | test_parameter_of_another_model |
| when() with a non-scalar / non-bool tensor       | ValueError            | test_when_non_scalar |
| NaN / inf, on_nonfinite="raise"                  | UpdateError           | test_nonfinite_raise |
| NaN / inf, on_nonfinite="skip"                   | skipped, counted      | test_nonfinite_skip* |
| assigning a transformed tensor, no right_inverse | UpdateError           | test_parametrization_without_right_inverse |
| nested pu.step blocks                            | UpdateError           | test_nested_steps |
| unphased update of a trainable parameter         | AmbiguousOrderError   | test_ambiguous.py |
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import paramupdates as pu

from conftest import assert_same, snapshot
from models import Counter
from models import trained_counter as _trained

HERE = "test_bad_input.py"


def _line(offset: int = 1) -> int:
    """The line number ``offset`` lines below the caller's line."""
    return inspect.currentframe().f_back.f_lineno + offset


def check_message(msg: str, target: str | None, line: int, *hints: str) -> None:
    """The message names the target, the call site and the fix."""
    if target is not None:
        assert target in msg, f"target {target!r} not named in: {msg}"
    assert f"{HERE}:{line}" in msg, f"call site {HERE}:{line} not named in: {msg}"
    for h in hints:
        assert h in msg, f"fix hint {h!r} missing from: {msg}"


OPERAND_CASES = {
    "shape": (lambda m: pu.assign(m.acc, torch.zeros(3)), "'acc'", ["shape", "exactly that shape or a scalar"]),
    "dtype-tensor": (
        lambda m: pu.assign(m.count, torch.tensor(1.5)),
        "'count'",
        ["losing its kind", "Convert it explicitly"],
    ),
    "dtype-number": (lambda m: pu.assign_add(m.count, 0.5), "'count'", ["float value", "Pass an int"]),
    "device": (lambda m: pu.assign(m.acc, torch.zeros(2, device="meta")), "'acc'", ["meta", "value.to('cpu')"]),
    "key": (lambda m: pu.assign_key(m.acc, 5, 1.0), "'acc'", ["bad key 5"]),
    "key-shape": (lambda m: pu.assign_key(m.acc, slice(0, 1), torch.zeros(3)), "'acc'", ["Index and value must match"]),
    "type": (lambda m: pu.assign(m.acc, "zero"), "'acc'", ["not a tensor or a Python number"]),
    "not-a-tensor": (lambda m: pu.assign([1.0], 1.0), None, ["not a tensor", "Pass a pu.Parameter"]),
}


@pytest.mark.parametrize("case", sorted(OPERAND_CASES))
@pytest.mark.parametrize("where", ["step", "eager"])
def test_operand_errors(case, where):
    bad, target, hints = OPERAND_CASES[case]
    m, opt = _trained()
    before = snapshot(m, opt)
    with pytest.raises(pu.UpdateError) as ei:
        if where == "step":
            with pu.step(m, opt):
                m(torch.randn(4, 3)).sum().backward()
                bad(m)
        else:
            bad(m)  # outside a step the same checks run before the in-place write
    check_message(str(ei.value), target, bad.__code__.co_firstlineno, *hints)
    assert_same(before, snapshot(m, opt))


def test_tensor_of_no_module():
    m = Counter()
    stray = torch.zeros(2)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m):
            line = _line()
            pu.assign(stray, torch.ones(2))
    check_message(str(ei.value), "<unnamed Tensor shape=(2,)", line, "Register it on that model")
    assert "computed tensor" not in str(ei.value)
    assert torch.equal(stray, torch.zeros(2))


def test_computed_tensor_as_target():
    m = Counter()
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m):
            w = m.lin.weight * 2  # a value computed from a parameter, not a stored tensor
            line = _line()
            pu.assign(w, torch.zeros(2, 3))
    check_message(
        str(ei.value),
        "<unnamed Tensor shape=(2, 3)",
        line,
        "computed tensor",
        "update the stored tensor it is computed from",
    )


def test_parameter_of_another_model():
    m, other = Counter(), Counter()
    pu.step(other)  # an index of `other` exists, so its tensors have names
    before = snapshot(m, other)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m):
            line = _line()
            pu.assign_add(other.acc, 1.0)
    check_message(str(ei.value), "'acc' of Counter", line, "nn.ModuleList", "pu.attach(other", "outside the step")
    assert_same(before, snapshot(m, other))


def test_update_from_backward_hook():
    m = Counter()
    x = torch.randn(2, 3, requires_grad=True)
    line = 0

    def hook(grad):
        nonlocal line
        line = _line()
        pu.assign_add(m.count, 1)
        return grad

    before = snapshot(m)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m):
            y = m.lin(x)
            y.register_hook(hook)
            y.sum().backward()
    check_message(str(ei.value), "'count'", line, "during backward", "issue them in forward", "pu.checkpoint")
    assert_same(before, snapshot(m))


@pytest.mark.parametrize(
    "pred,err",
    [
        (lambda: torch.ones(2, dtype=torch.bool), ValueError),
        (lambda: torch.tensor(1.0), ValueError),
        (lambda: torch.tensor([True]), ValueError),
        (lambda: 1, TypeError),
    ],
)
def test_when_non_scalar(pred, err):
    m = Counter()
    before = snapshot(m)
    with pytest.raises(err) as ei:
        with pu.step(m):
            line = _line()
            with pu.when(pred()):
                pu.assign_add(m.count, 1)
    msg = str(ei.value)
    check_message(msg, None, line, "0-dim torch.bool tensor")
    if err is ValueError:
        assert "Reduce the predicate first" in msg
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_raise(bad):
    m, opt = _trained()
    before = snapshot(m, opt)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m, opt, on_nonfinite="raise"):
            m(torch.randn(4, 3)).sum().backward()
            line = _line()
            pu.assign(m.acc, torch.tensor([1.0, bad]))
    check_message(str(ei.value), "'acc'", line, "Nothing was written", "on_nonfinite='skip'")
    assert_same(before, snapshot(m, opt))


def test_nonfinite_raise_names_the_first_few_of_many_and_counts_the_rest():
    """A NaN input poisons the statistics of every batch norm: the message names the first five
    targets with their call sites and says how many more (readable for a model of hundreds)."""
    m = pu.convert(nn.Sequential(*[nn.BatchNorm1d(2) for _ in range(10)]))
    before = snapshot(m)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m, on_nonfinite="raise"):
            m(torch.tensor([[float("nan"), 1.0], [2.0, 3.0]]))
    msg = str(ei.value)
    assert msg.count("(last update at ") == 5, msg
    assert "'0.running_mean'" in msg and "and 15 more" in msg, msg  # 20 statistics: mean and var of 10
    assert "Nothing was written" in msg
    assert_same(before, snapshot(m))


def test_nonfinite_raise_under_attach():
    m, opt = _trained()
    att = pu.attach(m, opt, on_nonfinite="raise")
    before = snapshot(m, opt)
    m(torch.randn(4, 3)).sum().backward()
    line = _line()
    pu.assign_key(m.acc, 0, float("nan"))
    with pytest.raises(pu.UpdateError) as ei:
        opt.step()
    check_message(str(ei.value), "'acc'", line, "on_nonfinite='skip'")
    assert_same(before, snapshot(m, opt))
    assert att.steps == 0 and att.skipped_steps == 0


def test_nonfinite_skip_drops_whole_step_and_counts():
    m, opt = _trained()
    before = snapshot(m, opt)
    stepper = pu.Stepper(m, opt, on_nonfinite="skip")
    with stepper:
        m(torch.randn(4, 3)).sum().backward()
        pu.assign(m.acc, torch.tensor([float("nan"), 0.0]))
    assert stepper.skipped and stepper.skipped_steps == 1 and stepper.steps == 0
    assert_same(before, snapshot(m, opt))  # the optimizer did not step either
    opt.zero_grad()
    with stepper:
        m(torch.randn(4, 3)).sum().backward()
    assert not stepper.skipped and stepper.steps == 1
    assert stepper.state_dict()["skipped_steps"] == 1


def test_nonfinite_skip_under_attach():
    m, opt = _trained()
    att = pu.attach(m, opt, on_nonfinite="skip")
    before = snapshot(m, opt)
    m(torch.randn(4, 3)).sum().backward()
    pu.assign(m.acc, torch.tensor([float("inf"), 0.0]))
    opt.step()
    assert_same(before, snapshot(m, opt))  # optimizer ran without gradients: nothing moved
    assert att.skipped_steps == 1 and att.steps == 0
    assert m.lin.weight.grad is not None  # the gradients are given back to the user


def test_on_nonfinite_bad_value():
    with pytest.raises(ValueError, match="'raise' or 'skip'"):
        pu.Stepper(Counter(), on_nonfinite="ignore")


class _NoInverse(nn.Module):
    def forward(self, w):
        return w.clamp(min=0)


def test_parametrization_without_right_inverse():
    m = nn.Sequential(nn.Linear(3, 2))
    parametrize.register_parametrization(m[0], "weight", _NoInverse())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = snapshot(m)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m, opt):
            w = m[0].weight  # computed by the parametrization: not a stored tensor
            line = _line()
            pu.assign(w, torch.zeros_like(w), phase="after_grad")
    check_message(str(ei.value), "0.weight", line, "right_inverse")
    assert_same(before, snapshot(m))


def test_nested_steps():
    m = Counter()
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m):
            line = _line()
            with pu.step(m):
                pass
    msg = str(ei.value)
    check_message(msg, "Counter", line, "do not nest", "Finish the outer step first")
    assert not pu.Stepper(m).pending_schedule()  # and no step is left open
    with pu.step(m):  # the next step works
        pu.assign_add(m.count, 1)
    assert int(m.count) == 1
