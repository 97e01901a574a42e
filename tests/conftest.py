import pytest
import torch

import paramupdates as pu


def reset_pu() -> None:
    """Forget every step in progress, attachment and declared rule (also used by child processes)."""
    pu.testing.reset()
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _clean_state():
    """Each test starts with no step in progress, no attachment, no declared rule."""
    torch.manual_seed(0)
    yield
    reset_pu()


def bits(t):
    """The raw bytes of a tensor (bitwise comparison, NaN payloads and -0.0 included)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if (t.is_floating_point() or t.is_complex()) else t


def snapshot(*objs):
    """Bitwise copy of every tensor of modules/optimizers/tensors given."""
    out = []
    for o in objs:
        if isinstance(o, torch.nn.Module):
            out.extend((k, v.detach().clone()) for k, v in o.state_dict(keep_vars=True).items())
        elif isinstance(o, torch.optim.Optimizer):
            for p, st in o.state.items():
                out.extend((f"state{id(p)}.{k}", v.clone() if torch.is_tensor(v) else v) for k, v in st.items())
            out.append(("nstate", len(o.state)))
        elif torch.is_tensor(o):
            out.append(("t", o.detach().clone()))
    return out


def assert_trains_like(net, ref, inputs) -> None:
    """SGD steps of ``net`` in ``pu.step`` and of ``ref`` in plain PyTorch, one per input: outputs
    bitwise equal at each step, and every tensor of the two models bitwise equal after them."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in inputs:
        with pu.step(net, opt):
            out = net(x)
            out.square().mean().backward()
        ref_out = ref(x)
        ref_out.square().mean().backward()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert torch.equal(bits(out), bits(ref_out))
    assert_same(snapshot(ref), snapshot(net))


def assert_same(a, b):
    assert len(a) == len(b)
    for (ka, va), (kb, vb) in zip(a, b):
        assert ka == kb
        if torch.is_tensor(va):
            assert va.dtype == vb.dtype and va.shape == vb.shape, ka
            assert torch.equal(bits(va), bits(vb)), f"{ka} changed"
        else:
            assert va == vb, ka
