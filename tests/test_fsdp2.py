"""FSDP2 (``torch.distributed.fsdp.fully_shard``, DTensor parameters): every rule and update.

Two gloo ranks on 127.0.0.1 (``tests/dist_harness.py``), two launches: one for
the training scenarios (each compared with a single-process reference), one for
the guards (updates that must be refused, HSDP sync, FSDP1). The model is

    Linear(8, 16) -> BatchNorm1d(16) -> Linear(16, 5) -> Linear(5, 1)

with ``fully_shard`` on each Linear and on the root, so that FSDP2's
``Shard(0)`` gives uneven shards (``2.weight``: 3 and 2 rows) and an empty one
(``3.weight``, ``3.bias``: rank 1 holds no row). The batch norm's parameters
belong to the root's group and are unsharded during forward; its buffers are
plain tensors, one per rank (each rank normalises with its own batch, as
under DDP).

The reference runs in this process, on one unsharded model: for each step it
runs both ranks' batches (the running statistics kept per rank), averages the
two gradients, then applies the optimizer and the rules with full tensors.
Parameters, optimizer results and EMA copies must match to 1e-6.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paramupdates as pu
from dist_harness import launch, reset_pu

from conftest import bits

pytestmark = pytest.mark.distributed

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard") or not dist.is_available():  # pragma: no cover - old torch
    pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) is not available", allow_module_level=True)

STEPS = 3
LR = 1e-2
WD = 0.1
EMA_DECAY = 0.5
TOL = dict(atol=1e-6, rtol=1e-6)
EPS = 1e-7  # keras.backend.epsilon(), as pu's norm constraints


# ----------------------------------------------------------------------------
# model, data, configurations (shared by the ranks and the reference)
# ----------------------------------------------------------------------------
def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    # no bias before the batch norm: its gradient is 0 up to rounding, which Adam would amplify to +-lr
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Linear(16, 5), nn.Linear(5, 1))


def shard(model: nn.Module, mesh=None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    for i in (0, 2, 3):
        fsdp.fully_shard(model[i], mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g) * (1.0 + rank) + rank, torch.randn(6, 1, generator=g)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


WEIGHTS = ("0.weight", "2.weight", "3.weight")
NORMS = {
    "max_norm": lambda d: pu.max_norm(0.5, dim=d),
    "unit_norm": lambda d: pu.unit_norm(dim=d),
    "min_max_norm": lambda d: pu.min_max_norm(0.3, 0.6, rate=0.5, dim=d),
}
ELEMENTWISE = {"non_neg": pu.non_neg, "clamp": lambda: pu.clamp(-0.15, 0.15)}


def constraint_of(name: str, dim):
    return NORMS[name](dim) if name in NORMS else ELEMENTWISE[name]()


def constrained(name: str, dim) -> tuple[str, ...]:
    """What a constraint is declared on: the weights; for dim=None and elementwise ones the biases too."""
    if name in NORMS and dim is not None:
        return WEIGHTS
    return (*WEIGHTS, "2.bias", "3.bias")


def cfg(**kw):
    base = {
        "driver": "attach",
        "convert": None,
        "sync_stats": False,
        "wd": False,
        "constraint": None,
        "ema": False,
        "declare": "after",
        "skip": (),
        "on_module": False,
        "updates": False,
        "copies": False,
    }
    base.update(kw)
    return base


CONFIGS = {
    "default_attach": cfg(convert="before"),
    # the opt-in rollback copies (of local shards) on every commit
    "copies_attach": cfg(convert="before", wd=True, constraint=("max_norm", 1), ema=True, copies=True),
    "default_step": cfg(driver="step", convert="before"),
    # updates of sharded parameters issued after backward: before_grad, after_grad (folded over the
    # optimizer's result), a plain whole-shape operand (each rank keeps its chunk; rank 1's is empty)
    "updates": cfg(driver="step", convert="before", updates=True, constraint=("max_norm", 1)),
    "plain_bn": cfg(),
    "weight_decay": cfg(wd=True),
    "ema": cfg(ema=True, convert="before"),
    # declared on modules, before fully_shard: they follow the parameters by name
    "rules_before_shard": cfg(
        wd=True, constraint=("max_norm", None), ema=True, declare="before", convert="before", on_module=True
    ),
    "sync_stats_before_shard": cfg(convert="before", sync_stats=True),
    "sync_stats_after_shard": cfg(convert="after", sync_stats=True, driver="step"),
}
for _n in NORMS:
    for _d in (0, 1, None):
        CONFIGS[f"{_n}_dim{_d}"] = cfg(constraint=(_n, _d))
for _n in ELEMENTWISE:
    CONFIGS[_n] = cfg(constraint=(_n, None))
# the fault scenarios: the reference skips the failed step
CONFIGS["raising_constraint"] = cfg(driver="step", convert="before", skip=(1,))
CONFIGS["nan_skip"] = cfg(driver="step", convert="before", skip=(1,))
CONFIGS["nan_raise"] = cfg(driver="step", convert="before", skip=(1,))


def declare(model: nn.Module, c: dict) -> nn.Module | None:
    """The rules of configuration ``c`` on ``model``; the EMA copy (or None)."""
    named = dict(model.named_parameters())
    if c["wd"]:
        pu.weight_decay(model, WD)
    if c["constraint"] is not None:
        name, dim = c["constraint"]
        if c["on_module"]:  # the same tensors: every parameter of the three Linear layers
            for i in (0, 2, 3):
                pu.constrain(model[i], constraint_of(name, dim))
        else:
            pu.constrain([(n, named[n]) for n in constrained(name, dim)], constraint_of(name, dim))
    return pu.ema(model, EMA_DECAY) if c["ema"] else None


# ----------------------------------------------------------------------------
# in the ranks
# ----------------------------------------------------------------------------
def clean() -> None:
    """``reset_pu()``, also after a scenario that left an attachment whose abort raises."""
    from paramupdates import state

    try:
        reset_pu()
    except Exception:
        state.process.attachments.clear()
        reset_pu()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a DTensor; every rank calls it in the same order)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter, buffer and optimizer state tensor."""
    out = {f"m.{k}": local(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"opt.{names[id(p)]}.{k}"] = local(v)
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def results_of(model: nn.Module, avg: nn.Module | None) -> dict:
    out = {
        "params": {n: full(p) for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
    }
    if avg is not None:
        out["ema"] = {n: full(p) for n, p in avg.named_parameters()}
        # the copy's buffers are the model's, name for name; t (the number of EMA updates) travels in
        # the metadata of its state_dict
        assert [n for n, _ in avg.named_buffers()] == [n for n, _ in model.named_buffers()]
        out["ema_buffers"] = {n: b.detach().clone() for n, b in avg.named_buffers()}
        with torch.no_grad():
            out["ema_eval"] = avg(EVAL_X)  # FSDP all-gathers the averaged copy: every rank calls it
        saved = avg.state_dict()
        out["ema_updates"] = saved._metadata[""]["pu_ema_updates"]
        out["ema_saved"] = {k: full(v) for k, v in saved.items()}  # DTensors
    return out


EVAL_X = torch.linspace(-2, 2, 24).reshape(3, 8)


def train(rank: int, world: int, name: str) -> dict:
    c = CONFIGS[name]
    model = make_model()
    if c["convert"] == "before":
        pu.convert(model, sync_stats=c["sync_stats"])
    avg = declare(model, c) if c["declare"] == "before" else None
    shard(model)
    if c["convert"] == "after":
        pu.convert(model, sync_stats=c["sync_stats"])
    if c["declare"] == "after":
        avg = declare(model, c)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    att = pu.attach(model, opt, copy_for_rollback=c["copies"]) if c["driver"] == "attach" else None
    out: dict = {}
    for s in range(STEPS + len(c["skip"])):
        x, y = batch(s, rank)
        if att is not None:
            loss_of(model(x), y).backward()
            opt.step()
        else:
            with pu.step(model, opt, copy_for_rollback=c["copies"]):
                loss_of(model(x), y).backward()
                if c["updates"]:
                    issue_updates(model)
        opt.zero_grad()
    if att is not None:
        att.detach()
    out.update(results_of(model, avg))
    return out


def issue_updates(model: nn.Module) -> None:
    pu.assign(model[0].weight, model[0].weight.detach() * 0.99, phase="before_grad")
    pu.assign_sub(model[2].weight, 0.01 * model[2].weight.detach(), phase="after_grad")
    pu.assign_add(model[3].bias, torch.full((1,), 1e-3), phase="after_grad")


def fault_run(rank: int, world: int, name: str) -> dict:
    """Step 1 fails (a raising constraint, or a NaN in rank 1's shard only); steps 0, 2, 3 train."""
    model = make_model()
    pu.convert(model)
    shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    fail = {"now": False}

    def sometimes_raises(w):
        if fail["now"]:
            raise ValueError("constraint failed on purpose")
        return w

    if name.startswith("raising_constraint"):
        pu.constrain(model[2].weight, sometimes_raises)
    how = "skip" if name == "nan_skip" else "raise"
    # a failure after the optimizer's step is undone only with the opt-in copies
    stepper = pu.Stepper(model, opt, on_nonfinite=how, copy_for_rollback=name == "raising_constraint")
    out = {"errors": [], "unchanged": None}
    for s in range(STEPS + 1):
        x, y = batch(s, rank)
        fail["now"] = s == 1
        before = local_state(model, opt) if s == 1 else None
        try:
            with stepper:
                loss_of(model(x), y).backward()
                if s == 1 and not name.startswith("raising_constraint"):
                    w = model[2].weight
                    bad = w.detach() * 1.0
                    if rank == 1:
                        bad.to_local().fill_(float("nan"))  # rank 1's shard only
                    pu.assign(w, bad, phase="after_grad")
        except pu.UpdateError as e:
            out["errors"].append(str(e))
        if before is not None:
            out["unchanged"] = same(before, local_state(model, opt))
            out["skipped_steps"] = stepper.skipped_steps
        opt.zero_grad()
    out.update(results_of(model, None))
    return out


def comm_counts(rank: int, world: int) -> dict:
    """Collectives issued by a commit (inside optimizer.step() under pu.attach), counted by CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    for label, convert, constraint in [
        ("dim0", False, ("max_norm", 0)),
        ("dim1", False, ("max_norm", 1)),
        ("dimNone", False, ("unit_norm", None)),
        ("elementwise", False, ("clamp", None)),
        ("pending_stats", True, ("max_norm", 0)),
        ("pending_stats_checked", True, ("max_norm", 0)),
        ("pending_synced_stats", "sync", ("max_norm", 0)),
    ]:
        clean()
        model = make_model()
        if convert:
            pu.convert(model, sync_stats=convert == "sync")
        shard(model)
        c = cfg(wd=True, ema=True, constraint=constraint)
        declare(model, c)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        att = pu.attach(model, opt, **({"on_nonfinite": "skip"} if label.endswith("_checked") else {}))
        counts = []
        for s in range(2):
            x, y = batch(s, rank)
            loss_of(model(x), y).backward()
            mode = CommDebugMode()
            with mode:
                opt.step()
            counts.append({str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()})
            opt.zero_grad()
        att.detach()
        out[label] = counts
    return out


def run_training(rank: int, world: int) -> dict:
    out = {}
    for name in [*CONFIGS, "raising_constraint_default"]:
        clean()
        try:
            if name in ("raising_constraint", "raising_constraint_default", "nan_skip", "nan_raise"):
                out[name] = fault_run(rank, world, name)
            else:
                out[name] = train(rank, world, name)
        except Exception:
            out[name] = {"crash": traceback.format_exc()}
        dist.barrier()
    clean()
    try:
        out["comm"] = comm_counts(rank, world)
    except Exception:
        out["comm"] = {"crash": traceback.format_exc()}
    return out


# --- guards ------------------------------------------------------------------
class SelfScaling(nn.Linear):
    """Updates its own weight inside its forward: under FSDP2 that is the temporary unsharded parameter."""

    def forward(self, x):
        pu.assign(self.weight, self.weight.detach() * 0.5, phase="after_grad")
        return super().forward(x)


class AssignsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = SelfScaling(4, 4)

    def forward(self, x):
        return self.lin(x)


def guard_forward_update(rank, world):
    torch.manual_seed(0)
    model = AssignsInForward()
    fsdp.fully_shard(model.lin)
    fsdp.fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    before = {n: local(p) for n, p in model.named_parameters()}
    try:
        with pu.step(model, opt):
            model(torch.randn(2, 4)).sum().backward()
    except pu.UpdateError as e:
        model.lin.reshard()  # the exception left FSDP's unsharded parameter in the slot: put the shard back
        return {"error": str(e), "unchanged": same(before, {n: local(p) for n, p in model.named_parameters()})}
    return {"error": None}


def guard_sync_sharded(rank, world):
    """sync= on a Shard-placed target: refused inside a step and outside."""
    model = shard(make_model())
    w = model[2].weight
    w.requires_grad_(False)  # an auxiliary (non-trainable) sharded parameter
    out = {}
    before = local(w)
    try:
        with pu.step(model):
            pu.assign(w, w.detach() * 2, sync="mean")
        out["step"] = None
    except pu.UpdateError as e:
        out["step"] = str(e)
    try:
        pu.assign(w, w.detach() * 2, sync="mean")
        out["eager"] = None
    except pu.UpdateError as e:
        out["eager"] = str(e)
    out["unchanged"] = torch.equal(bits(before), bits(local(w)))
    return out


def guard_hsdp_sync(rank, world):
    """HSDP (2-D mesh: replicate over 2 ranks, shard over 1): sync= reduces over the replicated dim."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = shard(make_model(), mesh)
    w = model[2].weight
    w.requires_grad_(False)
    mine = torch.full((5, 16), float(rank + 1))
    with pu.step(model):
        v = w.detach() * 0 + 0  # a DTensor like w
        v.to_local().copy_(mine)
        pu.assign(w, v, sync="mean")
    in_step = local(w)
    pu.assign(w, w.detach() + (rank + 1), sync="sum")
    return {"placements": str(w.placements), "in_step": in_step, "eager": local(w)}


def guard_fsdp1(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(make_model(), use_orig_params=True, device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out = {}
    for what, fn in [
        ("attach", lambda: pu.attach(model, opt)),
        ("step", lambda: pu.Stepper(model, opt)),
        ("weight_decay", lambda: pu.weight_decay(model, WD)),
        ("constrain", lambda: pu.constrain(next(model.parameters()), pu.max_norm(1.0))),
        ("ema", lambda: pu.ema(model, 0.9)),
    ]:
        try:
            fn()
            out[what] = None
        except pu.UpdateError as e:
            out[what] = str(e)
        clean()
    return out


def guard_bare_rule_before_shard(rank, world):
    """A constraint declared on a bare tensor before fully_shard cannot follow it: a clear error at the commit."""
    model = make_model()
    pu.constrain(model[2].weight, pu.max_norm(1.0))
    shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    try:
        with pu.step(model, opt):
            loss_of(model(batch(0, rank)[0]), batch(0, rank)[1]).backward()
    except pu.UpdateError as e:
        return {"error": str(e)}
    return {"error": None}


def guard_storage(rank, world):
    """A target whose memory is gone when the commit comes: refused before any write, no crash."""
    model = shard(pu.convert(make_model()))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    rm = model[1].running_mean
    nbytes = rm.untyped_storage().nbytes()
    before = local_state(model, opt)
    try:
        with pu.step(model, opt):
            loss_of(model(batch(0, rank)[0]), batch(0, rank)[1]).backward()
            rm.untyped_storage().resize_(0)  # what FSDP's free_storage does to its unsharded parameters
        err = None
    except pu.UpdateError as e:
        err = str(e)
    rm.untyped_storage().resize_(nbytes)
    rm.copy_(before["m.1.running_mean"])
    return {"error": err, "unchanged": same(before, local_state(model, opt))}


GUARDS = {
    "forward_update": guard_forward_update,
    "storage": guard_storage,
    "bare_rule_before_shard": guard_bare_rule_before_shard,
    "sync_sharded": guard_sync_sharded,
    "hsdp_sync": guard_hsdp_sync,
    "fsdp1": guard_fsdp1,
}


def run_guards(rank: int, world: int) -> dict:
    out = {}
    for name, fn in GUARDS.items():
        clean()
        try:
            out[name] = fn(rank, world)
        except Exception:
            out[name] = {"crash": traceback.format_exc()}
        dist.barrier()
    return out


# ----------------------------------------------------------------------------
# the single-process reference
# ----------------------------------------------------------------------------
def _norms(w: torch.Tensor, dim) -> torch.Tensor:
    if dim is None or w.ndim == 0:
        return w.square().sum().sqrt()
    dims = tuple(i for i in range(w.ndim) if i != dim % w.ndim)
    return w.square().sum(dim=dims, keepdim=True).sqrt() if dims else w.abs()


def ref_constraint(name: str, dim, w: torch.Tensor) -> torch.Tensor:
    """The Keras formulas, written out on the whole tensor."""
    if name == "non_neg":
        return w * (w >= 0).to(w.dtype)
    if name == "clamp":
        return w.clamp(-0.15, 0.15)
    n = _norms(w, dim)
    if name == "max_norm":
        return w * n.clamp(0.0, 0.5) / (EPS + n)
    if name == "unit_norm":
        return w / (EPS + n)
    desired = 0.5 * n.clamp(0.3, 0.6) + 0.5 * n
    return w * desired / (EPS + n)


def reference(name: str, world: int = 2) -> dict:
    """One process, every rank's batch: per-rank running statistics, the mean of the ranks' gradients."""
    c = CONFIGS[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        avg = copy.deepcopy(model) if c["ema"] else None
        avg_bufs = None if avg is None else [{n: b.clone() for n, b in avg.named_buffers()} for _ in range(world)]
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        bufs = [{n: b.clone() for n, b in model.named_buffers()} for _ in range(world)]
        params = dict(model.named_parameters())
        for s in range(STEPS + len(c["skip"])):
            if s in c["skip"]:
                continue
            opt.zero_grad()
            for r in range(world):
                for n, b in model.named_buffers():
                    b.copy_(bufs[r][n])
                x, y = batch(s, r)
                (loss_of(model(x), y) / world).backward()
                bufs[r] = {n: b.clone() for n, b in model.named_buffers()}
            if c["sync_stats"]:
                for n in ("1.running_mean", "1.running_var"):
                    mean = sum(b[n] for b in bufs) / world
                    for b in bufs:
                        b[n] = mean.clone()
            with torch.no_grad():
                if c["wd"]:
                    for p in params.values():
                        if p.ndim > 1:
                            p.mul_(1 - LR * WD)
                if c["updates"]:
                    pre2 = params["2.weight"].detach().clone()
                    params["0.weight"].copy_(params["0.weight"] * 0.99)
            opt.step()
            with torch.no_grad():
                if c["constraint"] is not None:
                    cname, dim = c["constraint"]
                    for n in constrained(cname, dim):
                        params[n].copy_(ref_constraint(cname, dim, params[n]))
                if c["updates"]:
                    params["2.weight"].sub_(0.01 * pre2)
                    params["3.bias"].add_(1e-3)
                if avg is not None:
                    for n, a in avg.named_parameters():
                        a.lerp_(params[n], 1 - EMA_DECAY)
                    for r in range(world):
                        for n, a in avg_bufs[r].items():
                            if a.is_floating_point():
                                a.lerp_(bufs[r][n], 1 - EMA_DECAY)
                            else:
                                a.copy_(bufs[r][n])
        out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "buffers": bufs}
        if avg is not None:
            out["ema"] = {n: p.detach().clone() for n, p in avg.named_parameters()}
            out["ema_buffers"] = avg_bufs
            avg.eval()
            out["ema_eval"] = []
            with torch.no_grad():
                for r in range(world):
                    for n, b in avg.named_buffers():
                        b.copy_(avg_bufs[r][n])
                    out["ema_eval"].append(avg(EVAL_X))
        return out
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------
# the launches (one per group of scenarios)
# ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def training():
    return launch(run_training, timeout=120.0, pg_timeout=30.0, hard_exit=True)


@pytest.fixture(scope="module")
def guards():
    return launch(run_guards, timeout=90.0, pg_timeout=20.0, hard_exit=True)


def ranks(results, name):
    out = [r[name] for r in results]
    for rank, o in enumerate(out):
        if isinstance(o, dict) and "crash" in o:
            pytest.fail(f"rank {rank} raised in scenario {name}:\n{o['crash']}")
    return out


def close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL, msg=lambda m, k=k: f"{what} {k}: {m}")


def check_against_reference(results, name) -> list[dict]:
    outs = ranks(results, name)
    ref = reference(name)
    for rank, o in enumerate(outs):
        close(o["params"], ref["params"], f"{name} rank {rank} parameter")
        close(o["buffers"], ref["buffers"][rank], f"{name} rank {rank} buffer")
        if "ema" in ref:
            close(o["ema"], ref["ema"], f"{name} rank {rank} EMA parameter")
            close(o["ema_buffers"], ref["ema_buffers"][rank], f"{name} rank {rank} EMA buffer")
            close({"out": o["ema_eval"]}, {"out": ref["ema_eval"][rank]}, f"{name} rank {rank} EMA copy's output")
            close(o["ema_saved"], {**o["ema"], **o["ema_buffers"]}, f"{name} rank {rank} EMA state_dict")
            assert o["ema_updates"] == STEPS
    return outs


# --- training scenarios --------------------------------------------------------
@pytest.mark.parametrize("name", ["default_attach", "default_step", "plain_bn", "updates", "copies_attach"])
def test_default_settings_train_like_one_process(training, name):
    """pu.attach / pu.step with default settings, and with the opt-in rollback copies (copies_attach):
    3 Adam steps, uneven and empty shards."""
    check_against_reference(training, name)


def test_weight_decay_on_shards(training):
    check_against_reference(training, "weight_decay")


@pytest.mark.parametrize("dim", [0, 1, None])
@pytest.mark.parametrize("cname", list(NORMS))
def test_norm_constraints_on_shards(training, cname, dim):
    """Row norms (dim=0: local), column norms (dim=1) and whole-tensor norms (None) across uneven/empty shards."""
    check_against_reference(training, f"{cname}_dim{dim}")


@pytest.mark.parametrize("cname", list(ELEMENTWISE))
def test_elementwise_constraints_on_shards(training, cname):
    check_against_reference(training, cname)


def test_ema_of_a_sharded_model(training):
    """pu.ema(fsdp2_model): the averaged copy is sharded like the model and follows the reference."""
    check_against_reference(training, "ema")


def test_rules_declared_before_fully_shard_follow_the_parameters(training):
    """weight decay, a column-norm constraint and EMA declared on the unsharded model keep working."""
    check_against_reference(training, "rules_before_shard")


@pytest.mark.parametrize("when", ["before", "after"])
def test_convert_sync_stats_around_sharding(training, when):
    """pu.convert(sync_stats=True) before or after fully_shard: every rank commits the mean statistics."""
    r0, r1 = check_against_reference(training, f"sync_stats_{when}_shard")
    assert same(r0["buffers"], r1["buffers"])


def test_raising_constraint_with_copies_rolls_back_every_shard(training):
    outs = check_against_reference(training, "raising_constraint")
    for o in outs:
        assert len(o["errors"]) == 1 and "constraint failed on purpose" in o["errors"][0], o["errors"]
        assert "2.weight" in o["errors"][0]
        assert o["unchanged"], "a failed commit must leave every shard, buffer and optimizer state bitwise as before"


def test_raising_constraint_without_copies_raises_on_every_rank_and_training_goes_on(training):
    """The default (no copies): the optimizer's step stays, as in plain PyTorch; every rank raises the
    constraint's error (each runs it on the same DTensor), and the next steps commit on every rank."""
    for o in ranks(training, "raising_constraint_default"):
        assert len(o["errors"]) == 1 and "constraint failed on purpose" in o["errors"][0], o["errors"]
    r0, r1 = ranks(training, "raising_constraint_default")
    close(r0["params"], r1["params"], "after the failed step, the ranks")


def test_nan_on_one_shard_skips_on_every_rank(training):
    outs = check_against_reference(training, "nan_skip")
    for o in outs:
        assert o["errors"] == [] and o["skipped_steps"] == 1 and o["unchanged"]


def test_nan_on_one_shard_raises_on_every_rank(training):
    r0, r1 = check_against_reference(training, "nan_raise")
    assert r0["unchanged"] and r1["unchanged"]
    assert len(r1["errors"]) == 1 and "2.weight" in r1["errors"][0] and "non-finite" in r1["errors"][0]
    assert len(r0["errors"]) == 1 and "other rank" in r0["errors"][0]


def test_collective_counts(training):
    """CommDebugMode around optimizer.step() (the whole commit under pu.attach), two steps each.

    Weight decay, EMA and elementwise constraints work on local shards: no collective. Row norms of a
    Shard(0) weight (dim=0) are local: none. Column or whole-tensor norms: one all-reduce of the
    sums of squares of every constrained tensor. Pending values (the batch norm's statistics) add
    nothing by default (no finiteness check); with ``on_nonfinite=`` one all-reduce lets every rank
    decide on non-finite values together; with sync_stats, the statistics' own all-reduce.
    """
    for rank, out in enumerate(ranks(training, "comm")):
        expect = {
            "dim0": {},
            "dim1": {"allreduce_": 1},
            "dimNone": {"allreduce_": 1},
            "elementwise": {},
            "pending_stats": {},
            "pending_stats_checked": {"allreduce_": 1},
            "pending_synced_stats": {"allreduce_": 1},
        }
        for label, want in expect.items():
            assert out[label] == [want, want], (rank, label, out[label])


# --- guards ------------------------------------------------------------------------
def test_update_of_fsdp_parameter_inside_forward_is_refused(guards):
    for o in ranks(guards, "forward_update"):
        assert o["error"] is not None, "must be refused"
        assert "lin.weight" in o["error"] and "fully_shard" in o["error"] and "forward" in o["error"]
        assert o["unchanged"]


def test_commit_into_freed_memory_is_refused(guards):
    for o in ranks(guards, "storage"):
        assert o["error"] is not None and "1.running_mean" in o["error"] and "no memory" in o["error"], o
        assert o["unchanged"]


def test_rule_on_a_bare_tensor_declared_before_fully_shard_is_an_error(guards):
    for o in ranks(guards, "bare_rule_before_shard"):
        assert o["error"] is not None and "fully_shard" in o["error"] and "after fully_shard" in o["error"], o
        assert "test_fsdp2.py" in o["error"]  # the declaration's call site


def test_sync_on_a_sharded_target_is_refused(guards):
    for o in ranks(guards, "sync_sharded"):
        for where in ("step", "eager"):
            assert o[where] is not None and "2.weight" in o[where] and "Shard" in o[where], o[where]
        assert o["unchanged"]


def test_sync_over_the_replicated_mesh_dim_of_hsdp(guards):
    r0, r1 = ranks(guards, "hsdp_sync")
    assert "Replicate" in r0["placements"]
    for o in (r0, r1):
        assert torch.equal(o["in_step"], torch.full((5, 16), 1.5))  # mean of 1 and 2
        assert torch.equal(o["eager"], torch.full((5, 16), 1.5 * 2 + 3))  # sum over ranks of (1.5 + r + 1)


def test_fsdp1_is_refused_clearly(guards):
    for o in ranks(guards, "fsdp1"):
        for what, err in o.items():
            assert err is not None, f"{what} on an FSDP1 model must be refused"
            assert "FullyShardedDataParallel" in err and "fully_shard" in err, err


def test_fsdp2_example_runs_under_torchrun():
    """examples/fsdp2_train.py under torchrun (2 gloo ranks; see dist_harness.run_example_under_torchrun)."""
    from dist_harness import run_example_under_torchrun

    done = "weights and statistics identical on every rank"
    proc = run_example_under_torchrun("examples/fsdp2_train.py", done)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert done in proc.stdout and "tensors saved" in proc.stdout
    assert "weight_decay" in proc.stdout and "constrain:max_norm" in proc.stdout and "ema(decay=0.9)" in proc.stdout
