"""schedule(): the ordered plan; commit: grouped foreach kernels, not a loop per tensor."""

import inspect

import torch
from torch import nn

import paramupdates as pu


class Many(nn.Module):
    def __init__(self, n=12):
        super().__init__()
        for i in range(n):
            self.register_buffer(f"b{i}", torch.zeros(3))
        self.register_buffer("h", torch.zeros(3, dtype=torch.float64))


def test_schedule_rows_and_table():
    m = Many(2)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pu.step(m, opt) as s:
        line = inspect.currentframe().f_lineno + 1
        pu.assign_add(m.b1, 1.0, phase="after_step")
        with pu.when(torch.tensor(True)):
            pu.assign(m.b0, torch.ones(3), phase="before_grad")
    sched = s.schedule()
    assert [(r.phase, r.target, r.op, r.condition) for r in sched] == [
        ("before_grad", "b0", "assign", "when(tensor)"),
        ("grad", "<optimizer parameters>", "SGD.step", "-"),
        ("after_step", "b1", "assign_add", "-"),
    ]
    assert sched[2].origin.endswith(f"test_schedule_and_commit.py:{line}")
    text = str(sched)
    assert text.splitlines()[0].split() == ["#", "phase", "target", "op", "condition", "origin"]
    assert "when(tensor)" in text and "SGD.step" in text


def test_commit_uses_one_foreach_copy_per_device_and_dtype(monkeypatch):
    m = Many(12)
    calls = []
    real = torch._foreach_copy_

    def counting(dst, src, *a, **k):
        calls.append(len(dst))
        return real(dst, src, *a, **k)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    with pu.step(m):
        for i in range(12):
            pu.assign(getattr(m, f"b{i}"), torch.full((3,), float(i)))
        pu.assign(m.h, torch.ones(3, dtype=torch.float64))
    assert sorted(calls) == [1, 12]  # float32 group and float64 group
    assert all(float(getattr(m, f"b{i}")[0]) == i for i in range(12))
