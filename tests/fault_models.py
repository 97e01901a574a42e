"""Models, rules and an optimizer with injectable faults (test_faults, test_resume, determinism).

``Net`` issues auxiliary, conditional and phased updates; ``Tally`` and
``Shadow`` are declared rules with tensor and Python state (``Shadow`` is an
EMA-like copy of the weights kept outside the model); ``Flaky`` is AdamW
that can fail before or after writing; ``Harness`` wires them to
``pu.Stepper`` or ``pu.attach`` and snapshots *everything* a step may touch.
"""

from __future__ import annotations

import torch
from torch import nn

import paramupdates as pu
from paramupdates.rules.base import Rule, register, unregister

from conftest import snapshot


class Injected(RuntimeError):
    pass


class Tally(Rule):
    """A declared rule that writes a model buffer and counts its calls; can fail after writing."""

    kind = "tally"

    def __init__(self, t: torch.Tensor, phase: str) -> None:
        super().__init__("fault_models.py (declared)")
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
        super().__init__("fault_models.py (declared)")
        self.params = [p for p in model.parameters()]
        self.copies = [p.detach().clone() for p in self.params]
        self.decay = decay
        self.n = 0
        self.fail = False

    def tensors(self):
        return self.copies

    def owner_tensors(self):
        return self.params

    def rows(self, index):
        names = ", ".join(index.name_of(p) or "?" for p in self.params)
        return [pu.ScheduleEntry(self.phase, f"shadow of {names}", self.kind, "-", self.origin)]

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

    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        # running statistics and num_batches_tracked through assign (optional: torch.batch_norm
        # is slow on a loaded 2-core machine, so the long fault matrix runs without it)
        self.bn = pu.nn.BatchNorm1d(3) if bn else nn.Identity()
        self.scale = pu.Parameter(torch.ones(3), auxiliary=True)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("acc", torch.zeros(3))
        self.register_buffer("tally", torch.zeros(3))
        self.fault: str | None = None

    def forward(self, x):
        if self.fault == "user_begin":
            raise Injected("user begin")
        y = self.bn(self.lin(x))
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


SITES = [
    "user_begin",
    "user_mid",
    "user_end",
    "shape",
    "nonfinite",
    "rule:before_grad",
    "rule:after_grad",
    "rule:auxiliary",
    "rule:after_step",
    "optimizer:before",
    "optimizer:after",
]
USER_SITES = ("user_begin", "user_mid", "user_end", "shape")
# Faults that come before the commit's first write: the default commit (no copies) restores them too.
EARLY_SITES = (*USER_SITES, "nonfinite")
N_STEPS = 4


def data(i: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(1000 + i))


class Harness:
    def __init__(
        self,
        driver: str,
        *,
        seed: int = 0,
        on_nonfinite: str = "raise",
        bn: bool = False,
        ema: bool = False,
        copy_for_rollback: bool = False,
    ) -> None:
        torch.manual_seed(seed)
        self.m = Net(bn)
        self.averaged = pu.ema(self.m, 0.9) if ema else None  # the declared EMA rule
        self.opt = Flaky(self.m.parameters(), lr=0.05, weight_decay=0.01)
        self.rules = [register(Tally(self.m.tally, ph)) for ph in ("before_grad", "after_grad", "auxiliary")]
        self.shadow = register(Shadow(self.m))
        self.rules.append(self.shadow)
        self.driver = driver
        opts = {"on_nonfinite": on_nonfinite, "copy_for_rollback": copy_for_rollback}
        self.owner = pu.attach(self.m, self.opt, **opts) if driver == "attach" else pu.Stepper(self.m, self.opt, **opts)

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
                out.extend(
                    (f"rule{i}.{k}{j}", t.clone())
                    for j, t in enumerate(v if isinstance(v, list) else [v])
                    if torch.is_tensor(t)
                )
                if not isinstance(v, list):
                    out.append((f"rule{i}.{k}", v if not torch.is_tensor(v) else "tensor"))
        if self.averaged is not None:
            out += [(f"ema.{k}", v) for k, v in snapshot(self.averaged)]
        sd = self.owner.state_dict()
        out += [("steps", sd["steps"]), ("skipped", sd["skipped_steps"]), ("n_rules", len(sd["rules"]))]
        _flatten("pu", sd["rules"], out)  # every rule's saved state (EMA counters included)
        return out


def _flatten(prefix: str, obj: object, out: list) -> None:
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            _flatten(f"{prefix}.{k}", obj[k], out)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}", v, out)
    else:
        out.append((prefix, obj.detach().clone() if torch.is_tensor(obj) else obj))
