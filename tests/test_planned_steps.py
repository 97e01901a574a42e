"""Steps that run from a plan (issue 47): what differs from the plan falls back to the general path.

An attached optimizer's step with nothing to commit but its own update (nothing pending, no rule
declared, the default options) makes no commit: the optimizer runs, the step is counted and its
schedule is the gradient update alone. These tests check the guards of that plan: every way out of it
behaves as the commit does (the same writes, the same errors, the same counts), checked against a
twin run in which the plan cannot hold (a rule declared on another model keeps the process's rule
registry non-empty: the general path).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import paramupdates as pu


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), pu.nn.BatchNorm1d(4), nn.Linear(4, 2))


def _train(m: nn.Module, opt: torch.optim.Optimizer, steps: int, issue: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 4, generator=g)
        if issue:
            m(x).square().mean().backward()
        else:  # (nothing issued: gradients set by hand)
            for p in m.parameters():
                p.grad = torch.full_like(p, float(x[0, 0]))
        opt.step()
    return [t.detach().clone() for t in m.state_dict().values()]


class _Other(nn.Module):
    """A model of its own, with a rule: the process's registry is not empty, so no step runs from the plan."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        pu.constrain(self.w, pu.non_neg())


@pytest.mark.parametrize("issue", [False, True], ids=["nothing-issued", "batch-norm"])
def test_a_step_with_nothing_to_commit_is_the_commit_bitwise(issue):
    """With nothing issued (gradients set by hand, the model in eval) or with a batch norm's statistics
    (a commit each step), the attached run equals the run where the plan cannot hold, bitwise, and both
    count every step."""
    out = []
    for other in (None, _Other()):
        m = _model()
        if not issue:
            m.eval()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        att = pu.attach(m, opt)
        out.append(_train(m, opt, 4, issue))
        assert att.steps == 4
        rows = att.schedule().phases()
        assert rows == (["grad", "auxiliary", "auxiliary", "auxiliary"] if issue else ["grad"])
        att.detach()
        del other
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_the_plan_of_an_idle_step_is_the_gradient_update_alone():
    m = _model().eval()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    att = pu.attach(m, opt)
    _train(m, opt, 2, issue=False)
    (row,) = list(att.schedule())
    assert (row.phase, row.target, row.op) == ("grad", "<optimizer parameters>", "SGD.step")
    assert "test_planned_steps.py" in row.origin


def test_a_rule_declared_after_idle_steps_applies_at_the_next_step():
    """The plan holds only while no rule is declared: the first step after a declaration commits it."""
    m = _model().eval()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    att = pu.attach(m, opt)
    _train(m, opt, 2, issue=False)
    pu.constrain(m[0].weight, pu.clamp(-0.01, 0.01))
    _train(m, opt, 1, issue=False)
    assert m[0].weight.abs().max() <= 0.01
    assert "after_grad" in att.schedule().phases()


class _Probing(torch.optim.SGD):
    """An optimizer whose step issues an update (as an optimizer that runs the model would)."""

    def __init__(self, params, counter: torch.Tensor, phase: str | None) -> None:
        super().__init__(params, lr=0.1)
        self.counter, self.phase = counter, phase

    probing = True

    def step(self, closure=None):  # type: ignore[override]
        if self.probing:
            pu.assign_add(self.counter, 1, phase=self.phase)
        return super().step(closure)


def _probing_model() -> nn.Module:
    m = _model().eval()
    m.register_buffer("calls", torch.zeros((), dtype=torch.int64))
    return m


def test_an_update_issued_inside_an_idle_step_commits_with_it():
    """The update makes the step's commit (as the pre-hook makes it): it commits in its phase in the same
    optimizer step, nothing stays pending, and the schedule shows it."""
    m = _probing_model()
    opt = _Probing(m.parameters(), m.calls, None)
    att = pu.attach(m, opt)
    _train(m, opt, 3, issue=False)
    assert int(m.calls) == 3
    assert att.pending_schedule().phases() == []
    assert att.schedule().phases() == ["grad", "auxiliary"]
    assert att.steps == 3


def test_a_before_grad_update_inside_an_idle_step_raises_as_in_a_commit():
    """Inside the optimizer's step the ``before_grad`` phase is over: the update raises, naming the
    phase, and the step is rolled back as any failed commit (nothing written: the weights are as before)."""
    m = _probing_model()
    opt = _Probing(m.parameters(), m.calls, "before_grad")
    pu.attach(m, opt)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    before = [t.clone() for t in m.state_dict().values()]
    with pytest.raises(pu.UpdateError, match="before_grad"):
        opt.step()
    for a, b in zip(before, m.state_dict().values()):
        assert torch.equal(a, b)


def test_an_optimizer_step_that_raises_in_an_idle_step_counts_nothing():
    m = _model().eval()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    att = pu.attach(m, opt)

    def boom(*_a, **_k):
        raise RuntimeError("boom")

    h = opt.register_step_pre_hook(boom)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    h.remove()
    assert att.steps == 0
    opt.step()
    assert att.steps == 1


# --- random programs: the plan against the general path ------------------------------------------------
ACTIONS = ("idle", "forward", "eval-forward", "declare", "remove", "replace", "probe", "flush", "freeze")


def _run_program(actions: list[str], planned: bool, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Run ``actions`` on an attached model (each ending with an optimizer step, but ``flush``); with
    ``planned=False`` no step may run from its plan (the general path, the reference)."""
    if not planned:
        monkeypatch.setattr(pu.Attachment, "_nothing_to_commit", lambda self, *a: False)
    m = _probing_model()
    opt = _Probing(m.parameters(), m.calls, None)
    opt.probing = False
    att = pu.attach(m, opt)
    rules: list[pu.Rule] = []
    g = torch.Generator().manual_seed(2)
    out: list[torch.Tensor] = []
    for a in actions:
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        if a in ("forward", "eval-forward"):
            m.train(a == "forward")
            m(x).square().mean().backward()
        elif a == "declare":
            rules.append(pu.constrain(m[2].weight, pu.clamp(-0.2, 0.2)))
        elif a == "remove" and rules:
            rules.pop().remove()
        elif a == "replace":
            torch.manual_seed(len(out))
            m[2] = nn.Linear(4, 2)  # (a layer the optimizer does not step: a rule on it is lost, loudly)
        elif a == "freeze":
            m[0].weight.requires_grad_(not m[0].weight.requires_grad)
        for p in m.parameters():
            if p.grad is None and p.requires_grad:
                p.grad = torch.full_like(p, float(x[0, 0]))
        opt.probing = a == "probe"
        try:
            if a == "flush":
                att.flush()
            else:
                opt.step()
        except pu.UpdateError as e:
            out.append(torch.tensor(hash(str(e).split(" at ")[0]) % 1000))
        out += [t.detach().clone() for t in m.state_dict().values()]
        out.append(torch.tensor([att.steps, len(att.schedule())]))
    att.detach()
    for r in rules:
        r.remove()
    return out


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=12))
def test_random_programs_run_from_the_plan_as_on_the_general_path(actions):
    """Random sequences of steps and changes between them (nothing issued, a forward in train or eval
    mode, a rule declared or removed, a layer replaced, a parameter frozen or thawed, an update issued
    inside the optimizer's step, a flush): every tensor of the model, the step counts, the schedules'
    lengths and the errors are those of the same program on the general path."""
    with pytest.MonkeyPatch.context() as mp:
        ref = _run_program(actions, False, mp)
    with pytest.MonkeyPatch.context() as mp:
        got = _run_program(actions, True, mp)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.shape == b.shape and torch.equal(a, b)
