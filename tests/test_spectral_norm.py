"""pu.nn.spectral_norm vs torch.nn.utils.parametrizations.spectral_norm."""

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm as torch_sn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import paramupdates as pu

from conftest import assert_same, bits, snapshot


def _make(sn, seed=0, conv=False):
    torch.manual_seed(seed)
    m = nn.Conv2d(3, 4, 3) if conv else nn.Linear(5, 4)
    sn(m)
    return m


def _pair(conv=False):
    ref, mod = _make(torch_sn, conv=conv), _make(pu.nn.spectral_norm, conv=conv)
    assert_same(snapshot(ref), snapshot(mod))  # same initialization (15 power iterations)
    assert list(ref.state_dict()) == list(mod.state_dict())
    return ref, mod


def _u(m):
    return m.parametrizations.weight[0]._u


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("stepped", [False, True])
def test_values_bitwise_equal_to_torch(conv, stepped):
    ref, mod = _pair(conv)
    ro, mo = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
    shape = (2, 3, 6, 6) if conv else (6, 5)
    for i in range(4):
        x = torch.randn(shape)
        ref.train(i != 3)
        mod.train(i != 3)  # the last one in eval: no power iteration
        yr = ref(x)
        yr.square().sum().backward()
        ro.step()
        ro.zero_grad()
        if stepped:
            with pu.step(mod, mo):
                ym = mod(x)
                ym.square().sum().backward()
        else:
            ym = mod(x)
            ym.square().sum().backward()
            mo.step()
        mo.zero_grad()
        assert torch.equal(bits(yr), bits(ym))
        assert_same(snapshot(ref), snapshot(mod))


def test_used_twice_in_one_forward_sees_program_order():
    """Each evaluation runs one power iteration from what the previous one left (read-your-writes, rule 1)."""
    ref, mod = _pair()
    x1, x2 = torch.randn(3, 5), torch.randn(3, 5)
    (ref(x1).sum() + ref(x2).square().sum()).backward()
    with pu.step(mod):
        (mod(x1).sum() + mod(x2).square().sum()).backward()
    assert_same(snapshot(ref), snapshot(mod))
    for p, q in zip(ref.parameters(), mod.parameters()):
        assert torch.equal(bits(p.grad), bits(q.grad))


def _ckpt_run(sn, ckpt, stepped):
    m = _make(sn)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(7))

    def seg(x):
        return m(x) * 2 + m(x * 0.5)  # the weight twice inside the segment

    def body():
        out = seg(x) if ckpt is None else ckpt(seg, x)
        out.square().sum().backward()

    if stepped:
        with pu.step(m):
            body()
    else:
        body()
    return m.parametrizations.weight.original.grad.clone(), snapshot(m)


def test_torch_spectral_norm_under_checkpoint_is_wrong():
    """The contrast: the recomputation runs the power iteration again, so u and v
    advance twice and the recomputed weight differs: the gradient is silently wrong."""
    g0, s0 = _ckpt_run(torch_sn, None, False)
    g1, s1 = _ckpt_run(torch_sn, lambda f, x: torch_checkpoint(f, x, use_reentrant=False), False)
    assert not torch.equal(g0, g1)
    assert not torch.equal(s0[-2][1], s1[-2][1])  # _u differs


def _torch_ckpt(f, x):
    return torch_checkpoint(f, x, use_reentrant=False)


@pytest.mark.parametrize("ckpt", [pu.checkpoint, _torch_ckpt], ids=["pu.checkpoint", "torch.checkpoint"])
@pytest.mark.parametrize("stepped", [False, True])
def test_pu_spectral_norm_under_checkpoint_equals_no_checkpoint(stepped, ckpt):
    g0, s0 = _ckpt_run(pu.nn.spectral_norm, None, stepped)
    g1, s1 = _ckpt_run(pu.nn.spectral_norm, ckpt, stepped)
    assert torch.equal(bits(g0), bits(g1))
    assert_same(s0, s1)
    # and equals PyTorch's spectral norm without checkpointing, bitwise
    g2, s2 = _ckpt_run(torch_sn, None, False)
    assert torch.equal(bits(g0), bits(g2))
    assert_same(s0, s2)


def test_no_inplace_error_when_vectors_were_saved():
    """pytorch/pytorch#66363: an in-place write to a tensor autograd saved fails backward.
    With paramupdates the vectors are pending values, never written before commit."""
    mod = _make(pu.nn.spectral_norm)
    x = torch.randn(3, 5)
    with pu.step(mod):
        mod.eval()
        y_eval = mod(x)  # saves u and v for backward
        mod.train()
        y_train = mod(x)  # updates u and v
        (y_eval.sum() + y_train.sum()).backward()
    # the same with the pre-parametrization torch.nn.utils.spectral_norm hook (in-place) fails
    torch.manual_seed(0)
    old = nn.utils.spectral_norm(nn.Linear(5, 4))
    old.eval()
    a = old(x)
    old.train()
    b = old(x)
    with pytest.raises(RuntimeError, match="inplace"):
        (a.sum() + b.sum()).backward()
