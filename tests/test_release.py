"""After a commit nothing keeps the step's pending values alive (no reference cycle that only the cyclic
garbage collector frees, and the last schedule, which the stepper keeps, holds no tensor of the step)."""

import gc
import weakref

import pytest
import torch
from torch import nn

import paramupdates as pu


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = pu.nn.BatchNorm1d(4)
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        y = self.bn(self.lin(x))
        pu.assign(self.acc, self.acc + y.detach().mean(0))
        return y


@pytest.mark.parametrize("driver", ["step", "attach"])
@pytest.mark.parametrize("copy", [False, True])
def test_pending_values_are_freed_by_reference_counting(driver, copy):
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    owner = (
        pu.attach(m, opt, copy_for_rollback=copy) if driver == "attach" else pu.Stepper(m, opt, copy_for_rollback=copy)
    )
    gc.collect()
    gc.disable()
    try:
        refs = []
        for i in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
            if driver == "attach":
                m(x).sum().backward()
                refs += [weakref.ref(m._buffers["acc"]), weakref.ref(m.bn._buffers["running_mean"])]  # pending
                opt.step()
            else:
                with owner:
                    m(x).sum().backward()
                    refs += [weakref.ref(m._buffers["acc"]), weakref.ref(m.bn._buffers["running_mean"])]
            opt.zero_grad()
        assert m._buffers["acc"] is m.acc and all(r() is not m.acc for r in refs)
        assert [r() for r in refs] == [None] * len(refs)  # freed without the cyclic collector
        assert len(owner.schedule()) > 0  # the kept schedule still reads
    finally:
        gc.enable()


@pytest.mark.parametrize("declared", [False, True])
@pytest.mark.parametrize("copy", [False, True])
def test_an_optimizer_stepped_by_pu_step_is_collected_while_its_model_lives(declared, copy):
    """The caches of ``(model, optimizer)`` live in a weak dictionary keyed by the optimizer, on the model's
    index: nothing in them may hold the optimizer strongly (the guard of its step pre-hooks included), or an
    optimizer used with ``pu.step`` would live as long as its model."""
    m = Net()
    if declared:
        pu.weight_decay(m, 0.01)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for i in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        with pu.step(m, opt, copy_for_rollback=copy):
            m(x).sum().backward()
        opt.zero_grad()
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
    with pu.step(m):  # the model steps on without it
        m(torch.randn(5, 4))
