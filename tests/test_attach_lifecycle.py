"""The life of an attachment's step: it opens at the first update after an ``optimizer.step()`` and
ends inside the next one, whichever way that call ends.

``optimizer.step()`` may end with its own exception, with an exception of a step pre-hook (the
optimizer's own, registered before ``pu.attach``, or a global one), or with ``KeyboardInterrupt``.
Each ends the step as documented (README, "pu.attach without an optimizer step"): its pending
updates are dropped before the exception reaches the caller, so the next successful step commits
its own updates only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import paramupdates as pu


class Boom(Exception):
    pass


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), pu.nn.BatchNorm1d(3))


def _raise_once(exc):
    raised = []

    def hook(*_args):
        if not raised:
            raised.append(True)
            raise exc

    return hook


def _register(where, opt, hook):
    if where == "optimizer hook before attach":
        return opt.register_step_pre_hook(hook)
    if where == "global hook":
        return register_optimizer_step_pre_hook(hook)
    raise AssertionError(where)


@pytest.mark.parametrize("exc", [Boom("hook"), KeyboardInterrupt()], ids=["exception", "KeyboardInterrupt"])
@pytest.mark.parametrize("where", ["optimizer hook before attach", "global hook"])
def test_a_step_pre_hook_that_raises_ends_the_step(where, exc):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = _register(where, opt, _raise_once(exc))
    try:
        att = pu.attach(model, opt)
        model(torch.randn(4, 3)).sum().backward()
        with pytest.raises(type(exc)):
            opt.step()
        assert att.pending_schedule().targets() == []  # the failed step is over: nothing pending
        assert int(model[1].num_batches_tracked) == 0
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        assert int(model[1].num_batches_tracked) == 1  # this step's forward only
        assert att.steps == 1
    finally:
        handle.remove()


def test_the_optimizers_own_exception_ends_the_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    att = pu.attach(model, opt)
    model(torch.randn(4, 3)).sum().backward()
    opt.param_groups[0]["lr"] = "0.1"  # SGD raises on a learning rate that is not a number
    with pytest.raises(TypeError):
        opt.step()
    opt.param_groups[0]["lr"] = 0.1
    assert att.pending_schedule().targets() == []
    opt.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert int(model[1].num_batches_tracked) == 1
