"""Rule 1: read-your-writes in program order, in loops, across micro-batches."""

import torch
from torch import nn

import paramupdates as pu

from models import Counter


def test_print_old_then_new(capsys):
    m = Counter()
    with pu.step(m):
        print(m.scale)
        m.scale.assign(torch.full((2,), 3.0))
        print(m.scale)
    out = capsys.readouterr().out
    first, second = out.split("pu.Parameter")[1:]
    assert "1., 1." in first and "3., 3." in second


def test_python_loop_sees_previous_iteration():
    class Doubler(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = pu.Parameter(torch.ones(3), auxiliary=True)

        def forward(self):
            seen = []
            for _ in range(3):
                self.p.assign(self.p * 2)
                seen.append(self.p.clone())
            return seen

    m = Doubler()
    with pu.step(m):
        seen = m()
        assert [float(s[0]) for s in seen] == [2.0, 4.0, 8.0]
        with torch._C.DisableTorchFunctionSubclass():  # the storage, not the value a use sees
            assert torch.equal(m.p.detach(), torch.ones(3))  # untouched: deferred commit (rule 2)
    assert torch.equal(m.p.detach(), torch.full((3,), 8.0))


def test_buffer_read_through_module_attribute_and_alias():
    m = Counter()
    old_ref = m.count
    with pu.step(m):
        pu.assign_add(m.count, 5)
        assert int(m.count) == 5  # module attribute sees the pending value
        assert int(old_ref) == 0  # an old reference keeps the committed value
        pu.assign_add(m.count, 1)  # updating the pending tensor updates the same target
        assert int(m.count) == 6
        assert int(pu.read(old_ref)) == 6
    assert m.count is old_ref and int(old_ref) == 6
    assert m._buffers["count"] is old_ref


def test_plain_parameter_read_via_pu_read():
    m = Counter()
    w = m.lin.weight
    with pu.step(m):
        pu.assign(w, torch.zeros_like(w), phase="after_grad")
        assert torch.count_nonzero(pu.read(w)) == 0
        assert torch.count_nonzero(w) > 0  # model.parameters() never disturbed
        assert m.lin.weight is w
    assert torch.count_nonzero(w) == 0


def test_gradient_accumulation_overlay_lives_until_commit():
    m = Counter()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    xs = [torch.randn(4, 3) for _ in range(3)]
    counts = []
    w0 = m.lin.weight.detach().clone()
    with pu.step(m, opt):
        for x in xs:
            m(x).sum().backward()
            counts.append(int(m.count))
            assert torch.equal(m.lin.weight, w0)  # the optimizer has not run
    assert counts == [1, 2, 3]
    assert int(m.count) == 3
    assert not torch.equal(m.lin.weight, w0)  # one optimizer step at commit


def test_accumulation_scale_sequential_against_reference():
    """scale_k = 0.5*scale_{k-1} + 0.5*mean|y_k|, where y_k is computed with scale_{k-1}'s lin only."""
    torch.manual_seed(1)
    m = Counter()
    xs = [torch.randn(4, 3) for _ in range(3)]
    scale = torch.ones(2)
    acc = torch.zeros(2)
    for x in xs:
        y = m.lin(x).detach()
        acc = acc + y.mean(0)
        scale = scale * 0.5 + y.abs().mean(0) * 0.5
    with pu.step(m):
        for x in xs:
            m(x)
    assert torch.equal(m.scale.detach(), scale)
    assert torch.equal(m.acc, acc)


def test_gradient_reaches_trainable_parameter_through_update():
    p = pu.Parameter(torch.tensor([1.0, 2.0]), trainable=True)
    m = nn.Module()
    m.p = p
    opt = torch.optim.SGD([p], lr=0.5)
    x = torch.tensor([3.0, 4.0])
    with pu.step(m, opt):
        p.assign(p * 3, phase="before_grad")
        (p * x).sum().backward()
        assert torch.equal(p.grad, 3 * x)
    # before_grad: p = 3p; then SGD: p -= 0.5 * grad
    assert torch.equal(p.detach(), torch.tensor([3.0, 6.0]) - 0.5 * 3 * x)


def test_every_use_of_a_pu_parameter_sees_its_pending_value():
    """Rule 1 says every use: the legacy spellings too (``p.data``, ``copy.copy(p)``), not only ops."""
    import copy

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = pu.Parameter(torch.ones(3), auxiliary=True)

    m = M()
    with pu.step(m):
        pu.assign(m.p, torch.tensor([1.0, 2.0, 3.0]))
        seen = {
            "op": m.p * 1,
            "clone": m.p.clone(),
            "detach": m.p.detach(),
            "index": m.p[0:3],
            "data": m.p.data,
            "data.clone": m.p.data.clone(),
            "copy.copy": copy.copy(m.p),
        }
        assert m.p.tolist() == [1.0, 2.0, 3.0]
        assert float(m.p.data.norm()) == float(torch.tensor([1.0, 2.0, 3.0]).norm())
        for how, v in seen.items():
            with torch._C.DisableTorchFunctionSubclass():
                assert v.tolist() == [1.0, 2.0, 3.0], how
        assert isinstance(seen["copy.copy"], pu.Parameter)
    assert m.p.tolist() == [1.0, 2.0, 3.0]
    assert m.p.data.tolist() == [1.0, 2.0, 3.0]
