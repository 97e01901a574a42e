"""Launch a function on 2 gloo processes on 127.0.0.1 and collect what each rank returns.

``launch(fn, *args)`` spawns ``world`` processes with ``torch.multiprocessing``
(start method ``spawn``), each running ``fn(rank, world, *args)`` after
``init_process_group("gloo")`` at ``MASTER_ADDR=127.0.0.1`` and a free port,
and returns the list of the ranks' return values (saved with ``torch.save``).
Everything is bounded in time: the process group's timeout (``pg_timeout``)
bounds every collective, and the whole launch is killed after ``timeout``
seconds (the test then fails instead of hanging CI).
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import reset_pu

WORLD = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    outdir: str,
    pg_timeout: float,
    hard_exit: bool,
    init_group: bool,
    args: tuple,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # 2 processes on a shared CPU; also makes reductions deterministic
    if init_group:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))
    else:  # fn initialises it, as torchrun's processes do (env://)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    reset_pu()
    out = fn(rank, world, *args)
    path = os.path.join(outdir, f"rank{rank}.pt")
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)
    if hard_exit:
        # After a collective timed out the group cannot be destroyed cleanly.
        os._exit(0)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world: int = WORLD,
    timeout: float = 90.0,
    pg_timeout: float = 30.0,
    hard_exit: bool = False,
    init_group: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; the ranks' results, in rank order.

    ``init_group=False``: ``fn`` initialises the process group itself from the environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as torchrun
    sets them), e.g. RETURNN's Engine with ``torch_distributed``; its own timeout then bounds the collectives."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world, free_port(), outdir, pg_timeout, hard_exit, init_group, args),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed test {fn.__name__} did not finish within {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def run_example_under_torchrun(script: str, done: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 <script>`` (gloo, 127.0.0.1) from the repository root.

    Retried (at most twice) only on torch's own abort at interpreter exit: with torch 2.13 and gloo, a
    plain DDP script with no paramupdates in it (init, 10 DDP steps, barrier, destroy_process_group)
    ends with "terminate called without an active exception" (SIGABRT) after main() has returned, in
    2-4 of 25 runs on a loaded 2-core machine; ``done`` (what the script prints when it finished)
    tells that abort from a real failure. Any other failure, or that one three times in a row, is returned.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for _attempt in range(3):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            script,
        ]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
        exit_abort = "terminate called without an active exception" in proc.stdout + proc.stderr and done in proc.stdout
        if proc.returncode == 0 or not exit_abort:
            break
    return proc
