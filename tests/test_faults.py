"""Fault injection: an exception anywhere inside a step changes nothing (rule 7).

An exception raised at a random point of a step (in user code, inside a
declared rule of any phase, inside the optimizer before or after it wrote,
in validation at record time or at commit) must leave every parameter,
buffer, optimizer state, rule state (an EMA-like shadow copy and Python
counters) and step counter bitwise as before the step, with the overlay
gone; and the next step must work normally: a run with failed attempts
interleaved ends bitwise equal to the same run without them.

Two harnesses:

* ``test_fault_in_random_program``: hypothesis programs (``programs.py``)
  with a fault raised before a random statement of a random step, checked
  against the reference interpreter (the faulted step never happened);
* ``test_fault_matrix``: a seeded loop of 120 random scenarios over every
  fault site x {pu.step, pu.attach}, checked against a clean run.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import paramupdates as pu
from paramupdates import _state
from paramupdates.rules.base import Rule, register, unregister
from programs import Fault, PuRunner, count_statements, programs
from reference_model import Reference

from conftest import assert_same, bits, snapshot

# ---------------------------------------------------------------------------
# 1. random programs, fault before a random statement of a random step
# ---------------------------------------------------------------------------
_TAIL = ("step", [[("upd", "assign_add", "cnt", ("const", 1), None, None), ("read", "buf")]], True,
         [([1, 1, 1], [1, 1, 1])])


def _state_bytes(run: PuRunner) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in run.state().items()}


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from(["step", "run"]))
def test_fault_in_random_program(program, seg_pick, stmt_pick, driver):
    program = [*program, _TAIL]
    steps = [i for i, s in enumerate(program) if s[0] == "step" and count_statements([s]) > 0]
    assume(steps)
    target = steps[seg_pick % len(steps)]
    k = stmt_pick % count_statements([program[target]])

    run, ref = PuRunner(driver), Reference()
    for i, seg in enumerate(program):
        if i != target:
            run.run([seg])
            ref.run([seg])
            continue
        before = _state_bytes(run)
        n_reads = len(run.reads)
        run.fault_at = run.executed + k
        with pytest.raises(Fault):
            run.run([seg])
        run.fault_at = None
        assert _state_bytes(run) == before  # nothing the step issued was written
        assert not _state.explicit and not _state.pu_pending  # the overlay is gone
        assert run.m._buffers["buf"] is run.m.buf and run.m._buffers["cnt"] is run.m.cnt
        del run.reads[n_reads:]
        ref.grads = {n: None for n in ref.grads}  # the runner zero_grads after a failed step
    got = run.state()
    for name, want in ref.state.items():
        assert got[name].tobytes() == want.tobytes(), name
    assert [r.tobytes() for r in run.reads] == [r.tobytes() for r in ref.reads]


# ---------------------------------------------------------------------------
# 2. the fault matrix: rules, optimizer, validation, user code; step and attach
# ---------------------------------------------------------------------------
class Injected(RuntimeError):
    pass


class Tally(Rule):
    """A declared rule that writes a model buffer and counts its calls; can fail after writing."""

    kind = "tally"

    def __init__(self, t: torch.Tensor, phase: str) -> None:
        super().__init__("test_faults.py")
        self.phase = phase
        self.t = t
        self.calls = 0
        self.fail = False

    def tensors(self):
        return [self.t]

    def apply(self, ctx):
        self.calls += 1
        self.t.mul_(0.5).add_(float(self.calls))
        if self.fail:
            raise Injected(f"rule {self.phase}")

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = int(state["calls"])

    def save(self):
        return self.calls

    def restore(self, saved):
        self.calls = saved


class Shadow(Rule):
    """An EMA-like rule (phase after_step): shadow copies outside the model, an update counter.

    ``shadow <- d * shadow + (1 - d) * param`` with ``d = min(decay, (1 + n) / (10 + n))``;
    fails (if armed) after updating half of the copies.
    """

    phase = "after_step"
    kind = "shadow"

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        super().__init__("test_faults.py")
        self.params = [p for p in model.parameters()]
        self.copies = [p.detach().clone() for p in self.params]
        self.decay = decay
        self.n = 0
        self.fail = False

    def tensors(self):
        return self.copies

    def owner_tensors(self):
        return self.params

    def apply(self, ctx):
        d = min(self.decay, (1 + self.n) / (10 + self.n))
        for i, (c, p) in enumerate(zip(self.copies, self.params)):
            c.mul_(d).add_(p.detach(), alpha=1 - d)
            if self.fail and i == len(self.copies) // 2:
                raise Injected("rule after_step (shadow)")
        self.n += 1

    def state_dict(self):
        return {"n": self.n, "copies": [c.clone() for c in self.copies]}

    def load_state_dict(self, state):
        self.n = int(state["n"])
        for c, v in zip(self.copies, state["copies"]):
            c.copy_(v)

    def save(self):
        return self.n

    def restore(self, saved):
        self.n = saved


class Flaky(torch.optim.AdamW):
    """AdamW that can fail before it writes anything or after it wrote everything."""

    fail: str | None = None

    def step(self, closure=None):
        if self.fail == "before":
            raise Injected("optimizer before")
        out = super().step(closure)
        if self.fail == "after":
            raise Injected("optimizer after")
        return out


class Net(nn.Module):
    """Auxiliary updates, phased updates of trainable parameters, conditions, a counter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = pu.Parameter(torch.ones(3), auxiliary=True)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("acc", torch.zeros(3))
        self.register_buffer("tally", torch.zeros(3))
        self.fault: str | None = None

    def forward(self, x):
        if self.fault == "user_begin":
            raise Injected("user begin")
        y = self.lin(x)
        with pu.when(self.training):
            pu.assign_add(self.count, 1)
            pu.assign_add(self.acc, y.detach().mean(0))
            with pu.when(y.detach().mean() > 0):
                self.scale.assign(self.scale * 0.9 + 0.1)
        if self.fault == "user_mid":
            raise Injected("user mid")
        if self.fault == "shape":
            pu.assign(self.acc, torch.zeros(5))  # UpdateError at its call site
        if self.fault == "nonfinite":
            pu.assign_key(self.acc, 1, float("inf"))  # UpdateError at commit
        pu.assign_sub(self.lin.bias, 0.01 * pu.read(self.lin.bias), phase="before_grad")
        pu.assign(self.lin.weight, pu.read(self.lin.weight).clamp(-0.5, 0.5), phase="after_grad")
        return (y * self.scale).pow(2).mean()


SITES = ["user_begin", "user_mid", "user_end", "shape", "nonfinite", "rule:before_grad", "rule:after_grad",
         "rule:auxiliary", "rule:after_step", "optimizer:before", "optimizer:after"]
USER_SITES = ("user_begin", "user_mid", "user_end", "shape")
N_STEPS = 4


def _data(i: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(1000 + i))


class Harness:
    def __init__(self, driver: str) -> None:
        torch.manual_seed(0)
        self.m = Net()
        self.opt = Flaky(self.m.parameters(), lr=0.05, weight_decay=0.01)
        self.rules = [register(Tally(self.m.tally, ph)) for ph in ("before_grad", "after_grad", "auxiliary")]
        self.shadow = register(Shadow(self.m))
        self.rules.append(self.shadow)
        self.driver = driver
        self.owner = pu.attach(self.m, self.opt) if driver == "attach" else pu.Stepper(self.m, self.opt)

    def close(self) -> None:
        for r in self.rules:
            unregister(r)
        if self.driver == "attach":
            self.owner.detach()

    def step(self, x: torch.Tensor) -> None:
        if self.driver == "attach":
            self.m(x).backward()
            if self.m.fault == "user_end":
                raise Injected("user end")
            self.opt.step()
        else:
            with self.owner:
                self.m(x).backward()
                if self.m.fault == "user_end":
                    raise Injected("user end")
        self.opt.zero_grad()

    def arm(self, site: str | None) -> None:
        self.m.fault = site if site and not site.startswith(("rule", "optimizer")) else None
        self.opt.fail = site.split(":")[1] if site and site.startswith("optimizer") else None
        for r in self.rules:
            r.fail = site == f"rule:{r.phase}"

    def everything(self) -> list:
        """Every tensor and counter a step may touch, bitwise."""
        out = snapshot(self.m)
        params = [p for g in self.opt.param_groups for p in g["params"]]
        for j, p in enumerate(params):  # optimizer state keyed by position, comparable across runs
            for k, v in sorted(self.opt.state.get(p, {}).items()):
                out.append((f"opt{j}.{k}", v.clone() if torch.is_tensor(v) else v))
        out.append(("opt.nstate", len(self.opt.state)))
        for i, r in enumerate(self.rules):
            for k, v in r.state_dict().items():
                out.extend((f"rule{i}.{k}{j}", t.clone()) for j, t in enumerate(v if isinstance(v, list) else [v])
                           if torch.is_tensor(t))
                if not isinstance(v, list):
                    out.append((f"rule{i}.{k}", v if not torch.is_tensor(v) else "tensor"))
        sd = self.owner.state_dict()
        out += [("steps", sd["steps"]), ("skipped", sd["skipped_steps"]), ("n_rules", len(sd["rules"]))]
        return out


def _clean(driver: str) -> list:
    h = Harness(driver)
    try:
        for i in range(N_STEPS):
            h.step(_data(i))
        return h.everything()
    finally:
        h.close()


def _scenario(rng: random.Random, driver: str, clean: list, site: str) -> None:
    h = Harness(driver)
    try:
        faults = {rng.randrange(N_STEPS): site, rng.randrange(N_STEPS): rng.choice(SITES)}
        for i in range(N_STEPS):
            if i in faults:
                before = h.everything()
                acc, count = h.m.acc, h.m.count
                h.arm(faults[i])
                with pytest.raises((Injected, pu.UpdateError)):
                    h.step(_data(100 + i))  # the failed attempt sees other data
                h.arm(None)
                if driver == "attach" and faults[i] in USER_SITES:
                    # under attach an exception in user code is invisible to the library:
                    # the documented fix is discard() in the except block. Failures inside
                    # optimizer.step() (optimizer, rules, validation) roll back by themselves.
                    h.owner.discard()
                h.opt.zero_grad()
                assert not _state.explicit and not _state.pu_pending  # the overlay is gone
                assert h.m._buffers["acc"] is acc and h.m._buffers["count"] is count
                assert_same(before, h.everything())
            h.step(_data(i))
        assert_same(clean, h.everything())
    finally:
        h.close()


def test_fault_matrix():
    rng = random.Random(7)
    for driver in ("step", "attach"):
        clean = _clean(driver)
        assert ("steps", N_STEPS) in clean
        for j in range(60):
            site = SITES[j % len(SITES)]
            try:
                _scenario(rng, driver, clean, site)
            except AssertionError as e:
                raise AssertionError(f"driver={driver} scenario {j} site={site}: {e}") from e


def test_fault_sites_really_fire():
    """Each armed site raises, and from where it says (so the matrix cannot pass vacuously)."""
    for driver in ("step", "attach"):
        for site in SITES:
            h = Harness(driver)
            try:
                h.step(_data(0))
                h.arm(site)
                with pytest.raises((Injected, pu.UpdateError)) as ei:
                    h.step(_data(1))
                if site.startswith(("rule", "optimizer", "user")) and site != "user_end":
                    assert site.split(":")[-1].replace("_", " ") in str(ei.value).replace("_", " ")
            finally:
                if driver == "attach":
                    h.owner.discard()
                h.close()


# ---------------------------------------------------------------------------
# 3. named cases (moved from test_atomic.py)
# ---------------------------------------------------------------------------
def test_first_step_failure_removes_created_optimizer_state():
    m = Net()
    opt = Flaky(m.parameters(), lr=0.1)
    opt.fail = "after"
    before = snapshot(m, opt)
    with pytest.raises(Injected):
        with pu.step(m, opt):
            m(_data(0)).backward()
    assert len(opt.state) == 0
    assert_same(before, snapshot(m, opt))


def test_rule_failure_restores_python_counters_and_next_step_runs_it_once():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    rule = register(Tally(m.tally, "after_step"))
    rule.fail = True
    with pytest.raises(Injected):
        with pu.step(m, opt):
            m(_data(0)).backward()
    assert rule.calls == 0 and torch.equal(bits(m.tally), bits(torch.zeros(3)))
    rule.fail = False
    opt.zero_grad()
    with pu.step(m, opt):
        m(_data(0)).backward()
    assert rule.calls == 1 and torch.equal(m.tally, torch.ones(3)) and int(m.count) == 1


def test_attach_failed_optimizer_step_rolls_back_at_once_and_next_step_counts():
    """Under attach, optimizer.step() raising restores everything before the exception
    propagates (no discard() needed); the next forward's updates form a new step."""
    m = Net()
    opt = Flaky(m.parameters(), lr=0.1)
    att = pu.attach(m, opt)
    m(_data(0)).backward()
    opt.step()
    opt.zero_grad()
    before = snapshot(m, opt)
    m(_data(1)).backward()
    opt.fail = "after"
    with pytest.raises(Injected):
        opt.step()
    assert_same(before, snapshot(m, opt))
    assert not _state.pu_pending and att.steps == 1
    opt.fail = None
    opt.zero_grad()
    m(_data(2)).backward()
    opt.step()
    assert int(m.count) == 2 and att.steps == 2  # the third forward's updates were committed


def test_attach_subclassed_optimizer_commits_once():
    """An optimizer subclass calling super().step() runs the hooks of both classes
    (PyTorch hooks every class's step): the attachment commits once, at the outer call."""
    torch.optim.AdamW(nn.Linear(1, 1).parameters())  # makes sure AdamW.step itself is hooked
    m = Net()
    opt = Flaky(m.parameters(), lr=0.1)
    rule = register(Tally(m.tally, "after_step"))
    pu.attach(m, opt)
    m(_data(0)).backward()
    opt.step()
    assert rule.calls == 1 and int(m.count) == 1
