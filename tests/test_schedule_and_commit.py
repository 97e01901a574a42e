"""schedule(): the ordered plan; commit: grouped foreach kernels, not a loop per tensor."""

import contextlib
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


def _count_foreach_copies(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch._foreach_copy_

    def counting(dst, src, *a, **k):
        calls.append(len(dst))
        return real(dst, src, *a, **k)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    return calls


def test_commit_copies_on_cpu_with_one_foreach_call_whatever_the_dtypes(monkeypatch):
    # torch._foreach_copy_ on CPU copies pair by pair (Tensor.copy_, any dtypes): grouping by dtype
    # first would only add a pass over the tensors
    m = Many(12)
    calls = _count_foreach_copies(monkeypatch)
    with pu.step(m):
        for i in range(12):
            pu.assign(getattr(m, f"b{i}"), torch.full((3,), float(i)))
        pu.assign(m.h, torch.full((3,), 0.1, dtype=torch.float64))
    assert calls == [13]
    assert all(float(getattr(m, f"b{i}")[0]) == i for i in range(12))
    assert m.h.dtype == torch.float64 and torch.equal(m.h, torch.full((3,), 0.1, dtype=torch.float64))


def test_batch_norm_statistics_commit_in_one_foreach_call_on_cpu(monkeypatch):
    # the rows of pu.nn's statistics: float32 means and variances and int64 counters, one call
    model = nn.Sequential(pu.nn.BatchNorm1d(3), pu.nn.BatchNorm1d(3))
    reference = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    x = torch.randn(5, 3)
    calls = _count_foreach_copies(monkeypatch)
    with pu.step(model):
        model(x)
    reference(x)
    assert calls == [6]
    for mine, theirs in zip(model.state_dict().values(), reference.state_dict().values()):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


def test_off_cpu_pairs_are_copied_per_device_and_dtype(monkeypatch):
    # an accelerator's one-launch path needs one device and dtype: one call per group (meta tensors
    # stand in for a device here; CPU takes the one-call path above)
    from paramupdates.commit.driver import copy_pairs

    dst = [torch.empty(3, device="meta") for _ in range(4)] + [torch.empty(2, device="meta", dtype=torch.int64)]
    src = [torch.empty_like(t) for t in dst]
    calls = _count_foreach_copies(monkeypatch)
    copy_pairs(dst, src)
    assert sorted(calls) == [1, 4]


def test_a_batch_norms_rows_show_their_condition_step_by_step():
    """A batch norm call's statistics (one row) show the condition they were recorded under, step
    by step: a row under a condition is never shown as plain, nor the other way round."""
    torch.manual_seed(0)
    model = pu.convert(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    x = torch.randn(5, 3)
    seen = []
    for how in ("plain", "when", "plain", "twice", "plain", "when"):
        with pu.step(model) as s:
            with pu.when(torch.tensor(True)) if how == "when" else contextlib.nullcontext():
                for _ in range(2 if how == "twice" else 1):
                    model(x)  # (one line: the statistics' origin is the user's call of the model)
        seen.append([(e.target, e.op, e.condition, e.origin) for e in s.schedule() if e.phase == "auxiliary"])
    names = ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    origin = seen[0][0][3]
    assert "test_schedule_and_commit.py" in origin  # the user's call of the model (issue 38)
    plain = [(n, op, "-", origin) for n, op in zip(names, ("assign_add", "assign", "assign"))]
    assert seen[0] == seen[2] == seen[4] == plain
    assert seen[1] == seen[5] == [(n, op, "when(tensor)", o) for n, op, _c, o in plain]
    assert [(n, c) for n, _op, c, _o in seen[3]] == [(n, "-") for _ in range(2) for n in names]


def test_a_rows_updates_keep_their_place_in_the_issue_order_when_it_becomes_entries():
    """A batch norm call's three statistics are one row; a later update of one of them turns the
    row into entries in the row's own place: the schedule lists every update in issue order, and
    the later update composes after the statistics (rule 4: issue order within a phase)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), pu.nn.BatchNorm1d(4))
    model.register_buffer("a", torch.zeros(2))
    model.register_buffer("b", torch.zeros(2))
    ref = nn.BatchNorm1d(4)
    x = torch.randn(5, 3)
    with pu.step(model) as s:
        pu.assign(model.a, torch.ones(2))
        model(x)
        pu.assign(model.b, torch.ones(2))
        pu.assign_add(model[1].running_mean, torch.ones(4))  # the row becomes entries here
    ref(model[0](x))
    aux = [(e.target, e.op) for e in s.schedule() if e.phase == "auxiliary"]
    assert aux == [
        ("a", "assign"),
        ("1.num_batches_tracked", "assign_add"),
        ("1.running_mean", "assign"),
        ("1.running_var", "assign"),
        ("b", "assign"),
        ("1.running_mean", "assign_add"),
    ]
    assert torch.equal(
        model[1].running_mean, ref.running_mean + torch.ones(4)
    )  # assign_add's own formula: old + operand
    assert torch.equal(model[1].running_var, ref.running_var) and int(model[1].num_batches_tracked) == 1
    assert torch.equal(model.a, torch.ones(2)) and torch.equal(model.b, torch.ones(2))
