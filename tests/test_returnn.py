"""paramupdates.returnn against the real RETURNN (torch backend, CPU).

Every checkpointing case runs RETURNN without the bridge beside it, on the
same data, and asserts both halves: what goes wrong there (statistics and
counters updated twice, a wrong gradient) and that with the bridge the state
is bitwise that of the run without checkpointing. The ports of RETURNN's own
rf tests (``tests/test_rf_base.py::test_param_assign``,
``tests/test_rf_cond.py::test_cond_param_assign*``,
``tests/test_rf_normalization.py``, ``tests/test_torch_frontend.py::
test_convert_parameter_to_buffer``) keep their assertions and run with the
bridge on, eagerly and inside a step. The Engine tests train RETURNN's
``Engine`` for short epochs on its Task12AX demo data.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch

pytest.importorskip("returnn")
pytest.importorskip("tree")  # dm-tree: RETURNN's frontend needs it

import returnn.frontend as rf  # noqa: E402
from returnn.config import Config, global_config_ctx  # noqa: E402
from returnn.datasets import init_dataset  # noqa: E402
from returnn.tensor import Dim, Tensor, TensorDict, batch_dim  # noqa: E402
from returnn.tensor.utils import tensor_dict_fill_random_numpy_  # noqa: E402
from returnn.torch.data.tensor_utils import tensor_dict_numpy_to_torch_, tensor_dict_torch_to_numpy_  # noqa: E402
from returnn.torch.engine import Engine  # noqa: E402
from returnn.torch.frontend._backend import TorchBackend  # noqa: E402
from returnn.torch.frontend.bridge import rf_module_to_pt_module  # noqa: E402

import paramupdates as pu  # noqa: E402
import paramupdates.returnn as pur  # noqa: E402

from conftest import bits  # noqa: E402

HERE = os.path.basename(__file__)


@pytest.fixture(autouse=True)
def _torch_backend():
    rf.select_backend_torch()
    yield
    pur.disable()
    _end_gradient_checkpoint_scopes()


def _end_gradient_checkpoint_scopes() -> None:
    """RETURNN ends a gradient_checkpoint_scope whose recorded tensors died only at the next
    saved_tensors_hooks enter/exit; until then its pack hook stays installed for every autograd save
    in the process (later tests would save tensors through it). End them now, and check none is left
    (RETURNN's own scopes that recorded in-place writes of parameters end when those models die)."""
    import gc

    import returnn.torch.util.gradient_checkpoint as gcs

    gc.collect()
    tls = gcs._custom_saved_tensors_hooks_tls_ctx
    if getattr(tls, "active", False):
        gcs._custom_saved_tensors_hooks_call_callbacks()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None, "a gradient_checkpoint_scope is left"


@pytest.fixture
def bridge():
    pur.enable()
    yield
    pur.disable()


def _storage(t: torch.Tensor) -> Any:
    """What ``t``'s storage holds (a pu.Parameter otherwise shows its pending value)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().clone().tolist()


def _raw_state(pt: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pt.state_dict().items()}


def _assert_bitwise(a: dict[str, Any], b: dict[str, Any], what: str = "") -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        va, vb = a[k], b[k]
        if torch.is_tensor(va):
            assert va.dtype == vb.dtype and va.shape == vb.shape, f"{what} {k}"
            assert torch.equal(bits(va), bits(vb)), f"{what} {k} differs"
        elif isinstance(va, dict):
            _assert_bitwise(va, vb, f"{what} {k}")
        else:
            assert va == vb, f"{what} {k}"


# ---------------------------------------------------------------------------
# enable / disable
# ---------------------------------------------------------------------------
def test_enable_disable_idempotent_and_restore_returnn():
    found = dict(TorchBackend.__dict__)
    pur.enable()
    pur.enable()
    assert pur.is_enabled()
    assert TorchBackend.__dict__["parameter_assign"] is not found["parameter_assign"]
    d = Dim(3, name="d")
    p = rf.Parameter([d])
    assert isinstance(p.raw_tensor, pu.Parameter) and p.raw_tensor.requires_grad
    pur.disable()
    pur.disable()
    assert not pur.is_enabled()
    for name in ("create_parameter_raw", "parameter_assign", "parameter_assign_key", "parameter_move_to", "batch_norm"):
        assert TorchBackend.__dict__[name] is found[name]
    q = rf.Parameter([d])
    assert type(q.raw_tensor) is torch.nn.Parameter
    # an existing pu.Parameter raw tensor is an ordinary parameter outside a step
    p.assign_add(1.0)
    assert torch.equal(p.raw_tensor.detach(), torch.ones(3))


def test_raw_tensors_match_returnn(bridge):
    d = Dim(4, name="d")
    bn = rf.BatchNorm(d, use_mask=False)
    count = rf.Parameter((), dtype="int32")
    for p, grad in ((bn.running_mean, False), (bn.running_variance, False), (bn.gamma, True), (count, False)):
        assert isinstance(p.raw_tensor, pu.Parameter)
        assert isinstance(p.raw_tensor, torch.nn.Parameter)
        assert p.raw_tensor.requires_grad is grad
    assert torch.equal(bn.running_variance.raw_tensor.detach(), torch.ones(4))
    pt = rf_module_to_pt_module(bn)
    assert pt.running_mean is bn.running_mean.raw_tensor  # a buffer of the torch module
    assert dict(pt.named_buffers()).keys() == {"running_mean", "running_variance"}


# ---------------------------------------------------------------------------
# ports of RETURNN's rf tests (tests/rf_utils.py::run_model, torch side only)
# ---------------------------------------------------------------------------
def run_model(
    extern_data: TensorDict,
    get_model: Any,
    forward_step: Any,
    *,
    dyn_dim_max_sizes=None,
    in_step: bool = False,
    train: bool = False,
) -> tuple[TensorDict, Any]:
    """RETURNN's ``rf_utils._run_model_torch`` (random data, seed 42), optionally inside one ``pu.step``.
    Returns the outputs (as numpy) and the model."""
    extern_data.reset_content()
    tensor_dict_fill_random_numpy_(extern_data, dyn_dim_max_sizes=dyn_dim_max_sizes)
    extern_data_raw = extern_data.as_raw_tensor_dict()
    rf.select_backend_torch()
    rf.set_random_seed(42)
    tensor_dict_numpy_to_torch_(extern_data)
    model = get_model(epoch=1, step=0)
    if train:
        rf.init_train_step_run_ctx(train_flag=True, step=0, epoch=1)
    else:
        rf.init_forward_step_run_ctx(epoch=1, step=0)
    if in_step:
        with pu.step(rf_module_to_pt_module(model)):
            forward_step(model=model, extern_data=extern_data)
    else:
        forward_step(model=model, extern_data=extern_data)
    outputs = rf.get_run_ctx().outputs if not train else TensorDict(_TRAIN_OUTPUTS)
    _TRAIN_OUTPUTS.clear()
    tensor_dict_torch_to_numpy_(outputs)
    extern_data.assign_from_raw_tensor_dict_(extern_data_raw)
    return outputs, model


_TRAIN_OUTPUTS: dict[str, Tensor] = {}


def mark_output(t: Tensor, name: str, dims: Any) -> None:
    """``mark_as_output`` (forward stage); in a train step (where rf allows no outputs) kept aside."""
    if rf.get_run_ctx().stage == "forward_step":
        t.mark_as_output(name, shape=dims)
    else:
        _TRAIN_OUTPUTS[name] = t.copy_transpose(dims)


class _ParamAssignNet(rf.Module):
    """tests/test_rf_base.py::test_param_assign"""

    def __init__(self):
        super().__init__()
        self.param = rf.Parameter(dims=(), dtype="int32")
        self.param.initial = 2

    def __call__(self, x: Tensor):
        a = rf.copy(self.param)
        self.param.assign(5)
        b = rf.copy(self.param)
        self.param.assign(7)
        return a, b, self.param


@pytest.mark.parametrize("in_step", [False, True], ids=["eager", "in_step"])
def test_port_param_assign(bridge, in_step):
    time_dim = Dim(Tensor("time", [batch_dim], dtype="int32"))
    in_dim = Dim(7, name="in")
    extern_data = TensorDict({"data": Tensor("data", [batch_dim, time_dim, in_dim], dtype="float32")})

    def _forward_step(*, model: _ParamAssignNet, extern_data: TensorDict):
        a, b, c = model(extern_data["data"])
        a.mark_as_output("a", shape=())
        b.mark_as_output("b", shape=())
        c.mark_as_output("c", shape=())

    out, model = run_model(extern_data, lambda *, epoch, step: _ParamAssignNet(), _forward_step, in_step=in_step)
    assert out["a"].raw_tensor == 2 and out["b"].raw_tensor == 5 and out["c"].raw_tensor == 7
    assert model.param.raw_tensor.item() == 7  # committed


def test_port_param_assign_reads_pending_values_in_step(bridge):
    """Inside a step nothing is written before commit, yet rf reads see the assigns in program order."""
    net = _ParamAssignNet()
    pt = rf_module_to_pt_module(net)
    raw = net.param.raw_tensor
    version = raw._version
    with pu.step(pt) as s:
        a, b, c = net(None)
        assert (a.raw_tensor.item(), b.raw_tensor.item(), c.raw_tensor.item()) == (2, 5, 7)
        with torch._C.DisableTorchFunctionSubclass():
            assert raw.item() == 2 and raw._version == version  # storage untouched until commit
    assert raw.item() == 7
    rows = s.schedule()
    assert [(r.phase, r.target, r.op) for r in rows] == [("auxiliary", "param", "assign")] * 2
    assert all(
        r.origin.endswith(f"{HERE}:{_line_of('self.param.assign(5)')}")
        or r.origin.endswith(f"{HERE}:{_line_of('self.param.assign(7)')}")
        for r in rows
    )


def _line_of(text: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if text in line:
                return i
    raise AssertionError(text)


class _CondNet(rf.Module):
    """tests/test_rf_cond.py::test_cond_param_assign / 2 / 3"""

    def __init__(self, variant: int, time_dim: Dim):
        super().__init__()
        self.variant = variant
        self.time_dim = time_dim
        self.param = rf.Parameter(dims=(), dtype="int32")
        self.param.initial = 2

    def __call__(self, x: Tensor):
        pred = self.time_dim.get_dim_value_tensor() % 2 == 0
        if self.variant == 1:
            rf.cond(pred=pred, true_fn=lambda: self.param.assign_add(3), false_fn=lambda: None)
            return self.param, self.param
        if self.variant == 2:
            rf.cond(pred=pred, true_fn=lambda: self.param.assign_add(3), false_fn=lambda: self.param.assign_add(7))
            return self.param, self.param
        return (
            rf.cond(
                pred=pred,
                true_fn=lambda: (self.param.assign_add(3), rf.convert_to_tensor(42))[-1],
                false_fn=lambda: self.param * 3,
            ),
            self.param,
        )


@pytest.mark.parametrize("in_step", [False, True], ids=["eager", "in_step"])
@pytest.mark.parametrize(
    "variant,expected", [(1, {5: (2, 2), 6: (5, 5)}), (2, {5: (9, 9), 6: (5, 5)}), (3, {5: (6, 2), 6: (42, 5)})]
)
def test_port_cond_param_assign(bridge, variant, expected, in_step):
    time_dim = Dim(Tensor("time", [batch_dim], dtype="int32"))
    in_dim = Dim(7, name="in")
    extern_data = TensorDict({"data": Tensor("data", [batch_dim, time_dim, in_dim], dtype="float32")})

    def _forward_step(*, model: _CondNet, extern_data: TensorDict):
        out, param = model(extern_data["data"])
        out.mark_as_default_output(shape=())
        param.mark_as_output(shape=(), name="param")

    for max_size, (want_out, want_param) in expected.items():
        out, model = run_model(
            extern_data,
            lambda *, epoch, step: _CondNet(variant, time_dim),
            _forward_step,
            dyn_dim_max_sizes={time_dim: max_size},
            in_step=in_step,
        )
        assert out["output"].raw_tensor == want_out and out["param"].raw_tensor == want_param
        assert model.param.raw_tensor.item() == want_param


class _BNNet(rf.Module):
    """tests/test_rf_normalization.py::test_batch_norm / test_batch_norm_masking"""

    def __init__(self, in_dim: Dim, **bn_opts):
        super().__init__()
        self.bn = rf.BatchNorm(in_dim, **bn_opts)

    def __call__(self, x: Tensor) -> Tensor:
        return self.bn(x)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize(
    "bn_opts",
    [{"use_mask": False}, {"use_mask": True, "track_running_stats": False}, {"use_mask": True}],
    ids=["fused", "masked_no_stats", "masked"],
)
def test_port_batch_norm(bn_opts, train):
    """The ports' outputs and statistics with the bridge (eagerly and in a step) equal RETURNN's, bitwise."""
    time_dim = Dim(Tensor("time", [batch_dim], dtype="int32"))
    in_dim = Dim(7, name="in")
    extern_data = TensorDict({"data": Tensor("data", [batch_dim, time_dim, in_dim], dtype="float32")})

    def _forward_step(*, model: _BNNet, extern_data: TensorDict):
        mark_output(model(extern_data["data"]), "output", (batch_dim, time_dim, in_dim))

    results = []
    for on, in_step in ((False, False), (True, False), (True, True)):
        if on:
            pur.enable()
        out, model = run_model(
            extern_data, lambda *, epoch, step: _BNNet(in_dim, **bn_opts), _forward_step, in_step=in_step, train=train
        )
        pur.disable()
        results.append((torch.from_numpy(out["output"].raw_tensor.copy()), _raw_state(rf_module_to_pt_module(model))))
    ref_out, ref_state = results[0]
    for got_out, got_state in results[1:]:
        assert torch.equal(bits(got_out), bits(ref_out))
        _assert_bitwise(got_state, ref_state)
    if train and bn_opts.get("track_running_stats", True):  # the statistics did move
        assert not torch.equal(ref_state["bn.running_mean"], torch.zeros(7))


def test_port_convert_parameter_to_buffer(bridge):
    """tests/test_torch_frontend.py::test_convert_parameter_to_buffer. Its one exact type check
    (``type(mod_pt.weight) is torch.nn.Parameter``) sees a pu.Parameter, a torch.nn.Parameter subclass."""
    from returnn.torch.util.module import convert_parameters_to_buffers

    in_dim = Dim(2, name="in")
    out_dim = Dim(3, name="out")
    mod_rf = rf.Linear(in_dim, out_dim)
    mod_pt = rf_module_to_pt_module(mod_rf)
    convert_parameters_to_buffers(mod_pt, ["weight", "bias"], persistent=False)
    assert dict(mod_pt.named_parameters()) == {}
    assert set(dict(mod_pt.named_buffers()).keys()) == {"weight", "bias"}
    assert type(mod_pt.weight) is pu.Parameter and isinstance(mod_pt.weight, torch.nn.Parameter)  # same instance
    mod_pt.to(torch.bfloat16)
    assert type(mod_pt.weight) is torch.Tensor  # as in RETURNN: a moved plain buffer stays plain


def test_module_to_keeps_pu_parameters(bridge):
    """RETURNN re-wraps moved auxiliary parameters in new torch.nn.Parameters; with the bridge they stay
    pu.Parameters, the same object in the torch module and the rf.Parameter, and still take updates in a step."""
    d = Dim(3, name="d")
    bn = rf.BatchNorm(d, use_mask=False)
    pt = rf_module_to_pt_module(bn)
    pt.to(torch.float64)
    assert isinstance(bn.running_mean.raw_tensor, pu.Parameter) and bn.running_mean.raw_tensor.dtype == torch.float64
    assert pt.running_mean is bn.running_mean.raw_tensor
    bn.gamma.to(dtype="float64")  # rf.Parameter.to
    assert isinstance(bn.gamma.raw_tensor, pu.Parameter)
    x = rf.convert_to_tensor(torch.randn(4, 3, dtype=torch.float64), dims=[batch_dim, d])
    rf.init_train_step_run_ctx(train_flag=True, step=0)
    with pu.step(pt):
        bn(x)
    assert not torch.equal(bn.running_mean.raw_tensor.detach(), torch.zeros(3, dtype=torch.float64))


# ---------------------------------------------------------------------------
# checkpointing: torch.utils.checkpoint and rf.gradient_checkpoint_scope
# ---------------------------------------------------------------------------
_T, _IN, _HID = Dim(5, name="time"), Dim(3, name="in"), Dim(4, name="hid")


class _SegNet(rf.Module):
    """A counter and a batch norm (fused or masked path) in one segment, checkpointed or not."""

    def __init__(self, ckpt: str, use_mask: bool):
        super().__init__()
        self.ckpt = ckpt
        self.lin = rf.Linear(_IN, _HID)
        self.bn = rf.BatchNorm(_HID, use_mask=use_mask)
        self.count = rf.Parameter((), dtype="int32", auxiliary=True)
        self.count.initial = 0

    def segment(self, x: Tensor) -> Tensor:
        self.count.assign_add(1)
        return self.bn(self.lin(x))

    def __call__(self, x: Tensor) -> Tensor:
        return checkpointed(self.ckpt, self.segment, x, _IN, _HID)


def checkpointed(ckpt: str, fn: Any, x: Tensor, in_feature: Dim, out_feature: Dim) -> Tensor:
    """``fn(x)`` (``in_feature`` -> ``out_feature``) without checkpointing, under ``torch.utils.checkpoint``
    (``"torch"``, ``"reentrant"``) or under ``rf.gradient_checkpoint_scope`` (``"gcs"``)."""
    if ckpt == "none":
        return fn(x)
    if ckpt == "gcs":
        with rf.gradient_checkpoint_scope():
            return fn(x)
    dims = list(x.dims)

    def raw_fn(x_raw: torch.Tensor) -> torch.Tensor:
        y = fn(rf.convert_to_tensor(x_raw, dims=dims, feature_dim=in_feature))
        return y.copy_transpose([out_feature if d == in_feature else d for d in dims]).raw_tensor

    y_raw = torch.utils.checkpoint.checkpoint(raw_fn, x.raw_tensor, use_reentrant=ckpt == "reentrant")
    y_dims = [out_feature if d == in_feature else d for d in dims]
    return rf.convert_to_tensor(y_raw, dims=y_dims, feature_dim=out_feature)


def _train_segnet(ckpt: str, use_mask: bool, *, on: bool, steps: int = 3) -> dict[str, torch.Tensor]:
    """A few SGD steps of _SegNet (inside pu.step with the bridge, plain RETURNN without): the final state."""
    if on:
        pur.enable()
    try:
        rf.set_random_seed(1)
        net = _SegNet(ckpt, use_mask)
        pt = rf_module_to_pt_module(net)
        opt = torch.optim.SGD(pt.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(0)
        rf.init_train_step_run_ctx(train_flag=True, step=0)
        batch = Dim(4, name="batch")
        seq_lens = rf.convert_to_tensor(torch.tensor([5, 3, 4, 2], dtype=torch.int32), dims=[batch])
        time_dim = Dim(seq_lens, name="time") if use_mask else _T
        for _ in range(steps):
            x = rf.convert_to_tensor(
                torch.randn(4, 5, 3, generator=gen, requires_grad=True), dims=[batch, time_dim, _IN], feature_dim=_IN
            )
            if on:
                with pu.step(pt, opt):
                    y = net(x)
                    rf.reduce_sum(y * y, axis=y.dims).raw_tensor.backward()
            else:
                y = net(x)
                rf.reduce_sum(y * y, axis=y.dims).raw_tensor.backward()
                opt.step()
            opt.zero_grad()
        return _raw_state(pt)
    finally:
        pur.disable()


_RETURNN_ALONE_UNDER_GCS = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_returnn as T
T.rf.select_backend_torch()
torch.save({"segnet_fused": T._train_segnet("gcs", False, on=False), "segnet_masked": T._train_segnet("gcs", True, on=False),
            "read_assign": T._read_assign_grad("gcs", on=False)}, sys.argv[2])
"""
_GCS_ALONE: dict[str, Any] = {}


def returnn_alone(what: str, ckpt: str, use_mask: bool = False) -> Any:
    """RETURNN without the bridge: _train_segnet (``what="segnet"``) or _read_assign_grad (``"read_assign"``).

    Under ``rf.gradient_checkpoint_scope`` in a fresh interpreter: there RETURNN records its in-place
    writes of parameters as outputs of the scope, whose graph then keeps those parameters alive (a value
    of its weak-key dict references its key), so the scope's pack hook stays installed for every later
    autograd save in the process (and e.g. hides "modified by an inplace operation" errors from other tests).
    """
    if ckpt != "gcs":
        return _train_segnet(ckpt, use_mask, on=False) if what == "segnet" else _read_assign_grad(ckpt, on=False)
    if not _GCS_ALONE:
        import subprocess
        import sys
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.pt")
            subprocess.run(
                [sys.executable, "-c", _RETURNN_ALONE_UNDER_GCS, os.path.dirname(__file__), out],
                check=True,
                capture_output=True,
                timeout=600,
            )
            _GCS_ALONE.update(torch.load(out, weights_only=False))
    return _GCS_ALONE["read_assign" if what == "read_assign" else "segnet_masked" if use_mask else "segnet_fused"]


@pytest.mark.parametrize("use_mask", [False, True], ids=["fused_bn", "masked_bn"])
@pytest.mark.parametrize("ckpt", ["torch", "gcs"])
def test_checkpointed_counter_and_batchnorm(ckpt, use_mask):
    """RETURNN: the recomputation updates the counter and the statistics again (count 6 for 3 steps).
    Bridge: bitwise the state without checkpointing, which is RETURNN's own state without checkpointing."""
    returnn_plain = _train_segnet("none", use_mask, on=False)
    returnn_ckpt = returnn_alone("segnet", ckpt, use_mask)
    assert returnn_plain["count"].item() == 3
    assert returnn_ckpt["count"].item() == 6
    assert not torch.equal(returnn_ckpt["bn.running_mean"], returnn_plain["bn.running_mean"])
    bridge_plain = _train_segnet("none", use_mask, on=True)
    bridge_ckpt = _train_segnet(ckpt, use_mask, on=True)
    _assert_bitwise(bridge_plain, returnn_plain, "bridge vs RETURNN, no checkpointing")
    _assert_bitwise(bridge_ckpt, returnn_plain, f"bridge under {ckpt} vs no checkpointing")


class _ReadAssignNet(rf.Module):
    """A segment that reads an auxiliary parameter, assigns it, and reads it again."""

    def __init__(self, ckpt: str):
        super().__init__()
        self.ckpt = ckpt
        self.s = rf.Parameter([_IN], auxiliary=True)
        self.s.initial = 1.0

    def segment(self, x: Tensor) -> Tensor:
        y = x * rf.copy(self.s)
        self.s.assign(self.s + 1.0)
        return y + x * rf.copy(self.s)

    def __call__(self, x: Tensor) -> Tensor:
        return checkpointed(self.ckpt, self.segment, x, _IN, _IN)


def _read_assign_grad(ckpt: str, *, on: bool) -> tuple[float, float]:
    if on:
        pur.enable()
    try:
        net = _ReadAssignNet(ckpt)
        x_raw = torch.ones(3, requires_grad=True)
        x = rf.convert_to_tensor(x_raw, dims=[_IN], feature_dim=_IN)
        if on:
            with pu.step(rf_module_to_pt_module(net)):
                net(x).raw_tensor.sum().backward()
        else:
            net(x).raw_tensor.sum().backward()
        return x_raw.grad[0].item(), net.s.raw_tensor[0].item()
    finally:
        pur.disable()


@pytest.mark.parametrize("ckpt", ["torch", "gcs"])
def test_read_then_assign_segment_gradient(ckpt):
    """d/dx (x * s + x * (s + 1)) at s = 1 is 3. RETURNN under checkpointing: the recomputation reads the
    assigned value and assigns again (gradient 5, s = 3). Bridge: 3 and s = 2, as without checkpointing."""
    assert _read_assign_grad("none", on=False) == (3.0, 2.0)
    assert returnn_alone("read_assign", ckpt) == (5.0, 3.0)
    assert _read_assign_grad(ckpt, on=True) == (3.0, 2.0)
    assert _read_assign_grad("none", on=True) == (3.0, 2.0)


def test_gcs_replay_needs_subclass_dispatch_disabled(bridge):
    """Without the bridge's patch of the gcs replay, __torch_function__ would substitute the latest pending
    value (s = 2) into the recomputed ops that read s: gradient 5 = 2 + 3 instead of 3 = 1 + 2."""
    import returnn.torch.util.gradient_checkpoint as gcs

    patched = gcs._Graph.maybe_recompute
    gcs._Graph.maybe_recompute = pur._STATE.orig["maybe_recompute"]
    try:
        net = _ReadAssignNet("gcs")
        x_raw = torch.ones(3, requires_grad=True)
        with pu.step(rf_module_to_pt_module(net)):
            net(rf.convert_to_tensor(x_raw, dims=[_IN], feature_dim=_IN)).raw_tensor.sum().backward()
        assert x_raw.grad[0].item() == 5.0
    finally:
        gcs._Graph.maybe_recompute = patched


_GCS_THEN_TORCH_CHECKPOINT = """
import sys, torch
import paramupdates.returnn as pur
from returnn.torch.util.gradient_checkpoint import gradient_checkpoint_scope
if sys.argv[1] == "on":
    pur.enable()
x = torch.ones(3, requires_grad=True)
with gradient_checkpoint_scope():
    y = x * 2
    w = x + 1  # recorded, never saved for backward (like a pending value made in the scope)
(y * y).sum().backward()
del y, w
out = torch.utils.checkpoint.checkpoint(lambda a: (a * 3).sin(), x, use_reentrant=False)
print("result", out.sum().item())
"""


def test_gcs_cleanup_then_torch_checkpoint():
    """A gcs scope whose last recorded tensor was never saved for backward, then torch.utils.checkpoint:
    RETURNN alone raises "saved_tensors_hooks __exit__ mismatch" (the scope's cleanup runs inside the next
    saved_tensors_hooks' __enter__, after `with` bound RETURNN's __exit__); the bridge makes that __exit__
    the original one. With the bridge such scopes are common (pending values are made in them). Fresh
    interpreters: RETURNN's scopes that saw in-place writes of parameters stay registered for good."""
    import subprocess
    import sys

    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", _GCS_THEN_TORCH_CHECKPOINT, mode], capture_output=True, text=True, timeout=300
        )

    plain = run("off")
    assert plain.returncode != 0 and "saved_tensors_hooks __exit__ mismatch" in plain.stderr
    ours = run("on")
    assert ours.returncode == 0, ours.stderr
    assert float(ours.stdout.split()[-1]) == pytest.approx(3 * torch.sin(torch.tensor(3.0)).item())


def test_reentrant_checkpoint_in_step_raises_and_changes_nothing(bridge):
    rf.set_random_seed(1)
    net = _SegNet("reentrant", use_mask=False)
    pt = rf_module_to_pt_module(net)
    before = _raw_state(pt)
    rf.init_train_step_run_ctx(train_flag=True, step=0)
    x = rf.convert_to_tensor(torch.randn(4, 5, 3, requires_grad=True), dims=[batch_dim, _T, _IN], feature_dim=_IN)
    with pytest.raises(
        pu.UpdateError, match=r"'count' at .*test_returnn.py:\d+ was issued during backward.*use_reentrant"
    ):
        with pu.step(pt, torch.optim.SGD(pt.parameters(), lr=0.1)):
            y = net(x)
            rf.reduce_sum(y * y, axis=y.dims).raw_tensor.backward()
    _assert_bitwise(_raw_state(pt), before)


# ---------------------------------------------------------------------------
# phases, weight decay, constraints, errors
# ---------------------------------------------------------------------------
class _TrainableAssignNet(rf.Module):
    def __init__(self, phase: str | None = "unset"):
        super().__init__()
        self.phase = phase
        self.w = rf.Parameter([_IN])
        self.w.initial = 1.0

    def __call__(self, x: Tensor) -> Tensor:
        y = rf.reduce_sum(x * self.w, axis=_IN)
        if self.phase == "unset":
            self.w.assign_add(0.5)
        elif self.phase == "arg":
            pur.assign_add(self.w, 0.5, phase="after_grad")
        else:
            with pur.phase(self.phase):
                self.w.assign_add(0.5)
        return y


def test_trainable_assign_without_phase_raises_naming_target_site_and_fix(bridge):
    net = _TrainableAssignNet()
    pt = rf_module_to_pt_module(net)
    opt = torch.optim.SGD(pt.parameters(), lr=0.1)
    x = rf.convert_to_tensor(torch.ones(3), dims=[_IN])
    line = _line_of("self.w.assign_add(0.5)")
    with pytest.raises(pu.AmbiguousOrderError) as e:
        with pu.step(pt, opt):
            net(x)
    msg = str(e.value)
    assert "pu.assign_add on 'w' at " in msg and f"{HERE}:{line} has no phase" in msg
    assert "paramupdates.returnn.phase('after_grad')" in msg
    assert torch.equal(net.w.raw_tensor.detach(), torch.ones(3))


@pytest.mark.parametrize("how", ["before_grad", "after_grad", "arg"])
def test_phase_of_rf_assign(bridge, how):
    """before_grad: the optimizer updates w + 0.5; after_grad: 0.5 is added to the optimizer's result.
    SGD with L2 weight decay tells them apart; compared bitwise with the same ops by hand."""
    net = _TrainableAssignNet(how)
    pt = rf_module_to_pt_module(net)
    opt = torch.optim.SGD(pt.parameters(), lr=0.1, weight_decay=0.5)
    x = rf.convert_to_tensor(torch.tensor([1.0, 2.0, 3.0]), dims=[_IN])
    with pu.step(pt, opt) as s:
        net(x).raw_tensor.backward()
    # the anchor: torch's SGD on the value it sees (w + 0.5 before_grad; w after_grad, then + 0.5);
    # a formula by hand (w - 0.1 * (g + 0.5 * w)) rounds differently where SGD's add(alpha=) fuses
    w = torch.nn.Parameter(torch.ones(3) + (0.5 if how == "before_grad" else 0.0))
    w.grad = torch.tensor([1.0, 2.0, 3.0])
    torch.optim.SGD([w], lr=0.1, weight_decay=0.5).step()
    want = w.detach() if how == "before_grad" else w.detach() + 0.5
    assert torch.equal(bits(net.w.raw_tensor.detach()), bits(want))
    assert [r.phase for r in s.schedule() if r.target == "w"] == [
        "before_grad" if how == "before_grad" else "after_grad"
    ]


def test_assign_key_routed(bridge):
    d = Dim(4, name="d")
    p = rf.Parameter([d], auxiliary=True)
    p.initial = 0.0
    holder = rf.Module()
    holder.p = p
    pt = rf_module_to_pt_module(holder)
    idx = rf.convert_to_tensor(torch.tensor(1), dims=())
    p.assign_key(axis=d, key=idx, key_dim=None, value=rf.convert_to_tensor(3.0))  # eager
    assert p.raw_tensor.detach().tolist() == [0.0, 3.0, 0.0, 0.0]
    with pu.step(pt) as s:
        p.assign_key(axis=d, key=idx, key_dim=None, value=rf.convert_to_tensor(2.0))
        # op="add" (RETURNN's backend supports it): reads the pending value
        TorchBackend.parameter_assign_key(p, idx, rf.convert_to_tensor(1.5), op="add", axis=d, key_dim=None)
        assert rf.copy(p).raw_tensor.tolist() == [0.0, 3.5, 0.0, 0.0]
        with torch._C.DisableTorchFunctionSubclass():
            assert p.raw_tensor.tolist() == [0.0, 3.0, 0.0, 0.0]
    assert p.raw_tensor.detach().tolist() == [0.0, 3.5, 0.0, 0.0]
    assert [r.op for r in s.schedule()] == ["assign_key", "assign_key"]


def test_pu_when_in_rf_code(bridge):
    """pu.when with a 0-dim bool rf tensor's raw tensor: where(pred, new, old), no host sync; eagerly too."""
    holder = rf.Module()
    holder.count = rf.Parameter((), dtype="int32", auxiliary=True)
    holder.count.initial = 0
    pt = rf_module_to_pt_module(holder)
    for flag, want in ((True, 1), (False, 1), (True, 2)):
        pred = rf.convert_to_tensor(torch.tensor(flag), dims=())
        with pu.step(pt) as s, pu.when(pred.raw_tensor):
            holder.count.assign_add(1)
        assert holder.count.raw_tensor.item() == want
        assert [r.condition for r in s.schedule()] == ["when(tensor)"]
    with pu.when(rf.convert_to_tensor(torch.tensor(True), dims=()).raw_tensor):
        holder.count.assign_add(1)
    assert holder.count.raw_tensor.item() == 3


def test_parameter_made_before_enable_raises_inside_step():
    d = Dim(3, name="d")
    holder = rf.Module()
    holder.p = rf.Parameter([d], auxiliary=True)  # plain torch.nn.Parameter raw tensor
    holder.p.initial = 0.0
    pur.enable()
    holder.p.assign_add(1.0)  # outside a step: eager, as RETURNN
    assert holder.p.raw_tensor.detach().tolist() == [1.0] * 3
    pt = rf_module_to_pt_module(holder)
    with pytest.raises(pu.UpdateError, match=r"rf.Parameter 'p' .*plain torch.nn.Parameter.*enable\(\) before"):
        with pu.step(pt):
            holder.p.assign_add(1.0)
    assert holder.p.raw_tensor.detach().tolist() == [1.0] * 3


def test_value_kind_errors_name_target_and_call_site(bridge):
    d = Dim(3, name="d")
    holder = rf.Module()
    holder.count = rf.Parameter([d], dtype="int32", auxiliary=True)
    pt = rf_module_to_pt_module(holder)
    with pytest.raises(pu.UpdateError, match=rf"'count' at .*{HERE}:\d+: value of dtype torch.float32"):
        with pu.step(pt):
            holder.count.assign(rf.convert_to_tensor(torch.ones(3), dims=[d]))


class _WDNet(rf.Module):
    def __init__(self):
        super().__init__()
        self.a = rf.Linear(_IN, _HID)
        self.b = rf.Linear(_HID, _IN)
        self.a.weight.weight_decay = 0.1
        self.b.weight.weight_decay = 0.3
        self.b.bias.weight_decay = 0.3

    def __call__(self, x: Tensor) -> Tensor:
        return self.b(rf.relu(self.a(x)))


def test_weight_decay_honours_rf_parameter_weight_decay(bridge):
    """Adam + pur.weight_decay (rates from rf.Parameter.weight_decay) == AdamW with those rates per param
    group, bitwise, over 4 steps under pu.attach with 2 micro-batches per update."""
    rf.set_random_seed(3)
    net = _WDNet()
    pt = rf_module_to_pt_module(net)
    ref = {k: v.detach().clone() for k, v in pt.named_parameters()}
    rules = pur.weight_decay(net)
    assert [len(r.names) for r in rules] == [1, 2] and rules[1].names == ["b.weight", "b.bias"]
    opt = torch.optim.Adam(pt.parameters(), lr=0.01)
    att = pu.attach(pt, opt)
    ref_params = {k: torch.nn.Parameter(v) for k, v in ref.items()}
    rates = {"a.weight": 0.1, "b.weight": 0.3, "b.bias": 0.3}
    groups = [
        {"params": [ref_params[k] for k in ref_params if rates.get(k, 0.0) == r], "weight_decay": r}
        for r in (0.0, 0.1, 0.3)
    ]
    ref_opt = torch.optim.AdamW(groups, lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        for _ in range(2):
            xr = torch.randn(6, 3, generator=gen)
            x = rf.convert_to_tensor(xr, dims=[batch_dim, _IN], feature_dim=_IN)
            rf.reduce_sum(net(x) ** 2, axis=[batch_dim, _IN]).raw_tensor.backward()
            h = torch.relu(xr @ ref_params["a.weight"] + ref_params["a.bias"])
            ((h @ ref_params["b.weight"] + ref_params["b.bias"]) ** 2).sum().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for k, p in pt.named_parameters():
        assert torch.equal(bits(p.detach()), bits(ref_params[k].detach())), k
    assert att.steps == 4
    rows = [(r.phase, r.target, r.op) for r in att.schedule()][:2]
    assert rows == [
        ("before_grad", "a.weight", "weight_decay"),
        ("before_grad", "2 tensors (b.weight, b.bias)", "weight_decay"),
    ]


def test_constrain_rf_parameter(bridge):
    """pur.constrain(rf.Linear.weight, pu.max_norm(v, dim=1)): after each update every output unit's
    incoming weights have norm <= v, bitwise Keras' formula applied to the optimizer's result."""
    rf.set_random_seed(3)
    net = _WDNet()
    pt = rf_module_to_pt_module(net)
    pur.constrain(net.a.weight, pu.max_norm(0.05, dim=1))
    opt = torch.optim.SGD(pt.parameters(), lr=0.5)
    x = rf.convert_to_tensor(
        torch.randn(6, 3, generator=torch.Generator().manual_seed(0)), dims=[batch_dim, _IN], feature_dim=_IN
    )
    w0 = net.a.weight.raw_tensor.detach().clone()
    with pu.step(pt, opt) as s:
        rf.reduce_sum(net(x) ** 2, axis=[batch_dim, _IN]).raw_tensor.backward()
        g = net.a.weight.raw_tensor.grad.clone()
    w = torch.nn.Parameter(w0.clone())  # the anchor: torch's SGD, then Keras' formula on its result
    w.grad = g
    torch.optim.SGD([w], lr=0.5).step()
    w = w.detach()
    n = torch.linalg.vector_norm(w, dim=0, keepdim=True)
    want = w * (n.clamp(0, 0.05) / (1e-7 + n))
    assert torch.equal(bits(net.a.weight.raw_tensor.detach()), bits(want))
    assert (torch.linalg.vector_norm(net.a.weight.raw_tensor.detach(), dim=0) <= 0.05 + 1e-6).all()
    assert [(r.phase, r.target) for r in s.schedule() if r.phase == "after_grad"] == [("after_grad", "a.weight")]


# ---------------------------------------------------------------------------
# RETURNN's Engine, config only
# ---------------------------------------------------------------------------
_E_IN, _E_HID, _E_OUT = Dim(9, name="in"), Dim(8, name="hid"), Dim(2, name="classes")
_E_TIME = Dim(None, name="time")


class EngineModel(rf.Module):
    """Task12AX: input batch norm (fused path), a linear layer, a masked batch norm, a counter; the first
    three and the counter in one segment, checkpointed (``ckpt``) or not."""

    def __init__(self, ckpt: str = "none", weight_decay: float = 0.0):
        super().__init__()
        self.ckpt = ckpt
        self.bn_in = rf.BatchNorm(_E_IN, use_mask=False)
        self.lin = rf.Linear(_E_IN, _E_HID)
        self.bn = rf.BatchNorm(_E_HID, use_mask=True)
        self.out = rf.Linear(_E_HID, _E_OUT)
        self.count = rf.Parameter((), dtype="int32", auxiliary=True)
        self.count.initial = 0
        self.lin.weight.weight_decay = self.out.weight.weight_decay = weight_decay

    def segment(self, x: Tensor) -> Tensor:
        self.count.assign_add(1)  # the Engine model's counter
        return self.bn(self.lin(self.bn_in(x)))

    def __call__(self, x: Tensor) -> Tensor:
        return self.out(rf.relu(checkpointed(self.ckpt, self.segment, x, _E_IN, _E_HID)))


class GetEngineModel:
    """The config's get_model (a module-level class: RETURNN may pickle the config)."""

    def __init__(self, ckpt: str, weight_decay: float = 0.0, declare_decay: bool = False, constrain: bool = False):
        self.ckpt, self.weight_decay, self.declare_decay, self.constrain = ckpt, weight_decay, declare_decay, constrain

    def __call__(self, **_kwargs: Any) -> EngineModel:
        model = EngineModel(self.ckpt, self.weight_decay)
        if self.declare_decay:
            pur.weight_decay(model)
        if self.constrain:
            pur.constrain(model.out.weight, pu.max_norm(0.5, dim=1))  # the config's constraint
        return model


def engine_train_step(*, model: EngineModel, extern_data: TensorDict, **_kwargs: Any) -> None:
    logits = model(extern_data["data"])
    loss = rf.cross_entropy(estimated=logits, target=extern_data["classes"], axis=_E_OUT, estimated_type="logits")
    rf.get_run_ctx().mark_as_loss(loss, name="ce")


def _wd_include(*, full_param_name: str, **_kwargs: Any) -> bool:
    return full_param_name == "weight"


def run_engine(
    model_dir: str,
    *,
    on: bool,
    ckpt: str = "none",
    accum: int = 1,
    num_epochs: int = 1,
    epoch_end: bool = True,
    optimizer: Any = None,
    weight_decay: float = 0.0,
    extra: dict[str, Any] | None = None,
    wrap: bool = True,
    constrain: bool = False,
) -> dict[str, Any]:
    """One RETURNN Engine training run on Task12AX (20 sequences, 6 steps per epoch); returns its state.
    ``on``: with ``pur.enable()``; ``wrap``: and the config's optimizer is ``pur.optimizer(...)`` (else
    RETURNN's own); ``weight_decay``: ``rf.Parameter.weight_decay`` of the weights, declared with
    ``pur.weight_decay`` in get_model when on; ``constrain``: ``pur.constrain`` in get_model."""
    if on:
        pur.enable()
    try:
        # (a tuple of pairs in engine_run's cache key)
        opt = dict(optimizer) if optimizer is not None else {"class": "adam"}
        cfg: dict[str, Any] = dict(
            task="train",
            device="cpu",
            num_epochs=num_epochs,
            model=os.path.join(model_dir, "model"),
            random_seed=1,
            learning_rate=0.01,
            batch_size=300,
            torch_dataloader_opts={"num_workers": 0},
            extern_data={
                "data": {"dims": [batch_dim, _E_TIME, _E_IN], "dtype": "float32"},
                "classes": {"dims": [batch_dim, _E_TIME], "sparse_dim": _E_OUT, "dtype": "int32"},
            },
            get_model=GetEngineModel(ckpt, weight_decay, declare_decay=on and weight_decay > 0, constrain=constrain),
            train_step=engine_train_step,
            optimizer=pur.optimizer(opt) if on and wrap else opt,
        )
        if accum != 1:
            cfg["accum_grad_multiple_step"] = accum
        if on and wrap and epoch_end:
            cfg["epoch_end"] = pur.epoch_end
        cfg.update(extra or {})
        config = Config(cfg)
        dataset = init_dataset({"class": "Task12AXDataset", "num_seqs": 20, "name": "train", "fixed_random_seed": 1})
        dataset.init_seq_order(epoch=1)
        with global_config_ctx(config):
            engine = Engine(config=config)
            engine.init_train_from_config(train_data=dataset)
            n_updates = [0]
            engine.get_pt_optimizer().register_step_post_hook(lambda *_: n_updates.__setitem__(0, n_updates[0] + 1))
            engine.train()
        att = pur.attachment(engine)
        out = {
            "state": _raw_state(engine.get_pt_model()),
            "opt": engine.get_pt_optimizer().state_dict()["state"],
            "steps": engine.global_train_step,
            "updates": n_updates[0],
            "schedule": list(att.schedule()) if att is not None else None,  # rows: a lazy schedule holds its step
            "commits": att.steps if att is not None else None,
            "pending": list(att.pending_schedule()) if att is not None else [],
            "raw_count": _storage(engine.get_pt_model().count),
        }
        engine.finalize()
        if att is not None:
            att.detach()
        return out
    finally:
        pur.disable()
        for d in (_E_TIME, batch_dim):  # RETURNN caches the last batch's masks and sizes on the dims
            d.reset_eager()


_RUNS: dict[tuple, dict[str, Any]] = {}


def engine_run(tmp_path_factory: Any, **kw: Any) -> dict[str, Any]:
    """run_engine, cached for the module (several tests compare against the same runs)."""
    key = tuple(sorted(kw.items()))
    if key not in _RUNS:
        _RUNS[key] = run_engine(str(tmp_path_factory.mktemp("engine")), **kw)
    return _RUNS[key]


def test_engine_bridge_equals_returnn_without_checkpointing(tmp_path_factory):
    plain = engine_run(tmp_path_factory, on=False)
    ours = engine_run(tmp_path_factory, on=True)
    assert plain["steps"] == ours["steps"] == 6 and plain["updates"] == ours["updates"] == 6
    _assert_bitwise(ours["state"], plain["state"], "state")
    _assert_bitwise(ours["opt"], plain["opt"], "optimizer")
    assert ours["state"]["count"].item() == 6 and ours["commits"] == 6
    rows = list(ours["schedule"])
    assert [(r.phase, r.target) for r in rows] == [
        ("grad", "<optimizer parameters>"),
        ("auxiliary", "count"),
        ("auxiliary", "bn_in.running_mean"),
        ("auxiliary", "bn_in.running_variance"),
        ("auxiliary", "bn.running_mean"),
        ("auxiliary", "bn.running_variance"),
    ]
    counter_line = _line_of("the Engine model's counter")
    assert rows[1].origin.endswith(f"{HERE}:{counter_line}")
    assert re.search(r"returnn/frontend/normalization.py:\d+$", rows[4].origin)


@pytest.mark.parametrize("ckpt", ["torch", "gcs"])
def test_engine_epoch_under_checkpointing(tmp_path_factory, ckpt):
    """RETURNN's Engine, one epoch: without the bridge the checkpointed segment counts 12 for 6 steps and
    the statistics drift; with it, the state equals the run without checkpointing bitwise."""
    plain = engine_run(tmp_path_factory, on=False)
    ours = engine_run(tmp_path_factory, on=True, ckpt=ckpt)
    _assert_bitwise(ours["state"], plain["state"], f"bridge under {ckpt}")
    _assert_bitwise(ours["opt"], plain["opt"], "optimizer")
    if ckpt == "torch":  # plain RETURNN under checkpointing, once (gcs gives the same doubling, see above)
        broken = engine_run(tmp_path_factory, on=False, ckpt=ckpt)
        assert broken["state"]["count"].item() == 12
        assert not torch.equal(broken["state"]["bn.running_mean"], plain["state"]["bn.running_mean"])


def test_engine_gradient_accumulation_commits_once_per_update(tmp_path_factory):
    """accum_grad_multiple_step=4 over 6 steps: one optimizer update, whose commit holds the first four
    micro-batches' statistics (each read seeing the ones before), and the last two flushed by epoch_end
    before saving. Bitwise RETURNN's state with the same accumulation, with and without checkpointing."""
    plain = engine_run(tmp_path_factory, on=False, accum=4)
    assert plain["updates"] == 1
    for ckpt in ("none", "torch"):
        ours = engine_run(tmp_path_factory, on=True, accum=4, ckpt=ckpt)
        assert ours["updates"] == 1 and ours["commits"] == 2  # the optimizer's, then epoch_end's flush
        _assert_bitwise(ours["state"], plain["state"], f"accumulation, {ckpt}")
        _assert_bitwise(ours["opt"], plain["opt"], "optimizer")
        assert ours["state"]["count"].item() == 6
        # the last commit (the flush) has no optimizer step and two micro-batches of updates
        rows = list(ours["schedule"])
        assert "grad" not in {r.phase for r in rows} and sum(r.target == "count" for r in rows) == 2


def test_engine_accumulation_without_epoch_end_warns(tmp_path_factory):
    """Without epoch_end the last two micro-batches stay pending after the epoch: reads (state_dict, the
    saved model) see them, the storage does not; a warning says so when the optimizer is made."""
    with pytest.warns(UserWarning, match="epoch_end = paramupdates.returnn.epoch_end"):
        ours = run_engine(str(tmp_path_factory.mktemp("e")), on=True, accum=4, epoch_end=False)
    assert ours["raw_count"] == 4 and ours["state"]["count"].item() == 6
    assert [r.target for r in ours["pending"]].count("count") == 2
    flushed = engine_run(tmp_path_factory, on=True, accum=4)
    assert flushed["raw_count"] == 6 and flushed["pending"] == []


def test_engine_resume_is_bitwise(tmp_path):
    """Two epochs in one run == one epoch, a new Engine loading RETURNN's checkpoint, a second epoch:
    model and optimizer state, bitwise (bridge on, checkpointed segment, accumulation 4)."""
    kw = dict(on=True, ckpt="torch", accum=4)
    whole = run_engine(str(tmp_path / "a"), num_epochs=2, **kw)
    first = run_engine(str(tmp_path / "b"), num_epochs=1, **kw)
    resumed = run_engine(str(tmp_path / "b"), num_epochs=2, **kw)  # loads model.001 and trains epoch 2 only
    assert (whole["updates"], first["updates"], resumed["updates"]) == (2, 1, 1)
    assert resumed["steps"] == whole["steps"] == 12
    a = torch.load(tmp_path / "a" / "model.002.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "model.002.pt", weights_only=False)
    _assert_bitwise(a["model"], b["model"], "model")
    assert b["model"]["count"].item() == 12
    a = torch.load(tmp_path / "a" / "model.002.opt.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "model.002.opt.pt", weights_only=False)
    _assert_bitwise(a["optimizer"]["state"], b["optimizer"]["state"], "optimizer")


@pytest.mark.parametrize("accum", [1, 2])
def test_engine_weight_decay_equals_returnn_adamw(tmp_path_factory, accum):
    """rf.Parameter.weight_decay honoured: Engine with the bridge, Adam and pur.weight_decay (declared in
    get_model) == RETURNN's own AdamW with the same parameters decayed, bitwise, once per real update."""
    returnn_adamw = engine_run(
        tmp_path_factory,
        on=False,
        accum=accum,
        optimizer=(("class", "adamw"), ("weight_decay", 0.05), ("weight_decay_custom_include_check", _wd_include)),
    )
    ours = engine_run(tmp_path_factory, on=True, accum=accum, weight_decay=0.05, optimizer=(("class", "adam"),))
    _assert_bitwise(ours["state"], returnn_adamw["state"], "weights")
    assert ours["updates"] == returnn_adamw["updates"] == 6 // accum
    plain_adam = engine_run(tmp_path_factory, on=False, accum=accum)
    assert not torch.equal(ours["state"]["lin.weight"], plain_adam["state"]["lin.weight"])
    if accum == 1:  # RETURNN's own weight-decay grouping, through pur.optimizer's param_groups_custom
        ours_adamw = engine_run(
            tmp_path_factory,
            on=True,
            accum=accum,
            optimizer=(("class", "adamw"), ("weight_decay", 0.05), ("weight_decay_custom_include_check", _wd_include)),
        )
        _assert_bitwise(ours_adamw["state"], returnn_adamw["state"], "RETURNN's AdamW groups with the bridge")


def test_engine_optimizer_needs_enable(tmp_path):
    config = Config(
        dict(
            task="train",
            device="cpu",
            model=str(tmp_path / "model"),
            extern_data={
                "data": {"dims": [batch_dim, _E_TIME, _E_IN], "dtype": "float32"},
                "classes": {"dims": [batch_dim, _E_TIME], "sparse_dim": _E_OUT, "dtype": "int32"},
            },
            get_model=GetEngineModel("none"),
            train_step=engine_train_step,
            optimizer=pur.optimizer("adam"),
            batch_size=300,
            torch_dataloader_opts={"num_workers": 0},
        )
    )
    dataset = init_dataset({"class": "Task12AXDataset", "num_seqs": 4, "name": "train", "fixed_random_seed": 1})
    with global_config_ctx(config), pytest.raises(pu.UpdateError, match=r"not enabled.*enable\(\) at the top"):
        Engine(config=config).init_train_from_config(train_data=dataset)


@pytest.mark.parametrize("key,value", [("torch_optimizer_step", {}), ("torch_cuda_graph", {})])
def test_engine_refuses_what_skips_the_optimizer_hooks(tmp_path, key, value):
    with pytest.raises(pu.UpdateError, match=f"the config sets {key}, which paramupdates cannot support"):
        run_engine(str(tmp_path), on=True, extra={key: value})


# ---------------------------------------------------------------------------
# what the bridge refuses or warns about at the first train step
# ---------------------------------------------------------------------------
def test_engine_enable_alone_refuses_declared_rules(tmp_path):
    """pur.enable() with RETURNN's own optimizer dict: nothing commits inside optimizer.step(), so the
    pur.weight_decay and pur.constrain that get_model declared would never run. The first train step
    raises before the optimizer writes, naming each rule, its line and targets, and the config fix."""
    with pytest.raises(pu.UpdateError) as e:
        run_engine(str(tmp_path), on=True, wrap=False, weight_decay=0.05, constrain=True)
    msg = str(e.value)
    assert msg.startswith("paramupdates.returnn: Adam.step() at ")
    assert re.search(r"pu\.weight_decay declared at .*test_returnn\.py:\d+ on 'lin\.weight', 'out\.weight'", msg)
    line = _line_of("the config's constraint")
    assert re.search(rf"pu\.constrain\(max_norm\) declared at .*{HERE}:{line} on ", msg)
    assert "would never run" in msg and "optimizer = paramupdates.returnn.optimizer({...})" in msg


def test_engine_enable_alone_warns_and_changes_nothing(tmp_path_factory):
    """pur.enable() with RETURNN's own optimizer and no declared rule: the rf updates apply at once, as
    RETURNN's (bitwise RETURNN's state; under rf.gradient_checkpoint_scope they would be doubled, as
    RETURNN's); the first train step warns, naming the first such update's line and the fix."""
    counter_line = _line_of("the Engine model's counter")
    with pytest.warns(UserWarning) as record:
        ours = run_engine(str(tmp_path_factory.mktemp("e")), on=True, wrap=False)
    msgs = [str(w.message) for w in record if "paramupdates.returnn is enabled" in str(w.message)]
    assert len(msgs) == 1, [str(w.message) for w in record]
    assert "no paramupdates step or attachment commits Adam.step()" in msgs[0]
    assert re.search(rf"the first: .* at .*{HERE}:{counter_line}\)", msgs[0])
    assert "optimizer = paramupdates.returnn.optimizer({...})" in msgs[0]
    assert "gradient_checkpoint_scope's recomputation updates counters" in msgs[0]
    _assert_bitwise(ours["state"], engine_run(tmp_path_factory, on=False)["state"], "enable() alone is RETURNN")


@pytest.mark.parametrize(
    "opt",
    [(("class", "adamw"), ("weight_decay", 0.05)), (("class", "adamw"),)],
    ids=["adamw_weight_decay", "adamw_default_decay"],
)
def test_engine_refuses_double_weight_decay(tmp_path, opt):
    """pur.optimizer(AdamW, with its weight_decay or AdamW's default 0.01) and pur.weight_decay(model) would
    decay the weights twice: refused when the Engine creates the optimizer, naming both and the fix."""
    rate = "0.05" if len(opt) == 2 else "0.01"
    with pytest.raises(pu.UpdateError) as e:
        run_engine(str(tmp_path), on=True, weight_decay=0.05, optimizer=opt)
    msg = str(e.value)
    assert "'lin.weight'" in msg and "would be decayed twice" in msg
    assert re.search(r"by pu\.weight_decay \(declared at .*test_returnn\.py:\d+", msg)
    assert f"AdamW's own weight_decay={rate}" in msg and "use 'class': 'adam'" in msg


def test_double_weight_decay_declared_after_the_optimizer_refused_at_first_step(tmp_path):
    """A pur.weight_decay declared after the Engine made the optimizer (here: in the first train step) is
    refused at the first optimizer.step(), before anything is written."""
    state: dict[str, Any] = {}

    def train_step(*, model: EngineModel, extern_data: TensorDict, **kwargs: Any) -> None:
        if "rules" not in state:
            state["rules"] = pur.weight_decay(model)
        engine_train_step(model=model, extern_data=extern_data, **kwargs)

    with pytest.raises(pu.UpdateError, match=r"AdamW\.step\(\) at .*'lin\.weight'.* would be decayed twice"):
        run_engine(
            str(tmp_path),
            on=True,
            optimizer=(("class", "adamw"), ("weight_decay", 0.05)),
            extra={"train_step": train_step, "get_model": GetEngineModel("none", 0.05)},
        )
    for r in state["rules"]:
        r.remove()


# ---------------------------------------------------------------------------
# RETURNN versions and the contract of every patched function
# ---------------------------------------------------------------------------
def test_returnn_version_range_is_pinned_tested_and_warned(monkeypatch):
    """pyproject's returnn extra pins exactly the bridge's tested range; the installed RETURNN (what CI
    installs from that extra) lies in it; enable() warns on a RETURNN outside it."""
    import tomllib

    import returnn

    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["returnn"]
    low, high = pur.RETURNN_TESTED
    assert f"returnn>={low},<={high}" in extra
    vt = pur._version_tuple
    assert vt(low) <= vt(returnn.__version__)[:2] and vt(returnn.__version__) <= vt(high)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pur.enable()  # the tested version: no warning
    pur.disable()
    monkeypatch.setattr(returnn, "__version__", "1.20270105.120000+git.abc")
    with pytest.warns(UserWarning, match=r"tested with RETURNN 1\.20261022 to .*this is RETURNN 1\.20270105"):
        pur.enable()


def _spy(monkeypatch: Any, name: str) -> list[tuple[tuple, dict, Any]]:
    """Record every call of RETURNN's own ``TorchBackend.<name>`` (the bridge disabled): (args, kwargs, result)."""
    orig = TorchBackend.__dict__[name].__func__
    calls: list[tuple[tuple, dict, Any]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(TorchBackend, name, staticmethod(spy))
    return calls


def test_contract_create_parameter_raw(monkeypatch):
    """rf.Parameter's raw tensor is what TorchBackend.create_parameter_raw(param, device=...) returns: an
    exact torch.nn.Parameter of zeros in the parameter's dims and dtype, requires_grad unless int/bool. The
    bridge wraps that result (same data, same requires_grad) in a pu.Parameter."""
    calls = _spy(monkeypatch, "create_parameter_raw")
    d1, d2 = Dim(2, name="a"), Dim(3, name="b")
    for dtype, grad in (("float32", True), ("int32", False)):
        p = rf.Parameter([d1, d2], dtype=dtype)
        (args, kwargs, raw) = calls[-1]
        assert args[0] is p and set(kwargs) <= {"device"}
        assert p.raw_tensor is raw and type(raw) is torch.nn.Parameter and raw.requires_grad is grad
        assert raw.shape == (2, 3) and raw.dtype == getattr(torch, dtype) and not raw.detach().any()
    assert rf.Parameter([d1], auxiliary=True).raw_tensor.requires_grad is False  # set after creation


def test_contract_parameter_assign(monkeypatch):
    """rf.Parameter.assign / assign_add call TorchBackend.parameter_assign(param, value, op="assign" / "add"),
    which writes the value (given in a subset of the dims: broadcast) into the raw tensor in place
    (copy_ / add_ under no_grad). The bridge routes the same call; its eager writes are bitwise RETURNN's."""
    calls = _spy(monkeypatch, "parameter_assign")
    d1, d2 = Dim(2, name="a"), Dim(3, name="b")
    v = torch.tensor([1.5, -2.0, 0.1])

    def run() -> tuple[Any, list[torch.Tensor]]:
        p = rf.Parameter([d1, d2], auxiliary=True)
        p.initial = 0.3
        raw, seen = p.raw_tensor, []
        p.assign(rf.convert_to_tensor(v, dims=[d2]))
        seen.append(raw.detach().clone())
        p.assign_add(rf.convert_to_tensor(v * 3, dims=[d2]))
        seen.append(raw.detach().clone())
        assert p.raw_tensor is raw  # in place
        return p, seen

    p, returnn_seen = run()
    assert [(c[0][0], c[1].get("op", "assign")) for c in calls] == [(p, "assign"), (p, "add")]
    assert torch.equal(returnn_seen[0], v.expand(2, 3))
    pur.enable()
    _, bridge_seen = run()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(bridge_seen, returnn_seen))


def test_contract_parameter_assign_key(monkeypatch):
    """rf.Parameter.assign_key(axis, key, key_dim, value) calls TorchBackend.parameter_assign_key(param, key,
    value, op="assign", axis=axis, key_dim=key_dim), which writes raw[key] in place; op="add" adds. The
    bridge computes the key as RETURNN (_utils.strided_slice_raw_key); its eager writes are bitwise RETURNN's."""
    calls = _spy(monkeypatch, "parameter_assign_key")
    d = Dim(4, name="d")

    def run() -> list[list[float]]:
        p = rf.Parameter([d], auxiliary=True)
        p.initial = 0.25
        idx = rf.convert_to_tensor(torch.tensor(2), dims=())
        p.assign_key(axis=d, key=idx, key_dim=None, value=rf.convert_to_tensor(3.5))
        out = [p.raw_tensor.detach().tolist()]
        TorchBackend.parameter_assign_key(p, idx, rf.convert_to_tensor(1.25), op="add", axis=d, key_dim=None)
        out.append(p.raw_tensor.detach().tolist())
        return out

    assert run() == [[0.25, 0.25, 3.5, 0.25], [0.25, 0.25, 4.75, 0.25]]
    assert [(c[1].get("op", "assign"), c[1]["axis"]) for c in calls] == [("assign", d), ("add", d)]
    monkeypatch.undo()
    pur.enable()
    assert run() == [[0.25, 0.25, 3.5, 0.25], [0.25, 0.25, 4.75, 0.25]]


def test_contract_batch_norm(monkeypatch):
    """rf.BatchNorm (use_mask=False) calls TorchBackend.batch_norm(source, ..., running_mean=,
    running_variance=) with its own statistics by keyword (what the bridge reads), and in training RETURNN's
    function updates their raw tensors in place, exactly as F.batch_norm(training=True) does (the bridge
    passes copies and assigns them); in eval it writes nothing."""
    calls = _spy(monkeypatch, "batch_norm")
    d = Dim(3, name="f")
    bn = rf.BatchNorm(d, use_mask=False)
    x_raw = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    x = rf.convert_to_tensor(x_raw, dims=[batch_dim, d], feature_dim=d)
    for train in (False, True):
        rm, rv = bn.running_mean.raw_tensor, bn.running_variance.raw_tensor
        want_m, want_v = rm.detach().clone(), rv.detach().clone()
        F_out = torch.nn.functional.batch_norm(
            x_raw.reshape(5, 3, 1), want_m, want_v, bn.gamma.raw_tensor.detach(), bn.beta.raw_tensor.detach(),
            training=train, momentum=bn.momentum, eps=bn.eps,
        )  # fmt: skip
        rf.init_train_step_run_ctx(train_flag=train, step=0)
        y = bn(x)
        (args, kwargs, out) = calls[-1]
        assert kwargs["running_mean"] is bn.running_mean and kwargs["running_variance"] is bn.running_variance
        assert out is y and torch.equal(bits(y.raw_tensor), bits(F_out.reshape(5, 3)))
        assert bn.running_mean.raw_tensor is rm and torch.equal(bits(rm.detach()), bits(want_m))
        assert torch.equal(bits(rv.detach()), bits(want_v))
    assert not torch.equal(bn.running_mean.raw_tensor.detach(), torch.zeros(3))  # training moved them


def test_contract_parameter_move_to(monkeypatch):
    """rf.Parameter.to(device=, dtype=) calls TorchBackend.parameter_move_to(param, device=, dtype=), which
    replaces the raw tensor by a new exact torch.nn.Parameter, moved, with the same requires_grad (the old
    one unchanged). The bridge does the same, with a pu.Parameter. (A dtype change through rf.Parameter.to
    raises in RETURNN itself, the rf dtype not following: pt_module.to(dtype) is the way, see below.)"""
    calls = _spy(monkeypatch, "parameter_move_to")
    d = Dim(3, name="d")
    for aux in (False, True):
        p = rf.Parameter([d], auxiliary=aux)
        p.initial = 0.5
        old = p.raw_tensor
        p.to(device="cpu", dtype="float32")
        assert calls[-1][0] == (p,) and calls[-1][1] == {"device": "cpu", "dtype": "float32"}
        new = p.raw_tensor
        assert new is not old and type(new) is torch.nn.Parameter and new.requires_grad is (not aux)
        assert torch.equal(bits(new.detach()), bits(old.detach()))
    monkeypatch.undo()
    pur.enable()
    p = rf.Parameter([d], auxiliary=True)
    p.initial = 0.5
    old = p.raw_tensor
    p.to(device="cpu")
    assert type(p.raw_tensor) is pu.Parameter and p.raw_tensor is not old and p.raw_tensor.requires_grad is False
    assert torch.equal(p.raw_tensor.detach(), torch.full((3,), 0.5))


def test_contract_module_apply():
    """RFModuleAsPTModule._apply (pt_module.to(...)): torch's _apply moves the slots (a trainable
    parameter in place, a buffer as a new plain tensor); RETURNN then makes the rf dtype follow and wraps a
    moved auxiliary parameter (a buffer) in a new exact torch.nn.Parameter (requires_grad False) for the
    rf.Parameter, leaving the plain tensor in the buffer slot. That new torch.nn.Parameter is what the
    bridge replaces by a pu.Parameter, in both places."""
    d = Dim(3, name="d")
    bn = rf.BatchNorm(d, use_mask=False)
    pt = rf_module_to_pt_module(bn)
    old_rm, old_gamma = bn.running_mean.raw_tensor, bn.gamma.raw_tensor
    pt.to(torch.float64)
    assert bn.gamma.raw_tensor is old_gamma is pt._parameters["gamma"] and old_gamma.dtype == torch.float64
    rm = bn.running_mean.raw_tensor
    assert rm is not old_rm and type(rm) is torch.nn.Parameter and rm.requires_grad is False
    assert rm.dtype == torch.float64 and bn.running_mean.dtype == "float64"
    slot = pt._buffers["running_mean"]
    assert type(slot) is torch.Tensor and slot is not rm and torch.equal(slot, rm.detach())
    pur.enable()
    bn2 = rf.BatchNorm(d, use_mask=False)
    pt2 = rf_module_to_pt_module(bn2)
    pt2.to(torch.float64)
    assert (
        type(bn2.running_mean.raw_tensor) is pu.Parameter
        and pt2._buffers["running_mean"] is bn2.running_mean.raw_tensor
    )


class _SeenInReplay(torch.Tensor):
    """Records the ops that reach __torch_function__ with it while RETURNN's gcs replay runs."""

    replaying = False
    seen: list[Any] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.replaying:
            cls.seen.append((func, [a for a in args if isinstance(a, cls)]))
        with torch._C.DisableTorchFunctionSubclass():  # plain results, as pu.Parameter's
            return func(*args, **(kwargs or {}))


def test_contract_gcs_replays_recorded_ops_in_maybe_recompute(monkeypatch):
    """rf.gradient_checkpoint_scope records the aten ops of its block with the very tensors they got and
    replays them in backward, all inside _Graph.maybe_recompute, calling each op on those tensor objects
    (a tensor subclass's __torch_function__ sees them): so wrapping maybe_recompute with subclass dispatch
    disabled is what makes the replay read what the forward read (the bridge's patch)."""
    import returnn.torch.util.gradient_checkpoint as gcs

    orig = gcs._Graph.maybe_recompute
    runs: list[int] = []

    def spy(self: Any) -> Any:
        runs.append(len(self.ops_to_be_recomputed))
        _SeenInReplay.replaying, _SeenInReplay.seen = True, []
        try:
            return orig(self)
        finally:
            _SeenInReplay.replaying = False

    monkeypatch.setattr(gcs._Graph, "maybe_recompute", spy)
    x = torch.ones(3, requires_grad=True)
    w = torch.full((3,), 2.0).as_subclass(_SeenInReplay)
    with gcs.gradient_checkpoint_scope():
        y = (x * w).sin()
    y.sum().backward()
    assert runs and runs[0] >= 1  # the replay ran there, with the recorded ops
    muls = [ts for func, ts in _SeenInReplay.seen if "mul" in str(func)]
    assert muls and all(t is w for ts in muls for t in ts) and any(ts for ts in muls)
    assert torch.allclose(x.grad, 2 * torch.cos(torch.full((3,), 2.0)))
    del y


def test_contract_gcs_saved_tensors_hooks_exit():
    """While a gradient_checkpoint_scope outlives its block (its recorded tensors alive), RETURNN puts the
    module attribute _custom_saved_tensors_hooks_exit (looked up by name: with the bridge, the bridge's) on
    saved_tensors_hooks.__exit__, with _custom_saved_tensors_hooks_tls_ctx.active and the scope's hooks on
    its .stack; _orig_saved_tensors_hooks_exit is torch's own __exit__; once the tensors died, the next
    saved_tensors_hooks enter ends the scope (active False, torch's __exit__ back). What the bridge's
    replacement reads; RETURNN's bug it works around: test_gcs_cleanup_then_torch_checkpoint."""
    import gc

    import returnn.torch.util.gradient_checkpoint as gcs

    hooks = torch.autograd.graph.saved_tensors_hooks
    torch_exit = gcs._orig_saved_tensors_hooks_exit
    assert (torch_exit.__module__, torch_exit.__qualname__) == ("torch.autograd.graph", "saved_tensors_hooks.__exit__")
    tls = gcs._custom_saved_tensors_hooks_tls_ctx
    for on in (False, True):
        if on:
            pur.enable()
        x = torch.ones(3, requires_grad=True)
        with gcs.gradient_checkpoint_scope():
            y = x * 2
        assert tls.active and tls.stack
        assert hooks.__dict__["__exit__"] is (
            pur._saved_tensors_hooks_exit if on else gcs._custom_saved_tensors_hooks_exit
        )
        (y * y).sum().backward()
        del y
        gc.collect()
        with hooks(lambda t: t, lambda t: t):
            pass
        assert not tls.active and hooks.__dict__["__exit__"] is torch_exit
        pur.disable()
