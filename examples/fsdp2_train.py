"""Sharded training (FSDP2, ``fully_shard``) with weight decay, a max-norm constraint, EMA and synced BN statistics.

Run on CPU (gloo), two processes:

    torchrun --nproc_per_node=2 examples/fsdp2_train.py

``fully_shard`` replaces every parameter by a DTensor: each rank holds a
``Shard(0)`` of it (here ``2.weight``, 5 x 16, is split 3 + 2 rows, and
``3.weight``, 1 x 5, leaves rank 1 an empty shard). paramupdates applies every
rule to the shards:

* ``pu.weight_decay(model, 0.05)``: ``p <- p * (1 - lr * 0.05)`` on each local
  shard, before the optimizer step (no communication);
* ``pu.constrain(model[2], pu.max_norm(1.0, dim=None))``: the norm of each whole
  tensor; each rank sums the squares of its shard, one all-reduce per commit
  adds them up, each rank rescales its shard;
* ``pu.constrain(model[0], pu.max_norm(2.0))`` (``dim=0``: one norm per row, and
  rows are not split by ``Shard(0)``): local, no communication;
* ``pu.ema(model, 0.9)``: a copy sharded like the model; each rank averages its
  own shards. ``averaged(x)`` evaluates it (FSDP all-gathers it in forward, so
  every rank calls it) and ``averaged.state_dict()`` saves it (DTensors);
* ``pu.convert(model, sync_stats=True)``: the batch norm's running statistics
  (plain buffers, not sharded) are averaged over the ranks at every commit.

Declare the rules after ``fully_shard`` (or on modules, which follow their
parameters by name). The script checks that every rank holds the same full
weights and statistics, evaluates the EMA copy, and prints the step's plan.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import paramupdates as pu


def main() -> None:
    # A timeout on every collective: a rank that dies or hangs makes the others raise, not wait forever.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Linear(16, 5), nn.Linear(5, 1))
    pu.convert(model, sync_stats=True)  # BN statistics through pu.assign(..., sync="mean")
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # the optimizer steps the DTensor shards
    pu.weight_decay(model, 0.05)
    pu.constrain(model[0], pu.max_norm(2.0))  # dim=0: rows, local to each shard
    pu.constrain(model[2], pu.max_norm(1.0, dim=None))  # whole-tensor norms: one all-reduce per commit
    averaged = pu.ema(model, 0.9)
    att = pu.attach(model, opt, sync_timeout=30.0)  # commits inside opt.step(); an unchanged loop

    g = torch.Generator().manual_seed(1 + rank)  # every rank its own data
    for _ in range(10):
        x = torch.randn(16, 8, generator=g) + rank
        y = x.sum(dim=1, keepdim=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t  # an all-gather for a DTensor

    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        whole = full(t.detach())
        copies = [torch.empty_like(whole) for _ in range(world)]
        dist.all_gather(copies, whole)
        assert all(torch.equal(c, whole) for c in copies), f"{name} differs between ranks"
    norm2 = full(model[2].weight.detach()).norm().item()
    assert norm2 <= 1.0 + 1e-5, norm2
    assert full(model[0].weight.detach()).norm(dim=1).max().item() <= 2.0 + 1e-5
    with torch.no_grad():
        ema_out = averaged(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))  # every rank evaluates
    saved = {k: full(v) for k, v in averaged.state_dict().items()}
    if rank == 0:
        print(att.schedule())
        print(
            f"{att.steps} steps on {world} ranks; weights and statistics identical on every rank; "
            f"|2.weight| = {norm2:.4f} <= 1"
        )
        print(f"EMA copy: output {[round(v, 4) for v in ema_out.flatten().tolist()]}, {len(saved)} tensors saved")
    att.detach()
    del att, opt
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
