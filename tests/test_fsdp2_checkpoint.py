"""Sharded checkpoints (``torch.distributed.checkpoint``) of an FSDP2 model with weight decay, a constraint
and an EMA: every rule's state travels, and resumes bitwise on 2 ranks and onto 1 rank (a plain model).

Two gloo ranks on 127.0.0.1 (``tests/dist_harness.py``). The model is
``Linear(8, 16) -> BatchNorm1d(16) -> Linear(16, 5) -> Linear(5, 1)`` with ``fully_shard`` on each Linear
and on the root (uneven and empty shards), its batch norm made update-safe with synced statistics (so
that its buffers, which DCP takes as replicated, are the same on both ranks), and ``pu.weight_decay``,
``pu.constrain(pu.max_norm)`` and ``pu.ema(warmup=...)`` (its decay follows the counter ``t``) declared
on the sharded model. Each rank trains 2 steps, saves ``{"model", "optim", "pu"}`` with ``dcp.save``
(``get_state_dict`` for the model and optimizer; the pu.Stepper or attachment itself for ``"pu"``, and the
EMA copy for ``"swa"``, which DCP loads after it: both as ``Stateful`` objects), trains 2 more; fresh objects load the checkpoint and train the same 2 steps.
Then this process loads the same checkpoint into the plain, unsharded model with the same declarations.
"""

from __future__ import annotations

import tempfile
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paramupdates as pu
from dist_harness import launch

from conftest import bits

pytestmark = pytest.mark.distributed

fsdp = pytest.importorskip("torch.distributed.fsdp")
dcp = pytest.importorskip("torch.distributed.checkpoint")
if not hasattr(fsdp, "fully_shard") or not dist.is_available():  # pragma: no cover - old torch
    pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) is not available", allow_module_level=True)


def _model(sharded: bool) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Linear(16, 5), nn.Linear(5, 1))
    m = pu.convert(m, sync_stats=sharded)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for i in (0, 2, 3):
            fsdp.fully_shard(m[i], mesh=mesh)
        fsdp.fully_shard(m, mesh=mesh)
    return m


def _setup(sharded: bool, driver: str):
    """The model, its optimizer, the rules and the stepper or attachment, made afresh."""
    pu.testing.reset()
    m = _model(sharded)
    pu.weight_decay(m, 0.1)
    pu.constrain(m, pu.max_norm(0.5))
    avg = pu.ema(m, 0.5, warmup=2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    owner = pu.attach(m, opt) if driver == "attach" else pu.Stepper(m, opt)
    return m, opt, avg, owner


def _train(m, opt, owner, rank: int, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(1000 * s + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
        opt.zero_grad()
        if isinstance(owner, pu.Stepper):
            with owner:
                nn.functional.mse_loss(m(x), y).backward()
        else:
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()


def _full(sd) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}


def _optimizer_full(m, opt) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
    return {f"{fqn}.{k}": v.detach().clone() for fqn, st in sd["state"].items() for k, v in st.items()}


def _state(m, opt, avg, owner) -> dict:
    """What must resume: the model, the EMA copy (full tensors), the optimizer state, the counters."""
    return {
        "model": _full(m.state_dict()),
        "ema": _full(avg.state_dict()),
        "opt": _optimizer_full(m, opt),
        "counters": (pu.rules.ema.rule_of(avg).updates, owner.steps, owner.skipped_steps),
    }


def run_checkpoints(rank: int, world: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    try:
        for driver in ("attach", "step"):
            path = f"{root}/{driver}"
            m, opt, avg, owner = _setup(True, driver)
            _train(m, opt, owner, rank, range(2))
            msd, osd = get_state_dict(m, opt)
            dcp.save({"model": msd, "optim": osd, "pu": owner, "swa": avg}, checkpoint_id=path)
            saved = _state(m, opt, avg, owner)
            _train(m, opt, owner, rank, range(2, 4))
            straight = _state(m, opt, avg, owner)

            m2, opt2, avg2, owner2 = _setup(True, driver)
            msd2, osd2 = get_state_dict(m2, opt2)
            loaded = {"model": msd2, "optim": osd2, "pu": owner2, "swa": avg2}
            dcp.load(loaded, checkpoint_id=path)
            set_state_dict(m2, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
            at_load = _state(m2, opt2, avg2, owner2)
            _train(m2, opt2, owner2, rank, range(2, 4))
            out[driver] = {
                "saved": saved,
                "at_load": at_load,
                "straight": straight,
                "resumed": _state(m2, opt2, avg2, owner2),
            }
    except Exception:
        out["error"] = traceback.format_exc()
    return out


def _assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])), f"{what}: {k}"


def _assert_same_state(a: dict, b: dict, what: str) -> None:
    for part in ("model", "ema", "opt"):
        _assert_bitwise(a[part], b[part], f"{what} {part}")
    assert a["counters"] == b["counters"], what


@pytest.fixture(scope="module")
def checkpoints():
    root = tempfile.mkdtemp(prefix="pu-dcp-")
    return root, launch(run_checkpoints, root, timeout=150.0, pg_timeout=30.0, hard_exit=True)


@pytest.mark.parametrize("driver", ["attach", "step"])
def test_a_sharded_checkpoint_resumes_bitwise_on_two_ranks(checkpoints, driver):
    """Saved with ``dcp.save`` (the attachment or Stepper as a ``Stateful``, beside ``get_state_dict``'s
    model and optimizer), loaded into fresh objects on both ranks: the model, the EMA copy, the optimizer
    state and the counters (``t`` of the warmup included: it travels as a plain entry of the attachment's
    state, where DCP drops the copy's state_dict metadata; the copy, loaded after it, keeps it) are bitwise
    those saved, and 2 more steps end bitwise where training straight through ended. (Before, the copy
    took back the t of the state_dict DCP had it make before the load: 0.)"""
    _root, ranks = checkpoints
    for rank, out in enumerate(ranks):
        assert "error" not in out, out.get("error")
        run = out[driver]
        _assert_same_state(run["saved"], run["at_load"], f"rank {rank} at load")
        assert run["at_load"]["counters"] == (2, 2, 0)
        _assert_same_state(run["straight"], run["resumed"], f"rank {rank} resumed")


@pytest.mark.parametrize("driver", ["attach", "step"])
def test_a_sharded_checkpoint_loads_onto_one_rank_with_the_ema_and_its_counter(checkpoints, driver):
    """The checkpoint of 2 ranks loads into the plain model (one process, no process group) with the same
    declarations: the model, the EMA copy (whole tensors) and its counter, and the step counters are those
    saved; the copy's state_dict loads strictly into the model."""
    root, ranks = checkpoints
    saved = ranks[0][driver]["saved"]
    m, opt, avg, owner = _setup(False, driver)
    loaded = {"model": m.state_dict(), "pu": owner, "swa": avg}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # (DCP: one process)
        dcp.load(loaded, checkpoint_id=f"{root}/{driver}")
    m.load_state_dict(loaded["model"])
    _assert_bitwise(saved["model"], _full(m.state_dict()), "model")
    _assert_bitwise(saved["ema"], _full(avg.state_dict()), "ema")
    assert (pu.rules.ema.rule_of(avg).updates, owner.steps, owner.skipped_steps) == saved["counters"] == (2, 2, 0)
    m.load_state_dict(avg.state_dict())  # strict
