"""Misuse and lifecycle (issue 15): the mistakes users make by accident get a defined behaviour,
never a silent wrong step. One section per row of docs/guarantees.md's "Misuse and lifecycle" table."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

import paramupdates as pu
from test_checkpoint import assert_recomputation_changes_nothing

from conftest import assert_same, bits, snapshot


def _in_thread(fn, *args):
    """Run ``fn(*args)`` in a new thread; return its result, re-raise its exception."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            out["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "thread hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = pu.nn.BatchNorm1d(4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        pu.assign_add(self.calls, 1)
        return self.bn(self.lin(x))


# --- row 7: steps are per thread -------------------------------------------------------------------
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


# --- row 2: non-finite gradients -------------------------------------------------------------------
def _rules_model():
    torch.manual_seed(0)
    m = BNNet()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    pu.weight_decay(m, 0.1)
    pu.constrain(m.lin.weight, pu.max_norm(1.0))
    avg = pu.ema(m, 0.9)
    return m, opt, avg


def _nan_grad_step(m, how, opt, att=None, **options):
    """One training step whose lin.weight gradient has a NaN."""
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = m(x).square().sum()
        loss.backward()
        m.lin.weight.grad[0, 0] = float("nan")
        return loss

    if how == "step":
        with pu.step(m, opt, **options) as s:
            closure()
        return s
    if how == "closure":
        s = pu.Stepper(m, opt, closure=closure, **options)
        with s:
            pass
        return s
    closure()
    opt.step()
    return att


@pytest.mark.parametrize("how", ["step", "closure", "attach"])
def test_nonfinite_gradient_skips_the_whole_step(how):
    m, opt, avg = _rules_model()
    att = pu.attach(m, opt, on_nonfinite="skip") if how == "attach" else None
    before = snapshot(m, opt, avg)
    owner = _nan_grad_step(m, how, opt, att, **({} if how == "attach" else {"on_nonfinite": "skip"}))
    assert_same(before, snapshot(m, opt, avg))  # no optimizer step, no statistics, no rule, no EMA
    assert owner.skipped_steps == 1 and owner.steps == 0 and owner.skipped
    assert torch.isnan(m.lin.weight.grad[0, 0])  # the gradients are put back, as they were


@pytest.mark.parametrize("how", ["step", "closure", "attach"])
def test_nonfinite_gradient_raises_naming_the_parameter(how):
    m, opt, avg = _rules_model()
    att = pu.attach(m, opt) if how == "attach" else None
    before = snapshot(m, opt, avg)
    with pytest.raises(pu.UpdateError) as ei:
        _nan_grad_step(m, how, opt, att)
    msg = str(ei.value)
    assert "non-finite gradient of 'lin.weight'" in msg and "'lin.bias'" not in msg
    assert "on_nonfinite='skip'" in msg and "Nothing was written" in msg
    assert ("pu.attach(BNNet)" if how == "attach" else "pu.step at tests/test_misuse.py:") in msg
    assert_same(before, snapshot(m, opt, avg))


def test_nonfinite_sparse_gradient_is_checked_too():
    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 3, sparse=True)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    m = Emb()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = snapshot(m)
    with pytest.raises(pu.UpdateError, match="non-finite gradient of 'emb.weight'"):
        with pu.step(m, opt):
            pu.assign_add(m.calls, 1)
            (m.emb(torch.tensor([1, 2])).sum() * float("nan")).backward()
    assert_same(before, snapshot(m))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_gradients_that_require_grad_are_checked_without_a_write():
    """create_graph=True: the gradients are in a graph that may be differentiated again (an optimizer
    computing Hessian-vector products): the check must not write them (no version bump)."""
    m = BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pu.step(m, opt):
        m(torch.randn(8, 4)).square().sum().backward(create_graph=True)
        versions = [p.grad._version for p in m.parameters()]
        grads = [p.grad for p in m.parameters()]
    assert [g._version for g in grads] == versions
    m.zero_grad(set_to_none=True)  # (breaks the parameter-gradient cycle create_graph makes)


def test_nonfinite_gradient_with_check_finite_false_reaches_the_optimizer():
    m, opt, _ = _rules_model()
    _nan_grad_step(m, "step", opt, check_finite=False)
    assert torch.isnan(m.lin.weight).any()  # what plain PyTorch does


# --- row 1: an optimizer step taken inside a step that owns it --------------------------------------
def _line_of(marker: str) -> int:
    """The line of this file that holds ``marker`` (once)."""
    with open(__file__) as f:
        lines = [i for i, line in enumerate(f, 1) if "# " + marker in line]
    assert len(lines) == 1, marker
    return lines[0]


@pytest.mark.parametrize("attached", [False, True])
def test_optimizer_step_inside_pu_step_raises_before_it_writes(attached):
    m, opt, avg = _rules_model()
    if attached:
        pu.attach(m, opt)  # a pu.step on an attached optimizer owns its step too
    before = snapshot(m, opt, avg)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m, opt):
            m(torch.randn(8, 4)).square().sum().backward()
            opt.step()  # MARK: the usual port of an existing loop
    msg = str(ei.value)
    assert f"Adam.step() at tests/test_misuse.py:{_line_of('MARK: the usual')}" in msg
    assert "pu.step at tests/test_misuse.py:" in msg and "Remove the optimizer.step() call" in msg
    assert "pu.attach(model, optimizer)" in msg and "scaler=scaler" in msg
    assert_same(before, snapshot(m, opt, avg))  # the optimizer did not write, the step was discarded
    # the optimizer is ours again after the step: the next step commits once
    opt.zero_grad()
    with pu.step(m, opt) as s:
        m(torch.randn(8, 4)).square().sum().backward()
    assert s.steps == 1 and len(opt.state) == 4 and int(opt.state[m.lin.weight]["step"]) == 1
    opt.step()  # outside a step: plain PyTorch (or the attachment's commit)
    assert int(opt.state[m.lin.weight]["step"]) == 2


def test_gradscaler_step_inside_pu_step_raises():
    m, opt, avg = _rules_model()
    scaler = torch.amp.GradScaler("cpu")
    before = snapshot(m, opt, avg)
    with pytest.raises(pu.UpdateError, match=r"Adam.step\(\) at tests/test_misuse.py:\d+ was called inside"):
        with pu.step(m, opt):
            scaler.scale(m(torch.randn(8, 4)).square().sum()).backward()
            scaler.step(opt)
    assert_same(before, snapshot(m, opt, avg))


def _scaler_run(use, init_scale, steps=3):
    torch.manual_seed(0)
    m = BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    pu.constrain(m.lin.weight, pu.max_norm(1.0))
    avg = pu.ema(m, 0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    torch.manual_seed(1)
    xs = [torch.randn(8, 4) for _ in range(steps)]
    owner = pu.attach(m, opt) if use == "attach" else pu.Stepper(m, opt, scaler=scaler)
    for x in xs:
        opt.zero_grad()
        if use == "attach":
            scaler.scale(m(x).square().sum()).backward()
            scaler.step(opt)
            scaler.update()
        else:
            with owner:
                scaler.scale(m(x).square().sum()).backward()
    pu.testing.reset()
    return m, opt, avg, scaler, owner


def _opt_state(opt):
    return [(f"{i}.{k}", v) for i, st in opt.state_dict()["state"].items() for k, v in st.items()]


def test_gradscaler_through_pu_step_equals_the_attach_loop():
    """``pu.step(model, opt, scaler=scaler)``: the commit calls scaler.step(opt) and scaler.update()."""
    a = _scaler_run("step", 2.0**10)
    b = _scaler_run("attach", 2.0**10)
    assert_same(snapshot(a[0], a[2]), snapshot(b[0], b[2]))
    assert_same(_opt_state(a[1]), _opt_state(b[1]))
    assert a[3].get_scale() == b[3].get_scale() == 2.0**11  # grown once (growth_interval=2, 3 good steps)
    assert a[4].steps == 3 and a[4].skipped_steps == 0


def test_gradscaler_overflow_skips_the_whole_step_and_lowers_the_scale():
    m, opt, avg, scaler, owner = _scaler_run("step", 2.0**127, steps=1)  # the scaled loss overflows
    torch.manual_seed(0)
    fresh = BNNet()
    assert_same(snapshot(m), snapshot(fresh))  # nothing written: no statistics, no optimizer step
    assert_same(snapshot(avg), snapshot(pu.ema(fresh, 0.5)))
    assert owner.skipped_steps == 1 and owner.steps == 0 and not opt.state
    assert scaler.get_scale() == 2.0**126  # backed off, as scaler.update() does after an overflow


def test_scaler_option_is_refused_under_attach_and_with_a_closure():
    m = BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(TypeError, match="keep scaler.step"):
        pu.attach(m, opt, scaler=scaler)
    with pytest.raises(TypeError, match="closure= and scaler="):
        pu.Stepper(m, opt, scaler=scaler, closure=lambda: None)
    with pytest.raises(TypeError, match="GradScaler"):
        pu.step(m, opt, scaler=object())


# --- row 6: attachments never detached ---------------------------------------------------------------
def test_forgotten_attachments_are_collected_with_their_models():
    import gc
    import weakref

    from paramupdates import routing

    refs = []
    for trial in range(200):
        m = BNNet()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        pu.attach(m, opt, copy_for_rollback=trial % 2 == 0)  # never detached (a notebook, a loop over trials)
        m(torch.randn(8, 4)).square().sum().backward()
        opt.step()
        m(torch.randn(8, 4))  # and one with updates left pending
        refs.append(weakref.ref(m))
        del m, opt
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0 and not routing.attachments()


def test_a_forgotten_attachment_does_not_block_another_model():
    old = BNNet()
    old_opt = torch.optim.SGD(old.parameters(), lr=0.1)
    pu.attach(old, old_opt)
    old(torch.randn(8, 4))  # pending updates, never committed: the attachment is forgotten
    new = BNNet()
    pu.weight_decay(new, 0.1)  # another model: declared
    pu.constrain(new.lin.weight, pu.max_norm(1.0))
    pu.ema(new, 0.9)
    with pytest.raises(pu.UpdateError) as ei:
        pu.ema(old, 0.9)  # MARK: the same model
    msg = str(ei.value)
    assert f"pu.ema at tests/test_misuse.py:{_line_of('MARK: the same model')}" in msg
    assert "pu.attach(BNNet) at tests/test_misuse.py:" in msg and "'calls'" in msg
    assert "discard()" in msg and "flush()" in msg


def test_reattaching_names_the_first_attachment():
    m = BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pu.attach(m, opt)  # MARK: first
    with pytest.raises(
        pu.UpdateError,
        match=rf"already attached \(pu.attach\(BNNet\) at tests/test_misuse.py:{_line_of('MARK: first')}\).*detach\(\)",
    ):
        pu.attach(m, opt)


@pytest.mark.parametrize("first", ["outer", "inner"])
def test_attaching_a_module_inside_an_attached_one_is_refused(first):
    """Nested attachments would give a tensor of the inner module two commits (ambiguity is an
    error, rule 5's spirit): refused at attach, naming the module and the other attachment."""
    m = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), pu.nn.BatchNorm1d(4)))
    o1, o2 = torch.optim.SGD(m[0].parameters(), lr=0.1), torch.optim.SGD(m[1].parameters(), lr=0.1)
    a, b = (m, m[1]) if first == "outer" else (m[1], m)
    pu.attach(a, o1)  # MARK: nested first
    with pytest.raises(pu.UpdateError) as ei:
        pu.attach(b, o2)
    msg = str(ei.value)
    assert "the Sequential at '1' of the Sequential would be attached twice" in msg
    assert f"pu.attach(Sequential) at tests/test_misuse.py:{_line_of('MARK: nested first')}" in msg
    assert "pu.attach(model.encoder, opt_enc)" in msg
    assert len(o2._optimizer_step_pre_hooks) == 0  # nothing of the refused attachment stays


def test_two_optimizers_over_disjoint_submodules_equal_plain_pytorch():
    """What the refusal suggests: one attachment per optimizer, on the submodule it steps. With
    pu.weight_decay over the whole model and Adam, bitwise two AdamW and torch.nn.BatchNorm1d."""

    def make(bn):
        torch.manual_seed(0)
        return nn.ModuleDict(
            {"enc": nn.Sequential(nn.Linear(3, 4), bn(4)), "dec": nn.Sequential(nn.Linear(4, 2), bn(2))}
        )

    ref, m = make(nn.BatchNorm1d), make(pu.nn.BatchNorm1d)
    ref_opts = [
        torch.optim.AdamW(ref[k].parameters(), lr=lr, weight_decay=0.1) for k, lr in (("enc", 0.1), ("dec", 0.01))
    ]
    opts = [torch.optim.Adam(m[k].parameters(), lr=lr) for k, lr in (("enc", 0.1), ("dec", 0.01))]
    atts = [pu.attach(m["enc"], opts[0]), pu.attach(m["dec"], opts[1])]
    pu.weight_decay(m, 0.1, exclude=None)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        xs = [torch.randn(8, 3, generator=g) for _ in range(2)]  # two micro-batches
        for net, os in ((ref, ref_opts), (m, opts)):
            for o in os:
                o.zero_grad()
            for x in xs:
                net["dec"](net["enc"](x)).square().mean().backward()
            for o in os:
                o.step()
    for a in atts:
        a.detach()
    assert_same(snapshot(ref), snapshot(m))


@pytest.mark.parametrize("opener", ["pu.step", "recompute"])
def test_a_step_over_an_attached_model_with_pending_updates_is_refused(opener):
    """pu.step (or pu.recompute_batchnorm_stats, a step of its own) on a model whose attachment has
    updates pending since its last optimizer.step(): its reads would see them, its writes go into
    them (not into the buffers), and they would commit later on their own. Refused before anything
    is recorded, naming the attachment and what is pending; after flush() it runs, bitwise
    torch.optim.swa_utils.update_bn."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), pu.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    att = pu.attach(m, opt)  # MARK: pending attach
    x = torch.randn(8, 3)
    m(x).sum().backward()  # pending: the batch norm's statistics
    stored = [t.clone() for t in m.state_dict().values()]
    loader = [torch.randn(8, 3) for _ in range(3)]
    with pytest.raises(pu.UpdateError) as ei:
        if opener == "pu.step":
            with pu.step(m, opt):
                m(x).sum().backward()
        else:
            pu.recompute_batchnorm_stats(m, loader)
    msg = str(ei.value)
    assert f"pu.attach(Sequential) at tests/test_misuse.py:{_line_of('MARK: pending attach')}" in msg
    assert "1.running_mean" in msg and "flush()" in msg and "discard()" in msg
    assert all(torch.equal(a, b) for a, b in zip(stored, m.state_dict().values()))  # nothing written
    assert att.journal is not None and att.journal.pending_names()  # the attachment's updates still pending
    att.flush()
    if opener == "recompute":
        pu.recompute_batchnorm_stats(m, loader)
        plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        plain.load_state_dict(m.state_dict())
        torch.optim.swa_utils.update_bn(loader, plain)
        assert_same(snapshot(plain), snapshot(m))


# --- row 8: the same rule declared twice ---------------------------------------------------------------
def _decay_twice_run(*cells):
    """A notebook cell declaring weight decay and a max-norm, run once per ``(rate, bound)`` in ``cells``."""
    torch.manual_seed(0)
    m = BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for rate, bound in cells:  # the cell, run again (edited or not)
        pu.weight_decay(m, rate)  # MARK: the cell
        pu.constrain(m.lin.weight, pu.max_norm(bound))
    with pu.step(m, opt) as s:
        m(torch.randn(8, 4)).square().sum().backward()
    return m, s


def test_declaring_the_same_rule_again_changes_nothing_quietly():
    """The cell run again unchanged (or configure_optimizers run again by a later Lightning fit):
    the same kind, tensors and settings take the earlier rules' places with no warning."""
    once, s1 = _decay_twice_run((0.1, 0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twice, s2 = _decay_twice_run((0.1, 0.5), (0.1, 0.5))
    assert_same(snapshot(once), snapshot(twice))  # applied once, not twice
    assert str(s1.schedule()) == str(s2.schedule())
    from paramupdates.rules import base

    assert len([r for r in base.declared() if any(t is twice.lin.weight for t in r.owner_tensors())]) == 2
    # in the earlier one's place: constraints of two kinds on one tensor keep their order
    w = BNNet().lin.weight
    pu.constrain(w, pu.clamp(-1.0, 1.0))
    pu.constrain(w, pu.non_neg())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = pu.constrain(w, pu.clamp(-1.0, 1.0))
    on_w = [r for r in base.declared() if any(t is w for t in r.owner_tensors())]
    assert [r.kind for r in on_w] == ["constrain:clamp", "constrain:non_neg"] and on_w[0] is again


def test_declaring_a_rule_again_replaces_it_with_a_warning():
    """The cell edited (another rate, another bound), then run again: the later rules replace the
    earlier ones on the tensors they share, with a warning naming both call sites."""
    edited, s1 = _decay_twice_run((0.2, 0.4))
    with pytest.warns(UserWarning) as record:
        twice, s2 = _decay_twice_run((0.1, 0.5), (0.2, 0.4))
    assert_same(snapshot(edited), snapshot(twice))  # the later declarations, applied once
    assert str(s1.schedule()) == str(s2.schedule())  # one weight decay, one max_norm
    msgs = [str(w.message) for w in record]
    line = _line_of("MARK: the cell")
    wd = [m for m in msgs if m.startswith("pu.weight_decay declared")]
    assert len(wd) == 1 and wd[0].count(f"tests/test_misuse.py:{line}") == 2 and "'lin.weight'" in wd[0]
    mn = [m for m in msgs if m.startswith("pu.constrain(max_norm) declared")]
    assert len(mn) == 1 and mn[0].count(f"tests/test_misuse.py:{line + 1}") == 2
    assert all(w.filename.endswith("test_misuse.py") for w in record)  # points at the user's line


def test_a_later_rule_takes_over_only_the_tensors_it_shares():
    m = BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    w0, g0 = m.lin.weight.detach().clone(), m.bn.weight.detach().clone()
    pu.weight_decay(m, 0.1, exclude=None)  # every parameter
    with pytest.warns(UserWarning, match=r"on 'lin.weight', 'lin.bias':"):
        pu.weight_decay(m.lin, 0.2, exclude=None)  # lin's: the later rate wins there
    pu.constrain(m.lin.weight, pu.non_neg())  # another kind of constraint: both apply
    pu.constrain(m.lin.weight, pu.clamp(-10.0, 10.0))
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    with pu.step(m, opt):
        pass
    assert torch.equal(m.bn.weight, g0 * (1 - 0.5 * 0.1))
    assert torch.equal(m.lin.weight, (w0 * (1 - 0.5 * 0.2)).clamp_min(0))


def test_two_emas_of_one_model_with_other_settings_are_kept():
    m = BNNet()
    a = pu.ema(m, 0.9)
    b = pu.ema(m, 0.5)
    with pytest.warns(UserWarning, match="pu.ema declared at .* replaces the pu.ema declared at"):
        c = pu.ema(m, 0.9)  # the first one again
    from paramupdates.rules import base, ema

    assert {ema.rule_of(b), ema.rule_of(c)} == {r for r in base.declared()}
    with pytest.raises(ValueError):
        ema.rule_of(a)


# --- row 9: state_dict() and deepcopy inside a step --------------------------------------------------
class Mixed(nn.Module):
    """Every kind of target: a pu.Parameter, a plain parameter, buffers (statistics rows and entries)."""

    def __init__(self):
        super().__init__()
        self.net = BNNet()
        self.scale = pu.Parameter(torch.ones(4), auxiliary=True)
        self.frozen = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x):
        y = self.net(x) * self.scale
        self.scale.assign(self.scale * 0.5)
        pu.assign_add(self.frozen, 1.0)
        return y


def _committed(m):
    return [(k, v.detach().clone()) for k, v in m.state_dict().items()]


@pytest.mark.parametrize("use", ["step", "attach"])
def test_state_dict_and_deepcopy_inside_a_step_hold_committed_values(use):
    import copy

    m = Mixed()
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1)
    att = pu.attach(m, opt) if use == "attach" else None
    with pu.step(m, opt) if use == "step" else contextlib_nullcontext():
        m(torch.randn(8, 4)).square().sum().backward()
    committed = _committed(m)
    stored = {k: v for k, v in m.state_dict(keep_vars=True).items()}
    with pu.step(m, opt) if use == "step" else contextlib_nullcontext():
        m(torch.randn(8, 4)).square().sum().backward()
        # reads see the pending values ...
        assert int(m.net.calls) == 2 and torch.equal(pu.read(m.frozen), torch.full((4,), 2.0))
        assert torch.equal(m.scale, torch.full((4,), 0.25))
        # ... serialization never does
        assert_same(committed, list(m.state_dict().items()))
        kept = m.state_dict(keep_vars=True)
        assert all(kept[k] is stored[k] for k in stored)  # the stored tensors themselves
        sub = [(k, v) for k, v in committed if k.startswith("net.")]
        assert_same(sub, list(m.net.state_dict(prefix="net.").items()))  # a submodule's too
        twin = copy.deepcopy(m)
        assert_same(committed, list(twin.state_dict().items()))
        assert type(twin.scale) is pu.Parameter
        # a pending value read, then copied, is the pending value
        assert int(copy.deepcopy(m.net.calls)) == 2
        mean = m.net.bn.running_mean
        assert torch.equal(copy.deepcopy(mean), mean)
    if att is not None:
        opt.step()
    assert int(m.net.calls) == 2


def test_a_checkpoint_saved_inside_a_step_resumes_without_counting_the_batch_twice(tmp_path):
    xs = [torch.randn(8, 4) for _ in range(3)]
    torch.manual_seed(3)
    m = Mixed()
    init = copy_state(m)
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1)
    for i, x in enumerate(xs):
        with pu.step(m, opt):
            m(x).square().sum().backward()
            if i == 1:
                torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
        opt.zero_grad()
    # resume: the checkpoint holds the state before batch 1; batches 1 and 2 run again
    r = Mixed()
    r.load_state_dict(init)
    ropt = torch.optim.SGD(r.net.parameters(), lr=0.1)
    ckpt = torch.load(tmp_path / "ckpt.pt")
    r.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["opt"])
    for x in xs[1:]:
        with pu.step(r, ropt):
            r(x).square().sum().backward()
        ropt.zero_grad()
    assert_same(snapshot(m), snapshot(r))
    assert int(r.net.calls) == 3


def copy_state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def contextlib_nullcontext():
    import contextlib

    return contextlib.nullcontext()


# --- row 4: converting the model inside a step ----------------------------------------------------------
def _as(state, dtype):
    return [(k, v.to(dtype) if v.is_floating_point() else v) for k, v in state]


@pytest.mark.parametrize("ending", ["exception", "commit"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_converting_the_model_inside_a_step_keeps_stored_values(ending, dtype):
    m = Mixed()
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1)
    before = _committed(m)
    with pytest.raises((pu.UpdateError, KeyError)) as ei:
        with pu.step(m, opt):
            m(torch.randn(8, 4)).square().sum().backward()
            m.to(dtype)  # MARK: converts the model while its updates are pending
            if ending == "exception":
                raise KeyError("user code fails")
    if ending == "commit":
        msg = str(ei.value)
        assert ei.type is pu.UpdateError and "Nothing of the step was written" in msg
        for name in ("'net.bn.running_mean'", "'net.bn.running_var'", "'scale'", "'frozen'"):
            assert name in msg, name
        assert "between steps" in msg
    # the conversion, applied to the stored values; nothing of the step (statistics, counters, pu.Parameter)
    assert_same(_as(before, dtype), _committed(m))
    assert m.scale.dtype == dtype and type(m.scale) is pu.Parameter
    # and the next step is an ordinary one
    opt.zero_grad()
    with pu.step(m, opt):
        m(torch.randn(8, 4).to(dtype)).square().sum().backward()
    assert int(m.net.calls) == 1 and torch.equal(m.scale, torch.full((4,), 0.5, dtype=dtype))


def test_converting_a_pu_parameter_between_steps_keeps_its_updates():
    m = Mixed()
    with pu.step(m):
        m.scale.assign_add(1.0)
    m.double()  # between steps: fine
    with pu.step(m):
        m.scale.assign_add(1.0)
    assert m.scale.dtype == torch.float64 and torch.equal(m.scale, torch.full((4,), 3.0, dtype=torch.float64))


# --- row 5: load_state_dict inside a step ------------------------------------------------------------------
@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("use", ["step", "attach"])
def test_load_state_dict_of_tensors_with_pending_updates_raises_before_loading(use, assign):
    m = Mixed()
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1)
    other = Mixed()
    with torch.no_grad():
        for t in other.state_dict().values():
            t.add_(7)
    sd = other.state_dict()
    before = _committed(m)
    att = pu.attach(m, opt) if use == "attach" else None
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m, opt) if use == "step" else contextlib_nullcontext():
            m(torch.randn(8, 4))
            m.load_state_dict(sd, assign=assign)  # MARK: load inside the step
    msg = str(ei.value)
    assert f"Mixed.load_state_dict() at tests/test_misuse.py:{_line_of('MARK: load inside the step')}" in msg
    assert "'net.calls'" in msg and "Nothing was loaded" in msg
    assert ("flush()" in msg and "discard()" in msg) if use == "attach" else "between steps" in msg.lower()
    if att is not None:
        att.discard()
    assert_same(before, _committed(m))  # nothing loaded, nothing of the step written
    m.load_state_dict(sd, assign=assign)  # between steps: loads
    assert_same(list(sd.items()), _committed(m))


def test_loading_tensors_without_pending_updates_inside_a_step_loads():
    m = Mixed()
    src, other = BNNet(), BNNet()
    with pu.step(m):
        m(torch.randn(8, 4))  # pending: statistics, counters, scale, frozen
        m.net.lin.load_state_dict(src.lin.state_dict())  # no pending update of these: loads
        other.load_state_dict(src.state_dict())  # another model: loads
    assert torch.equal(m.net.lin.weight, src.lin.weight) and int(m.net.calls) == 1
    assert_same(snapshot(other), snapshot(src))


def test_assigning_a_buffer_with_pending_updates_raises_at_the_call():
    m = Mixed()
    before = _committed(m)
    with pytest.raises(
        pu.UpdateError, match=r"assigning the buffer 'net.calls' \(BNNet.calls = ...\) at tests/test_misuse.py:\d+"
    ):
        with pu.step(m):
            m(torch.randn(8, 4))
            m.net.calls = torch.zeros((), dtype=torch.long)
    with pytest.raises(pu.UpdateError, match=r"assigning the parameter 'frozen'"):
        with pu.step(m):
            m(torch.randn(8, 4))
            m.frozen = nn.Parameter(torch.zeros(4), requires_grad=False)
    assert_same(before, _committed(m))


# --- row 3: parameters replaced under the same name ---------------------------------------------------------
def _declare(m):
    pu.weight_decay(m.net, 0.1)
    pu.constrain(m.net.lin, pu.max_norm(0.5))
    return pu.ema(m, 0.9)


def _train_steps(m, avg, n=2, dtype=torch.float32):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.manual_seed(5)
    for _ in range(n):
        opt.zero_grad()
        with pu.step(m, opt) as s:
            m(torch.randn(8, 4, dtype=dtype)).square().sum().backward()
    m.last_schedule = str(s.schedule())
    return snapshot(m, avg)


def _other_state():
    torch.manual_seed(9)
    return {k: v.clone() for k, v in Mixed().state_dict().items()}


def test_rules_follow_parameters_replaced_by_load_state_dict_assign():
    sd = _other_state()
    torch.manual_seed(0)
    ref = Mixed()
    ref_avg = _declare(ref)
    ref.load_state_dict(sd)  # in place: the reference
    torch.manual_seed(0)
    m = Mixed()
    avg = _declare(m)
    pu.Stepper(m)  # the model is known now: a rule on a bare tensor follows it by name too
    pu.constrain(m.net.bn.weight, pu.clamp(-0.5, 0.5))
    pu.constrain(ref.net.bn.weight, pu.clamp(-0.5, 0.5))
    old = m.net.lin.weight
    m.load_state_dict(sd, assign=True)
    assert m.net.lin.weight is not old and type(m.scale) is pu.Parameter and m.scale.auxiliary
    assert_same(_train_steps(ref, ref_avg), _train_steps(m, avg))
    rows = m.last_schedule
    for kind in ("weight_decay", "constrain:max_norm", "constrain:clamp", "ema"):
        assert kind in rows, kind


def test_meta_init_then_to_empty_keeps_rules_the_ema_and_pu_parameters():
    sd = _other_state()
    ref = Mixed()
    ref.load_state_dict(sd)
    ref_avg = _declare(ref)
    with torch.device("meta"):
        m = Mixed()
    avg = _declare(m)  # declared on the meta model: the copy is on meta too
    m.to_empty(device="cpu")
    m.load_state_dict(sd)
    assert_same(_train_steps(ref, ref_avg), _train_steps(m, avg))  # the copy started as a copy of sd
    assert type(m.scale) is pu.Parameter and m.scale.auxiliary and not any(t.is_meta for t in avg.state_dict().values())


def test_a_rule_on_a_bare_meta_tensor_is_refused_at_declaration():
    with torch.device("meta"):
        m = Mixed()
    with pytest.raises(
        pu.UpdateError, match=r"pu.constrain at tests/test_misuse.py:\d+: '0' is a meta tensor .* on the module"
    ):
        pu.constrain(m.net.lin.weight, pu.max_norm(1.0))


def test_model_to_that_recreates_parameters_keeps_rules_and_the_ema_follows():
    torch.manual_seed(0)
    ref = Mixed().double()
    ref_avg = _declare(ref)
    torch.manual_seed(0)
    m = Mixed()
    avg = _declare(m)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        m.to(torch.float64)  # new parameter objects
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert_same(_train_steps(ref, ref_avg, dtype=torch.float64), _train_steps(m, avg, dtype=torch.float64))
    assert avg.net.lin.weight.dtype == torch.float64 and type(m.scale) is pu.Parameter


def test_the_ema_copy_follows_the_model_cast_between_steps():
    torch.manual_seed(0)
    m = Mixed()
    avg = _declare(m)
    _train_steps(m, avg, n=1)
    m.double()
    a0 = avg.net.lin.weight.detach().clone().double()
    _train_steps(m, avg, n=1, dtype=torch.float64)
    assert avg.net.lin.weight.dtype == torch.float64
    # the anchor, torch.optim.swa_utils' EMA: lerp with the weight 1 - decay, as the rule computes it
    # (torch.lerp(a0, w, 0.1) rounds differently: 1 - 0.9 is not 0.1, and it agreed only on some CPUs)
    expect = [a0]
    get_ema_multi_avg_fn(0.9)(expect, [m.net.lin.weight.detach()], None)
    assert torch.equal(bits(avg.net.lin.weight), bits(expect[0]))


def test_a_rule_that_cannot_follow_raises_at_the_next_commit():
    torch.manual_seed(0)
    m = Mixed()
    m.extra = nn.Linear(2, 2)
    pu.weight_decay(m, 0.1, exclude=None)  # MARK: on the model
    head = pu.constrain(m.extra, pu.max_norm(1.0))
    _train_steps(m, None, n=1)
    del m.extra  # a layer removed
    before = snapshot(m)
    with pytest.raises(pu.UpdateError) as ei:
        _train_steps(m, None, n=1)
    msg = str(ei.value)
    assert "pu.constrain(max_norm) declared at tests/test_misuse.py:" in msg or (
        f"pu.weight_decay declared at tests/test_misuse.py:{_line_of('MARK: on the model')}" in msg
        and "'extra.weight'" in msg
    )
    assert "Nothing of this step was written" in msg and ".remove()" in msg
    assert_same(before, snapshot(m))
    head.remove()
    with pytest.raises(pu.UpdateError, match=r"'extra.weight', 'extra.bias', which Mixed no longer has"):
        _train_steps(m, None, n=1)


# --- row 10: smaller misuses -----------------------------------------------------------------------------
class Typed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("count", torch.zeros(2, dtype=torch.int32))
        self.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
        self.code = pu.Parameter(torch.zeros(2, dtype=torch.int32), auxiliary=True)


def _check(msg, target, marker, *hints):
    assert target in msg, msg
    assert f"tests/test_misuse.py:{_line_of(marker)}" in msg, msg
    for h in hints:
        assert h in msg, msg


@pytest.mark.parametrize("where", ["step", "eager"])
def test_an_int_that_does_not_fit_the_target(where):
    m = Typed()
    pu.Stepper(m)  # (eager errors name a target of a model paramupdates knows)
    before = _committed(m)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m) if where == "step" else contextlib_nullcontext():
            pu.assign(m.count, 2**40)  # MARK: 2**40 into int32
    _check(str(ei.value), "'count'", "MARK: 2**40 into int32", "does not fit a torch.int32", "torch.int64")
    assert_same(before, _committed(m))


def test_complex_values_and_targets():
    m = Typed()
    pu.Stepper(m)
    with pu.step(m):
        pu.assign_add(m.phase, 1 + 2j)  # a complex number into a complex target
        pu.assign_key(m.phase, 0, 3j)
    assert torch.equal(m.phase, torch.tensor([3j, 1 + 2j], dtype=torch.complex64))
    pu.assign_sub(m.phase, 1j)  # eager too
    assert torch.equal(m.phase, torch.tensor([2j, 1 + 1j], dtype=torch.complex64))
    with pytest.raises(pu.UpdateError) as ei:
        pu.assign(m.lin.bias, 1j)  # MARK: complex into float
    _check(str(ei.value), "'lin.bias'", "MARK: complex into float", "imaginary part", "value.real")
    with pytest.raises(pu.UpdateError) as ei:
        pu.constrain(m.phase, pu.clamp(0.0, 1.0))  # MARK: clamp a complex tensor
    _check(str(ei.value), "'0'", "MARK: clamp a complex tensor", "needs a real dtype", "callable")


def test_a_norm_constraint_on_an_int_tensor():
    m = Typed()
    with pytest.raises(pu.UpdateError) as ei:
        pu.constrain([("code", m.code)], pu.max_norm(1.0))  # MARK: max_norm on int
    _check(str(ei.value), "'code'", "MARK: max_norm on int", "need floating point", "leave this one out")


def test_a_step_on_meta_tensors():
    with torch.device("meta"):
        m = Typed()
    opt = torch.optim.SGD(m.lin.parameters(), lr=0.1)
    with pytest.raises(pu.UpdateError) as ei:
        with pu.step(m, opt):  # MARK: a meta model
            pu.assign_add(m.count, 1)
    _check(str(ei.value), "'code', 'count'", "MARK: a meta model", "meta device", "to_empty", "Nothing was written")


def test_a_pu_step_object_is_one_step():
    m = Typed()
    s = pu.step(m)
    with s:
        pu.assign_add(m.count, 1)
    with pytest.raises(pu.UpdateError) as ei:
        with s:  # MARK: entered again
            pass
    _check(str(ei.value), "Typed", "MARK: entered again", "already used", "pu.Stepper")
    assert torch.equal(m.count, torch.ones(2, dtype=torch.int32))


def test_wrong_argument_types_name_the_call():
    m = Typed()
    opt = torch.optim.SGD(m.lin.parameters(), lr=0.1)
    with pytest.raises(TypeError) as ei:
        pu.step(m, m)  # MARK: pu.step(model, model)
    _check(str(ei.value), "Typed", "MARK: pu.step(model, model)", "torch.optim.Optimizer", "pu.step(model, optimizer)")
    with pytest.raises(TypeError) as ei:
        pu.step(opt, m)  # MARK: swapped
    _check(str(ei.value), "SGD", "MARK: swapped", "torch.nn.Module")
    with pytest.raises(TypeError) as ei:
        pu.attach(m, m)  # MARK: attach(model, model)
    _check(str(ei.value), "Typed", "MARK: attach(model, model)", "torch.optim.Optimizer")


def test_with_stepper_names_the_with_line():
    m = Typed()
    stepper = pu.Stepper(m)
    with pytest.raises(pu.UpdateError) as ei:
        with stepper:  # MARK: with stepper
            pu.assign(m.lin.bias, float("nan"), phase="after_grad")
    _check(str(ei.value), "'lin.bias'", "MARK: with stepper", "non-finite")
    assert str(ei.value).startswith(f"pu.step at tests/test_misuse.py:{_line_of('MARK: with stepper')}:")
    with pytest.raises(pu.UpdateError) as ei:
        with stepper.step():  # MARK: stepper.step()
            pu.assign(m.lin.bias, float("nan"), phase="after_grad")
    assert str(ei.value).startswith(f"pu.step at tests/test_misuse.py:{_line_of('MARK: stepper.step()')}:")


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
