"""Property test of rule 12 ("accounted for"): declared rules follow, by name, whatever the model holds.

Each seeded sequence (``accounting_reference.make_plan``) builds a tiny model and an optimizer, declares
a subset of ``pu.weight_decay`` / ``pu.constrain(max_norm)`` / ``pu.ema`` (on the model, on one layer, or
on a ``logit_scale`` the optimizer steps but the model does not hold), drives it with ``pu.attach`` (an
unchanged loop) or ``pu.step``, and between steps does what users do: replace a layer (keeping the old one
or not, with or without ``opt.add_param_group``), delete one and insert another in its place, tie two weights and untie them, wrap one LoRA-style, ``load_state_dict(assign=True)``
(then rebuild the optimizer or add the new tensors), register a parametrization, freeze and unfreeze,
``model.to(float64)`` and back. After every step the model, the optimizer state, the EMA copy and
``logit_scale`` must equal, bitwise, ``accounting_reference.Reference``: plain torch, the same rules
applied by name to what the model holds at that step; where a covered name vanished, the step must raise
``pu.UpdateError`` naming the rule, its declaration site and the name, with nothing written.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import paramupdates as pu
from accounting_reference import STEPS, Plan, Reference, RuleSpec, Session, build_model, inputs, loss_of, make_plan
from misuse_helpers import line_of

from conftest import bits

SEEDS = range(320)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (and contend on a shared machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class PuSide(Session):
    """The paramupdates side: the converted model, the rules declared through pu, the chosen driver."""

    def __init__(self, plan: Plan, model: nn.Module) -> None:
        super().__init__(plan, pu.convert(model))
        self.attachment: Any = None
        self.ema: nn.Module | None = None

    def attach(self) -> None:
        if self.plan.driver == "attach":
            self.attachment = pu.attach(self.model, self.opt)

    def rebuilt(self) -> None:
        if self.attachment is not None:
            self.attachment.detach()
            self.attach()

    def declare(self, spec: RuleSpec) -> tuple[int, Any]:
        """Declare ``spec`` through paramupdates; returns the line of the call and the constraint object."""
        model = self.model
        where = model if spec.on == "model" else model[spec.layer] if spec.on == "layer" else [self.logit]
        exclude: dict[str, Any] = {} if spec.exclude_1d else {"exclude": None}
        if spec.kind == "weight_decay":
            pu.weight_decay(where, spec.value, foreach=False, **exclude)  # MARK: weight_decay
            return line_of("MARK: weight_decay"), None
        if spec.kind == "constrain":
            c = pu.max_norm(spec.value)
            pu.constrain(where, c, foreach=False)  # MARK: constrain
            return line_of("MARK: constrain"), c
        self.ema = pu.ema(model, spec.value, foreach=False)  # MARK: ema
        return line_of("MARK: ema"), None

    def step(self, x: torch.Tensor) -> None:
        self.opt.zero_grad()
        self.model.zero_grad()
        if self.plan.driver == "step":
            with pu.step(self.model, self.opt):
                loss_of(self.model, x, self.logit).backward()
        else:
            loss_of(self.model, x, self.logit).backward()
            self.opt.step()


def assert_same(got: Any, want: Any, where: str) -> None:
    """Bitwise equality of nested dicts / lists of tensors (dtype included)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype} {got.shape}, want {want.dtype} {want.shape}"
        )
        assert torch.equal(bits(got), bits(want)), f"{where}: paramupdates {got}, reference {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: keys {list(got)}, want {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {got}, want {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r}, want {want!r}"


def assert_agree(pu_side: PuSide, ref: Reference, ema: Any, when: str) -> None:
    """The model, the optimizer state, ``logit_scale`` and the EMA copy, bitwise."""
    assert_same(pu_side.model.state_dict(), ref.model.state_dict(), f"{when}: model")
    assert_same(pu_side.opt.state_dict(), ref.opt.state_dict(), f"{when}: optimizer")
    if ref.logit is not None:
        assert_same(pu_side.logit, ref.logit, f"{when}: logit_scale")
    if ema is not None:
        assert_same(pu_side.ema.state_dict(), ema.copy.state_dict(), f"{when}: EMA copy")


def setup(plan: Plan) -> tuple[PuSide, Reference]:
    model = build_model(plan.seed)
    ref = Reference(plan, model)
    pu_side = PuSide(plan, copy.deepcopy(model))
    if not plan.declare_first:
        pu_side.attach()
    for spec in plan.rules:
        line, constraint = pu_side.declare(spec)
        ref.declare(spec, line, constraint)
    if plan.declare_first:
        pu_side.attach()
    return pu_side, ref


def raises(pu_side: PuSide, x: torch.Tensor, why: list, when: str) -> str:
    """The step raises ``pu.UpdateError``; its message."""
    try:
        pu_side.step(x)
    except pu.UpdateError as exc:
        return str(exc)
    pytest.fail(f"{when}: no pu.UpdateError; expected one naming one of {expected(why)}")


def expected(why: list) -> list[tuple[str, int, tuple[str, ...] | None]]:
    return [(rule.title, rule.line, gone) for rule, gone in why]


def assert_names_one(msg: str, why: list, when: str) -> None:
    """The message names one unresolved rule, its declaration site and (where a name vanished) the name."""
    assert any(
        title in msg and f"test_accounted_for.py:{line}" in msg and (gone is None or any(n in msg for n in gone))
        for title, line, gone in expected(why)
    ), f"{when}: the error names none of {expected(why)}: {msg}"


def run_sequence(seed: int) -> None:
    plan = make_plan(seed)
    pu_side, ref = setup(plan)
    ema = next((r for r in ref.rules if r.spec.kind == "ema"), None)
    for step in range(STEPS):
        for k, action in enumerate(plan.steps[step]):
            pu_side.act(step, k, action)
            ref.act(step, k, action)
        when = f"{plan}\nstep {step}"
        x = inputs(seed, step, ref.dtype)
        why = ref.unresolved()
        if why:
            msg = raises(pu_side, x, why, when)
            assert_agree(pu_side, ref, ema, f"{when} (nothing written before the error)")
            assert_names_one(msg, why, when)
            return
        pu_side.step(x)
        ref.step(x)
        assert_agree(pu_side, ref, ema, when)


@pytest.mark.parametrize("seed", SEEDS)
def test_rules_follow_what_the_model_holds(seed):
    run_sequence(seed)


def test_the_reference_applies_rules_by_name():
    """The reference itself, on a case checked by hand (so the spec cannot drift silently): a layer replaced
    (the old one still held) gets the weight decay, the constraint and the EMA; the old one none of them;
    a wrap and a parametrization make covered names vanish; a rule on a replaced layer cannot resolve."""
    wd, con, avg = (
        RuleSpec("weight_decay", "model", 0.5),
        RuleSpec("constrain", "model", 1.0),
        RuleSpec("ema", "model", 0.5),
    )
    plan = Plan(0, "sgd", 0.1, "step", True, False, [wd, con, avg, RuleSpec("constrain", "layer", 1.0, layer=3)])
    ref = Reference(plan, build_model(0))
    c = pu.max_norm(1.0)
    for spec in plan.rules:
        ref.declare(spec, 0, c)
    ref.act(0, 0, ("replace", 2, True, True))
    old, new = ref.kept[0], ref.model[2]
    old_w, w0, a0 = old.weight.detach().clone(), new.weight.detach().clone(), ref.rules[2].copy[2].weight.clone()
    x = inputs(0, 0, torch.float32)
    by_hand = copy.deepcopy(ref.model)
    loss_of(by_hand, x, None).backward()
    with torch.no_grad():
        want = c(w0.mul(1 - 0.1 * 0.5).add_(by_hand[2].weight.grad, alpha=-0.1))  # decay, SGD, constraint
    ref.step(x)
    assert torch.equal(bits(new.weight), bits(want)) and torch.equal(bits(old.weight), bits(old_w))
    assert torch.equal(bits(ref.rules[2].copy[2].weight), bits(a0.lerp(want, 0.5)))
    assert ref.unresolved() == []
    ref.act(1, 0, ("wrap", 0, False))
    ref.act(1, 1, ("parametrize", 2))
    ref.act(1, 2, ("replace", 3, False, False))
    assert [(r.spec.kind, r.spec.on, gone) for r, gone in ref.unresolved()] == [
        ("weight_decay", "model", ("0.weight", "2.weight")),
        ("constrain", "model", ("0.weight", "0.bias", "2.weight")),
        ("ema", "model", ("0.weight", "0.bias", "2.weight")),
    ]
    # the rule declared on the layer that was replaced follows its place in the model: the new layer
    assert ref.resolve(ref.rules[3]) == {"3.weight": ref.model[3].weight, "3.bias": ref.model[3].bias}
