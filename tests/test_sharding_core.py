"""The core's side of sharding support, in one process: no DTensor needed."""

from __future__ import annotations

import torch
from torch import nn

import paramupdates as pu
from paramupdates import hooks, sharding


class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("empty", torch.zeros(0))
        self.register_buffer("full", torch.zeros(3))


def test_commit_with_an_empty_pending_value():
    """An empty pending value (as an empty local shard is) is finite by definition: the commit goes on.
    (torch._foreach_norm(ts, inf) refuses empty tensors.)"""
    m = WithEmpty()
    with pu.step(m):
        pu.assign(m.empty, torch.zeros(0))
        pu.assign(m.full, torch.ones(3))
    assert torch.equal(m.full, torch.ones(3))


def test_storage_ok_sees_freed_memory():
    t = torch.zeros(4, 3)
    assert sharding.storage_ok(t) and sharding.storage_ok(t[1:, 2]) and sharding.storage_ok(torch.zeros(0))
    t.untyped_storage().resize_(0)  # what FSDP's free_storage does to an unsharded parameter
    assert not sharding.storage_ok(t)


def test_plain_tensors_are_their_own_local_shards():
    ts = [torch.zeros(2), torch.ones(3)]
    assert sharding.locals_of(ts) is ts and sharding.local(ts[0]) is ts[0]
    assert not sharding.is_sharded(ts[0]) and not sharding.any_sharded(ts)


def test_hooks_register_and_remove():
    before = hooks.sharding_support()
    assert before is not None  # paramupdates registers the FSDP2 support on import
    mine = sharding.ShardingHooks()
    handle = hooks.register_sharding_support(mine)
    assert hooks.sharding_support() is mine
    handle.remove()
    assert hooks.sharding_support() is before
