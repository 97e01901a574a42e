"""Rule 4: the fixed five-phase commit order, issue order inside a phase."""

import pytest
import torch
from torch import nn

import paramupdates as pu
from paramupdates.rules.base import Rule, register


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0]))
        self.register_buffer("t", torch.tensor([0.0]))


def test_phase_order_not_issue_order():
    m = Two()
    with pu.step(m) as s:
        # issued in reverse phase order
        pu.assign_add(m.t, 1.0, phase="after_step")
        pu.assign_add(m.t, 5.0)  # auxiliary
        pu.assign_sub(m.t, 3.0, phase="after_grad")
        pu.assign(m.t, torch.tensor([10.0]), phase="before_grad")
    # before_grad: 10, after_grad: 7, auxiliary: 12, after_step: 13 (issue order would give 10+5-3+... != 13)
    assert float(m.t) == 13.0
    assert s.schedule().phases() == ["before_grad", "after_grad", "auxiliary", "after_step"]


@pytest.mark.parametrize(
    "first,second",
    [
        ("before_grad", "after_grad"),
        ("after_grad", "auxiliary"),
        ("auxiliary", "after_step"),
    ],
)
def test_each_adjacent_pair_of_phases_commits_in_order(first, second):
    """assign and assign_add do not commute: swapping two phases changes the result."""
    m = Two()
    with pu.step(m):
        pu.assign(m.t, torch.tensor([10.0]), phase=None if second == "auxiliary" else second)
        pu.assign_add(m.t, 1.0, phase=None if first == "auxiliary" else first)
    assert float(m.t) == 10.0  # first: 0 + 1, then second: = 10 (swapped would give 11)
    with pu.step(m):
        pu.assign_add(m.t, 1.0, phase=None if second == "auxiliary" else second)
        pu.assign(m.t, torch.tensor([5.0]), phase=None if first == "auxiliary" else first)
    assert float(m.t) == 6.0  # first: = 5, then second: + 1 (swapped would give 5)


def test_optimizer_between_before_and_after_grad():
    m = Two()
    opt = torch.optim.SGD([m.w], lr=1.0)
    with pu.step(m, opt) as s:
        pu.assign(m.w, torch.tensor([10.0]), phase="before_grad")
        pu.assign_add(m.w, 100.0, phase="after_grad")
        (m.w * 2.0).sum().backward()  # grad 2, computed at the committed w
    # 10 (before_grad) -> 10 - 1.0*2 (SGD) -> +100 (after_grad)
    assert float(m.w.detach()) == 108.0
    assert s.schedule().phases() == ["before_grad", "grad", "after_grad"]


def test_issue_order_inside_a_phase():
    m = Two()
    with pu.step(m):
        pu.assign(m.t, torch.tensor([5.0]), phase="after_grad")
        pu.assign_add(m.t, 2.0, phase="after_grad")
    assert float(m.t) == 7.0
    with pu.step(m):
        pu.assign_add(m.t, 2.0, phase="after_grad")
        pu.assign(m.t, torch.tensor([5.0]), phase="after_grad")
    assert float(m.t) == 5.0


class Recorder(Rule):
    """A declared rule that logs the value of its tensor when it runs."""

    kind = "recorder"

    def __init__(self, t, phase, log):
        super().__init__("test")
        self.t, self.phase, self.log = t, phase, log

    def tensors(self):
        return [self.t]

    def apply(self, ctx):
        self.log.append((self.phase, float(self.t)))
        self.t.mul_(2.0)


def test_declared_rules_run_first_in_their_phase_in_declaration_order():
    m = Two()
    log = []
    register(Recorder(m.t, "after_grad", log))
    register(Recorder(m.t, "before_grad", log))
    with pu.step(m) as s:
        pu.assign_add(m.t, 1.0, phase="before_grad")
        pu.assign_add(m.t, 1.0, phase="after_grad")
    # before_grad: rule (0 -> 0), +1 -> 1; after_grad: rule (1 -> 2), +1 -> 3
    assert log == [("before_grad", 0.0), ("after_grad", 1.0)]
    assert float(m.t) == 3.0
    assert [(r.phase, r.op) for r in s.schedule()] == [
        ("before_grad", "recorder"),
        ("before_grad", "assign_add"),
        ("after_grad", "recorder"),
        ("after_grad", "assign_add"),
    ]


def test_rules_run_once_per_optimizer_update_not_per_micro_batch():
    m = Two()
    log = []
    register(Recorder(m.t, "after_step", log))
    opt = torch.optim.SGD([m.w], lr=0.1)
    att = pu.attach(m, opt)
    for _ in range(2):
        for _ in range(3):  # three micro-batches
            (m.w * 1.0).sum().backward()
        opt.step()
        opt.zero_grad()
    assert len(log) == 2 and att.steps == 2
