"""The executable spec: the rules of docs/design.md as a small NumPy interpreter.

This file knows nothing about paramupdates. It interprets an *update
program* (the little language below) the way docs/design.md says a step behaves,
with NumPy arrays as the state. ``tests/test_properties.py`` runs the same
programs through paramupdates and requires both to agree, bitwise, on every
read and on the final state.

The state (one model)
    ``a``    float32 (3,)  auxiliary pu.Parameter           (not trainable)
    ``buf``  float32 (3,)  buffer                           (not trainable)
    ``cnt``  int64   ()    buffer                           (not trainable)
    ``w``    float32 (3,)  nn.Parameter, read via pu.read   (trainable)
    ``tp``   float32 (3,)  trainable pu.Parameter           (trainable)

    The optimizer is plain SGD, ``p <- p - LR * grad``, on given gradients:
    each micro-batch adds its gradient vectors to ``grad`` (gradient
    accumulation); an optimizer step consumes them and resets them to None
    (``zero_grad``). Without an optimizer the gradients keep accumulating.

The language
    expression   ("const", c)                 the Python number c
                 ("lin", src, mul, add)       read(src) * mul + add
                 ("elem", src, i, add)        read(src)[i] + add        (0-dim)
    predicate    ("bool", b)                  Python bool
                 ("tensor", b)                torch.tensor(b)
                 ("gt", src, i, k)            read(src)[i] > k  (i None: read(src) > k)
    statement    ("upd", op, target, expr, key, phase)
                 ("read", name)
                 ("when", predicate, [statement...])
                 ("loop", n, [statement...])
    rule         ("rule", phase, target, mul, src, c, add)      declared once, applied at
                 each commit in its phase: target <- target * mul + src * c + add
    segment      ("eager", [statement...])                     outside any step
                 ("step", [[statement...] per micro-batch], optimizer: bool,
                  [(grad_w, grad_tp) per micro-batch])

The rules interpreted (numbers as in docs/design.md)
    1  a read sees every update issued before it in the step, none after,
       across loops and micro-batches: the *view* is folded in issue order;
    2  nothing is written before commit: the committed state is untouched
       until the step ends;
    4  at commit the phases run in the fixed order before_grad, grad (SGD),
       after_grad, auxiliary (phase None), after_step; inside a phase the
       declared rules run first, in declaration order, once per commit (not
       per micro-batch), on the values of that moment; then the
       records fold in issue order over the value the target has *then*
       (an operand is the value computed at issue time); the step's plan
       (``schedule()``) lists them in that order;
    6  when(False) records nothing; when(tensor) records
       new = where(pred, new, old); nested whens AND together;
    8  outside a step an update applies at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

LR = 0.5
PHASE_ORDER = ("before_grad", "grad", "after_grad", "auxiliary", "after_step")
TRAINABLE = ("w", "tp")


def initial_state() -> dict[str, np.ndarray]:
    """The model's initial values (small integers: float32 arithmetic on them is exact)."""
    return {
        "a": np.array([1.0, -2.0, 3.0], np.float32),
        "buf": np.array([0.0, 1.0, 2.0], np.float32),
        "cnt": np.array(0, np.int64),
        "w": np.array([2.0, 0.0, -1.0], np.float32),
        "tp": np.array([-3.0, 1.0, 4.0], np.float32),
    }


def as_key(key: Any) -> Any:
    """The language's keys: an int, or ("slice", start, stop)."""
    if isinstance(key, tuple) and key and key[0] == "slice":
        return slice(key[1], key[2])
    return key


def apply_op(op: str, old: np.ndarray, operand: Any, key: Any, cond: Any) -> np.ndarray:
    """One update, out of place: the math of docs/design.md's assign family."""
    x = np.asarray(operand).astype(old.dtype)
    if op == "assign":
        new = np.broadcast_to(x, old.shape).copy()
    elif op == "assign_add":
        new = old + x
    elif op == "assign_sub":
        new = old - x
    elif op == "assign_key":
        new = old.copy()
        new[as_key(key)] = x
    else:
        raise ValueError(op)
    new = new.astype(old.dtype)
    if cond is not None:  # conditions (rule 6): where(pred, new, old)
        new = np.where(cond, new, old).astype(old.dtype)
    return new


@dataclass
class Record:
    target: str
    op: str
    operand: Any
    key: Any
    cond: Any  # None or a numpy bool
    phase: str


@dataclass
class Reference:
    """Interprets programs; ``reads`` collects what every ``read`` statement saw."""

    state: dict[str, np.ndarray] = field(default_factory=initial_state)
    grads: dict[str, np.ndarray | None] = field(default_factory=lambda: {n: None for n in TRAINABLE})
    reads: list[np.ndarray] = field(default_factory=list)
    steps: int = 0
    # per committed step, the plan: (phase, target, op, condition) in commit order
    schedules: list[list[tuple[str, str, str, str]]] = field(default_factory=list)
    rules: list[tuple] = field(default_factory=list)

    # --- the program ------------------------------------------------------
    def run(self, program: list) -> None:
        for seg in program:
            if seg[0] == "eager":
                self._block(seg[1], self.state, None)
            else:
                _, micro_batches, optimizer, grads = seg
                self.step(micro_batches, optimizer, grads)

    def step(self, micro_batches: list, optimizer: bool, grads: list) -> None:
        view = dict(self.state)  # deferred commit (rule 2): the committed state stays as is until commit
        records: list[Record] = []
        for body, (gw, gtp) in zip(micro_batches, grads):
            self._block(body, view, records)
            self._accumulate("w", gw)
            self._accumulate("tp", gtp)
        self.commit(records, optimizer)

    def commit(self, records: list[Record], optimizer: bool) -> None:
        """Rule 4: the phases in their fixed order; records in issue order inside each."""
        plan = []
        for phase in PHASE_ORDER:
            if phase == "grad":
                if optimizer:
                    plan.append(("grad", "<optimizer parameters>", "SGD.step", "-"))
                    for n in TRAINABLE:
                        g = self.grads[n]
                        if g is not None:
                            self.state[n] = (self.state[n] - np.float32(LR) * g).astype(np.float32)
                        self.grads[n] = None  # zero_grad(set_to_none=True)
                continue
            for _, rphase, target, mul, src, c, add in self.rules:
                if rphase == phase:
                    f = np.float32
                    self.state[target] = (self.state[target] * f(mul) + self.state[src] * f(c) + f(add)).astype(f)
                    plan.append((phase, target, "prog_rule", "-"))
            for r in records:
                if r.phase == phase:
                    self.state[r.target] = apply_op(r.op, self.state[r.target], r.operand, r.key, r.cond)
                    plan.append((phase, r.target, r.op, "-" if r.cond is None else "when(tensor)"))
        self.schedules.append(plan)
        self.steps += 1

    def _accumulate(self, name: str, g: Any) -> None:
        g = np.asarray(g, np.float32)
        self.grads[name] = g.copy() if self.grads[name] is None else self.grads[name] + g

    # --- statements --------------------------------------------------------
    def _block(self, body: list, view: dict, records: list | None, cond: Any = None) -> None:
        for stmt in body:
            self._stmt(stmt, view, records, cond)

    def _stmt(self, stmt: tuple, view: dict, records: list | None, cond: Any) -> None:
        kind = stmt[0]
        if kind == "read":
            self.reads.append(view[stmt[1]].copy())
        elif kind == "loop":
            for _ in range(stmt[1]):
                self._block(stmt[2], view, records, cond)
        elif kind == "when":
            pred = self.predicate(stmt[1], view)
            if pred is False or cond is False:
                inner: Any = False
            elif pred is True:
                inner = cond
            else:
                inner = pred if cond is None else np.logical_and(cond, pred)
            self._block(stmt[2], view, records, inner)
        elif kind == "upd":
            _, op, target, expr, key, phase = stmt
            if cond is False:  # when(False) records nothing
                return
            operand = self.expression(expr, view)
            view[target] = apply_op(op, view[target], operand, key, cond)
            if records is not None:
                records.append(Record(target, op, operand, key, cond, phase or "auxiliary"))
        else:
            raise ValueError(kind)

    @staticmethod
    def expression(expr: tuple, view: dict) -> Any:
        if expr[0] == "const":
            return expr[1]
        src = view[expr[1]]
        if expr[0] == "lin":
            _, _, mul, add = expr
            return (src * src.dtype.type(mul) + src.dtype.type(add)).astype(src.dtype)
        if expr[0] == "elem":
            _, _, i, add = expr
            return (src[i] + src.dtype.type(add)).astype(src.dtype)
        raise ValueError(expr)

    @staticmethod
    def predicate(pred: tuple, view: dict) -> Any:
        if pred[0] == "bool":
            return bool(pred[1])
        if pred[0] == "tensor":
            return np.bool_(pred[1])
        _, src, i, k = pred
        v = view[src] if i is None else view[src][i]
        return np.bool_(v > k)
