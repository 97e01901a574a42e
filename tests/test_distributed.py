"""Rule 9 under torch.distributed: 2 gloo processes on 127.0.0.1, bounded in time.

The scenarios (``scen_*``) run in the spawned ranks and return tensors; the
tests compare them, bitwise, across ranks and with single-process references
that see every rank's data. All scenarios share one launch (one process
start-up for the module); the failure scenario, which breaks the process
group on purpose (a collective times out), runs last.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import paramupdates as pu
from dist_harness import launch, reset_pu, run_example_under_torchrun
from dist_models import (
    MOMENTUM,
    NO_BROADCAST,
    C,
    Net,
    RuleNet,
    Two,
    batch,
    loss_of,
    reference_stats,
    same,
    state_of,
)

from conftest import bits

pytestmark = pytest.mark.distributed

STEPS = 3


# ----------------------------------------------------------------------------
# scenarios (run in each rank)
# ----------------------------------------------------------------------------
def scen_ddp_stats(rank, world, model_arg):
    """DDP without buffer broadcast; pu.Stepper over the wrapper or its .module."""
    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net, **NO_BROADCAST)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    stepper = pu.Stepper(ddp if model_arg == "wrapper" else net, opt)
    for s in range(STEPS):
        with stepper:
            loss_of(ddp(batch(s, rank))).backward()
        opt.zero_grad()
    return {"state": state_of(net), "schedule": str(stepper.schedule())}


def scen_grad_accum(rank, world, ddp_kwargs):
    """Two micro-batches per step, the first under ddp.no_sync(); one commit per step."""
    torch.manual_seed(0)
    net = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated in torch 2.13
        ddp = DDP(net, **ddp_kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    stepper = pu.Stepper(ddp, opt)
    for s in range(STEPS):
        with stepper:
            with ddp.no_sync():
                loss_of(ddp(batch(s, rank, 0))).backward()
            loss_of(ddp(batch(s, rank, 1))).backward()
        opt.zero_grad()
    return {"state": state_of(net)}


def scen_attach(rank, world):
    """pu.attach(ddp, opt): an unchanged loop; the all-reduce runs inside optimizer.step()."""
    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net, **NO_BROADCAST)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    att = pu.attach(ddp, opt)
    for s in range(STEPS):
        loss_of(ddp(batch(s, rank))).backward()
        opt.step()
        opt.zero_grad()
    trained = state_of(net)
    with torch.no_grad():  # statistics only (no optimizer step follows): flush() commits and syncs them
        ddp(batch(STEPS, rank))
    att.flush()
    att.detach()
    return {"state": trained, "flushed": state_of(net), "steps": att.steps}


def scen_broadcast_on(rank, world, model_arg):
    """DDP with its default broadcast_buffers=True and synced targets: an error at the update, nothing written."""
    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    before = state_of(net)
    try:
        with pu.step(ddp if model_arg == "wrapper" else net, opt):
            loss_of(ddp(batch(0, rank))).backward()
    except pu.UpdateError as e:
        return {"error": str(e), "unchanged": same(before, state_of(net))}
    return {"error": None}


def scen_torch_broadcast(rank, world):
    """Plain torch.nn.BatchNorm1d under DDP(broadcast_buffers=True): the PyTorch behaviour."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.BatchNorm1d(C, momentum=MOMENTUM), nn.Linear(C, 3))
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(STEPS):
        loss_of(ddp(batch(s, rank))).backward()
        opt.step()
        opt.zero_grad()
    own = state_of(net[0])  # this rank's statistics after its last step
    ddp.eval()
    with torch.no_grad():
        ddp(batch(0, rank))  # the next forward broadcasts rank 0's buffers
    return {"own": own, "after": state_of(net[0])}


def scen_rules(rank, world):
    """Custom-update programs and declared rules under DDP: after N steps, every rank bitwise equal."""
    torch.manual_seed(0)
    net = RuleNet()
    net.declare_rules()
    ddp = DDP(net, **NO_BROADCAST)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    stepper = pu.Stepper(ddp, opt)
    for s in range(4):
        with stepper:
            # decoupled weight decay, written as a program: before the gradient update
            pu.assign_sub(net.lin.weight, 0.1 * 0.05 * net.lin.weight.detach(), phase="before_grad")
            loss_of(ddp(batch(s, rank))).backward()
        opt.zero_grad()
    rows = [(r.phase, r.op) for r in stepper.schedule()]
    return {"state": state_of(net), "rows": rows}


def scen_declared_rules(rank, world):
    """pu.weight_decay, pu.constrain(max_norm) and pu.ema under DDP with synced stats: ranks bitwise equal."""
    torch.manual_seed(0)
    net = Net()
    pu.weight_decay(net, 0.05)
    pu.constrain(net.lin.weight, pu.max_norm(0.5))
    avg = pu.ema(net, 0.9)
    ddp = DDP(net, **NO_BROADCAST)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    stepper = pu.Stepper(ddp, opt)
    for s in range(4):
        with stepper:
            loss_of(ddp(batch(s, rank))).backward()
        opt.zero_grad()
    rows = [(r.phase, r.op) for r in stepper.schedule()]
    return {"state": state_of(net), "ema": state_of(avg), "rows": rows}


class Mixed(nn.Module):
    """Buffers of several dtypes, synced with mean and sum."""

    def __init__(self):
        super().__init__()
        self.register_buffer("f32", torch.zeros(3))
        self.register_buffer("f16", torch.zeros(2, dtype=torch.float16))
        self.register_buffer("f64", torch.zeros(2, dtype=torch.float64))
        self.register_buffer("total", torch.zeros(2))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("imean", torch.zeros((), dtype=torch.int32))
        self.aux = pu.Parameter(torch.zeros(2), auxiliary=True)


def mixed_values(rank):
    g = torch.Generator().manual_seed(rank)
    return {
        "f32": torch.randn(3, generator=g),
        "f16": torch.randn(2, generator=g).half(),
        "f64": torch.randn(2, generator=g, dtype=torch.float64),
        "total": torch.randn(2, generator=g),
        "imean": torch.tensor(3 * rank + 2, dtype=torch.int32),
        "aux": torch.randn(2, generator=g),
    }


def scen_buckets(rank, world):
    """Mean and sum over float32/float16/float64/int targets: one all_reduce per reduction dtype."""
    m = Mixed()
    # the optimizer holds the auxiliary pu.Parameter too (model.parameters()): it must still commit the mean
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    v = mixed_values(rank)
    calls = []
    real = dist.all_reduce

    def counting(t, *a, **k):
        calls.append((t.dtype, t.numel()))
        return real(t, *a, **k)

    dist.all_reduce = counting
    try:
        with pu.step(m, opt):
            pu.assign(m.f32, v["f32"], sync="mean")
            pu.assign(m.f16, v["f16"], sync="mean")
            pu.assign(m.f64, v["f64"], sync="mean")
            pu.assign(m.total, v["total"], sync="sum")
            pu.assign_add(m.count, rank + 1, sync="sum")
            pu.assign(m.imean, v["imean"], sync="mean")
            m.aux.assign(v["aux"], sync="mean")
    finally:
        dist.all_reduce = real
    return {"state": state_of(m), "calls": calls}


def scen_nonfinite(rank, world):
    """A non-finite value on one rank: every rank skips (or raises), none commits alone."""
    out = {}
    m = Two()
    before = state_of(m)
    # unsynced NaN on rank 1 only, skip: both skip
    s = pu.Stepper(m, on_nonfinite="skip")
    with s:
        pu.assign(m.a, torch.full((2,), 1.0 + rank), sync="mean")
        pu.assign(m.local, torch.full((2,), float("nan") if rank == 1 else 1.0))
    out["skip_unsynced"] = (s.skipped, s.skipped_steps, same(before, state_of(m)))
    # synced NaN on rank 1 only: the NaN reaches every rank through the sum; both skip
    with s:
        pu.assign(m.a, torch.full((2,), float("nan") if rank == 1 else 1.0), sync="mean")
    out["skip_synced"] = (s.skipped, s.skipped_steps, same(before, state_of(m)))
    # raise: both raise, the rank without NaN says another rank has one
    try:
        with pu.step(m, on_nonfinite="raise"):
            pu.assign(m.a, torch.ones(2), sync="mean")
            pu.assign(m.local, torch.full((2,), float("inf") if rank == 1 else 1.0))
        out["raise"] = None
    except pu.UpdateError as e:
        out["raise"] = str(e)
    out["unchanged"] = same(before, state_of(m))
    return out


def scen_disagree(rank, world):
    """Ranks that sync different targets, or different steps, raise on every rank before writing."""
    out = {}
    m = Two()
    before = state_of(m)
    try:
        with pu.step(m):
            pu.assign(m.a if rank == 0 else m.b, torch.ones(2), sync="mean")  # same size, other target
        out["targets"] = None
    except pu.UpdateError as e:
        out["targets"] = str(e)
    s = pu.Stepper(m)
    if rank == 1:  # rank 1's first step raises; it goes on alone to the next one
        try:
            with s:
                pu.assign(m.a, torch.ones(2), sync="mean")
                raise RuntimeError("simulated")
        except RuntimeError:
            pass
    try:
        with s:
            pu.assign(m.a, torch.ones(2), sync="mean")
        out["steps"] = None
    except pu.UpdateError as e:
        out["steps"] = str(e)
    out["unchanged"] = same(before, state_of(m))
    return out


def scen_group(rank, world):
    """process_group= is honoured: over a group of one, sync is the identity; over the default, the mean."""
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    pair = dist.new_group(list(range(world)))
    out = {}
    for name, group in (("single", singles[rank]), ("pair", pair)):
        m = Two()
        with pu.step(m, process_group=group):
            pu.assign(m.a, torch.full((2,), float(rank + 1)), sync="mean")
        out[name] = m.a.clone()
    return out


def batch2d(step, rank):
    g = torch.Generator().manual_seed(7919 * step + 101 * rank + 50)
    return torch.randn(4, 3, 5, 5, generator=g) * (1.0 + rank) + 2.0 * rank


def scen_pu_bn2d(rank, world):
    """pu.nn.BatchNorm2d(sync_stats=True) under DDP (first layer: its statistics depend on the data only)."""
    torch.manual_seed(0)
    net = nn.Sequential(pu.nn.BatchNorm2d(3, sync_stats=True), nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(18, 2))
    ddp = DDP(net, **NO_BROADCAST)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    stepper = pu.Stepper(ddp, opt)
    for s in range(STEPS):
        with stepper:
            loss_of(ddp(batch2d(s, rank))).backward()
        opt.zero_grad()
    return {"state": state_of(net)}


def scen_pu_bn_eager(rank, world):
    """pu.nn.BatchNorm1d(sync_stats=True) trained outside any step (plain loop): each forward syncs at once."""
    torch.manual_seed(0)
    bn = pu.nn.BatchNorm1d(C, sync_stats=True)
    for s in range(STEPS):
        bn(batch(s, rank))
    return {"state": state_of(bn)}


def scen_eager_and_when(rank, world):
    """Outside a step a synced update is reduced at once; under when(tensor) a false rank contributes old."""
    m = Two()
    m.register_buffer("count", torch.zeros((), dtype=torch.long))
    pu.assign(m.a, torch.full((2,), float(rank + 1)), sync="mean")  # eager (eager outside a step, rule 8): 1.5 on both
    pu.assign_add(m.count, rank + 1, sync="sum")  # 3 on both
    pu.assign(m.local, torch.full((2,), float(rank + 1)))  # eager, not synced: rank-local
    eager = state_of(m)
    with pu.step(m):
        with pu.when(torch.tensor(rank == 0)):  # true on rank 0 only
            pu.assign(m.b, torch.full((2,), 4.0), sync="mean")
    return {"eager": eager, "b": m.b.clone()}


SCENARIOS = {
    "eager_when": (scen_eager_and_when, ()),
    "pu_bn_eager": (scen_pu_bn_eager, ()),
    "pu_bn2d": (scen_pu_bn2d, ()),
    "stats_wrapper": (scen_ddp_stats, ("wrapper",)),
    "stats_module": (scen_ddp_stats, ("module",)),
    "accum_forward_sync_buffers": (scen_grad_accum, (NO_BROADCAST,)),
    "accum_broadcast_buffers": (scen_grad_accum, ({"broadcast_buffers": False},)),
    "attach": (scen_attach, ()),
    "broadcast_wrapper": (scen_broadcast_on, ("wrapper",)),
    "broadcast_module": (scen_broadcast_on, ("module",)),
    "torch_broadcast": (scen_torch_broadcast, ()),
    "rules": (scen_rules, ()),
    "declared_rules": (scen_declared_rules, ()),
    "buckets": (scen_buckets, ()),
    "nonfinite": (scen_nonfinite, ()),
    "disagree": (scen_disagree, ()),
    "group": (scen_group, ()),
}


def run_scenarios(rank, world, names, marker):
    """Every scenario in turn, then the one that breaks the process group (a timed-out collective)."""
    out = {}
    for name in names:
        fn, args = SCENARIOS[name]
        reset_pu()
        try:
            out[name] = fn(rank, world, *args)
        except Exception:
            out[name] = {"crash": traceback.format_exc()}
        dist.barrier()
    reset_pu()
    try:
        out["rank_raises"] = scen_rank_raises(rank, world, marker)
    except Exception:
        out["rank_raises"] = {"crash": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def results():
    """One launch (one process start-up) for the whole module."""
    with tempfile.TemporaryDirectory() as d:
        marker = os.path.join(d, "rank0-done")
        return launch(run_scenarios, list(SCENARIOS), marker, pg_timeout=20.0, timeout=120.0, hard_exit=True)


def ranks(results, name):
    out = [r[name] for r in results]
    for rank, o in enumerate(out):
        if "crash" in o:
            pytest.fail(f"rank {rank} raised in scenario {name}:\n{o['crash']}")
    return out


# ----------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("model_arg", ["wrapper", "module"])
def test_synced_statistics_equal_mean_of_rank_updates(results, model_arg):
    """running stats == mean over ranks of each rank's update, bitwise, on every rank."""
    r0, r1 = ranks(results, f"stats_{model_arg}")
    assert same(r0["state"], r1["state"])
    ref_m, ref_v = reference_stats(STEPS, 2)
    st = r0["state"]
    assert torch.equal(bits(st["bn.running_mean"]), bits(ref_m))
    assert torch.equal(bits(st["bn.running_var"]), bits(ref_v))
    assert int(st["bn.num_batches_tracked"]) == STEPS
    # the ranks' data differ: rank 0 alone would give other statistics
    alone, _ = reference_stats(STEPS, 1)
    assert not torch.allclose(st["bn.running_mean"], alone, atol=1e-3)
    assert "sync=mean" in r0["schedule"]


def torch_bn_mean_of_updates(ref: nn.Module, data) -> nn.Module:
    """Single process, every rank's data, torch's own BN: each step, the mean over ranks of its updates.

    One thread, as in the ranks (the BatchNorm kernel's reduction order depends on it).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s in range(STEPS):
            per_rank = []
            for r in range(2):
                bn = copy.deepcopy(ref)
                bn(data(s, r))
                per_rank.append(bn)
            with torch.no_grad():
                ref.running_mean.copy_((per_rank[0].running_mean + per_rank[1].running_mean) / 2)
                ref.running_var.copy_((per_rank[0].running_var + per_rank[1].running_var) / 2)
                ref.num_batches_tracked.copy_(per_rank[0].num_batches_tracked)
    finally:
        torch.set_num_threads(threads)
    return ref


def test_pu_batchnorm2d_sync_stats_equals_mean_of_torch_batchnorm_updates(results):
    """pu.nn.BatchNorm2d(sync_stats=True) under DDP: running stats == mean over ranks of torch.nn.BatchNorm2d's."""
    r0, r1 = ranks(results, "pu_bn2d")
    assert same(r0["state"], r1["state"])
    ref = torch_bn_mean_of_updates(nn.BatchNorm2d(3), batch2d)
    st = r0["state"]
    assert torch.equal(bits(st["0.running_mean"]), bits(ref.running_mean))
    assert torch.equal(bits(st["0.running_var"]), bits(ref.running_var))
    assert int(st["0.num_batches_tracked"]) == STEPS


def test_pu_batchnorm_sync_stats_outside_a_step(results):
    """Without pu.step (a plain loop), sync_stats=True still averages: every forward reduces at once."""
    r0, r1 = ranks(results, "pu_bn_eager")
    assert same(r0["state"], r1["state"])
    ref = torch_bn_mean_of_updates(nn.BatchNorm1d(C), batch)
    assert torch.equal(bits(r0["state"]["running_mean"]), bits(ref.running_mean))
    assert torch.equal(bits(r0["state"]["running_var"]), bits(ref.running_var))


@pytest.mark.parametrize("kw", ["forward_sync_buffers", "broadcast_buffers"])
def test_gradient_accumulation_under_no_sync(results, kw):
    """Two micro-batches (first under no_sync): stats and parameters match the single-process reference."""
    r0, r1 = ranks(results, f"accum_{kw}")
    assert same(r0["state"], r1["state"])
    ref_m, ref_v = reference_stats(STEPS, 2, micro=2)
    assert torch.equal(bits(r0["state"]["bn.running_mean"]), bits(ref_m))
    assert torch.equal(bits(r0["state"]["bn.running_var"]), bits(ref_v))
    assert int(r0["state"]["bn.num_batches_tracked"]) == 2 * STEPS
    # parameters: one process sees all 4 micro-batches; DDP averages over ranks, sums over micro-batches
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(STEPS):
        for r in range(2):
            for k in range(2):
                (loss_of(ref(batch(s, r, k))) / 2).backward()
        opt.step()
        opt.zero_grad()
    for k in ("lin.weight", "lin.bias", "bn.weight", "bn.bias"):
        torch.testing.assert_close(r0["state"][k], ref.state_dict()[k], rtol=0, atol=1e-6)


def test_attach_under_ddp(results):
    r0, r1 = ranks(results, "attach")
    assert same(r0["state"], r1["state"]) and same(r0["flushed"], r1["flushed"])
    assert r0["steps"] == STEPS + 1  # the flush counts as a step
    for key, steps in (("state", STEPS), ("flushed", STEPS + 1)):
        ref_m, ref_v = reference_stats(steps, 2)
        assert torch.equal(bits(r0[key]["bn.running_mean"]), bits(ref_m))
        assert torch.equal(bits(r0[key]["bn.running_var"]), bits(ref_v))


@pytest.mark.parametrize("model_arg", ["wrapper", "module"])
def test_broadcast_buffers_on_is_an_error(results, model_arg):
    for out in ranks(results, f"broadcast_{model_arg}"):
        assert out["error"] is not None, "broadcast_buffers=True with synced targets must raise"
        assert "bn.running_mean" in out["error"] and "broadcast_buffers=False" in out["error"]
        assert "dist_models.py:" in out["error"]  # the call site of the update
        assert out["unchanged"]


def test_pytorch_broadcast_buffers_loses_rank1_statistics(results):
    """The contrast: plain BN under DDP(broadcast_buffers=True) ends with rank 0's statistics only."""
    r0, r1 = ranks(results, "torch_broadcast")
    assert not same(r0["own"], r1["own"])  # each rank had its own statistics...
    assert same(r1["after"], r0["own"])  # ...and the next forward replaced rank 1's with rank 0's
    # a single process that sees rank 0's data only has exactly these statistics
    # (one thread, as in the ranks: the BatchNorm kernel's reduction order depends on it)
    alone = nn.BatchNorm1d(C, momentum=MOMENTUM)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s in range(STEPS):
            alone(batch(s, 0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits(r1["after"]["running_mean"]), bits(alone.running_mean))
    assert torch.equal(bits(r1["after"]["running_var"]), bits(alone.running_var))
    both, _ = reference_stats(STEPS, 2)
    assert not torch.allclose(r1["after"]["running_mean"], both, atol=1e-2)  # rank 1's data left no trace


def test_rules_give_identical_ranks(results):
    """Weight decay (a program), a declared max-norm, an EMA rule and synced stats: ranks bitwise equal."""
    r0, r1 = ranks(results, "rules")
    shared = {k: v for k, v in r0["state"].items() if k != "seen"}
    other = {k: v for k, v in r1["state"].items() if k != "seen"}
    assert same(shared, other)
    assert not torch.equal(r0["state"]["seen"], r1["state"]["seen"])  # the rank-local control differs
    assert r0["rows"] == [
        ("before_grad", "assign_sub"),
        ("grad", "SGD.step"),
        ("after_grad", "max_norm"),
        ("auxiliary", "assign_add"),  # seen (rank-local)
        ("auxiliary", "assign sync=mean"),
        ("auxiliary", "assign sync=mean"),
        ("auxiliary", "assign_add sync=mean"),
        ("after_step", "ema"),
    ]
    assert float(r0["state"]["lin.weight"].norm(dim=1).max()) <= 0.5 + 1e-6
    assert not torch.equal(r0["state"]["ema.weight"], r0["state"]["lin.weight"])


def test_declared_rules_of_pu_give_identical_ranks(results):
    """The library's rules (weight decay, max-norm constraint, EMA) under DDP: ranks bitwise equal, EMA too."""
    r0, r1 = ranks(results, "declared_rules")
    assert same(r0["state"], r1["state"]) and same(r0["ema"], r1["ema"])
    rules = [(phase, op) for phase, op in r0["rows"] if not op.startswith(("assign", "SGD"))]
    assert [phase for phase, _ in rules] == ["before_grad", "after_grad", "after_step"]
    assert rules[0][1] == "weight_decay" and rules[1][1].startswith("constrain") and rules[2][1].startswith("ema")
    # the EMA saw the synced statistics: its running mean is the EMA of identical values on both ranks
    assert not torch.equal(r0["ema"]["bn.running_mean"], torch.zeros(C))
    assert float(r0["state"]["lin.weight"].norm(dim=1).max()) <= 0.5 + 1e-6


def test_buckets_and_reductions(results):
    r0, r1 = ranks(results, "buckets")
    assert same(r0["state"], r1["state"])
    v0, v1 = mixed_values(0), mixed_values(1)
    st = r0["state"]
    assert torch.equal(bits(st["f32"]), bits((v0["f32"] + v1["f32"]) / 2))
    assert torch.equal(bits(st["f16"]), bits(((v0["f16"].float() + v1["f16"].float()) / 2).half()))
    assert torch.equal(bits(st["f64"]), bits((v0["f64"] + v1["f64"]) / 2))
    assert torch.equal(bits(st["total"]), bits(v0["total"] + v1["total"]))
    assert torch.equal(bits(st["aux"]), bits((v0["aux"] + v1["aux"]) / 2))
    assert int(st["count"]) == 1 + 2 and st["count"].dtype == torch.long
    assert int(st["imean"]) == (2 + 5) // 2 and st["imean"].dtype == torch.int32
    # one collective per reduction dtype: float32 (float32, float16, mean and sum together), float64, int64
    assert sorted(str(d) for d, _ in r0["calls"]) == ["torch.float32", "torch.float64", "torch.int64"]


def test_nonfinite_decided_alike_on_every_rank(results):
    r0, r1 = ranks(results, "nonfinite")
    for out in (r0, r1):
        assert out["skip_unsynced"] == (True, 1, True)
        assert out["skip_synced"] == (True, 2, True)
        assert out["unchanged"]
    assert "other rank" in r0["raise"]
    assert "'local'" in r1["raise"]


def test_ranks_that_disagree_raise_on_every_rank(results):
    for out in ranks(results, "disagree"):
        assert out["targets"] is not None and "disagree" in out["targets"]
        assert out["steps"] is not None and "not the same step" in out["steps"]
        assert out["unchanged"]


def test_eager_sync_and_when_tensor(results):
    r0, r1 = ranks(results, "eager_when")
    for out in (r0, r1):
        assert torch.equal(out["eager"]["a"], torch.full((2,), 1.5))
        assert int(out["eager"]["count"]) == 3
        assert torch.equal(out["b"], torch.full((2,), 2.0))  # (4 + 0) / 2: rank 1 kept its old value
    assert torch.equal(r0["eager"]["local"], torch.full((2,), 1.0))
    assert torch.equal(r1["eager"]["local"], torch.full((2,), 2.0))


def test_process_group_is_honoured(results):
    r0, r1 = ranks(results, "group")
    assert torch.equal(r0["single"], torch.full((2,), 1.0))
    assert torch.equal(r1["single"], torch.full((2,), 2.0))
    assert torch.equal(r0["pair"], torch.full((2,), 1.5)) and torch.equal(r1["pair"], r0["pair"])


# ----------------------------------------------------------------------------
# a rank that raises inside a step: the other gets an error, not a hang
# ----------------------------------------------------------------------------
SYNC_TIMEOUT = 2.0


def scen_rank_raises(rank, world, marker):
    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net, **NO_BROADCAST)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    stepper = pu.Stepper(ddp, opt, sync_timeout=SYNC_TIMEOUT)
    with stepper:  # one good step
        loss_of(ddp(batch(0, rank))).backward()
    opt.zero_grad()
    before = state_of(net)
    if rank == 1:
        try:
            with stepper:
                loss_of(ddp(batch(1, rank))).backward()
                raise RuntimeError("rank 1 fails inside its step")
        except RuntimeError:
            pass
        # alive, but never reaching the commit (a stuck data loader, a log-and-continue handler)
        deadline = time.monotonic() + 30
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"unchanged": same(before, state_of(net))}
    t0 = time.monotonic()
    try:
        with stepper:
            loss_of(ddp(batch(1, rank))).backward()
        err = None
    except pu.UpdateError as e:
        err = str(e)
    waited = time.monotonic() - t0
    out = {"error": err, "waited": waited, "unchanged": same(before, state_of(net))}
    open(marker, "w").close()
    return out


def test_rank_that_raises_gives_the_others_an_error_not_a_hang(results):
    r0, r1 = ranks(results, "rank_raises")
    assert r0["error"] is not None, "rank 0 committed although rank 1 never reached the commit"
    assert "did not complete" in r0["error"] and f"sync_timeout={SYNC_TIMEOUT:g} s" in r0["error"]
    assert "module.bn.running_mean" in r0["error"]
    assert SYNC_TIMEOUT <= r0["waited"] < SYNC_TIMEOUT + 5
    assert r0["unchanged"] and r1["unchanged"]


# ----------------------------------------------------------------------------
# the README's example, run as documented (torchrun, 2 processes, gloo)
# ----------------------------------------------------------------------------
def test_ddp_example_runs_under_torchrun():
    """examples/ddp_train.py under torchrun (2 gloo ranks; see dist_harness.run_example_under_torchrun)."""
    proc = run_example_under_torchrun("examples/ddp_train.py", "statistics and weights identical on every rank")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "statistics and weights identical on every rank" in proc.stdout
    assert "module.1.running_mean         assign sync=mean" in proc.stdout
    assert "module.1.running_var          assign sync=mean" in proc.stdout
