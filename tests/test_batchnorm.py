"""pu.nn.BatchNorm*d equals torch.nn.BatchNorm*d bitwise where PyTorch is right.

Every case runs the torch module and the pu module side by side from the
same state on the same data and compares outputs, input and parameter
gradients and every buffer bitwise (CPU).
"""

import contextlib
import inspect

import pytest
import torch
from torch import nn

import paramupdates as pu

from conftest import bits

CASES = [
    (nn.BatchNorm1d, pu.nn.BatchNorm1d, (8, 4)),
    (nn.BatchNorm1d, pu.nn.BatchNorm1d, (8, 4, 5)),
    (nn.BatchNorm2d, pu.nn.BatchNorm2d, (6, 4, 5, 3)),
    (nn.BatchNorm3d, pu.nn.BatchNorm3d, (4, 4, 3, 2, 3)),
]


def _pair(tcls, pcls, momentum, affine, track):
    ref = tcls(4, momentum=momentum, affine=affine, track_running_stats=track)
    mod = pcls(4, momentum=momentum, affine=affine, track_running_stats=track)
    with torch.no_grad():
        if affine:
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
        if track:
            ref.running_mean.uniform_(-1, 1)
            ref.running_var.uniform_(0.5, 2)
            ref.num_batches_tracked.fill_(3)
    mod.load_state_dict(ref.state_dict())
    return ref, mod


def _assert_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), what


def _assert_modules(ref, mod):
    rs, ms = ref.state_dict(), mod.state_dict()
    assert list(rs) == list(ms)
    for k in rs:
        _assert_bits(rs[k], ms[k], k)
    for (k, p), (_, q) in zip(ref.named_parameters(), mod.named_parameters()):
        if p.grad is not None or q.grad is not None:
            _assert_bits(p.grad, q.grad, f"{k}.grad")


def _run(module, xs, train, stepper_cls=None):
    module.train(train)
    outs, grads = [], []
    for x in xs:
        x = x.clone().requires_grad_(True)
        if stepper_cls is None:
            y = module(x)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        else:
            with pu.step(module):
                y = module(x)
                (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append(x.grad)
    return outs, grads


@pytest.mark.parametrize("tcls,pcls,shape", CASES, ids=lambda c: getattr(c, "__name__", str(c)))
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("in_step", [False, True])
def test_batchnorm_bitwise_equal_to_torch(tcls, pcls, shape, momentum, affine, track, train, in_step):
    ref, mod = _pair(tcls, pcls, momentum, affine, track)
    xs = [torch.randn(shape) * 3 + 1 for _ in range(3)]
    ro, rg = _run(ref, xs, train)
    mo, mg = _run(mod, xs, train, pu.step if in_step else None)
    for i in range(3):
        _assert_bits(ro[i], mo[i], f"output {i}")
        _assert_bits(rg[i], mg[i], f"input grad {i}")
    _assert_modules(ref, mod)


def test_state_dict_keys_and_round_trip():
    ref, mod = _pair(nn.BatchNorm2d, pu.nn.BatchNorm2d, 0.1, True, True)
    assert (
        list(ref.state_dict())
        == list(mod.state_dict())
        == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    )
    back = nn.BatchNorm2d(4)
    back.load_state_dict(mod.state_dict())
    _assert_modules(ref, back)
    assert isinstance(mod, nn.BatchNorm2d)  # a drop-in subclass


def test_constructor_arguments_match_torch():
    m = pu.nn.BatchNorm1d(3, 1e-3, 0.3, False, True, dtype=torch.float64)
    assert (m.eps, m.momentum, m.affine, m.track_running_stats) == (1e-3, 0.3, False, True)
    assert m.running_mean.dtype == torch.float64 and m.weight is None
    assert m.sync_stats is False and "sync_stats" not in repr(m)
    assert "sync_stats=True" in repr(pu.nn.BatchNorm1d(3, sync_stats=True))
    with pytest.raises(ValueError):
        pu.nn.BatchNorm2d(3)(torch.randn(2, 3))  # torch's own input check


def test_no_write_before_commit_and_reads_see_pending():
    """Rule 2 and read-your-writes (rule 1) for the running statistics inside a step."""
    mod = pu.nn.BatchNorm1d(4)
    ref = nn.BatchNorm1d(4)
    committed = mod.running_mean
    version = committed._version
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)
    with pu.step(mod):
        mod(x1)
        assert torch.equal(committed, torch.zeros(4)) and committed._version == version
        ref(x1)
        _assert_bits(mod.running_mean, ref.running_mean, "pending value read through the module")
        mod(x2)  # the second forward of the step starts from the pending statistics
        ref(x2)
        assert int(mod.num_batches_tracked) == 2
    assert mod.running_mean is committed  # the committed tensor object is kept
    _assert_modules(ref, mod)


def test_sync_stats_issues_mean_synced_updates():
    mod = pu.nn.BatchNorm1d(4, sync_stats=True)
    s = pu.Stepper(mod)
    s.run(mod, torch.randn(8, 4))
    ops = {r.target: r.op for r in s.schedule()}
    assert ops == {
        "num_batches_tracked": "assign_add",
        "running_mean": "assign sync=mean",
        "running_var": "assign sync=mean",
    }


class _CallsItsNorm(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)  # the line the statistics show


def _line_before() -> str:
    """``file:line`` of the line before the caller's."""
    f = inspect.currentframe().f_back
    return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno - 1}"


def test_schedule_origin_is_the_users_call_of_the_module():
    """Issue 38: a batch norm's statistics show the user's line that called the module (the frames of
    pu.nn and torch.nn between are skipped), never a line inside paramupdates: in a module of the
    user's, through nn.Sequential, through Stepper.run, and on the synced path alike."""
    mod = pu.nn.BatchNorm1d(4)
    s = pu.Stepper(mod)
    s.run(mod, torch.randn(8, 4))
    site = _line_before()
    assert [r.phase for r in s.schedule()] == ["auxiliary"] * 3
    assert all(r.origin.endswith(site) for r in s.schedule()), s.schedule()
    for sync_stats in (False, True):
        net = _CallsItsNorm(pu.nn.BatchNorm1d(4, sync_stats=sync_stats))
        with pu.step(net) as s2:
            net(torch.randn(8, 4))
        lines, start = inspect.getsourcelines(_CallsItsNorm.forward)
        line = start + next(i for i, text in enumerate(lines) if "self.norm(x)" in text)
        assert all(r.origin.endswith(f"test_batchnorm.py:{line}") for r in s2.schedule()), s2.schedule()
    seq = nn.Sequential(nn.Linear(4, 4), pu.nn.BatchNorm1d(4))
    with pu.step(seq) as s3:
        seq(torch.randn(8, 4))
        site = _line_before()
    assert all(r.origin.endswith(site) for r in s3.schedule()), s3.schedule()
    assert not any("paramupdates" in r.origin for sched in (s, s2, s3) for r in sched.schedule())


def test_reset_running_stats_in_a_step_is_pending():
    mod = pu.nn.BatchNorm1d(4)
    mod(torch.randn(8, 4))
    committed = mod.running_mean
    before = committed.clone()
    with pu.step(mod):
        mod.reset_running_stats()
        assert torch.equal(mod.running_mean, torch.zeros(4))  # the read sees the reset
        assert torch.equal(committed, before)  # storage untouched until commit
    assert torch.equal(mod.running_mean, torch.zeros(4)) and int(mod.num_batches_tracked) == 0
    mod(torch.randn(8, 4))
    with pytest.raises(RuntimeError, match="boom"), pu.step(mod):
        mod.reset_running_stats()
        raise RuntimeError("boom")
    assert not torch.equal(mod.running_mean, torch.zeros(4)) and not torch.equal(before, mod.running_mean)


@pytest.mark.parametrize("flag", [False, True])
def test_tensor_condition_gates_the_statistics(flag):
    """Rule 6 inside the module: pu.when(tensor) around a forward -> where(pred, new, old)."""
    ref, mod = _pair(nn.BatchNorm1d, pu.nn.BatchNorm1d, None, True, True)
    x = torch.randn(8, 4)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    with pu.step(mod), pu.when(torch.tensor(flag)):
        y = mod(x)
    assert torch.equal(bits(y), bits(ref(x)))  # the output never depends on the condition
    if flag:
        _assert_modules(ref, mod)
    else:
        for k, v in mod.state_dict().items():
            _assert_bits(v, before[k], k)


def test_eval_forward_in_the_same_step_reads_pending_statistics():
    ref, mod = _pair(nn.BatchNorm1d, pu.nn.BatchNorm1d, 0.1, True, True)
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)
    ref(x1)
    ref.eval()
    y_ref = ref(x2)
    with pu.step(mod):
        mod(x1)
        mod.eval()
        y = mod(x2)  # normalizes with the statistics x1 left pending (read-your-writes, rule 1)
    _assert_bits(y_ref, y, "eval output")
    _assert_modules(ref, mod)


def test_statistics_become_the_pending_values_without_a_copy():
    """pu.nn hands the statistics it computed for an update over as they are (assign_fresh);
    a user's assign still copies, so the user's later in-place writes cannot reach the step."""
    from paramupdates.updates import assign_fresh

    bn = pu.nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    with pu.step(bn):
        fresh = bn.running_mean.clone().add_(1.0)
        assign_fresh(bn.running_mean, fresh)
        assert bn.running_mean.data_ptr() == fresh.data_ptr()  # the handed-over storage itself, not a copy
        mine = torch.full((3,), 5.0)
        pu.assign(bn.running_var, mine)
        mine.fill_(7.0)  # after the assign: not seen by the step
        assert torch.equal(bn.running_var, torch.full((3,), 5.0))
        bn(x)
    ref = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        ref.running_mean.add_(1.0)
        ref.running_var.fill_(5.0)
    ref(x)
    assert torch.equal(bn.running_mean, ref.running_mean) and torch.equal(bn.running_var, ref.running_var)


# --- drop-in: every argument of the installed torch's classes --------------------------
PAIRS = [
    (nn.BatchNorm1d, pu.nn.BatchNorm1d, (6, 3, 4)),
    (nn.BatchNorm2d, pu.nn.BatchNorm2d, (4, 3, 5, 2)),
    (nn.BatchNorm3d, pu.nn.BatchNorm3d, (3, 3, 2, 3, 2)),
    (nn.SyncBatchNorm, pu.nn.SyncBatchNorm, (4, 3, 5, 2)),  # one process: a batch norm
]
# a value other than the default for every argument torch's batch norms take (bias= since torch 2.x)
NON_DEFAULT = {
    "eps": 1e-3,
    "momentum": None,
    "affine": False,
    "track_running_stats": False,
    "device": "cpu",
    "dtype": torch.float64,
    "bias": False,
    "process_group": None,
}


def _assert_drop_in(tcls, pcls, kwargs, shape, args=(3,)):
    """Same init, then the same outputs, input and parameter gradients and state_dict, bitwise, in train
    and eval mode, eagerly and in pu.step."""
    torch.manual_seed(0)
    ref = tcls(*args, **kwargs)
    torch.manual_seed(0)
    mod = pcls(*args, **kwargs)
    rs, ms = ref.state_dict(), mod.state_dict()
    assert list(rs) == list(ms), kwargs
    for k in rs:
        _assert_bits(rs[k], ms[k], k)
    dtype = ref.running_mean.dtype if ref.running_mean is not None else kwargs.get("dtype", torch.float32)
    xs = [torch.randn(shape, dtype=dtype) * 2 + 1 for _ in range(2)]
    for train in (True, False):
        for in_step in (False, True):
            ro, rg = _run(ref, xs, train)
            mo, mg = _run(mod, xs, train, pu.step if in_step else None)
            for i in range(len(xs)):
                _assert_bits(ro[i], mo[i], f"output {i} ({kwargs}, train={train}, in_step={in_step})")
                _assert_bits(rg[i], mg[i], f"input grad {i} ({kwargs})")
            _assert_modules(ref, mod)
    assert repr(ref).replace(type(ref).__name__, "") == repr(mod).replace(type(mod).__name__, "")


@pytest.mark.parametrize("tcls,pcls,shape", PAIRS, ids=lambda c: getattr(c, "__name__", ""))
def test_every_argument_of_torchs_class_is_accepted(tcls, pcls, shape):
    """The signature is the installed torch class's plus sync_stats; each argument, given alone with a
    value other than its default (bias=False raised TypeError before the fix), builds the module torch
    builds, which then trains and evaluates as torch's does."""
    theirs = inspect.signature(tcls).parameters
    ours = dict(inspect.signature(pcls).parameters)
    assert ours.pop("sync_stats").default is False
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]
    for name in list(theirs)[1:]:
        assert name in NON_DEFAULT, f"torch's {tcls.__name__} takes {name!r}: give this test a value for it"
        _assert_drop_in(tcls, pcls, {name: NON_DEFAULT[name]}, shape)
    _assert_drop_in(tcls, pcls, {"bias": False, "momentum": None, "eps": 1e-4}, shape)
    positional = [p for p in theirs.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert pcls(*[3, *(p.default for p in positional[1:])]).sync_stats is False  # every positional one too


def _module_db_batchnorms():
    try:
        from torch.testing._internal.common_modules import module_db  # needs expecttest (the test extra)
    except Exception as exc:  # noqa: BLE001 - an internal torch module: any failure to import is a skip
        pytest.skip(f"torch.testing._internal.common_modules does not import: {exc}")
    return {m.module_cls: m for m in module_db if m.module_cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)}


@pytest.mark.parametrize(
    "tcls,pcls,entry",
    [(t, p, t) for t, p, _ in PAIRS[:3]]
    + [
        (nn.SyncBatchNorm, pu.nn.SyncBatchNorm, nn.BatchNorm2d),
        (nn.SyncBatchNorm, pu.nn.SyncBatchNorm, nn.BatchNorm3d),
    ],
    ids=lambda c: getattr(c, "__name__", ""),
)
def test_pytorchs_own_module_inputs(tcls, pcls, entry):
    """PyTorch's own test cases for its batch norms (``module_db``'s ``module_inputs_func``, the inputs of
    test/test_modules.py: affine, not affine, bias=False, cumulative average, not tracking, zero batch, ...):
    the pu class built from the same constructor input equals torch's, bitwise, in train and eval mode."""
    info = _module_db_batchnorms()[entry]
    n = 0
    for training in (True, False):
        for mi in info.module_inputs_func(
            info, device="cpu", dtype=torch.float32, requires_grad=True, training=training
        ):
            args, kwargs = mi.constructor_input.args, mi.constructor_input.kwargs
            torch.manual_seed(0)
            ref = tcls(*args, **kwargs).train(training)
            torch.manual_seed(0)
            mod = pcls(*args, **kwargs).train(training)
            for in_step in (False, True):
                x = mi.forward_input.args[0].detach()
                outs = []
                for m in (ref, mod):
                    xi = x.clone().requires_grad_(True)
                    with pu.step(m) if in_step and m is mod else contextlib.nullcontext():
                        y = m(xi)
                        if y.numel():
                            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
                    outs.append((y.detach(), xi.grad))
                (yr, gr), (ym, gm) = outs
                _assert_bits(yr, ym, f"{mi.desc}: output")
                if gr is not None or gm is not None:
                    _assert_bits(gr, gm, f"{mi.desc}: input grad")
                _assert_modules(ref, mod)
                ref.zero_grad()
                mod.zero_grad()
            n += 1
    assert n >= 14  # every case of the entry, in both modes


@pytest.mark.parametrize(
    ("tcls", "pcls", "shape"),
    [(nn.BatchNorm1d, pu.nn.BatchNorm1d, (1, 4)), (nn.BatchNorm2d, pu.nn.BatchNorm2d, (1, 4, 1, 1))],
)
def test_one_value_per_channel_in_training_raises_torchs_error_and_writes_nothing(tcls, pcls, shape):
    """The statistics call torch.batch_norm directly (F.batch_norm's wrapper costs 2.3 us a call):
    F.batch_norm's check of the batch comes with it, the same ValueError, before anything is recorded."""
    x = torch.randn(*shape)
    with pytest.raises(ValueError) as theirs:
        tcls(4)(x)
    bn = pcls(4)
    model = nn.Sequential(bn)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    with pytest.raises(ValueError) as ours, pu.step(model) as s:
        bn(x)
    assert str(ours.value) == str(theirs.value)
    assert all(torch.equal(before[k], v) for k, v in bn.state_dict().items())
    assert len(s.pending_schedule()) == 0 and len(s.schedule()) == 0
    with pu.step(model):
        bn(torch.randn(2, *shape[1:]))  # the next step records and commits as usual
    assert int(bn.num_batches_tracked) == 1


def test_a_forward_is_one_record_and_a_later_update_of_a_statistic_folds_after_it():
    """A batch norm's call is one record of its three statistics (kept on the record while nothing else
    touches them); an update of one of them later in the step, and a second forward, fold after it in
    issue order, bitwise what torch's in-place writes in that order leave."""
    ref, mod = _pair(nn.BatchNorm1d, pu.nn.BatchNorm1d, 0.1, True, True)
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)
    block = pu.step(mod)
    with block as s:
        mod(x1)
        (rec,) = block._journal.order
        assert sorted(rec.names()) == ["num_batches_tracked", "running_mean", "running_var"] and not rec.entries
        pu.assign_add(mod.running_mean, 1.0)  # reads the pending mean: the record's values
        mod(x2)
        pu.assign_sub(mod.running_var, 0.25)
    ref(x1)
    with torch.no_grad():
        ref.running_mean.add_(1.0)
    ref(x2)
    with torch.no_grad():
        ref.running_var.sub_(0.25)
    _assert_modules(ref, mod)
    ops = [(r.target, r.op) for r in s.schedule()]
    three = [(n, op) for n, op in zip(rec.names(), rec.ops)]
    assert ops == three + [("running_mean", "assign_add")] + three + [("running_var", "assign_sub")]


def _cumulative_pair(tcls, pcls):
    """A fresh torch batch norm with ``momentum=None`` (``num_batches_tracked == 0``) and its pu twin."""
    ref = tcls(4, momentum=None)
    mod = pcls(4, momentum=None)
    mod.load_state_dict(ref.state_dict())
    return ref, mod


CUMULATIVE = [(nn.BatchNorm1d, pu.nn.BatchNorm1d, (8, 4)), (nn.BatchNorm2d, pu.nn.BatchNorm2d, (6, 4, 5, 3))]


@pytest.mark.parametrize("tcls,pcls,shape", CUMULATIVE, ids=lambda c: getattr(c, "__name__", str(c)))
@pytest.mark.parametrize("where", ["no step", "pu.step", "pu.attach"])
def test_cumulative_average_under_a_tensor_condition_is_torchs_on_the_steps_it_holds(tcls, pcls, shape, where):
    """momentum=None under pu.when(tensor) on a fresh model (issue 49): a False step leaves the statistics
    as they are (no ZeroDivisionError from 1 / num_batches_tracked), a True step is bitwise torch's module
    run on the True steps alone (the factor stays on the device: the condition is not read on the host)."""
    ref, mod = _cumulative_pair(tcls, pcls)
    # (lr=0: the optimizer's step commits the statistics and leaves the weights as torch's module has them)
    opt = torch.optim.SGD(mod.parameters(), lr=0.0) if where == "pu.attach" else None
    att = pu.attach(mod, opt) if opt is not None else None
    flags = [False, True, False, True, True, False]
    for i, flag in enumerate(flags):
        x = torch.randn(shape) * 3 + 1
        before = {k: v.clone() for k, v in mod.state_dict().items()}
        step = pu.step(mod) if where == "pu.step" else contextlib.nullcontext()
        with step, pu.when(torch.tensor(flag)):
            y = mod(x)
        if opt is not None:
            y.sum().backward()
            opt.step()
            opt.zero_grad()
        if flag:
            with torch.no_grad():
                y_ref = ref(x)
            _assert_bits(y_ref, y.detach(), f"output {i}")
            for k, v in ref.state_dict().items():
                _assert_bits(v, mod.state_dict()[k], f"{k} after step {i}")
        else:
            for k, v in mod.state_dict().items():
                _assert_bits(before[k], v, f"{k} after step {i} (False)")
    if att is not None:
        att.detach()


@pytest.mark.parametrize("flag", [False, True])
def test_cumulative_average_two_forwards_of_a_step_under_a_tensor_condition(flag):
    """Gradient accumulation: the second forward reads the count the first left pending (conditional):
    the factor is taken from it on the device, bitwise torch's two forwards when the flag is True."""
    ref, mod = _cumulative_pair(nn.BatchNorm1d, pu.nn.BatchNorm1d)
    xs = [torch.randn(8, 4) * 3 + 1 for _ in range(2)]
    with pu.step(mod), pu.when(torch.tensor(flag)):
        for x in xs:
            mod(x)
    if flag:
        for x in xs:
            ref(x)
    _assert_modules(ref, mod)


def test_cumulative_average_under_a_host_condition_is_unchanged():
    """pu.when(True/False) around a momentum=None forward: False records nothing, True is torch's."""
    ref, mod = _cumulative_pair(nn.BatchNorm1d, pu.nn.BatchNorm1d)
    for flag in (False, True, False, True):
        x = torch.randn(8, 4)
        with pu.step(mod), pu.when(flag):
            mod(x)
        if flag:
            ref(x)
        _assert_modules(ref, mod)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records every read of a tensor's value to the host (bool(), float(), int(), .item(), .tolist())."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist"):
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("flag", [False, True])
def test_cumulative_average_under_a_tensor_condition_reads_nothing_on_the_host(flag):
    """Rule 6: a tensor condition is never read on the host, nor is the count it may have left pending
    (the cumulative average's factor 1 / num_batches_tracked stays on the device)."""
    mod = pu.nn.BatchNorm1d(4, momentum=None)
    with _HostReads() as seen, pu.step(mod), pu.when(torch.tensor(flag)):
        mod(torch.randn(8, 4))
        mod(torch.randn(8, 4))
    assert seen.reads == []
    assert int(mod.num_batches_tracked) == (2 if flag else 0)
