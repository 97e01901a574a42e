"""The CUDA checks (issue 47, item 4): what the CPU tests cannot show, on one GPU.

Every test here is marked ``cuda`` and skips without a CUDA device (CI has none):
``python -m pytest -m cuda`` selects them, ``bash benchmarks/device_check.sh`` runs them where a GPU
is lent. Each is small (a few steps of a tiny model):

* ``pu.nn.BatchNorm1d/2d`` against ``torch.nn.BatchNorm1d/2d`` through a ``pu.step`` / ``pu.attach``
  loop, with cuDNN and with ATen's native kernel: outputs, gradients and statistics bitwise;
* the same under ``pu.checkpoint`` and ``torch.utils.checkpoint(use_reentrant=False)``: statistics
  bitwise those without checkpointing (torch's own batch norm counts every batch twice);
* the default commit and ``on_nonfinite="skip"`` with ``AdamW(fused=True)``: no host sync
  (``torch.cuda.set_sync_debug_mode("error")``);
* ``Adam(fused=True)`` + ``pu.weight_decay`` in bfloat16: bitwise ``AdamW(fused=True)`` (the
  optimizer's own kernel, docs/rules.md), with a ``pu.clamp`` constraint; SGD + ``pu.weight_decay``
  in bfloat16: bitwise ``Tensor.mul_`` before the step (the separate pass);
* ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) of a forward with ``pu.nn.BatchNorm1d``
  inside ``pu.step``: bitwise the same compile without CUDA graphs, close to eager;
* ``sync_stats=True`` under DDP on a one-process NCCL group: the statistics of the unsynced run.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import paramupdates as pu

from conftest import assert_same, bits, snapshot

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]

DEV = "cuda"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cudnn(enabled: bool):
    """cuDNN on (deterministic, no autotuning) or off (ATen's native batch-norm kernel)."""
    return torch.backends.cudnn.flags(enabled=enabled, benchmark=False, deterministic=True)


def _same_init(*models: nn.Module) -> None:
    sd = models[0].state_dict()
    for m in models[1:]:
        m.load_state_dict(sd)


# --- batch norm: bitwise torch.nn's on CUDA --------------------------------------------------------
class Net1d(nn.Module):
    def __init__(self, bn_cls):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.bn = bn_cls(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.lin(x))))


class Net2d(nn.Module):
    def __init__(self, bn_cls):
        super().__init__()
        self.bn = bn_cls(3)
        self.head = nn.Linear(3 * 5 * 5, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(x)).flatten(1))


_NETS = {
    "1d": (Net1d, nn.BatchNorm1d, pu.nn.BatchNorm1d, (16, 8)),
    "2d": (Net2d, nn.BatchNorm2d, pu.nn.BatchNorm2d, (8, 3, 5, 5)),
}


@pytest.mark.parametrize("cudnn", [True, False], ids=["cudnn", "native"])
@pytest.mark.parametrize("how", ["step", "attach"])
@pytest.mark.parametrize("dim", ["1d", "2d"])
def test_pu_batchnorm_equals_torch_batchnorm_bitwise_on_cuda(dim, how, cudnn):
    net_cls, torch_bn, pu_bn, shape = _NETS[dim]
    ref, net = net_cls(torch_bn).to(DEV), net_cls(pu_bn).to(DEV)
    _same_init(ref, net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if how == "attach":
        pu.attach(net, opt)
    g = torch.Generator(device=DEV).manual_seed(1)
    with _cudnn(cudnn):
        for _ in range(4):
            x = torch.randn(shape, device=DEV, generator=g)
            xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
            out_ref = ref(xr)
            out_ref.square().mean().backward()
            ref_opt.step()
            if how == "step":
                with pu.step(net, opt):
                    out = net(xp)
                    out.square().mean().backward()
                    grads = [p.grad.clone() for p in net.parameters()]
            else:
                out = net(xp)
                out.square().mean().backward()
                grads = [p.grad.clone() for p in net.parameters()]
                opt.step()
            assert torch.equal(bits(out), bits(out_ref))
            assert torch.equal(bits(xp.grad), bits(xr.grad))
            for a, b in zip(grads, [p.grad for p in ref.parameters()]):
                assert torch.equal(bits(a), bits(b))
            ref_opt.zero_grad()
            opt.zero_grad()
    assert_same(snapshot(ref), snapshot(net))  # weights, running_mean/var, num_batches_tracked
    assert int(net.bn.num_batches_tracked) == 4


# --- batch norm under activation checkpointing (rule 3) --------------------------------------------
class Block(nn.Module):
    def __init__(self, bn_cls):
        super().__init__()
        self.lin = nn.Linear(6, 12)
        self.bn = bn_cls(12)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x)))


class CkptNet(nn.Module):
    def __init__(self, bn_cls=pu.nn.BatchNorm1d, ckpt=None):
        super().__init__()
        self.block = Block(bn_cls)
        self.head = nn.Linear(12, 2)
        self.ckpt = ckpt

    def forward(self, x):
        h = self.block(x) if self.ckpt is None else self.ckpt(self.block, x)
        return self.head(h)


def _torch_ckpt(f, *args):
    return torch_checkpoint(f, *args, use_reentrant=False)


def _train(model, xs, stepped):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in xs:
        opt.zero_grad()
        if stepped:
            with pu.step(model, opt):
                model(x).square().sum().backward()
        else:
            model(x).square().sum().backward()
            opt.step()
    return model


@pytest.mark.parametrize("cudnn", [True, False], ids=["cudnn", "native"])
@pytest.mark.parametrize("ckpt", [pu.checkpoint, _torch_ckpt], ids=["pu.checkpoint", "torch.utils.checkpoint"])
def test_batchnorm_statistics_under_checkpointing_equal_no_checkpointing_bitwise(ckpt, cudnn):
    xs = [torch.randn(16, 6, device=DEV) for _ in range(3)]
    with _cudnn(cudnn):
        plain, under = CkptNet().to(DEV), CkptNet(ckpt=ckpt).to(DEV)
        ref, doubled = CkptNet(nn.BatchNorm1d).to(DEV), CkptNet(nn.BatchNorm1d, ckpt=_torch_ckpt).to(DEV)
        _same_init(plain, under, ref, doubled)
        _train(plain, xs, stepped=True)
        _train(under, xs, stepped=True)
        assert_same(snapshot(plain), snapshot(under))  # weights, running statistics, counter
        assert int(under.block.bn.num_batches_tracked) == 3
        # the contrast (pytorch/pytorch#96136): torch's batch norm under torch's checkpoint counts twice
        _train(ref, xs, stepped=False)
        _train(doubled, xs, stepped=False)
        assert int(ref.block.bn.num_batches_tracked) == 3
        assert int(doubled.block.bn.num_batches_tracked) == 6
        assert not torch.equal(ref.block.bn.running_mean, doubled.block.bn.running_mean)
        assert_same(snapshot(ref), snapshot(under))  # pu under checkpointing == torch without


# --- no host sync: the default commit and on_nonfinite="skip" with a fused optimizer (rule 7) ------
@contextlib.contextmanager
def _no_host_sync():
    """torch raises at any operation that makes the host wait for the GPU; the mode is restored."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


class SyncNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.bn = pu.nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 4)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        pu.assign_add(self.seen, 1.0)
        pu.assign(self.lin.bias, self.lin.bias * 0.5, phase="after_grad")
        return self.out(torch.relu(self.bn(self.lin(x))))


@pytest.mark.parametrize("how", ["step", "attach"])
def test_the_default_commit_makes_no_host_sync_with_a_fused_optimizer(how):
    torch.manual_seed(0)
    m = SyncNet().to(DEV)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    pu.weight_decay(m, 0.1)
    pu.constrain(m.lin.weight, pu.max_norm(0.5))
    pu.constrain(m.out.bias, pu.clamp(-0.05, 0.05))
    avg = pu.ema(m, 0.9)
    attachment = pu.attach(m, opt) if how == "attach" else None
    x, y = torch.randn(64, 16, device=DEV), torch.randn(64, 4, device=DEV)

    def one_step():
        opt.zero_grad()
        if attachment is not None:
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        else:
            with pu.step(m, opt):
                nn.functional.mse_loss(m(x), y).backward()

    for _ in range(3):  # warm-up: the rules' plans, the optimizer's state
        one_step()
    torch.cuda.synchronize()
    with _no_host_sync():
        for _ in range(3):
            one_step()
    torch.cuda.synchronize()
    assert int(m.bn.num_batches_tracked) == 6 and float(m.seen) == 6.0
    assert all(torch.isfinite(t).all() for t in avg.state_dict().values() if t.is_floating_point())


@pytest.mark.parametrize("scaler", [False, True], ids=["no scaler", "GradScaler"])
@pytest.mark.parametrize("how", ["step", "attach"])
def test_on_nonfinite_skip_makes_no_host_sync_with_a_fused_optimizer(how, scaler):
    """benchmarks/sync_free_skip_gpu.py's check as a test: good steps, a NaN gradient, a NaN pending value
    (and an overflowing scaled loss) under the guard; each skipped step leaves the model, the EMA copy and
    the optimizer's state bitwise as before; every step bitwise the synced skip's."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from benchmarks import sync_free_skip_gpu as bench

    try:
        states, skipped, errors = bench.run(torch.device(DEV), how, scaler, on_device=True, guard=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not errors, "host syncs under set_sync_debug_mode('error'):\n" + "\n".join(errors)
    assert skipped, "the program has skipped steps"
    for i, before, after in skipped:
        assert bench._equal(before, after), f"skipped step {i} changed something"
    synced, _, _ = bench.run(torch.device(DEV), how, scaler, on_device=False, guard=False)
    assert len(states) == len(synced)
    for i, (a, b) in enumerate(zip(states, synced)):
        assert bench._equal(a, b), f"step {i} differs from the synced skip"


# --- bfloat16 with a fused optimizer: the optimizer's own kernel (docs/rules.md) --------------------
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        return self.out(torch.relu(self.lin(x)))


def _bf16_pair():
    torch.manual_seed(0)
    ref = Small().to(DEV, torch.bfloat16)
    net = Small().to(DEV, torch.bfloat16)
    _same_init(ref, net)
    g = torch.Generator(device=DEV).manual_seed(2)
    data = [
        (
            torch.randn(32, 32, device=DEV, generator=g).bfloat16(),
            torch.randn(32, 8, device=DEV, generator=g).bfloat16(),
        )
        for _ in range(5)
    ]
    return ref, net, data


def _opt_state(opt: torch.optim.Optimizer, model: nn.Module) -> list[torch.Tensor]:
    """The optimizer's tensors in the model's parameter order (the two optimizers' keys differ by id)."""
    return [v for p in model.parameters() for _, v in sorted(opt.state[p].items()) if torch.is_tensor(v)]


def test_fused_adam_with_pu_weight_decay_equals_fused_adamw_in_bfloat16_bitwise():
    """Adam(fused=True) + pu.weight_decay(exclude=None) is AdamW(fused=True, weight_decay=) bitwise, in
    bfloat16 on CUDA (the decay runs in the optimizer's own fused kernel), and pu.clamp after the
    gradient update is the hand-written clamp_ after optimizer.step()."""
    ref, net, data = _bf16_pair()
    lr, wd = 1e-2, 0.1
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd, fused=True)
    opt = torch.optim.Adam(net.parameters(), lr=lr, fused=True)
    pu.weight_decay(net, wd, exclude=None)
    pu.constrain(net.out.bias, pu.clamp(-0.02, 0.02))
    for x, y in data:
        loss_ref = nn.functional.mse_loss(ref(x), y)
        loss_ref.backward()
        ref_opt.step()
        with torch.no_grad():
            ref.out.bias.clamp_(-0.02, 0.02)
        with pu.step(net, opt):
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
        assert torch.equal(bits(loss), bits(loss_ref))
        ref_opt.zero_grad()
        opt.zero_grad()
        assert_same(snapshot(ref), snapshot(net))
        for a, b in zip(_opt_state(ref_opt, ref), _opt_state(opt, net)):
            assert torch.equal(bits(a), bits(b))
    assert opt.param_groups[0]["weight_decay"] == 0  # the optimizer's own setting restored after each step
    assert net.out.bias.abs().max() <= 0.02


def test_sgd_with_pu_weight_decay_equals_mul_before_the_step_in_bfloat16_bitwise():
    """The separate pass (SGD has no decoupled decay): p * (1 - lr * rate) rounded once, Tensor.mul_'s
    result in bfloat16 (docs/rules.md), then torch's SGD."""
    ref, net, data = _bf16_pair()
    lr, wd = 1e-2, 0.1
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    pu.weight_decay(net, wd, exclude=None)
    for x, y in data:
        nn.functional.mse_loss(ref(x), y).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(1 - lr * wd)
        ref_opt.step()
        with pu.step(net, opt):
            nn.functional.mse_loss(net(x), y).backward()
        ref_opt.zero_grad()
        opt.zero_grad()
        assert_same(snapshot(ref), snapshot(net))


# --- CUDA graphs: torch.compile(mode="reduce-overhead") -------------------------------------------
class CompiledNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.bn = pu.nn.BatchNorm1d(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.lin(x))))


def _compiled_run(init: dict, data, **compile_kwargs):
    """Four pu.step steps of a (compiled) CompiledNet; returns the outputs (cloned at once: a CUDA
    graph's outputs are overwritten by its next replay) and the state after the last commit."""
    torch._dynamo.reset()
    m = CompiledNet().to(DEV)
    m.load_state_dict(init)
    fwd = torch.compile(m, **compile_kwargs) if compile_kwargs else m
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    outs = []
    for x in data:
        opt.zero_grad()
        with pu.step(m, opt):
            out = fwd(x)
            out.square().mean().backward()
        outs.append(out.detach().clone())
    torch.cuda.synchronize()
    return outs, snapshot(m)


@pytest.mark.compile
@pytest.mark.parametrize(
    "graphs, twin",
    [
        (dict(mode="reduce-overhead"), dict(backend="inductor")),  # inductor's kernels, with and without graphs
        (dict(backend="cudagraphs"), dict(backend="aot_eager_default_partitioner")),  # ATen's kernels, same split
    ],
    ids=["reduce-overhead", "cudagraphs-backend"],
)
def test_cuda_graphs_of_a_forward_with_pu_batchnorm_equal_the_same_compile_without_graphs(graphs, twin):
    """A forward that issues batch-norm updates, captured and replayed as CUDA graphs inside pu.step: the
    outputs and the committed state (weights, running statistics, counter) are bitwise those of the same
    compile without CUDA graphs (the same kernels, launched one by one), and equal to eager to rounding
    (a compiler does not promise eager's bits); no CUDA graph was skipped (a pending value, a host read
    or a mutated input would make inductor fall back, with a reason in its counters)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    init = CompiledNet().to(DEV).state_dict()
    g = torch.Generator(device=DEV).manual_seed(3)
    data = [torch.randn(64, 16, device=DEV, generator=g) for _ in range(4)]
    eager_outs, eager_state = _compiled_run(init, data)
    counters.clear()
    outs, state = _compiled_run(init, data, **graphs)
    skips = dict(counters["inductor"])
    twin_outs, twin_state = _compiled_run(init, data, **twin)
    torch._dynamo.reset()
    assert skips.get("cudagraph_skips", 0) == 0, f"CUDA graphs skipped (TORCH_LOGS=perf_hints says why): {skips}"
    for a, b in zip(outs, twin_outs):
        assert torch.equal(bits(a), bits(b))
    assert_same(twin_state, state)
    for a, b in zip(outs, eager_outs):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    for (ka, va), (kb, vb) in zip(state, eager_state):
        assert ka == kb
        if va.is_floating_point():
            torch.testing.assert_close(va, vb, rtol=1e-3, atol=1e-4, msg=ka)
        else:
            assert torch.equal(va, vb), ka  # num_batches_tracked: exact
    assert int(dict(state)["bn.num_batches_tracked"]) == 4


# --- DDP: sync_stats=True on a one-process NCCL group (rule 9) -------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_kwargs() -> dict:
    """No buffer broadcast (docs/distributed.md): forward_sync_buffers=False where torch has it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    params = inspect.signature(DDP.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def _bn_model(sync_stats: bool) -> nn.Module:
    torch.manual_seed(0)
    return pu.convert(
        nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)), sync_stats=sync_stats
    ).to(DEV)


@pytest.mark.skipif(
    torch.cuda.is_available() and not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
    reason="needs torch.distributed with NCCL",
)
def test_sync_stats_under_ddp_on_a_one_process_nccl_group_commits_the_unsynced_statistics():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    g = torch.Generator(device=DEV).manual_seed(4)
    data = [torch.randn(32, 8, device=DEV, generator=g) for _ in range(3)]
    ref = _bn_model(sync_stats=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in data:
        ref_opt.zero_grad()
        with pu.step(ref, ref_opt):
            ref(x).square().mean().backward()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        model = _bn_model(sync_stats=True)
        ddp = DDP(model, device_ids=[0], **_ddp_kwargs())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x in data:
            opt.zero_grad()
            with pu.step(ddp, opt):
                ddp(x).square().mean().backward()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    assert_same(snapshot(ref), snapshot(model))  # the mean over one rank: the rank's own statistics
    assert int(model[1].num_batches_tracked) == 3
