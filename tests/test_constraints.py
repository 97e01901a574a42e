"""pu.constrain: Keras constraint semantics in phase after_grad, foreach path vs reference path.

The Keras formulas are written out here in NumPy (float64), in Keras' own
layout: a Dense kernel is (in, out), a Conv2D kernel (kh, kw, in, out).
"""

import copy
import inspect

import numpy as np
import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import assert_same, snapshot

EPS = 1e-7  # keras.backend.epsilon()


# --- Keras, by hand (keras/src/constraints/constraints.py) -------------------
def k_norms(w, axis):
    return np.sqrt(np.sum(np.square(w), axis=axis, keepdims=True))


def k_max_norm(w, max_value, axis=0):
    n = k_norms(w, axis)
    return w * (np.clip(n, 0, max_value) / (EPS + n))


def k_unit_norm(w, axis=0):
    return w / (EPS + k_norms(w, axis))


def k_min_max_norm(w, min_value, max_value, rate, axis=0):
    n = k_norms(w, axis)
    desired = rate * np.clip(n, min_value, max_value) + (1 - rate) * n
    return w * (desired / (EPS + n))


def k_non_neg(w):
    return w * (w >= 0.0).astype(w.dtype)


def _foreach(constraint, ts, norms="auto"):
    ts = [t.clone() for t in ts]
    constraint.apply_(ts, constraint.plan(ts, norms))
    return ts


def _close(ours, keras):
    np.testing.assert_allclose(ours.detach().double().numpy(), keras, rtol=2e-6, atol=1e-7)


LINEAR_CASES = [
    (pu.max_norm(1.5), lambda k: k_max_norm(k, 1.5, axis=0)),
    (pu.unit_norm(), lambda k: k_unit_norm(k, axis=0)),
    (pu.min_max_norm(0.5, 1.0, rate=0.7), lambda k: k_min_max_norm(k, 0.5, 1.0, 0.7, axis=0)),
    (pu.non_neg(), k_non_neg),
    # dim=1 on a torch (out, in) weight: one norm per *input*: Keras axis=1 on the (in, out) kernel
    (pu.max_norm(0.8, dim=1), lambda k: k_max_norm(k, 0.8, axis=1)),
]


@pytest.mark.parametrize(
    "c,keras", LINEAR_CASES, ids=lambda x: repr(x) if isinstance(x, pu.rules.constraints.Constraint) else ""
)
def test_linear_weight_matches_keras_dense_kernel(c, keras, strategy):
    w = nn.Linear(6, 4).weight.detach() * 3  # torch (out, in); norms both above and below the bounds
    k = w.double().numpy().T  # Keras kernel (in, out)
    _close(c(w).T, keras(k))  # reference path
    _close(_foreach(c, [w], strategy)[0].T, keras(k))  # foreach path


def test_conv_weight_matches_keras_conv_kernel_axis_012(strategy):
    w = nn.Conv2d(3, 5, 3).weight.detach() * 4  # (out, in, kh, kw)
    k = w.double().numpy().transpose(2, 3, 1, 0)  # Keras (kh, kw, in, out)
    for c, keras in [
        (pu.max_norm(0.9), lambda k: k_max_norm(k, 0.9, axis=(0, 1, 2))),
        (pu.unit_norm(), lambda k: k_unit_norm(k, axis=(0, 1, 2))),
        (pu.min_max_norm(0.2, 0.6, rate=0.5), lambda k: k_min_max_norm(k, 0.2, 0.6, 0.5, axis=(0, 1, 2))),
    ]:
        expect = keras(k).transpose(3, 2, 0, 1)
        _close(c(w), expect)
        _close(_foreach(c, [w], strategy)[0], expect)


def test_bias_whole_vector_norm_with_dim_none_matches_keras_axis0(strategy):
    b = torch.randn(9) * 2
    _close(_foreach(pu.max_norm(1.0, dim=None), [b], strategy)[0], k_max_norm(b.double().numpy(), 1.0, axis=0))
    # dim=0 on a 1-D tensor: one "norm" per element, |b_i|
    _close(_foreach(pu.max_norm(1.0), [b], strategy)[0], k_max_norm(b.double().numpy()[:, None], 1.0, axis=1).ravel())


def test_non_neg_equals_keras_in_value():
    w = torch.tensor([-2.0, -0.0, 0.0, 1.5, -1e-30])
    ours = _foreach(pu.non_neg(), [w])[0]
    assert torch.equal(ours, torch.from_numpy(k_non_neg(w.numpy())))  # -0.0 == 0.0: equal in value
    assert torch.equal(pu.non_neg()(w), torch.from_numpy(k_non_neg(w.numpy())))


def test_clamp():
    w = torch.randn(4, 4) * 3
    assert torch.equal(_foreach(pu.clamp(-1.0, 0.5), [w])[0], w.clamp(-1.0, 0.5))
    assert torch.equal(_foreach(pu.clamp(max=0.0), [w])[0], w.clamp(max=0.0))
    i = torch.arange(-3, 4)
    assert torch.equal(_foreach(pu.clamp(-1, 1), [i])[0], i.clamp(-1, 1))


@pytest.fixture(params=["each", "concat", "segments"])
def strategy(request):
    """Every row-norm strategy (``pu.constrain(..., norms=)``), checked on CPU: per tensor and
    concatenated small tensors (CPU), one segment_reduce (accelerators)."""
    return request.param


def test_cpu_concatenated_row_norms_are_bitwise_the_per_tensor_ones():
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 3), (5, 3), (4, 3, 2, 2), (6, 3, 2, 2), (2, 9), (7, 9), (3, 5, 4), (6, 5, 4), (300, 20)]
    ts = [torch.randn(s, generator=g) * 3 for s in shapes]
    for c in [pu.max_norm(1.0), pu.max_norm(1.0, dim=-1), pu.unit_norm(dim=1), pu.min_max_norm(0.5, 2.0, 0.3)]:
        each = _foreach(c, ts, "each")
        for a, b in zip(_foreach(c, ts, "concat"), each):
            assert torch.equal(a, b), c


def test_foreach_path_equals_reference_over_mixed_shapes_and_dtypes(strategy):
    ts = [
        torch.randn(s, dtype=dt) * 2
        for s, dt in [
            ((8, 3), torch.float32),
            ((5,), torch.float32),
            ((4, 3, 2, 2), torch.float32),
            ((7, 7), torch.float64),
            ((2, 9), torch.float32),
            ((), torch.float32),
            ((0, 3), torch.float32),
            ((3, 2, 5), torch.float64),
        ]
    ]
    for c in [
        pu.max_norm(1.0),
        pu.max_norm(2.0, dim=-1),
        pu.unit_norm(dim=None),
        pu.min_max_norm(0.5, 1.5, 0.3),
        pu.non_neg(),
        pu.clamp(-0.5, 0.5),
    ]:
        for ours, t in zip(_foreach(c, ts, strategy), ts):
            torch.testing.assert_close(ours, c(t), rtol=1e-6, atol=1e-7)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _data(n=4):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(5, 4, generator=g) for _ in range(n)]


def test_constraint_runs_after_the_optimizer_step():
    """Bitwise: torch's SGD, then the constraint's own foreach path (what the rule runs) on its result.
    (Earlier, the reference applied ``c(w)``, the reference path, whose norms round differently,
    under a tolerance that held on AVX-512 and failed with ATEN_CPU_CAPABILITY=default.)"""
    m = Net()
    ref = copy.deepcopy(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    c = pu.max_norm(0.3)
    pu.constrain([m.a.weight, m.b.weight], c)
    for x in _data():
        with pu.step(m, opt):
            m(x).pow(2).sum().backward()
        opt.zero_grad()
        ref(x).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            ws = [ref.a.weight, ref.b.weight]
            c.apply_(ws, c.plan(ws))  # after the gradient update (Keras: after apply_gradients)
    assert_same(snapshot(ref), snapshot(m))
    assert float(m.a.weight.detach().norm(dim=1).max()) <= 0.3 + 1e-6


def test_several_constraints_apply_in_declaration_order():
    m = Net()
    w0 = m.a.weight.detach().clone() * 5
    with torch.no_grad():
        m.a.weight.copy_(w0)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    pu.constrain(m.a.weight, pu.unit_norm())
    pu.constrain(m.a.weight, pu.clamp(-0.2, 0.2))
    with pu.step(m, opt) as s:
        m(torch.randn(2, 4)).sum().backward()
    torch.testing.assert_close(m.a.weight.detach(), pu.clamp(-0.2, 0.2)(pu.unit_norm()(w0)))
    assert not torch.allclose(m.a.weight.detach(), pu.unit_norm()(pu.clamp(-0.2, 0.2)(w0)))
    assert [r.op for r in s.schedule() if r.phase == "after_grad"] == ["constrain:unit_norm", "constrain:clamp"]


def test_callable_constraint_and_schedule_origin():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    calls = []

    def halve(w):
        calls.append(tuple(w.shape))
        return w * 0.5

    line = inspect.currentframe().f_lineno + 1
    pu.constrain(m.b, halve)  # a module: all its parameters
    before = {k: v.clone() for k, v in m.b.state_dict().items()}
    with pu.step(m, opt) as s:
        (0.0 * m(torch.randn(2, 4)).sum()).backward()
    assert calls == [(2, 6), (2,)]
    for k, v in before.items():
        assert torch.equal(m.b.state_dict()[k], v * 0.5)
    row = [r for r in s.schedule() if r.phase == "after_grad"][0]
    assert row.op == "constrain:halve" and row.origin.endswith(f"test_constraints.py:{line}")


def test_callable_returning_wrong_shape_is_an_error_naming_target_and_origin():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    line = inspect.currentframe().f_lineno + 1
    pu.constrain(m.a.weight, lambda w: w[:1])
    before = snapshot(m, opt)
    with pytest.raises(pu.UpdateError, match="same shape") as ei:
        with pu.step(m, opt, copy_for_rollback=True):
            m(torch.randn(2, 4)).sum().backward()
    assert "'a.weight'" in str(ei.value) and f"test_constraints.py:{line}" in str(ei.value)
    assert_same(before, snapshot(m, opt))
    # without copies the optimizer's step stays (it ran before the constraint), and the note says so
    with pytest.raises(pu.UpdateError, match="same shape") as ei:
        with pu.step(m, opt):
            m(torch.randn(2, 4)).sum().backward()
    assert "SGD.step" in "\n".join(ei.value.__notes__)


@pytest.mark.parametrize("how", ["one_step", "attach"])
def test_gradient_accumulation_constrains_once_per_update(how):
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    calls = []
    pu.constrain(m.a.weight, lambda w: calls.append(1) or w)
    att = pu.attach(m, opt) if how == "attach" else None
    for _ in range(2):
        if att is None:
            with pu.step(m, opt):
                for x in _data(3):
                    m(x).sum().backward()
        else:
            for x in _data(3):
                m(x).sum().backward()
            opt.step()
        opt.zero_grad()
    assert len(calls) == 2


def test_declaration_errors():
    m = Net()
    with pytest.raises(ValueError, match="out of range"):
        pu.constrain(m.a.bias, pu.max_norm(1.0, dim=1))
    with pytest.raises(pu.UpdateError, match="floating point"):
        pu.constrain(torch.zeros(3, dtype=torch.long), pu.unit_norm())
    with pytest.raises(TypeError, match="callable"):
        pu.constrain(m.a.weight, 3)
    with pytest.raises(ValueError):
        pu.max_norm(-1.0)
    with pytest.raises(ValueError):
        pu.min_max_norm(2.0, 1.0)


def test_moved_storage_is_revalidated():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pu.constrain(m.a.weight, pu.max_norm(0.1))
    with pu.step(m, opt):
        m(torch.randn(2, 4)).sum().backward()
    m.double()  # new storage for every parameter: the plan is rebuilt
    opt.zero_grad()
    with pu.step(m, opt):
        m(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    assert m.a.weight.dtype == torch.float64
    assert float(m.a.weight.detach().norm(dim=1).max()) <= 0.1 + 1e-9


def test_constraint_on_a_pu_parameter_with_an_update_in_the_same_phase():
    """The committed value is constrained; an after_grad update issued in the step then applies on top."""
    m = nn.Module()
    m.w = pu.Parameter(torch.randn(3, 4) * 3)
    opt = torch.optim.SGD([m.w], lr=0.0)
    pu.constrain(m.w, pu.max_norm(1.0))
    w0 = m.w.detach().clone()
    with pu.step(m, opt):
        (m.w * 0).sum().backward()
        m.w.assign_add(1.0, phase="after_grad")
    torch.testing.assert_close(m.w.detach(), pu.max_norm(1.0)(w0) + 1.0)
