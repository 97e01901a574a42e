"""A notebook cell with ``pu.attach`` run again, a lost handle found again, and updates left pending
after the last ``optimizer.step()``, which no step commits: warned at process exit."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import paramupdates as pu
from misuse_helpers import line_of as _line_of

from conftest import assert_same, snapshot


def _nets():
    """The same net with torch.nn.BatchNorm1d (the plain reference) and converted (pu)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    torch.manual_seed(0)
    return ref, pu.convert(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 4, generator=g) for _ in range(n)]


def _plain_steps(ref, xs):
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in xs:
        opt.zero_grad()
        ref(x).square().sum().backward()
        opt.step()


def test_attach_again_with_the_same_optimizer_and_options_returns_the_earlier_attachment():
    """The cell run again unchanged: the same attachment, quietly; its pending updates stay and the
    next optimizer.step() commits them once (bitwise the plain loop)."""
    ref, m = _nets()
    xs = _batches(2)
    _plain_steps(ref, xs)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    att = pu.attach(m, opt)
    for x in xs:
        opt.zero_grad()
        loss = m(x).square().sum()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = pu.attach(m, opt)  # the cell, run again between the forward and the step
        assert again is att and pu.Attachment.of(m) is att
        loss.backward()
        opt.step()
    assert len(opt._optimizer_step_pre_hooks) == 1 and att.steps == 2
    assert_same(snapshot(ref), snapshot(m))


def test_attach_again_with_other_options_replaces_the_earlier_one_and_keeps_its_pending_updates():
    """The cell edited (other options) and run again with updates pending: the new attachment takes
    the earlier one's place, with a warning naming where that was made; the pending updates and
    the counters carry over, so no batch is lost (bitwise the plain loop)."""
    ref, m = _nets()
    xs = _batches(2)
    _plain_steps(ref, xs)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    first = pu.attach(m, opt)  # MARK: first attach
    opt.zero_grad()
    m(xs[0]).square().sum().backward()
    opt.step()
    opt.zero_grad()
    loss = m(xs[1]).square().sum()  # pending: the second batch's statistics
    with pytest.warns(UserWarning, match="with other options") as record:
        att = pu.attach(m, opt, on_nonfinite="skip")  # MARK: again
    msg = str(record[0].message)
    assert f"pu.attach at tests/test_attach_again.py:{_line_of('MARK: again')}" in msg
    assert f"pu.attach(Sequential) at tests/test_attach_again.py:{_line_of('MARK: first attach')}" in msg
    assert record[0].filename.endswith("test_attach_again.py")
    assert att is not first and pu.Attachment.of(m) is att and att.options.on_nonfinite == "skip"
    assert first.journal is None and len(opt._optimizer_step_pre_hooks) == 1  # the first is detached
    assert att.steps == 1 and att.pending_schedule().targets()  # carried over
    loss.backward()
    opt.step()
    assert att.steps == 2
    assert_same(snapshot(ref), snapshot(m))


def test_attach_again_after_the_optimizer_was_made_again():
    """The cell makes a new optimizer and attaches it. The earlier optimizer, held only by a reference
    cycle (the attachment's wrapper of its step, an LR scheduler's) and no longer by the plan of its
    last step, is collected and its attachment goes: the new one is made. With updates pending, the
    earlier step holds its optimizer: refused, naming the earlier attachment and how to reach it
    (``pu.Attachment.of(model)``), and made once they are flushed."""
    ref, m = _nets()
    xs = _batches(2)
    ref(xs[0])  # (plain: the statistics of a forward that pu flushes below)
    _plain_steps(ref, xs[1:])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pu.attach(m, opt)
    opt.step()  # (a committed step: its plan is kept)
    gc.collect()
    gc.disable()  # (nothing collects the earlier optimizer but pu.attach)
    try:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)  # the cell run again
        att = pu.attach(m, opt)  # MARK: the earlier cell
        assert pu.Attachment.of(m) is att and att.optimizer is opt
        m(xs[0])  # pending
        opt = torch.optim.SGD(m.parameters(), lr=0.1)  # and again
        with pytest.raises(pu.UpdateError) as ei:
            pu.attach(m, opt)
        msg = str(ei.value)
        assert f"(pu.attach(Sequential) at tests/test_attach_again.py:{_line_of('MARK: the earlier cell')})" in msg
        assert "pu.Attachment.of(model).detach()" in msg and ".flush()" in msg
        pu.Attachment.of(m).flush()  # what the message says
        att = pu.attach(m, opt)
    finally:
        gc.enable()
    assert pu.Attachment.of(m) is att and att.optimizer is opt
    opt.zero_grad()
    m(xs[1]).square().sum().backward()
    opt.step()
    assert_same(snapshot(ref), snapshot(m))


_SCRIPT = textwrap.dedent(
    """
    import torch, paramupdates as pu
    m = pu.convert(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    att = pu.attach(m, opt)
    m(torch.randn(8, 4)).square().sum().backward()
    opt.step()
    m(torch.randn(8, 4))  # the final train-mode forward
    if {flush}:
        att.flush()
    """
)


@pytest.mark.parametrize("flush", [False, True])
def test_pending_updates_at_exit_are_warned_unless_flushed(flush):
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(flush=flush)], capture_output=True, text=True, timeout=300, check=True
    )
    if flush:
        assert "AccountingWarning" not in out.stderr, out.stderr
    else:
        assert "AccountingWarning" in out.stderr and "the process exits" in out.stderr
        assert "'1.running_mean'" in out.stderr and "flush()" in out.stderr and "<string>:5" in out.stderr


def _train_then_save(model, path, xs, *, last, after=None):
    """Under pu.attach: a step per batch of ``xs``; then ``last`` (``"forward"``: a final train-mode forward
    after the last optimizer.step(); ``"mid-step"``: the next batch's forward and backward, the checkpoint
    saved before its optimizer.step()); then ``torch.save(model.state_dict())`` and, for ``"mid-step"``,
    that optimizer.step(). ``after(attachment)`` runs before the save. The function returns: the model,
    its optimizer and attachment go."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    att = pu.attach(model, opt)  # MARK: attach
    for x in xs[:-1]:
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    if last == "forward":
        model(xs[-1])
    else:
        opt.zero_grad()
        model(xs[-1]).square().sum().backward()
    if after is not None:
        after(att)
    torch.save(model.state_dict(), path)  # MARK: save
    if last == "mid-step":
        opt.step()


def test_pending_updates_a_state_dict_missed_are_warned_when_the_model_is_collected(tmp_path):
    """A final train-mode forward after the last optimizer.step(), then torch.save(model.state_dict()), and
    the function returns: the file holds 3 batches of statistics where plain PyTorch saves 4, and when the
    model is collected (its pending updates with it) that is warned, naming the attachment's call site, the
    targets, the state_dict() call and flush() / discard(). (Before, nothing was warned: the at-exit warning
    covers models alive at exit only.) With flush() before the save, the file is plain PyTorch's bitwise and
    nothing is warned; nor is a checkpoint saved inside a step (before its optimizer.step(), which commits
    the pending updates: documented, tests/test_serialization.py), nor a model dropped with pending updates
    that nothing saved (a sweep over trial models: nothing that outlives the model lacks them)."""
    xs = _batches(4)
    ref, _ = _nets()
    _plain_steps(ref, xs[:3])
    ref(xs[3])  # plain PyTorch: the final forward's statistics are in the model at once
    plain = ref.state_dict()
    assert int(plain["1.num_batches_tracked"]) == 4

    with pytest.warns(pu.AccountingWarning) as caught:
        _train_then_save(_nets()[1], tmp_path / "lost.pt", xs, last="forward")
        gc.collect()
    (w,) = caught
    message = str(w.message)
    assert "its model was collected" in message and "'1.running_mean'" in message
    assert f"pu.attach(Sequential) at tests/test_attach_again.py:{_line_of('MARK: attach')}" in message
    assert f"state_dict() at tests/test_attach_again.py:{_line_of('MARK: save')}" in message
    assert "flush()" in message and "discard()" in message
    assert int(torch.load(tmp_path / "lost.pt")["1.num_batches_tracked"]) == 3  # what was lost

    with warnings.catch_warnings():
        warnings.simplefilter("error", pu.AccountingWarning)
        _train_then_save(_nets()[1], tmp_path / "flushed.pt", xs, last="forward", after=lambda att: att.flush())
        _train_then_save(_nets()[1], tmp_path / "inside.pt", xs, last="mid-step")
        _trial(xs)  # a trial of a sweep: dropped with its final forward's statistics pending, unsaved
        gc.collect()
    assert_same(list(plain.items()), list(torch.load(tmp_path / "flushed.pt").items()))
    assert int(torch.load(tmp_path / "inside.pt")["1.num_batches_tracked"]) == 3  # (the state before batch 4)


def _trial(xs):
    """A trial of a sweep under pu.attach: a step per batch, a final train-mode forward, nothing saved."""
    model = _nets()[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pu.attach(model, opt)
    for x in xs[:-1]:
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    model(xs[-1])
