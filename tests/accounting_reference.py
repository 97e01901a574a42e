"""The executable spec of rule 12 ("accounted for"): declared rules applied **by name to whatever the
model holds at each step**, in plain PyTorch.

This file knows nothing about paramupdates (the one object it takes from it is the constraint, whose
``__call__`` is the library's reference formula, handed in by the test). ``tests/test_accounted_for.py``
runs the same seeded sequences through paramupdates and requires both to agree bitwise after every step.

A sequence (:func:`make_plan`)
    A model ``Sequential(Linear(3, 3), BatchNorm1d(3), Linear(3, 3), Linear(3, 3))``, an optimizer
    (SGD, SGD with momentum or Adam), maybe a ``logit_scale`` the optimizer steps but the model does
    not hold, some declared rules, a driver (``pu.attach`` or ``pu.step``) and six steps, each preceded
    by what users do between steps (:data:`ACTIONS`).

The rules interpreted
    * A rule declared on a module covers the qualified names (relative to that module) of the tensors it
      had at declaration: ``weight_decay`` its parameters not excluded (the default ``exclude`` skips
      ``ndim <= 1``), ``constrain`` its parameters, ``ema`` its parameters and buffers. At each optimizer
      step every covered name resolves to the tensor the module holds under that name *now*.
    * A rule that cannot resolve makes the step raise ``pu.UpdateError`` before anything is written,
      naming the rule, its declaration site and what vanished: a covered name the module no longer has
      (a LoRA-style wrap renamed it, a parametrization moved it to ``...parametrizations.weight.original``).
    * A rule declared on one layer follows that layer's *place* in the model: when ``model[i]`` is replaced
      (by a fresh layer, or by a wrapper around it), the rule covers ``i.<name>`` in the model from then on,
      whatever holds the old layer. A fresh layer of the same kind is covered by name; a wrapper renames
      ``i.weight`` to ``i.inner.weight``, so the next step raises naming the vanished ``i.weight``.
    * A rule writes a tensor once per step however many covered names hold it: weights tied between
      steps (``model[j].weight = model[i].weight``, as transformers' ``tie_weights()``) and untied again.
    * A layer deleted and another inserted in its place (``del model[i]; model.insert(i, ...)``, the old
      one held or not) is followed by place like a replaced one.
    * ``weight_decay`` (phase ``before_grad``): for each covered tensor that is in the optimizer's param
      groups and has a ``.grad``: ``p.mul_(1 - lr_of_its_group * rate)``.
    * the optimizer's own step (the real ``torch.optim`` one, on this side's copy of the model);
    * ``constrain`` (``after_grad``): ``w.copy_(constraint(w))`` for every covered tensor;
    * batch-norm statistics: plain ``torch.nn.BatchNorm1d``'s in-place update during the forward;
    * ``ema`` (``after_step``): the copy follows the model's dtype, then for every covered name
      ``copy[name].lerp_(model_now[name], 1 - decay)`` (floating) or ``copy_`` (others).
    * A rule on a bare tensor (``logit_scale``) applies to that tensor, like the others.
"""

from __future__ import annotations

import copy
import gc
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

LINEARS = (0, 2, 3)  # the positions of the Linear layers in the model
STEPS = 6
ACTIONS = ("replace", "readd", "tie", "untie", "wrap", "load", "parametrize", "freeze", "unfreeze", "to")


# --- the model and what users do to it ------------------------------------------------------------
class Wrapped(nn.Module):
    """LoRA-style: ``inner(x) + x a^T b^T``; its names are ``inner.weight``, ``inner.bias``, ``a``, ``b``."""

    def __init__(self, inner: nn.Module, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.a = nn.Parameter(a)
        self.b = nn.Parameter(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + (x @ self.a.t()) @ self.b.t()


class Doubled(nn.Module):
    """A parametrization with a ``right_inverse``: ``weight = 2 * original`` (exact in binary floats)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x / 2


def generator(*key: int) -> torch.Generator:
    """A torch generator seeded from a tuple of ints (the same values on both sides of a comparison)."""
    return torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF)


def build_model(seed: int) -> nn.Sequential:
    """The plain torch model of sequence ``seed`` (the paramupdates side converts a deep copy)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 3), nn.Linear(3, 3))


def fresh_linear(key: tuple[int, ...], dtype: torch.dtype) -> nn.Linear:
    """A new ``Linear(3, 3)`` with values drawn from ``key``."""
    g = generator(*key)
    lin = nn.Linear(3, 3, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, 3, generator=g))
        lin.bias.copy_(torch.randn(3, generator=g))
    return lin


def wrap(layer: nn.Module, key: tuple[int, ...], dtype: torch.dtype) -> Wrapped:
    """``Wrapped(layer)`` with rank-2 factors drawn from ``key``."""
    g = generator(*key)
    return Wrapped(layer, torch.randn(2, 3, generator=g).to(dtype) / 4, torch.randn(3, 2, generator=g).to(dtype) / 4)


def fresh_state(model: nn.Module, key: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """New tensors for every entry of ``model.state_dict()`` (same shapes and dtypes; variances > 0,
    integer buffers as they are)."""
    g = generator(*key)
    out = {}
    for k, v in model.state_dict().items():
        if not v.is_floating_point():
            out[k] = v.clone()
            continue
        new = torch.randn(v.shape, generator=g).to(v.dtype)
        out[k] = new.abs() + 0.5 if k.endswith("running_var") else new
    return out


def inputs(seed: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, 3, generator=generator(seed, step, -1)).to(dtype)


def loss_of(model: nn.Module, x: torch.Tensor, logit: torch.Tensor | None) -> torch.Tensor:
    out = model(x)
    if logit is not None:
        out = out * logit
    return out.square().mean()


# --- a sequence -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RuleSpec:
    """One declared rule: ``kind`` (weight_decay, constrain, ema), ``on`` (model, layer, bare)."""

    kind: str
    on: str
    value: float  # the rate, the max_norm bound, the decay
    layer: int | None = None
    exclude_1d: bool = True  # weight decay: the default exclude (else exclude=None)


@dataclass
class Plan:
    seed: int
    optimizer: str  # "sgd", "momentum", "adam"
    lr: float
    driver: str  # "attach", "step"
    declare_first: bool  # rules declared before pu.attach (else after)
    logit: bool
    rules: list[RuleSpec]
    steps: list[list[tuple]] = field(default_factory=list)  # the actions before each step

    def __str__(self) -> str:
        rules = ", ".join(
            f"{r.kind}({r.on}{'' if r.layer is None else f'[{r.layer}]'}, {r.value}"
            f"{'' if r.kind != 'weight_decay' or r.exclude_1d else ', exclude=None'})"
            for r in self.rules
        )
        steps = "; ".join(f"{i}: {a}" for i, a in enumerate(self.steps) if a)
        return (
            f"seed {self.seed}: {self.optimizer}(lr={self.lr}) via {self.driver} "
            f"({'declared first' if self.declare_first else 'attached first'}), logit_scale={self.logit}, "
            f"rules [{rules}], actions before step {{{steps}}}"
        )


def _rules(rng: random.Random) -> tuple[list[RuleSpec], bool]:
    rules: list[RuleSpec] = []
    wd = rng.choice(["model", "model", "layer", None])
    if wd:
        layer = rng.choice(LINEARS) if wd == "layer" else None
        rules.append(RuleSpec("weight_decay", wd, rng.choice([0.1, 0.5]), layer, rng.random() < 0.5))
    con = rng.choice(["model", "layer", None])
    if con:
        rules.append(
            RuleSpec("constrain", con, rng.choice([0.5, 1.0]), rng.choice(LINEARS) if con == "layer" else None)
        )
    if rng.random() < 0.4:
        rules.append(RuleSpec("ema", "model", rng.choice([0.9, 0.5])))
    bare = rng.choice(["weight_decay", "constrain", None, None])
    if bare or not rules:
        bare = bare or "weight_decay"
        rules.append(RuleSpec(bare, "bare", 0.5 if bare == "weight_decay" else 1.0, exclude_1d=False))
    return rules, bool(bare) or rng.random() < 0.3


def _covered_weights(rules: list[RuleSpec]) -> list[int]:
    """The Linear positions whose weight some rule covers at declaration."""
    if any(r.on == "model" for r in rules):
        return list(LINEARS)
    return sorted({r.layer for r in rules if r.on == "layer"})


def _action(rng: random.Random, plan: Plan, dtype: list[str], parametrized: set[int], tied: set[int]) -> tuple | None:
    kinds = ["replace", "replace", "readd", "tie", "untie", "wrap", "load", "parametrize", "freeze", "unfreeze"]
    if plan.optimizer == "sgd":
        kinds += ["to", "to"]
    kind = rng.choice(kinds)
    i = rng.choice(LINEARS)
    if kind in ("replace", "readd"):
        parametrized.discard(i)
        tied.discard(i)
        return (kind, i, rng.random() < 0.5, rng.random() < 0.5)  # keep the old one, add_param_group
    if kind == "tie":  # (model[j].weight = model[i].weight: two plain Linear weights, neither parametrized)
        free = [j for j in LINEARS if j not in parametrized and j not in tied]
        if len(free) < 2:
            return None
        src, dst = rng.sample(free, 2)
        tied.add(dst)
        return ("tie", src, dst)
    if kind == "untie":
        if not tied:
            return None
        j = rng.choice(sorted(tied))
        tied.discard(j)
        return ("untie", j)
    if kind == "wrap":
        return ("wrap", i, rng.random() < 0.5)
    if kind == "load":
        return ("load", rng.choice(["rebuild", "add"]))
    if kind == "parametrize":
        free = [j for j in (_covered_weights(plan.rules) or LINEARS) if j not in parametrized and j not in tied]
        if not free:
            return None
        i = rng.choice(free)
        parametrized.add(i)
        return ("parametrize", i)
    if kind == "to":
        dtype[0] = "float32" if dtype[0] == "float64" else "float64"
        return ("to", dtype[0])
    return (kind, i)


def make_plan(seed: int) -> Plan:
    """Sequence ``seed``: everything chosen from ``random.Random(seed)``."""
    rng = random.Random(seed)
    opt = rng.choice(["sgd", "sgd", "momentum", "adam"])
    rules, logit = _rules(rng)
    plan = Plan(seed, opt, rng.choice([0.1, 0.05]), rng.choice(["attach", "step"]), rng.random() < 0.5, logit, rules)
    dtype, parametrized, tied = ["float32"], set(), set()
    for step in range(STEPS):
        n = rng.choices([0, 1, 2], [0.45, 0.4, 0.15] if step else [0.7, 0.3, 0.0])[0]
        actions = [_action(rng, plan, dtype, parametrized, tied) for _ in range(n)]
        plan.steps.append([a for a in actions if a is not None])
    return plan


# --- the model, the optimizer and the actions: the user's code, the same on both sides --------------
class Session:
    """A model, its optimizer and ``logit_scale``, and the actions of a plan applied to them."""

    def __init__(self, plan: Plan, model: nn.Module) -> None:
        self.plan = plan
        self.model = model
        self.dtype = torch.float32
        self.logit = nn.Parameter(torch.randn(3, generator=generator(plan.seed, -2))) if plan.logit else None
        self.kept: list[nn.Module] = []  # old layers the user still holds
        self.opt = self.new_optimizer()

    def new_optimizer(self) -> torch.optim.Optimizer:
        params = [*self.model.parameters(), *([self.logit] if self.logit is not None else [])]
        if self.plan.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.plan.lr)
        return torch.optim.SGD(params, lr=self.plan.lr, momentum=0.9 if self.plan.optimizer == "momentum" else 0.0)

    def rebuilt(self) -> None:
        """Called after the optimizer was made again (the paramupdates side attaches the new one)."""

    def add_missing(self) -> None:
        """``opt.add_param_group`` of the model's parameters the optimizer does not hold."""
        held = {id(p) for g in self.opt.param_groups for p in g["params"]}
        new = [p for p in self.model.parameters() if id(p) not in held]
        if new:
            self.opt.add_param_group({"params": new})

    def act(self, step: int, k: int, action: tuple) -> None:
        kind, model = action[0], self.model
        if kind == "replace":
            _, i, keep, add = action
            if keep:
                self.kept.append(model[i])
            model[i] = fresh_linear((self.plan.seed, step, k), self.dtype)
            if add:
                self.opt.add_param_group({"params": list(model[i].parameters())})
        elif kind == "readd":  # the layer deleted, then a new one inserted in its place (no hook, same size)
            _, i, keep, add = action
            if keep:
                self.kept.append(model[i])
            del model[i]
            gc.collect()  # (not held: the new layer may be made where the old one was)
            model.insert(i, fresh_linear((self.plan.seed, step, k), self.dtype))
            if add:
                self.opt.add_param_group({"params": list(model[i].parameters())})
        elif kind == "tie":  # what transformers' tie_weights() does
            _, i, j = action
            model[j].weight = model[i].weight
        elif kind == "untie":
            j = action[1]
            model[j].weight = nn.Parameter(model[j].weight.detach().clone())
            self.opt.add_param_group({"params": [model[j].weight]})
        elif kind == "wrap":
            _, i, add = action
            model[i] = wrap(model[i], (self.plan.seed, step, k), self.dtype)
            if add:
                self.opt.add_param_group({"params": [model[i].a, model[i].b]})
        elif kind == "load":
            model.load_state_dict(fresh_state(model, (self.plan.seed, step, k)), assign=True)
            if action[1] == "rebuild":
                self.opt = self.new_optimizer()
                self.rebuilt()
            else:
                self.add_missing()
        elif kind == "parametrize":
            layer = model[action[1]]
            while isinstance(layer, Wrapped):
                layer = layer.inner
            parametrize.register_parametrization(layer, "weight", Doubled())
        elif kind in ("freeze", "unfreeze"):
            model[action[1]].requires_grad_(kind == "unfreeze")
        elif kind == "to":
            self.dtype = getattr(torch, action[1])
            model.to(self.dtype)
        else:
            raise ValueError(action)


# --- the reference ----------------------------------------------------------------------------------
@dataclass
class Declared:
    """A rule as the reference holds it: the module it was declared on (``None``: the bare tensor), the
    names it covers there, its declaration line in the test file, and its math's parameter."""

    spec: RuleSpec
    line: int
    module: nn.Module | None
    names: list[str]
    constraint: Callable[[torch.Tensor], torch.Tensor] | None = None
    copy: nn.Module | None = None  # the EMA's averaged copy

    @property
    def title(self) -> str:
        """How the library names the rule in its messages."""
        return {"weight_decay": "pu.weight_decay", "constrain": "pu.constrain(max_norm)", "ema": "pu.ema"}[
            self.spec.kind
        ]


def _named(module: nn.Module, buffers: bool) -> dict[str, torch.Tensor]:
    """Every name, a tensor tied under two names under both (a rule covers names)."""
    out = dict(module.named_parameters(remove_duplicate=False))
    if buffers:
        out.update(module.named_buffers(remove_duplicate=False))
    return out


def _once(tensors: Any) -> list[torch.Tensor]:
    """Each tensor once, at its first name: a rule writes a tensor once per step, however many of its
    names hold it (tied weights)."""
    out: list[torch.Tensor] = []
    for t in tensors:
        if not any(t is u for u in out):
            out.append(t)
    return out


class Reference(Session):
    """The plain-torch side: rules applied by name, at each step, to what the model holds then."""

    def __init__(self, plan: Plan, model: nn.Module) -> None:
        super().__init__(plan, model)
        self.rules: list[Declared] = []

    def declare(self, spec: RuleSpec, line: int, constraint: Any = None) -> Declared:
        """Record a rule declared at ``line`` of the test file (``constraint``: the pu constraint object)."""
        if spec.on == "bare":
            rule = Declared(spec, line, None, ["logit_scale"], constraint)
        else:
            module = self.model if spec.on == "model" else self.model[spec.layer]
            named = _named(module, spec.kind == "ema")
            names = [
                n for n, t in named.items() if not (spec.kind == "weight_decay" and spec.exclude_1d and t.ndim <= 1)
            ]
            rule = Declared(spec, line, module, names, constraint)
            if spec.kind == "ema":
                rule.copy = copy.deepcopy(module)
        self.rules.append(rule)
        return rule

    def act(self, step: int, k: int, action: tuple) -> None:
        if action[0] in ("replace", "readd", "wrap"):
            i, old = action[1], self.model[action[1]]
            for rule in self.rules:
                if rule.module is old:  # the rule follows the layer's place in the model
                    rule.module = self.model
                    rule.names = [f"{i}.{n}" for n in rule.names]
        super().act(step, k, action)

    def resolve(self, rule: Declared) -> dict[str, torch.Tensor] | tuple[str, ...] | None:
        """What ``rule`` covers now, by name; else what vanished (``None``: the module it was declared on
        is no longer part of the model)."""
        if rule.module is None:
            return {"logit_scale": self.logit}
        if not any(m is rule.module for m in self.model.modules()):
            return None
        now = _named(rule.module, rule.spec.kind == "ema")
        gone = tuple(n for n in rule.names if n not in now)
        return gone or {n: now[n] for n in rule.names}

    def unresolved(self) -> list[tuple[Declared, tuple[str, ...] | None]]:
        """The rules that cannot resolve now, with what vanished: the next step must raise naming one."""
        out = []
        for rule in self.rules:
            got = self.resolve(rule)
            if not isinstance(got, dict):
                out.append((rule, got))
        return out

    def step(self, x: torch.Tensor) -> None:
        """One training step: zero_grad, forward (batch-norm statistics), backward, then the commit."""
        resolved = [(rule, self.resolve(rule)) for rule in self.rules]
        self.opt.zero_grad()
        self.model.zero_grad()
        loss_of(self.model, x, self.logit).backward()
        with torch.no_grad():
            self._weight_decay([(r, t) for r, t in resolved if r.spec.kind == "weight_decay"])
        self.opt.step()
        with torch.no_grad():
            for rule, tensors in resolved:
                if rule.spec.kind == "constrain":
                    for w in _once(tensors.values()):
                        w.copy_(rule.constraint(w))
            for rule, tensors in resolved:
                if rule.spec.kind == "ema":
                    self._ema(rule, tensors)

    def _weight_decay(self, resolved: list[tuple[Declared, dict[str, torch.Tensor]]]) -> None:
        """``p <- p * (1 - lr * rate)`` for each covered tensor the optimizer steps (has a ``.grad``)."""
        lr_of = {id(p): g["lr"] for g in self.opt.param_groups for p in g["params"]}
        for rule, tensors in resolved:
            for p in _once(tensors.values()):
                if id(p) in lr_of and p.grad is not None:
                    p.mul_(1 - lr_of[id(p)] * rule.spec.value)

    def _ema(self, rule: Declared, tensors: dict[str, torch.Tensor]) -> None:
        """The copy follows the model's dtype; then ``a.lerp_(p, 1 - decay)`` (floating) or ``a.copy_(p)``."""
        avg = _named(rule.copy, True)
        done: list[torch.Tensor] = []
        for name, p in tensors.items():
            a = avg[name]
            if any(a is d for d in done):
                continue  # (a copy tensor under two names: averaged once)
            done.append(a)
            if a.dtype != p.dtype:
                a.data = a.data.to(p.dtype)
            if p.is_floating_point():
                a.lerp_(p, 1 - rule.spec.value)
            else:
                a.copy_(p)
