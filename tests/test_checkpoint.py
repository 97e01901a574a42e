"""Rule 3: recomputation replays, never re-issues (pu.checkpoint vs torch.utils.checkpoint)."""

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import paramupdates as pu

from conftest import assert_same, bits, snapshot


class Block(nn.Module):
    def __init__(self, bn_cls):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = bn_cls(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self, bn_cls=pu.nn.BatchNorm2d, ckpt=None):
        super().__init__()
        self.block = Block(bn_cls)
        self.head = nn.Linear(4, 2)
        self.ckpt = ckpt

    def forward(self, x):
        h = self.block(x) if self.ckpt is None else self.ckpt(self.block, x)
        return self.head(h.mean((2, 3)))


def _train(model, xs, stepped):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in xs:
        opt.zero_grad()
        if stepped:
            with pu.step(model, opt):
                model(x).square().sum().backward()
        else:
            model(x).square().sum().backward()
            opt.step()
    return model


def _same_init(*models):
    sd = models[0].state_dict()
    for m in models[1:]:
        m.load_state_dict(sd)


def test_running_stats_under_pu_checkpoint_equal_no_checkpoint_bitwise():
    xs = [torch.randn(4, 3, 5, 5) for _ in range(3)]
    plain, ckpt = Net(), Net(ckpt=pu.checkpoint)
    _same_init(plain, ckpt)
    _train(plain, xs, stepped=True)
    _train(ckpt, xs, stepped=True)
    assert_same(snapshot(plain), snapshot(ckpt))  # weights, grads' effect, running stats, counters
    assert int(ckpt.block.bn.num_batches_tracked) == 3


def test_torch_batchnorm_under_torch_checkpoint_updates_twice():
    """The contrast (pytorch/pytorch#96136): plain PyTorch counts every batch twice."""
    xs = [torch.randn(4, 3, 5, 5) for _ in range(3)]
    plain = Net(nn.BatchNorm2d)
    ckpt = Net(nn.BatchNorm2d, ckpt=lambda f, x: torch_checkpoint(f, x, use_reentrant=False))
    _same_init(plain, ckpt)
    _train(plain, xs, stepped=False)
    _train(ckpt, xs, stepped=False)
    assert int(plain.block.bn.num_batches_tracked) == 3
    assert int(ckpt.block.bn.num_batches_tracked) == 6  # doubled
    assert not torch.equal(plain.block.bn.running_mean, ckpt.block.bn.running_mean)
    # ... while pu batch norm under pu.checkpoint equals the torch run without checkpointing
    fixed = Net(ckpt=pu.checkpoint)
    ref = Net(nn.BatchNorm2d)
    _same_init(ref, fixed)
    _train(ref, xs, stepped=False)
    _train(fixed, xs, stepped=True)
    assert_same(snapshot(ref), snapshot(fixed))


def test_pu_checkpoint_outside_a_step_applies_once():
    """Eager (eager outside a step, rule 8) plus replay (rule 3): with no step, the forward applies, the recomputation drops."""
    xs = [torch.randn(4, 3, 5, 5) for _ in range(2)]
    ref, ckpt = Net(nn.BatchNorm2d), Net(ckpt=pu.checkpoint)
    _same_init(ref, ckpt)
    _train(ref, xs, stepped=False)
    _train(ckpt, xs, stepped=False)
    assert int(ckpt.block.bn.num_batches_tracked) == 2
    assert_same(snapshot(ref), snapshot(ckpt))


class ReadAfterWrite(nn.Module):
    """A segment that reads its targets after updating them, several times."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))
        self.scale = pu.Parameter(torch.ones(3), auxiliary=True)
        self.gain = pu.Parameter(torch.full((3,), 0.5))  # trainable, updated after the gradient step
        self.register_buffer("acc", torch.zeros(3))

    def segment(self, x):
        h = x @ self.w
        for _ in range(2):
            self.scale.assign(self.scale * 0.9 + h.detach().abs().mean(0) * 0.1)
            pu.assign_add(self.acc, h.detach().mean(0))
            h = h * self.scale + self.acc
        self.gain.assign(self.gain * 1.5, phase="after_grad")
        return h * self.gain  # reads the pending gain: gradient flows to gain through the update

    def forward(self, x, ckpt):
        self.scale.assign(self.scale + 1.0)  # before the segment: the entry value differs from the committed one
        h = ckpt(self.segment, x) if ckpt else self.segment(x)
        self.scale.assign(self.scale * 2.0)  # after the segment: the recomputation must not see it
        pu.assign_add(self.acc, 1.0)
        return (h * self.scale).sum()


def assert_recomputation_changes_nothing(use_attach: bool, backward=lambda loss: loss.backward()) -> None:
    """One step of :class:`ReadAfterWrite` without checkpointing and one with ``pu.checkpoint``
    (``backward(loss)`` runs the backward pass): loss, gradients and every tensor of the model
    after the commit are bitwise the same."""
    x = torch.randn(5, 3)
    results = []
    for ckpt in (None, pu.checkpoint):
        torch.manual_seed(1)
        m = ReadAfterWrite()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        if use_attach:
            pu.attach(m, opt)
            loss = m(x, ckpt)
            backward(loss)
            grads = [p.grad.clone() for p in (m.w, m.gain)]
            opt.step()
        else:
            with pu.step(m, opt):
                loss = m(x, ckpt)
                backward(loss)
                grads = [p.grad.clone() for p in (m.w, m.gain)]
        results.append((loss.detach(), grads, snapshot(m)))
        pu.testing.reset()
    (l0, g0, s0), (l1, g1, s1) = results
    assert torch.equal(bits(l0), bits(l1))
    for a, b in zip(g0, g1):
        assert torch.equal(bits(a), bits(b))
    assert_same(s0, s1)


@pytest.mark.parametrize("use_attach", [False, True])
def test_segment_that_reads_after_assigning_recomputes_the_same(use_attach):
    assert_recomputation_changes_nothing(use_attach)


def test_in_place_update_inside_torch_checkpoint_gives_wrong_gradients():
    """The contrast: a hand-written in-place update in a torch-checkpointed segment
    is seen again by the recomputation (different values, different gradients)."""

    def run(ckpt):
        torch.manual_seed(1)
        w = nn.Parameter(torch.randn(3, 3))
        scale = torch.ones(3)

        def segment(x):
            scale.mul_(0.5).add_(1.0)  # the usual in-place state update
            return (x @ w) * scale

        x = torch.randn(5, 3)
        out = ckpt(segment, x) if ckpt else segment(x)
        out.square().sum().backward()
        return w.grad, scale

    g_plain, s_plain = run(None)
    g_ckpt, s_ckpt = run(lambda f, x: torch_checkpoint(f, x, use_reentrant=False))
    assert not torch.equal(g_plain, g_ckpt)  # silently wrong gradient
    assert not torch.equal(s_plain, s_ckpt)  # and the state updated twice


def _torch_ckpt(f, *args):
    return torch_checkpoint(f, *args, use_reentrant=False)


@pytest.mark.parametrize("stepped", [False, True])
def test_plain_torch_checkpoint_is_made_update_safe(stepped):
    """torch.utils.checkpoint(use_reentrant=False) itself: a segment that issues updates is
    adopted at its first update, so the recomputation replays like pu.checkpoint."""
    xs = [torch.randn(4, 3, 5, 5) for _ in range(3)]
    ref, ckpt = Net(nn.BatchNorm2d), Net(ckpt=_torch_ckpt)
    _same_init(ref, ckpt)
    _train(ref, xs, stepped=False)
    _train(ckpt, xs, stepped=stepped)
    assert int(ckpt.block.bn.num_batches_tracked) == 3  # torch's own BN would count 6
    assert_same(snapshot(ref), snapshot(ckpt))


def test_plain_torch_checkpoint_read_after_write_segment():
    x = torch.randn(5, 3)
    results = []
    for ckpt in (None, _torch_ckpt):
        torch.manual_seed(1)
        m = ReadAfterWrite()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with pu.step(m, opt):
            m(x, ckpt).backward()
            grads = [p.grad.clone() for p in (m.w, m.gain)]
        results.append((grads, snapshot(m)))
    (g0, s0), (g1, s1) = results
    for a, b in zip(g0, g1):
        assert torch.equal(bits(a), bits(b))
    assert_same(s0, s1)


def test_reentrant_torch_checkpoint_inside_a_step_raises_and_changes_nothing():
    """Reentrant checkpointing recomputes inside backward with no hook to replay: a clear error."""
    model = Net(ckpt=lambda f, x: torch_checkpoint(f, x, use_reentrant=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3, 5, 5).requires_grad_())  # some statistics to keep
    before = snapshot(model)
    with pytest.raises(pu.UpdateError, match=r"pu\.checkpoint") as ei, pu.step(model, opt):
        model(torch.randn(4, 3, 5, 5).requires_grad_()).sum().backward()
    msg = str(ei.value)
    # in the user's terms: the batch norm's statistics, updated by the user's call of the module
    # (Block.forward's line), not a pu.assign the user never made at a line inside paramupdates
    assert "the update of 'block.bn.num_batches_tracked' (BatchNorm2d running statistics)" in msg
    line = Block.forward.__code__.co_firstlineno + 1
    assert "by the call of the module at " in msg and f"test_checkpoint.py:{line} was issued during backward" in msg
    assert "pu.assign" not in msg and "paramupdates/" not in msg
    assert_same(before, snapshot(model))


class ReadOnlySegment(nn.Module):
    """The segment issues no update but reads a target updated after it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))
        self.scale = pu.Parameter(torch.full((3,), 2.0), auxiliary=True)

    def forward(self, x, ckpt):
        seg = lambda x: (x @ self.w) * self.scale  # noqa: E731
        h = seg(x) if ckpt is None else ckpt(seg, x)
        self.scale.assign(self.scale * 10.0)
        return h.square().sum()


def test_pu_checkpoint_segment_without_updates_sees_entry_values():
    x = torch.randn(5, 3)
    grads = []
    for ckpt in (None, pu.checkpoint):
        torch.manual_seed(1)
        m = ReadOnlySegment()
        with pu.step(m):
            m(x, ckpt).backward()
        grads.append(m.w.grad)
    assert torch.equal(bits(grads[0]), bits(grads[1]))


def test_checkpoint_passes_kwargs_and_keeps_rng():
    drop = nn.Dropout(0.5)
    bn = pu.nn.BatchNorm1d(4)
    seq = nn.Sequential(bn, drop)

    def f(x, *, k):
        return seq(x) * k

    x = torch.randn(8, 4, requires_grad=True)
    torch.manual_seed(3)
    with pu.step(seq):
        y = pu.checkpoint(f, x, k=2.0)
        y.sum().backward()
    g1 = x.grad.clone()
    x.grad = None
    bn2 = pu.nn.BatchNorm1d(4)
    seq2 = nn.Sequential(bn2, nn.Dropout(0.5))
    torch.manual_seed(3)
    with pu.step(seq2):
        (seq2(x) * 2.0).sum().backward()
    assert torch.equal(g1, x.grad)
    assert torch.equal(bn.running_mean, bn2.running_mean)


@pytest.mark.parametrize("stepped", [False, True])
def test_torch_batchnorm_under_pu_checkpoint_counts_once(stepped):
    """A batch norm left unconverted in a pu.checkpoint segment (inside a step or not): the
    recomputation gives it back the statistics it found, so they equal plain PyTorch without
    checkpointing, bitwise (earlier pu.checkpoint warned and counted the batch twice)."""
    xs = [torch.randn(4, 3, 5, 5) for _ in range(3)]
    ref, ckpt = Net(nn.BatchNorm2d), Net(nn.BatchNorm2d, ckpt=pu.checkpoint)
    _same_init(ref, ckpt)
    _train(ref, xs, stepped=False)
    _train(ckpt, xs, stepped=stepped)
    assert int(ckpt.block.bn.num_batches_tracked) == 3
    assert_same(snapshot(ref), snapshot(ckpt))


_NORMS = {
    "BatchNorm2d": nn.BatchNorm2d,
    "BatchNorm2d(momentum=None)": lambda c: nn.BatchNorm2d(c, momentum=None),  # reads num_batches_tracked
    "InstanceNorm2d(track_running_stats=True)": lambda c: nn.InstanceNorm2d(c, track_running_stats=True),
}


def _train_in(model, xs, use):
    """Train ``model`` on ``xs`` under ``pu.attach``, in ``pu.step`` blocks, or with no paramupdates."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if use == "attach":
        pu.attach(model, opt)
    for x in xs:
        with pu.step(model, opt) if use == "step" else contextlib.nullcontext():
            model(x).square().sum().backward()
        if use != "step":
            opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("norm", list(_NORMS))
@pytest.mark.parametrize("use", ["attach", "step"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_torch_batchnorm_under_torch_checkpoint_counts_once_in_a_model_paramupdates_steps(use_reentrant, use, norm):
    """A model under pu.attach (or pu.step) that was not converted, checkpointed with
    torch.utils.checkpoint (either mode): its torch.nn norm layers' statistics are bitwise those of
    plain PyTorch without checkpointing. The same model that paramupdates does not step, checkpointed
    beside it, keeps torch's own double count (pytorch/pytorch#96136)."""
    xs = [torch.randn(4, 3, 5, 5).requires_grad_() for _ in range(3)]  # (reentrant: an input needs grad)
    ckpt = lambda f, x: torch_checkpoint(f, x, use_reentrant=use_reentrant)  # noqa: E731
    ref, stepped, bare = Net(_NORMS[norm]), Net(_NORMS[norm], ckpt=ckpt), Net(_NORMS[norm], ckpt=ckpt)
    _same_init(ref, stepped, bare)
    _train_in(ref, xs, None)
    _train_in(stepped, xs, use)
    _train_in(bare, xs, None)
    assert_same(snapshot(ref), snapshot(stepped))
    # torch's own, where paramupdates is not in play: every batch counted twice
    assert not torch.equal(bare.block.bn.running_mean, ref.block.bn.running_mean)


class Probe(nn.Module):
    """Notes, at each call, how many global forward pre-hooks torch has."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(len(torch.nn.modules.module._global_forward_pre_hooks))
        return x


def test_norms_are_noted_only_while_a_recomputation_runs():
    """What it costs: nothing in forward; a global forward pre-hook only during the recomputation."""
    before = len(torch.nn.modules.module._global_forward_pre_hooks)
    probe = Probe()
    model = Net(nn.BatchNorm2d, ckpt=lambda f, x: torch_checkpoint(lambda y: f(probe(y)), x, use_reentrant=False))
    _train_in(model, [torch.randn(4, 3, 5, 5)], "attach")
    assert probe.seen == [before, before + 1]  # the forward, then the recomputation
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == before
    assert int(model.block.bn.num_batches_tracked) == 1


# --- the pu.when condition in force at a segment's forward, in force at its recomputation (rule 3) ---
class ConditionalSegment(nn.Module):
    """Issues updates, reads one after updating it, and enters a pu.when of its own."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bn = pu.nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        with pu.when(False):  # (first in the segment: torch's checkpoint finds the segment here)
            pu.assign(self.scale, self.scale * 100.0)
        pu.assign(self.scale, self.scale * 3.0 + 1.0)
        # read after the update (the gradient depends on it); a copy, which an eager update in
        # place (outside a step) leaves valid for backward
        h = self.bn(self.lin(x)) * self.scale.clone()
        with pu.when(torch.tensor(True)):
            pu.assign(self.scale, self.scale - 0.5)
        return h * self.scale.clone()


class UnderCondition(nn.Module):
    def __init__(self, cond, ckpt):
        super().__init__()
        self.seg = ConditionalSegment()
        self.head = nn.Linear(4, 2)
        self.cond, self.ckpt = cond, ckpt

    def forward(self, x):
        with pu.when(self.cond):
            h = self.seg(x) if self.ckpt is None else self.ckpt(self.seg, x)
        return self.head(h)


def _conditions():
    return {
        "tensor-false": lambda: torch.tensor(False),
        "tensor-true": lambda: torch.tensor(True),
        "bool-false": lambda: False,
    }


@pytest.mark.parametrize("stepped", [True, False])
@pytest.mark.parametrize("ckpt", ["pu", "torch"])
@pytest.mark.parametrize("cond", list(_conditions()))
def test_recomputation_runs_under_the_condition_of_its_forward(cond, ckpt, stepped):
    """A segment checkpointed under an outer pu.when: its recomputation sees the condition the
    forward saw, so gradients, statistics and every update equal the run without checkpointing,
    bitwise (before, it ran unconditioned: wrong gradients, or an error blaming use_reentrant=True)."""
    xs = [torch.randn(6, 3) for _ in range(2)]
    results = []
    for c in (None, pu.checkpoint if ckpt == "pu" else _torch_ckpt):
        torch.manual_seed(0)
        m = UnderCondition(_conditions()[cond](), c)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        grads = []
        for x in xs:
            opt.zero_grad()
            with pu.step(m, opt) if stepped else contextlib.nullcontext():
                m(x).square().sum().backward()
                grads.append([p.grad.clone() for p in m.parameters()])
                if not stepped:
                    opt.step()
        results.append((grads, snapshot(m)))
        pu.testing.reset()
    (g0, s0), (g1, s1) = results
    for a, b in zip(sum(g0, []), sum(g1, [])):
        assert torch.equal(bits(a), bits(b))
    assert_same(s0, s1)
