"""Cost of synced statistics on 2 gloo ranks (CPU), side by side in one run.

    python benchmarks/distributed_sync.py [--layers 32] [--channels 256] [--iters 200]

Each step updates the running mean and variance (float32) and the batch count
(int64) of ``--layers`` batch-norm-like layers and makes them equal on both
ranks, three ways:

* ``per-tensor``: hand-written eager code, one ``all_reduce`` per buffer (what
  a loop over ``model.buffers()`` does), then in-place writes;
* ``bucketed``:   hand-written eager code, one flattened ``all_reduce`` per
  dtype (the floor for this work);
* ``pu``:         ``pu.assign(..., sync="mean")`` inside ``pu.step``, i.e.
  recording, the overlay, the commit with its finiteness check and its one
  bucketed ``all_reduce`` per dtype (default settings: no rollback copy);
* ``pu no sync``: the same without ``sync`` (ranks diverge; it isolates
  what recording and committing cost from what syncing costs).

Prints the median step time of each and the ratios (rank 0). No goal: it shows
what syncing costs and what bucketing saves. Not part of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import paramupdates as pu


class Stats(nn.Module):
    def __init__(self, layers: int, channels: int) -> None:
        super().__init__()
        for i in range(layers):
            m = nn.Module()
            m.register_buffer("running_mean", torch.zeros(channels))
            m.register_buffer("running_var", torch.ones(channels))
            m.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))
            self.add_module(f"bn{i}", m)


def _median_ms(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _worker(rank: int, port: int, layers: int, channels: int, iters: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    model = Stats(layers, channels)
    mods = [m for m in model.children()]
    g = torch.Generator().manual_seed(rank)
    means = [torch.randn(channels, generator=g) for _ in mods]
    vars_ = [torch.rand(channels, generator=g) for _ in mods]
    m = 0.1

    def per_tensor() -> None:
        for bn, mu, var in zip(mods, means, vars_):
            new_m = (1 - m) * bn.running_mean + m * mu
            new_v = (1 - m) * bn.running_var + m * var
            cnt = bn.num_batches_tracked + 1
            for t in (new_m, new_v, cnt):
                dist.all_reduce(t)
            bn.running_mean.copy_(new_m / world)
            bn.running_var.copy_(new_v / world)
            bn.num_batches_tracked.copy_(torch.div(cnt, world, rounding_mode="floor"))

    def bucketed() -> None:
        new_m = [(1 - m) * bn.running_mean + m * mu for bn, mu in zip(mods, means)]
        new_v = [(1 - m) * bn.running_var + m * var for bn, var in zip(mods, vars_)]
        cnt = torch.stack([bn.num_batches_tracked + 1 for bn in mods])
        flat = torch.cat(new_m + new_v)
        w1, w2 = dist.all_reduce(flat, async_op=True), dist.all_reduce(cnt, async_op=True)
        w1.wait()
        w2.wait()
        flat.div_(world)
        dst = [bn.running_mean for bn in mods] + [bn.running_var for bn in mods]
        torch._foreach_copy_(dst, list(flat.split([t.numel() for t in dst])))
        torch._foreach_copy_(
            [bn.num_batches_tracked for bn in mods], list(torch.div(cnt, world, rounding_mode="floor"))
        )

    stepper = pu.Stepper(model)

    def with_pu(sync: str | None = "mean") -> None:
        with stepper:
            for bn, mu, var in zip(mods, means, vars_):
                pu.assign(bn.running_mean, (1 - m) * bn.running_mean + m * mu, sync=sync)
                pu.assign(bn.running_var, (1 - m) * bn.running_var + m * var, sync=sync)
                pu.assign_add(bn.num_batches_tracked, 1, sync=sync)

    runs = (
        ("per-tensor", per_tensor),
        ("bucketed", bucketed),
        ("pu", with_pu),
        ("pu no sync", lambda: with_pu(None)),
    )
    rows = [(name, _median_ms(fn, iters)) for name, fn in runs]
    if rank == 0:
        base = dict(rows)["bucketed"]
        print(f"{layers} layers x 3 buffers ({channels} channels), 2 gloo ranks, median of {iters} steps")
        for name, ms in rows:
            print(f"  {name:<11} {ms:8.3f} ms/step   {ms / base:5.2f}x bucketed")
        t = dict(rows)
        print(f"  pu vs per-tensor: {t['per-tensor'] / t['pu']:.2f}x faster")
        print(f"  cost of sync inside pu (pu - pu no sync): {t['pu'] - t['pu no sync']:.3f} ms/step")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--channels", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, a.layers, a.channels, a.iters), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
