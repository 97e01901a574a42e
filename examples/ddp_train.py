"""Data-parallel training whose batch-norm statistics are synced, not lost.

Run on CPU (gloo), two processes:

    torchrun --nproc_per_node=2 examples/ddp_train.py

Each rank sees its own data (rank 1's inputs are shifted by +1). With plain
``torch.nn.BatchNorm2d`` under ``DistributedDataParallel`` (whose
``broadcast_buffers=True`` default copies rank 0's buffers into every rank
at each forward), rank 1's statistics would never count. Here
``pu.nn.BatchNorm2d(sync_stats=True)`` commits its running statistics with
``sync="mean"``: at the end of every step (after both micro-batches) each
rank's update is averaged over the ranks, in one all-reduce, and every rank
writes the same value,
``running <- (1 - m) * running + m * mean_r(batch statistic of rank r)``.
The script checks that, and prints the step's plan.
"""

from __future__ import annotations

import datetime
import inspect
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import paramupdates as pu


def no_buffer_broadcast() -> dict[str, bool]:
    """DDP's switch for buffer broadcasting in forward (renamed in torch 2.13)."""
    params = inspect.signature(DDP.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def main() -> None:
    # A timeout on every collective: a rank that dies or hangs makes the others raise, not wait forever.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        pu.nn.BatchNorm2d(8, sync_stats=True),  # running statistics committed with sync="mean"
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    ddp = DDP(model, **no_buffer_broadcast())  # pu syncs the statistics; DDP must not overwrite them
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    stepper = pu.Stepper(ddp, opt, sync_timeout=30.0)

    g = torch.Generator().manual_seed(1 + rank)  # every rank its own data
    accumulate = 2
    for _ in range(10):
        with stepper:  # one commit per optimizer step, after all micro-batches
            for micro in range(accumulate):
                with ddp.no_sync() if micro < accumulate - 1 else nullcontext():
                    x = torch.randn(16, 3, 8, 8, generator=g) + rank
                    y = torch.randint(0, 10, (16,), generator=g)
                    (F.cross_entropy(ddp(x), y) / accumulate).backward()
        opt.zero_grad()

    bn = model[1]
    for name, t in (("running_mean", bn.running_mean), ("running_var", bn.running_var), ("weight", model[0].weight)):
        copies = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(copies, t)
        assert all(torch.equal(c, t) for c in copies), f"{name} differs between ranks"
    if rank == 0:
        print(stepper.schedule())
        print(f"{stepper.steps} steps on {world} ranks; statistics and weights identical on every rank")
        print("running_mean", [round(v, 4) for v in bn.running_mean.tolist()])
    # Tear down in order: DDP (its reducer's threads) before the process group, then leave together;
    # otherwise gloo aborts a rank at exit now and then ("terminate called without an active exception").
    del stepper, opt, ddp
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
