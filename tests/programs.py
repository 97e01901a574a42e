"""Random update programs (hypothesis strategies) and their paramupdates runner.

The language is defined in ``reference_model.py``; :func:`programs` generates
well-typed programs in it and :class:`PuRunner` executes them with
paramupdates on a real ``nn.Module``, so that the two interpreters can be
compared statement by statement.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch import nn

import paramupdates as pu
from paramupdates.rules.base import Rule, register
from reference_model import LR, TRAINABLE, as_key, initial_state

VEC = ("a", "buf", "w", "tp")  # float32 (3,) targets
FLOAT_SRC = ("a", "buf", "cnt", "w", "tp")
NONTRAIN_PHASES = (None, "before_grad", "after_grad", "after_step")
TRAIN_PHASES = ("before_grad", "after_grad", "after_step")


# --------------------------------------------------------------------------
# generation
# --------------------------------------------------------------------------
def _consts(target: str) -> st.SearchStrategy:
    if target == "cnt":
        return st.integers(-3, 3)
    return st.one_of(st.integers(-3, 3), st.sampled_from([0.5, -1.5, 2.0]))


@st.composite
def expressions(draw: Any, target: str, scalar: bool) -> tuple:
    """An operand for ``target``; ``scalar``: a Python number or a 0-dim tensor."""
    kind = draw(st.sampled_from(["const", "lin", "elem"]))
    if kind == "const":
        return ("const", draw(_consts(target)))
    if target == "cnt":  # an int target takes int values only (float into int is bad input)
        return ("lin", "cnt", draw(st.sampled_from([1, -1, 2])), draw(st.integers(-2, 2)))
    if kind == "lin" and not scalar:
        src = draw(st.sampled_from(FLOAT_SRC))
        return ("lin", src, draw(st.sampled_from([1, -1, 2])), draw(st.integers(-2, 2)))
    if draw(st.booleans()):
        return ("lin", "cnt", draw(st.sampled_from([1, -1])), draw(st.integers(-2, 2)))
    return ("elem", draw(st.sampled_from(VEC)), draw(st.integers(0, 2)), draw(st.integers(-2, 2)))


@st.composite
def updates(draw: Any) -> tuple:
    target = draw(st.sampled_from(("a", "buf", "cnt", "w", "tp")))
    ops = ["assign", "assign_add", "assign_sub"] + ([] if target == "cnt" else ["assign_key"])
    op = draw(st.sampled_from(ops))
    key = None
    if op == "assign_key":
        key = draw(st.one_of(st.integers(0, 2), st.just(("slice", 0, 2)), st.just(("slice", 1, 3))))
    expr = draw(expressions(target, scalar=op == "assign_key"))
    phase = draw(st.sampled_from(TRAIN_PHASES if target in TRAINABLE else NONTRAIN_PHASES))
    return ("upd", op, target, expr, key, phase)


def predicates() -> st.SearchStrategy:
    return st.one_of(
        st.tuples(st.just("bool"), st.booleans()),
        st.tuples(st.just("tensor"), st.booleans()),
        st.tuples(st.just("gt"), st.sampled_from(VEC), st.integers(0, 2), st.integers(-2, 2)),
        st.tuples(st.just("gt"), st.just("cnt"), st.none(), st.integers(-1, 3)),
    )


@st.composite
def statements(draw: Any, depth: int = 0) -> tuple:
    """A statement; ``when`` and ``loop`` nest up to two levels."""
    kind = draw(st.sampled_from(["upd", "upd", "upd", "read", "when", "loop"] if depth < 2 else ["upd", "read"]))
    if kind == "upd":
        return draw(updates())
    if kind == "read":
        return ("read", draw(st.sampled_from(("a", "buf", "cnt", "w", "tp"))))
    body = draw(st.lists(statements(depth + 1), min_size=1, max_size=3 if kind == "when" else 2))
    if kind == "when":
        return ("when", draw(predicates()), body)
    return ("loop", draw(st.integers(1, 3)), body)


def bodies() -> st.SearchStrategy:
    return st.lists(statements(), min_size=0, max_size=6)


_GRAD = st.lists(st.integers(-2, 2), min_size=3, max_size=3)


@st.composite
def step_segments(draw: Any) -> tuple:
    n = draw(st.integers(1, 3))  # micro-batches
    return (
        "step",
        [draw(bodies()) for _ in range(n)],
        draw(st.sampled_from([True, False])),  # an optimizer step (the more interesting case) first
        [(draw(_GRAD), draw(_GRAD)) for _ in range(n)],
    )


@st.composite
def programs(draw: Any, eager: bool = True) -> list:
    """A program: steps (and, if ``eager``, update blocks outside any step)."""
    seg = st.one_of(step_segments(), st.tuples(st.just("eager"), bodies())) if eager else step_segments()
    return draw(st.lists(seg, min_size=2, max_size=4))


def rule_specs() -> st.SearchStrategy:
    """Declared rules: ("rule", phase, target, mul, src, c, add) on float targets."""
    return st.tuples(
        st.just("rule"),
        st.sampled_from(("before_grad", "after_grad", "auxiliary", "after_step")),
        st.sampled_from(VEC),
        st.sampled_from([1, -1, 2]),
        st.sampled_from(VEC),
        st.sampled_from([0, 1, -1]),
        st.integers(-2, 2),
    )


@st.composite
def programs_with_rules(draw: Any) -> tuple[list, list]:
    """(rules, program): every step has an optimizer step (rules run once per optimizer update)."""
    rules = draw(st.lists(rule_specs(), min_size=1, max_size=4))
    prog = draw(programs())
    prog = [s if s[0] == "eager" else (s[0], s[1], True, s[3]) for s in prog]
    return rules, prog


# --------------------------------------------------------------------------
# the paramupdates side
# --------------------------------------------------------------------------
class Model(nn.Module):
    """The state of ``reference_model`` as a module."""

    def __init__(self) -> None:
        super().__init__()
        s = initial_state()
        self.a = pu.Parameter(torch.from_numpy(s["a"].copy()), auxiliary=True)
        self.register_buffer("buf", torch.from_numpy(s["buf"].copy()))
        self.register_buffer("cnt", torch.from_numpy(s["cnt"].copy()))
        self.w = nn.Parameter(torch.from_numpy(s["w"].copy()))
        self.tp = pu.Parameter(torch.from_numpy(s["tp"].copy()))


class ProgRule(Rule):
    """A declared rule of the language: ``target <- target * mul + src * c + add`` at commit."""

    kind = "prog_rule"

    def __init__(self, m: nn.Module, spec: tuple) -> None:
        super().__init__("programs.py")
        _, self.phase, target, self.mul, src, self.c, self.add = spec
        self.t, self.src = getattr(m, target), getattr(m, src)

    def tensors(self) -> list[torch.Tensor]:
        return [self.t]

    def apply(self, ctx: Any) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            self.t.copy_(self.t * self.mul + self.src * self.c + self.add)


class Fault(Exception):
    """Raised by the runner at an injected fault point."""


class PuRunner:
    """Runs a program with paramupdates.

    ``driver``: ``"step"`` (``with pu.step``), ``"run"`` (``Stepper.run``) or
    ``"attach"`` (``pu.attach`` and an unchanged loop; ``flush()`` for a step
    without an optimizer; programs without eager blocks).
    ``fault_at``: raise :class:`Fault` before the n-th executed statement.
    """

    def __init__(self, driver: str = "step", fault_at: int | None = None, rules: list | None = None) -> None:
        self.m = Model()
        for spec in rules or []:
            register(ProgRule(self.m, spec))
        self.opt = torch.optim.SGD([self.m.w, self.m.tp], lr=LR)
        self.driver = driver
        self.reads: list[np.ndarray] = []
        self.schedules: list[list[tuple[str, str, str, str]]] = []
        self.fault_at = fault_at
        self.executed = 0
        self.att = pu.attach(self.m, self.opt) if driver == "attach" else None
        self.stepper = pu.Stepper(self.m, self.opt)
        self.bare = pu.Stepper(self.m, None)

    # --- reads ----------------------------------------------------------
    def rd(self, name: str) -> torch.Tensor:
        if name == "w":
            return pu.read(self.m.w)  # a plain nn.Parameter reads its pending value via pu.read
        return getattr(self.m, name)  # pu.Parameter: itself; buffer: the module attribute

    def state(self) -> dict[str, np.ndarray]:
        with torch.no_grad():
            return {k: v.detach().clone().numpy() for k, v in self.m.state_dict(keep_vars=True).items()}

    # --- the program ------------------------------------------------------
    def run(self, program: list) -> None:
        for seg in program:
            if seg[0] == "eager":
                self.block(seg[1])
            else:
                self.step(*seg[1:])

    def step(self, micro_batches: list, optimizer: bool, grads: list) -> None:
        def body() -> None:
            for mb, (gw, gtp) in zip(micro_batches, grads):
                self.block(mb)
                (self.m.w * torch.tensor(gw, dtype=torch.float32)).sum().backward()  # real autograd
                g = torch.tensor(gtp, dtype=torch.float32)
                self.m.tp.grad = g if self.m.tp.grad is None else self.m.tp.grad + g

        try:
            if self.driver == "attach":
                body()
                owner = self.att
                if optimizer:
                    self.opt.step()
                elif self.att.journal is None:
                    owner = pu.Stepper(self.m)  # flush() with nothing pending commits nothing: empty plan
                else:
                    self.att.flush()
            elif self.driver == "run":
                owner = self.stepper if optimizer else self.bare
                owner.run(body)
            else:
                with pu.step(self.m, self.opt if optimizer else None) as owner:
                    body()
        except Fault:
            if self.att is not None:
                self.att.discard()
            self.opt.zero_grad()
            raise
        self.schedules.append([(r.phase, r.target, r.op, r.condition) for r in owner.schedule()])
        if optimizer:
            self.opt.zero_grad()

    def block(self, body: list) -> None:
        for s in body:
            self.stmt(s)

    def stmt(self, s: tuple) -> None:
        if self.fault_at is not None and self.executed == self.fault_at:
            self.executed += 1
            raise Fault(f"injected before statement {self.fault_at}")
        self.executed += 1
        kind = s[0]
        if kind == "read":
            self.reads.append(self.rd(s[1]).detach().clone().numpy())
        elif kind == "loop":
            for _ in range(s[1]):  # a Python loop: each iteration sees the previous one's writes
                self.block(s[2])
        elif kind == "when":
            with pu.when(self.predicate(s[1])):
                self.block(s[2])
        elif kind == "upd":
            _, op, target, expr, key, phase = s
            t = self.rd(target) if target != "w" else self.m.w
            v = self.expression(expr)
            if op == "assign_key":
                pu.assign_key(t, as_key(key), v, phase=phase)
            else:
                getattr(pu, op)(t, v, phase=phase)
        else:
            raise ValueError(kind)

    def expression(self, expr: tuple) -> Any:
        if expr[0] == "const":
            return expr[1]
        src = self.rd(expr[1])
        if expr[0] == "lin":
            return src * expr[2] + expr[3]
        return src[expr[2]] + expr[3]

    def predicate(self, pred: tuple) -> Any:
        if pred[0] == "bool":
            return pred[1]
        if pred[0] == "tensor":
            return torch.tensor(pred[1])
        _, src, i, k = pred
        v = self.rd(src)
        return (v if i is None else v[i]) > k


def count_statements(program: list) -> int:
    """How many statements a program executes (loops unrolled)."""

    def body(b: list) -> int:
        n = 0
        for s in b:
            if s[0] == "loop":
                n += 1 + s[1] * body(s[2])
            elif s[0] == "when":
                n += 1 + body(s[2])
            else:
                n += 1
        return n

    total = 0
    for seg in program:
        total += body(seg[1]) if seg[0] == "eager" else sum(body(mb) for mb in seg[1])
    return total
