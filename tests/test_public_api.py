"""The public API as users' tools see it: typed (PEP 561), fully annotated, and in the API reference.

``.ci/run`` also type-checks this file with mypy's strict flags (``[tool.mypy]`` in pyproject.toml):
``test_a_typed_training_loop_through_the_public_names`` calls the public names the way a user's
strictly checked code does, so an unannotated or ``Any``-returning public function, or a public
name that is not re-exported, fails the type check.
"""

from __future__ import annotations

import importlib.resources
import inspect
import pathlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import paramupdates as pu

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _public_callables() -> Iterator[tuple[str, Callable[..., Any]]]:
    """Every public function, and every public method of a public class, under its public name."""
    for name in pu.__all__:
        obj = getattr(pu, name)
        if isinstance(obj, types.ModuleType):
            items = [(f"{name}.{n}", getattr(obj, n)) for n in getattr(obj, "__all__", [])]
        else:
            items = [(name, obj)]
        for qual, item in items:
            if not inspect.isclass(item):
                yield qual, item
                continue
            for attr, member in vars(item).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                if isinstance(member, staticmethod | classmethod):
                    member = member.__func__
                if isinstance(member, property) and member.fget is not None:
                    member = member.fget
                if inspect.isfunction(member):
                    yield f"{qual}.{attr}", member


def _unannotated(name: str, fn: Callable[..., Any]) -> list[str]:
    sig = inspect.signature(fn)
    out = [
        f"{name}({p.name})"
        for p in sig.parameters.values()
        if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty
    ]
    if sig.return_annotation is inspect.Signature.empty and not name.endswith(".__init__"):
        out.append(f"{name} -> ?")
    return out


def test_the_package_is_typed_and_every_public_signature_is_annotated() -> None:
    """py.typed ships inside the package (so the wheel has it), and no public signature leaves a
    parameter or a return type out (a user's type checker would see ``Any`` there)."""
    assert importlib.resources.files("paramupdates").joinpath("py.typed").is_file()
    missing = [m for name, fn in _public_callables() for m in _unannotated(name, fn)]
    assert missing == []


def test_the_api_reference_documents_every_public_name() -> None:
    """docs/api/index.rst (Sphinx autodoc, built with warnings as errors in .ci/run) names each
    name of ``paramupdates.__all__``: a new public name needs its entry."""
    index = (ROOT / "docs" / "api" / "index.rst").read_text()
    documented = {line.split("::", 1)[1].strip() for line in index.splitlines() if line.startswith(".. auto")}
    assert [n for n in pu.__all__ if f"paramupdates.{n}" not in documented] == []


def test_a_typed_training_loop_through_the_public_names() -> None:
    """A user's strictly typed step: the rules, a step, a read, the schedule, an attachment."""
    torch.manual_seed(0)
    model = pu.convert(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)))  # keeps its type
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pu.weight_decay(model, 0.01)
    pu.constrain(model[2].weight, pu.max_norm(1.0))
    counter = pu.Parameter(torch.zeros(()), auxiliary=True)
    model.register_parameter("seen_steps", counter)
    averaged: nn.Module = pu.ema(model, 0.99, warmup=True)
    with pu.step(model, opt) as s:
        model(torch.randn(8, 4)).square().mean().backward()
        with pu.when(True):
            pu.assign_add(counter, torch.ones(()))
        seen: torch.Tensor = pu.read(counter)
    schedule: pu.Schedule = s.schedule()
    assert float(seen) == 1.0 and float(counter) == 1.0
    assert [e.phase for e in schedule][:1] == ["before_grad"]
    attachment: pu.Attachment = pu.attach(model, opt)
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    state: dict[str, Any] = attachment.state_dict()
    attachment.detach()
    assert state and any(not torch.equal(a, b) for a, b in zip(averaged.parameters(), model.parameters()))
    pu.testing.reset()
