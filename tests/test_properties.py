"""Property tests: paramupdates agrees with the reference interpreter on random programs.

Every generated program (``programs.py``: assign / assign_add / assign_sub /
assign_key, reads in between, ``when`` with bool and tensor predicates,
nesting, Python loops, all phases, 1-3 micro-batches, with and without an
optimizer step, eager blocks outside steps) runs through paramupdates and
through ``reference_model.Reference``; both must agree **bitwise** on every
read, on each step's schedule() (phase, target, op, condition, in commit
order) and on the final state (values are small dyadic numbers, so float32
arithmetic on them is exact and the comparison is not a tolerance).

540 programs per run (100 with declared rules; plus 120 with injected faults in test_faults.py), derandomized so CI is deterministic.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramupdates.rules import base as rules_base
from programs import PuRunner, programs, programs_with_rules
from reference_model import Reference

SETTINGS = {"deadline": None, "derandomize": True, "suppress_health_check": [HealthCheck.too_slow]}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check(program: list, driver: str, rules: list | None = None) -> None:
    ref = Reference(rules=list(rules or []))
    ref.run(program)
    run = PuRunner(driver, rules=rules)
    try:
        run.run(program)
    finally:
        for r in rules_base.declared():
            r.remove()
    assert len(run.reads) == len(ref.reads)
    for i, (got, want) in enumerate(zip(run.reads, ref.reads)):
        assert _same(got, want), f"read #{i}: paramupdates {got!r}, reference {want!r}"
    state = run.state()
    assert sorted(state) == sorted(ref.state)
    for k, want in ref.state.items():
        assert _same(state[k], want), f"final {k}: paramupdates {state[k]!r}, reference {want!r}"
    assert run.schedules == ref.schedules  # schedule(): phase order (rule 4)'s order, step by step
    for n in ("w", "tp"):  # gradients accumulate across micro-batches and optimizer-less steps
        g = getattr(run.m, n).grad
        assert (g is None) == (ref.grads[n] is None), n
        if g is not None:
            assert _same(g.numpy(), ref.grads[n]), n


@settings(max_examples=220, **SETTINGS)
@given(programs())
def test_pu_step_agrees_with_reference(program):
    check(program, "step")


@settings(max_examples=110, **SETTINGS)
@given(programs())
def test_stepper_run_agrees_with_reference(program):
    check(program, "run")


@settings(max_examples=110, **SETTINGS)
@given(programs(eager=False))
def test_attach_agrees_with_reference(program):
    check(program, "attach")


@settings(max_examples=100, **SETTINGS)
@given(programs_with_rules(), st.sampled_from(["step", "run", "attach"]))
def test_declared_rules_agree_with_reference(rules_and_program, driver):
    """Declared rules run in their phase, before the issued updates, in declaration order,
    once per commit whatever the number of micro-batches, on the values of that moment."""
    rules, program = rules_and_program
    if driver == "attach":
        program = [s for s in program if s[0] != "eager"]
    check(program, driver, rules)


def test_reference_examples():
    """The reference itself, on hand-computed cases (so the spec cannot drift silently)."""
    # read-your-writes in a loop, then commit order: before_grad, SGD, after_grad
    prog = [
        (
            "step",
            [
                [
                    ("loop", 2, [("upd", "assign_add", "w", ("const", 1), None, "after_grad"), ("read", "w")]),
                    ("upd", "assign", "w", ("const", 10), None, "before_grad"),
                    ("read", "w"),
                ]
            ],
            True,
            [([2, 2, 2], [0, 0, 0])],
        )
    ]
    ref = Reference()
    ref.run(prog)
    assert [r.tolist() for r in ref.reads] == [[3.0, 1.0, 0.0], [4.0, 2.0, 1.0], [10.0, 10.0, 10.0]]
    # commit: w = 10 (before_grad), w -= 0.5 * 2 (SGD), w += 1 twice (after_grad)
    assert ref.state["w"].tolist() == [11.0, 11.0, 11.0]
    # when(False) records nothing; when(tensor(False)) records a no-op; nesting ANDs
    prog = [
        (
            "step",
            [
                [
                    (
                        "when",
                        ("tensor", True),
                        [
                            ("when", ("bool", False), [("upd", "assign", "buf", ("const", 7), None, None)]),
                            ("when", ("gt", "cnt", None, 5), [("upd", "assign", "a", ("const", 7), None, None)]),
                            ("upd", "assign_add", "cnt", ("const", 1), None, None),
                        ],
                    ),
                ]
            ],
            False,
            [([0, 0, 0], [0, 0, 0])],
        )
    ]
    ref = Reference()
    ref.run(prog)
    assert ref.state["buf"].tolist() == [0.0, 1.0, 2.0] and ref.state["a"].tolist() == [1.0, -2.0, 3.0]
    assert int(ref.state["cnt"]) == 1
    check(prog, "step")
