"""Steps are per thread (docs/guarantees.md, "Misuse and lifecycle"): what a thread has in progress is its own;
a checkpointed segment recomputed in another thread replays through the steps live when its forward ran."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import paramupdates as pu
from misuse_helpers import BNNet
from misuse_helpers import in_thread as _in_thread
from test_checkpoint import assert_recomputation_changes_nothing

from conftest import assert_same, snapshot


def _train(model, xs, barrier=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in xs:
        opt.zero_grad()
        with pu.step(model, opt):
            model(x).square().sum().backward()
            if barrier is not None:
                barrier.wait(timeout=30)  # both threads are inside their steps here
    return model


def test_two_threads_step_two_models():
    xs = [torch.randn(8, 4) for _ in range(4)]
    torch.manual_seed(1)
    a, b = BNNet(), BNNet()
    ref_a, ref_b = BNNet(), BNNet()
    ref_a.load_state_dict(a.state_dict())
    ref_b.load_state_dict(b.state_dict())
    _train(ref_a, xs)
    _train(ref_b, xs[::-1])
    barrier = threading.Barrier(2)
    errors = []

    def worker(m, data):
        try:
            _train(m, data, barrier)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(a, xs)), threading.Thread(target=worker, args=(b, xs[::-1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert_same(snapshot(a), snapshot(ref_a))
    assert_same(snapshot(b), snapshot(ref_b))
    assert int(a.calls) == 4 and int(b.bn.num_batches_tracked) == 4


def test_eager_update_in_another_thread_is_unaffected_by_a_step():
    stepped, other = BNNet(), BNNet()
    before = snapshot(other)
    stored = stepped.calls
    with pu.step(stepped):
        stepped(torch.randn(8, 4))  # this thread's step has pending updates of `stepped`
        _in_thread(other, torch.randn(8, 4))  # an eager forward of another model, in another thread
        assert int(other.calls) == 1 and int(other.bn.num_batches_tracked) == 1  # applied at once
        assert int(stored) == 0 and int(stepped.calls) == 1  # stored and pending: the step is still open
    assert int(stepped.calls) == 1
    after = dict(snapshot(other))
    assert not torch.equal(dict(before)["bn.running_mean"], after["bn.running_mean"])


def test_eager_update_in_another_thread_ignores_this_threads_when():
    m = BNNet()
    with pu.when(False):
        _in_thread(pu.assign_add, m.calls, 5)
        pu.assign_add(m.calls, 1)  # this thread: dropped
    assert int(m.calls) == 5


def test_a_step_in_another_thread_does_not_nest():
    a, b = BNNet(), BNNet()
    with pu.step(a):
        pu.assign_add(a.calls, 1)
        _in_thread(lambda: [pu.step(b).__enter__(), pu.assign_add(b.calls, 2), None][-1])
        # the other thread's step is its own: not "nested", not seen here
        assert int(pu.read(a.calls)) == 1
    assert int(a.calls) == 1


@pytest.mark.parametrize("use_attach", [False, True])
def test_recomputation_in_another_thread_replays(use_attach):
    """Autograd recomputes checkpointed segments in its device threads on accelerators: here
    backward runs in another thread (on CPU, autograd runs it in the calling thread)."""
    assert_recomputation_changes_nothing(use_attach, lambda loss: _in_thread(loss.backward))


def test_running_stats_recomputed_in_another_thread_equal_no_checkpoint():
    class Seg(nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.net = BNNet()
            self.ckpt = ckpt

        def forward(self, x):
            return self.ckpt(self.net, x) if self.ckpt else self.net(x)

    xs = [torch.randn(8, 4) for _ in range(3)]
    torch.manual_seed(2)
    plain, ckpt = Seg(None), Seg(pu.checkpoint)
    ckpt.load_state_dict(plain.state_dict())
    for m in (plain, ckpt):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x in xs:
            opt.zero_grad()
            with pu.step(m, opt):
                loss = m(x).square().sum()
                _in_thread(loss.backward)
    assert_same(snapshot(plain), snapshot(ckpt))
    assert int(ckpt.net.calls) == 3


@pytest.mark.compile
def test_a_compiled_forward_records_into_the_calling_threads_step():
    """Row 7 under torch.compile: the step a traced forward records into is the calling thread's (the
    thread-local state is read by the graph's guards, per thread), with one compilation."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    m, ref = BNNet(), BNNet()
    ref.load_state_dict(m.state_dict())
    cc = CompileCounterWithBackend("eager")
    fwd = torch.compile(m, fullgraph=True, backend=cc)
    xs = [torch.randn(8, 4) for _ in range(4)]

    def step(f, model, x):
        with pu.step(model):
            f(x)
        return int(model.calls)

    for i, x in enumerate(xs):
        (step if i % 2 == 0 else lambda *a: _in_thread(step, *a))(fwd, m, x)  # this thread, then another
        step(ref, ref, x)
    assert_same(snapshot(ref), snapshot(m))
    assert cc.frame_count == 1
    # an eager forward of the compiled model in another thread while this thread has a step open
    other = BNNet()
    with pu.step(other):
        _in_thread(fwd, xs[0])  # no step in that thread: eager, in place
        assert int(m.calls) == 5
    assert cc.frame_count <= 2  # (in place, outside a step: one graph more at most)
