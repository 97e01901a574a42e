"""paramupdates.returnn under RETURNN's own distributed training: ``torch_distributed`` (DDP), 2 gloo ranks.

Each rank runs RETURNN's ``Engine`` from a config, as ``torchrun`` would start it: RETURNN initialises
the process group itself (``returnn/torch/distributed.py``, ``init_process_group`` from the environment)
and wraps the model in ``DistributedDataParallel``; ``"dataset_distribution": "shard"`` gives every rank
its own half of the Task12AX sequences. One launch runs, in each rank:

* ``plain``: RETURNN without the bridge (DDP's default: buffers broadcast from rank 0 at every forward);
* ``synced``: the bridge, ``pur.optimizer``, the train step under ``pur.sync("mean")``, and
  ``"options": {"forward_sync_buffers": False}`` (docs/distributed.md: a synced buffer needs a DDP that
  does not broadcast buffers);
* ``broadcast``: the same with DDP's default options, which the bridge refuses with RETURNN's fix.

The single-process reference (RETURNN without the bridge, in the test process) replays every step: from
the state the ranks shared before the step, each rank's recorded batch gives that rank's statistics
``v_r``; docs/distributed.md's rule says the committed value is ``(v_0 + v_1) / 2`` (integers floored).
"""

from __future__ import annotations

import inspect
import os
import tempfile
import traceback
from typing import Any

import pytest
import torch

pytest.importorskip("returnn")
pytest.importorskip("tree")

import returnn.frontend as rf  # noqa: E402
from returnn.config import Config, global_config_ctx  # noqa: E402
from returnn.datasets import init_dataset  # noqa: E402
from returnn.datasets.basic import Dataset  # noqa: E402
from returnn.tensor import TensorDict, batch_dim  # noqa: E402
from returnn.torch.data.extern_data import raw_dict_to_extern_data  # noqa: E402
from returnn.torch.engine import Engine  # noqa: E402
from returnn.torch.frontend.bridge import rf_module_to_pt_module  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import paramupdates.returnn as pur  # noqa: E402
from dist_harness import launch  # noqa: E402
from test_returnn import _E_IN, _E_OUT, _E_TIME, EngineModel, engine_train_step  # noqa: E402

from conftest import bits  # noqa: E402

pytestmark = pytest.mark.distributed

EXTERN_DATA = {
    "data": {"dims": [batch_dim, _E_TIME, _E_IN], "dtype": "float32"},
    "classes": {"dims": [batch_dim, _E_TIME], "sparse_dim": _E_OUT, "dtype": "int32"},
}
NO_BROADCAST = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else {"broadcast_buffers": False}
)
AUX = ("bn_in.running_mean", "bn_in.running_variance", "bn.running_mean", "bn.running_variance", "count", "x_mean")


class SyncModel(EngineModel):
    """test_returnn's Engine model (a fused and a masked batch norm, an integer counter) plus an auxiliary
    float parameter that the forward ``assign``\\ s: an average of the input features."""

    def __init__(self):
        super().__init__("none")
        self.x_mean = rf.Parameter([_E_IN], auxiliary=True)
        self.x_mean.initial = 0.0

    def __call__(self, x):
        self.x_mean.assign(0.5 * self.x_mean + 0.5 * rf.reduce_mean(x, axis=x.remaining_dims(_E_IN)))
        return super().__call__(x)


def get_model(**_kwargs: Any) -> SyncModel:
    return SyncModel()


class TrainStep:
    """The config's train_step: records the batch, and runs the step under ``pur.sync(sync)``."""

    def __init__(self, sync: str | None, batches: list[dict[str, Any]]):
        self.sync, self.batches = sync, batches

    def __call__(self, *, model: SyncModel, extern_data: TensorDict, **_kwargs: Any) -> None:
        raw = extern_data.as_raw_tensor_dict()
        self.batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in raw.items()})
        if self.sync is None:
            engine_train_step(model=model, extern_data=extern_data)
            return
        with pur.sync(self.sync):
            engine_train_step(model=model, extern_data=extern_data)


def _state(pt: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pt.state_dict().items()}


def _engine_run(rank: int, model_dir: str, *, on: bool, ddp_options: dict[str, Any]) -> dict[str, Any]:
    """One epoch of RETURNN's Engine on this rank: the state before every step and after the last, and the
    batches. RETURNN keeps one distributed context per process (made from the first config's
    torch_distributed); it is made again for each run, so that each run's DDP options apply (the process
    group stays: RETURNN's own path for a process whose group exists, _RETURNN_TORCH_DISTRIBUTED_INIT_INFO)."""
    import returnn.torch.distributed as rtd

    rtd._is_set_up, rtd._ctx = False, None
    if on:
        pur.enable()
    states: list[dict[str, torch.Tensor]] = []
    batches: list[dict[str, Any]] = []
    try:
        config = Config(
            dict(
                task="train",
                device="cpu",
                num_epochs=1,
                model=os.path.join(model_dir, "model"),
                random_seed=1,
                learning_rate=0.01,
                batch_size=300,
                torch_dataloader_opts={"num_workers": 0},
                torch_distributed={
                    "backend": "gloo",
                    "timeout_sec": 60,
                    "dataset_distribution": "shard",
                    "options": ddp_options,
                },
                extern_data=EXTERN_DATA,
                get_model=get_model,
                train_step=TrainStep("mean" if on else None, batches),
                optimizer=pur.optimizer({"class": "adam"}) if on else {"class": "adam"},
                **({"epoch_end": pur.epoch_end} if on else {}),
            )
        )
        with global_config_ctx(config):
            dataset = init_dataset(
                {"class": "Task12AXDataset", "num_seqs": 24, "name": "train", "fixed_random_seed": 1},
                default_kwargs=Dataset.get_default_kwargs_train(config),
            )
            dataset.init_seq_order(epoch=1)
            engine = Engine(config=config)
            engine.init_train_from_config(train_data=dataset)
            pt = engine.get_pt_model()
            states.append(_state(pt))
            # after the attachment's post-hook (registered when the optimizer was made): the committed state
            engine.get_pt_optimizer().register_step_post_hook(lambda *_: states.append(_state(pt)))
            engine.train()
        att = pur.attachment(engine)
        if att is not None:
            att.detach()
        engine.finalize()
        return {"states": states, "batches": batches}
    finally:
        pur.disable()
        for d in (_E_TIME, batch_dim):
            d.reset_eager()


def run_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, on, options in (("plain", False, {}), ("synced", True, NO_BROADCAST), ("broadcast", True, {})):
        try:
            out[name] = _engine_run(rank, os.path.join(root, f"{name}-{rank}"), on=on, ddp_options=options)
        except Exception as e:  # noqa: BLE001 - reported to the test, which checks what it expects
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        return launch(run_ranks, d, init_group=False, timeout=240.0)


def _ok(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    for rank, r in enumerate(results):
        if "error" in r[name]:
            pytest.fail(f"rank {rank}, run {name!r}: {r[name]['traceback']}")
    return [r[name] for r in results]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: Any = None) -> bool:
    keys = a.keys() if keys is None else keys
    return all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in keys)


def _rank_update(state: dict[str, torch.Tensor], batch: dict[str, Any], step: int) -> dict[str, torch.Tensor]:
    """RETURNN without the bridge, one process: the model in ``state``, one train-step forward on ``batch``;
    its auxiliary state after (what that rank's step alone writes)."""
    rf.select_backend_torch()
    model = SyncModel()
    pt = rf_module_to_pt_module(model)
    pt.load_state_dict(state)
    template = TensorDict()
    template.update(EXTERN_DATA, auto_convert=True)
    # as the Engine makes it from the data loader's batch (data, data:seq_len, ...)
    loader_batch = {k: batch[k] for k in EXTERN_DATA} | {f"{k}:seq_len": batch[f"{k}:size1"] for k in EXTERN_DATA}
    extern_data = raw_dict_to_extern_data(loader_batch, extern_data_template=template, device="cpu")
    rf.init_train_step_run_ctx(train_flag=True, step=step, epoch=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks ran (dist_harness): the same reduction order in the matmuls
    try:
        engine_train_step(model=model, extern_data=extern_data)
    finally:
        torch.set_num_threads(threads)
        for d in (_E_TIME, batch_dim):
            d.reset_eager()
    return {k: v.detach().clone() for k, v in pt.state_dict().items() if k in AUX}


def _mean_of_ranks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """docs/distributed.md's sync="mean" of two ranks' values: (v_0 + v_1) / 2, integers floored."""
    if a.is_floating_point():
        return (a + b) / 2
    return torch.div(a + b, 2, rounding_mode="floor")


def test_engine_ddp_synced_statistics_equal_mean_of_rank_updates(results):
    """Bridge + pur.sync("mean") under RETURNN's DDP: after every step both ranks hold bitwise the same
    statistics, counter and assigned parameter, and they are the mean of the two ranks' own updates from
    the shared state (the single-process reference, RETURNN without the bridge); the counter counts steps."""
    r0, r1 = _ok(results, "synced")
    n = len(r0["batches"])
    assert n >= 3 and len(r1["batches"]) == n and len(r0["states"]) == len(r1["states"]) == n + 1
    assert r0["batches"][0]["data"].shape != r1["batches"][0]["data"].shape or not torch.equal(
        r0["batches"][0]["data"], r1["batches"][0]["data"]
    ), "the ranks must see different data (dataset_distribution: shard)"
    for s in range(n):
        before = r0["states"][s]
        assert _equal(before, r1["states"][s]), f"the ranks differ before step {s}"
        v0 = _rank_update(before, r0["batches"][s], s)
        v1 = _rank_update(before, r1["batches"][s], s)
        assert not _equal(v0, v1), f"step {s}: the two ranks' own updates should differ"
        after = r0["states"][s + 1]
        for k in AUX:
            want = _mean_of_ranks(v0[k], v1[k])
            assert after[k].dtype == want.dtype and torch.equal(bits(after[k]), bits(want)), f"step {s}: {k}"
        assert _equal(after, r1["states"][s + 1]), f"the ranks differ after step {s}"
    assert r0["states"][-1]["count"].item() == n


def test_engine_ddp_parameters_are_returnns_and_plain_ddp_keeps_rank0_statistics(results):
    """The trainable parameters with the bridge are bitwise those of RETURNN's DDP without it, step by step
    (DDP averages the gradients either way; batch norm in training reads no running statistics). Without
    the bridge, DDP's buffer broadcast makes every step start from rank 0's statistics: rank 0's are its own
    updates of its own data alone (rank 1's are lost), and the saved model's (rank 0's) differ from the
    synced mean."""
    s0, _s1 = _ok(results, "synced")
    p0, p1 = _ok(results, "plain")
    n = len(p0["batches"])
    assert len(p0["states"]) == len(s0["states"]) == n + 1
    trainable = [k for k in s0["states"][0] if k not in AUX]
    assert "lin.weight" in trainable and "bn.gamma" in trainable
    for s, (ours, plain, plain1) in enumerate(zip(s0["states"], p0["states"], p1["states"])):
        assert _equal(ours, plain, trainable), f"parameters differ from RETURNN's DDP before step {s}"
        assert _equal(plain, plain1, trainable)
    for s in range(n):
        before = p0["states"][s]  # what DDP broadcasts at the start of step s's forward
        assert _equal(p0["states"][s + 1], _rank_update(before, p0["batches"][s], s), AUX), f"rank 0, step {s}"
        assert _equal(p1["states"][s + 1], _rank_update(before, p1["batches"][s], s), AUX), f"rank 1, step {s}"
    for k in ("bn_in.running_mean", "bn.running_variance", "x_mean"):
        assert not torch.equal(p0["states"][-1][k], s0["states"][-1][k]), k


def test_engine_ddp_broadcasting_buffers_refused_with_returnns_fix(results):
    """RETURNN's torch_distributed default (DDP broadcasts buffers; rf's auxiliary parameters are buffers of
    the torch module) with a synced update: refused on every rank, naming the target and RETURNN's option."""
    for r in results:
        err = r["broadcast"].get("error", "")
        assert err.startswith("UpdateError"), r["broadcast"]
        assert "sync='mean'" in err and "broadcasts buffers" in err
        assert "torch_distributed = {'options': {'forward_sync_buffers': False}}" in err
        assert "'bn_in.running_mean'" in err or "'x_mean'" in err
