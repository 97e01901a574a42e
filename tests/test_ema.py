"""pu.ema: phase after_step, once per optimizer update, checked against torch.optim.swa_utils.AveragedModel."""

import copy
import inspect

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import paramupdates as pu
from paramupdates.rules.ema import rule_of

from conftest import assert_same, bits, snapshot
from models import Counter


def _bn_net():
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def _data(n=5, d=4):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(8, d, generator=g) for _ in range(n)]


def test_matches_averaged_model_with_ema_multi_avg_fn_bitwise():
    m = _bn_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    avg = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    avg.update_parameters(m)  # AveragedModel's first update copies; ours starts from the copy at declaration
    ours = pu.ema(m, 0.9)
    stepper = pu.Stepper(m, opt)
    for x in _data():
        with stepper:
            m(x).pow(2).mean().backward()
        opt.zero_grad()
        avg.update_parameters(m)
    theirs = avg.module.state_dict()
    for k, v in ours.state_dict().items():
        if v.is_floating_point():
            assert torch.equal(bits(v), bits(theirs[k])), k  # parameters and running statistics, bitwise
    # Where PyTorch is wrong: AveragedModel "averages" the integer num_batches_tracked in float and
    # truncates, so it lags the model; pu.ema copies it.
    assert int(ours[1].num_batches_tracked) == int(m[1].num_batches_tracked) == 5
    assert int(avg.module[1].num_batches_tracked) < 5


def test_sees_the_committed_running_statistics():
    m = Counter()  # acc and scale are updated in the auxiliary phase of each step
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    averaged = pu.ema(m, 0.5)
    a_acc = averaged.acc.clone()
    for x in _data(3, 3):
        with pu.step(m, opt):
            m(x).sum().backward()
        opt.zero_grad()
        a_acc = torch.lerp(a_acc, m.acc, 1 - 0.5)  # the value committed by this step, not the one before
        assert torch.equal(bits(averaged.acc), bits(a_acc))
        assert torch.equal(averaged.count, m.count)  # integer buffer: copied


def _reference_ema(m, opt, decay, data, k):
    """Hand-written: accumulate k micro-batches, step, then average once."""
    avg = [t.detach().clone() for t in m.parameters()]
    for i in range(0, len(data), k):
        for x in data[i : i + k]:
            m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for a, p in zip(avg, m.parameters()):
                a.lerp_(p, 1 - decay)
    return avg


@pytest.mark.parametrize("how", ["one_step", "micro_steps", "attach"])
def test_gradient_accumulation_averages_once_per_optimizer_update(how):
    """The Keras bug (EMA applied per micro-step under gradient accumulation) must not exist."""
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))
    ref_m = copy.deepcopy(m)
    data = _data(6)
    ref = _reference_ema(ref_m, torch.optim.SGD(ref_m.parameters(), lr=0.1), 0.8, data, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    averaged = pu.ema(m, 0.8)
    att = pu.attach(m, opt) if how == "attach" else None
    for i in range(0, 6, 3):
        micro = data[i : i + 3]
        if how == "one_step":
            with pu.step(m, opt):
                for x in micro:
                    m(x).pow(2).mean().backward()
        elif how == "micro_steps":
            for j, x in enumerate(micro):
                with pu.step(m, opt if j == 2 else None):
                    m(x).pow(2).mean().backward()
        else:
            for x in micro:
                m(x).pow(2).mean().backward()
            opt.step()
        opt.zero_grad()
    assert rule_of(averaged).updates == 2
    if att is not None:
        assert att.steps == 2
    for a, r in zip(averaged.parameters(), ref):
        assert torch.equal(bits(a), bits(r))


def test_warmup_formula():
    m = nn.Linear(3, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.3)
    averaged = pu.ema(m, 0.99, warmup=True)
    custom = pu.ema(m, 0.99, warmup=lambda t: 0.5)
    ref = m.weight.detach().clone()
    for t, x in enumerate(_data(4, 3)):
        with pu.step(m, opt):
            m(x).sum().backward()
        opt.zero_grad()
        d = min(0.99, (1 + t) / (10 + t))
        ref = torch.lerp(ref, m.weight.detach(), 1 - d)
        assert torch.equal(bits(averaged.weight), bits(ref))
    assert rule_of(custom).decay_at(3) == 0.5 and rule_of(averaged).decay_at(1000) == 0.99
    assert rule_of(pu.ema(m, 0.9, warmup=5)).decay_at(0) == 1 / 5


def _train(m, opt, stepper, data):
    for x in data:
        with stepper:
            m(x).pow(2).mean().backward()
        opt.zero_grad()


def _everything(m, opt, averaged):
    """Model, optimizer state (by position, not by id) and the averaged copy."""
    opt_tensors = [v for st in opt.state_dict()["state"].values() for v in st.values()]
    return snapshot(m, averaged, *opt_tensors)


@pytest.mark.parametrize("how", ["stepper", "attach"])
def test_resume_is_bitwise_identical(how):
    data = _data(6)
    m = _bn_net()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    pu.weight_decay(m, 0.01)
    pu.constrain(m[0].weight, pu.max_norm(1.0))
    averaged = pu.ema(m, 0.9, warmup=True)
    owner = pu.Stepper(m, opt) if how == "stepper" else pu.attach(m, opt)

    def run(m, opt, owner, xs):
        for x in xs:
            if how == "stepper":
                with owner:
                    m(x).pow(2).mean().backward()
            else:
                m(x).pow(2).mean().backward()
                opt.step()
            opt.zero_grad()

    run(m, opt, owner, data[:3])
    saved = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict(), "pu": owner.state_dict()})
    assert saved["pu"]["rules"]["2:ema"]["updates"] == 3
    run(m, opt, owner, data[3:])
    expect = _everything(m, opt, averaged)

    # a fresh process: same declarations, then load
    torch.manual_seed(123)
    pu.testing.reset()
    m2 = _bn_net()
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.01)
    pu.weight_decay(m2, 0.01)
    pu.constrain(m2[0].weight, pu.max_norm(1.0))
    averaged2 = pu.ema(m2, 0.9, warmup=True)
    owner2 = pu.Stepper(m2, opt2) if how == "stepper" else pu.attach(m2, opt2)
    m2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    owner2.load_state_dict(saved["pu"])
    assert rule_of(averaged2).updates == 3
    run(m2, opt2, owner2, data[3:])
    assert_same(expect, _everything(m2, opt2, averaged2))


def test_copy_is_for_evaluation_and_not_a_target_of_the_models_steps():
    m = _bn_net()
    averaged = pu.ema(m, 0.9)
    assert type(averaged) is type(m) and not averaged.training
    assert not any(p.requires_grad for p in averaged.parameters())
    assert all(a is not p for a, p in zip(averaged.parameters(), m.parameters()))
    with pytest.raises(pu.UpdateError, match="not a parameter or buffer of the model"):
        with pu.step(m):
            pu.assign(averaged[1].running_mean, torch.zeros(6))
    averaged(torch.randn(3, 4))  # usable for evaluation


def test_include_buffers_false_copies_the_statistics():
    m = _bn_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    averaged = pu.ema(m, 0.9, include_buffers=False)
    _train(m, opt, pu.Stepper(m, opt), _data(3))
    assert torch.equal(averaged[1].running_mean, m[1].running_mean)
    assert not torch.equal(averaged[0].weight, m[0].weight)


def test_schedule_row_declared_after_the_stepper_and_other_models_unaffected():
    g, d = nn.Linear(3, 3), nn.Linear(3, 1)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    sg, sd = pu.Stepper(g, opt_g), pu.Stepper(d, opt_d)
    line = inspect.currentframe().f_lineno + 1
    averaged = pu.ema(g, 0.5)
    with sd:
        d(torch.randn(2, 3)).sum().backward()
    assert rule_of(averaged).updates == 0 and not any(r.phase == "after_step" for r in sd.schedule())
    with sg:
        g(torch.randn(2, 3)).sum().backward()
    assert rule_of(averaged).updates == 1
    row = sg.schedule()[-1]
    assert row.phase == "after_step" and row.origin.endswith(f"test_ema.py:{line}")
    assert sd.state_dict()["rules"] == {} and list(sg.state_dict()["rules"]) == ["0:ema"]


def test_moved_copy_is_an_error_before_anything_is_written():
    m = nn.Linear(3, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    averaged = pu.ema(m, 0.5)
    averaged.double()
    before = snapshot(m, opt, *averaged.state_dict().values())
    with pytest.raises(pu.UpdateError, match="'weight' is cpu/float32/.* in the model but cpu/float64"):
        with pu.step(m, opt):
            m(torch.randn(2, 3)).sum().backward()
    assert_same(before, snapshot(m, opt, *averaged.state_dict().values()))
    assert rule_of(averaged).updates == 0


def test_declaration_errors():
    m = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="decay"):
        pu.ema(m, 1.5)
    with pytest.raises(TypeError):
        pu.ema(m.weight, 0.9)
    with pytest.raises(ValueError, match="warmup"):
        pu.ema(m, 0.9, warmup=-1)


# --- t is a buffer of the copy; timm's warmup; dtype= and device= -------------------


def _steps(m, opt, xs):
    stepper = pu.Stepper(m, opt)
    for x in xs:
        with stepper:
            m(x).pow(2).mean().backward()
        opt.zero_grad()


def _saved(obj, path, **load):
    torch.save(obj, path)
    return torch.load(path, **load)


@pytest.mark.parametrize("weights_only", [True, False])
def test_saving_the_copy_alone_resumes_the_warmup_bitwise(tmp_path, weights_only):
    """A framework that saves only the averaged copy (timm's CheckpointSaver, a Lightning module holding it)
    keeps the warmup state: ``t`` travels in the metadata of the copy's state_dict. (Earlier, t
    lived only in the rule and a resumed warmup restarted at t = 0; later it was a buffer.)"""
    data = _data(6)
    m = _bn_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    averaged = pu.ema(m, 0.99, warmup=True)
    _steps(m, opt, data[:3])
    sd = averaged.state_dict()
    assert sd._metadata[""]["pu_ema_updates"] == rule_of(averaged).updates == 3
    assert list(sd) == list(m.state_dict())  # no tensor beside the model's
    saved = _saved({"model": m.state_dict(), "opt": opt.state_dict(), "ema": sd}, tmp_path / "c.pt")
    _steps(m, opt, data[3:])
    expect = snapshot(m, averaged)

    torch.manual_seed(9)
    m2 = _bn_net()
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    averaged2 = pu.ema(m2, 0.99, warmup=True)
    saved = torch.load(tmp_path / "c.pt", weights_only=weights_only)
    m2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    averaged2.load_state_dict(saved["ema"])  # the copy alone, no pu state_dict
    assert rule_of(averaged2).updates == 3
    _steps(m2, opt2, data[3:])
    assert_same(expect, snapshot(m2, averaged2))
    assert rule_of(averaged2).updates == 6


def test_the_copy_loads_into_the_model_strictly_and_its_buffers_pair_with_the_models():
    """The most common EMA pattern: evaluate or export the averaged weights by loading them into the model,
    and code written for ``AveragedModel(...).module``. Failed before the fix: the copy had an extra root
    buffer, pu_ema_updates ('Unexpected key(s)'; zip(copy.buffers(), model.buffers()) off by one)."""
    m = _bn_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    averaged = pu.ema(m, 0.5)
    _steps(m, opt, _data(3))
    swa = AveragedModel(m, use_buffers=True)
    assert list(averaged.state_dict()) == list(m.state_dict()) == list(swa.module.state_dict())
    assert [n for n, _ in averaged.named_buffers()] == [n for n, _ in m.named_buffers()]
    for (na, a), (nb, b) in zip(averaged.named_buffers(), m.named_buffers()):
        assert na == nb and a.shape == b.shape and a.dtype == b.dtype
    target = copy.deepcopy(m)
    keys = target.load_state_dict(averaged.state_dict())  # strict: no missing, no unexpected key
    assert keys.missing_keys == keys.unexpected_keys == []
    assert_same(snapshot(target), snapshot(averaged))
    target.load_state_dict(pu.rules.ema.weights(averaged))  # the older spelling still works
    assert_same(snapshot(target), snapshot(averaged))
    assert rule_of(averaged).updates == 3  # loading the copy elsewhere leaves its t alone


def test_counter_travels_with_a_module_that_holds_the_copy(tmp_path):
    """A LightningModule-like holder: its state_dict carries t under the copy's prefix; loading it restores t."""

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _bn_net()
            self.ema = pu.ema(self.net, 0.9, warmup=True)

    h = Holder()
    _steps(h.net, torch.optim.SGD(h.net.parameters(), lr=0.1), _data(4))
    sd = _saved(h.state_dict(), tmp_path / "h.pt")  # weights_only=True
    assert sd._metadata["ema"]["pu_ema_updates"] == 4 and "ema.pu_ema_updates" not in sd
    fresh = Holder()
    fresh.load_state_dict(sd)
    assert rule_of(fresh.ema).updates == 4
    assert_same(snapshot(h), snapshot(fresh))
    rule_of(fresh.ema).updates = 2
    with pytest.warns(pu.AccountingWarning, match=r"update counter t .* t stays 2") as rec:
        fresh.load_state_dict(dict(sd))  # a plain dict: no metadata, t left as it is, and said
    assert rule_of(fresh.ema).updates == 2
    assert rec[0].filename == __file__  # (the user's load call, not torch's hook runner)


def test_a_plain_dict_without_the_counter_warns_for_a_warmup_only(tmp_path):
    """A state_dict rebuilt as a plain dict (safetensors, ``{k: v.cpu() ...}``, DCP's flattening) drops the
    metadata where the copy keeps t: loading it into the copy of an EMA with a warmup keeps t as it is and
    warns (pu.AccountingWarning: the rule, its declaration site, the load's call site, the fix), since the
    warmup goes on from that t; an EMA without warmup, whose decay does not depend on t, loads quietly, and
    so does a Stepper's or attachment's state_dict (it carries t as a plain entry)."""
    for warmup in (None, 10):
        pu.testing.reset()
        net = _bn_net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        avg = pu.ema(net, 0.9, warmup=warmup)
        att = pu.attach(net, opt)
        _steps(net, opt, _data(3))
        plain = {k: v.clone() for k, v in avg.state_dict().items()}
        state = att.state_dict()
        state["rules"] = {
            k: {**v, "module": {n: t.clone() for n, t in v["module"].items()}} for k, v in state["rules"].items()
        }
        rule_of(avg).updates = 0
        if warmup is None:
            avg.load_state_dict(plain)
        else:
            with pytest.warns(
                pu.AccountingWarning, match=r"declared at tests/test_ema.py:\d+.*loaded at tests/test_ema.py:\d+"
            ):
                avg.load_state_dict(plain)
        assert rule_of(avg).updates == 0
        att.load_state_dict(state)  # (no warning: t comes with it)
        assert rule_of(avg).updates == 3


def test_a_state_saved_with_the_counter_buffer_still_loads(tmp_path):
    """Checkpoints written by earlier versions hold t as the copy's buffer ``pu_ema_updates`` (and no metadata
    entry): the copy, a module holding it and a Stepper load them strictly and take t from them."""
    m = _bn_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    averaged = pu.ema(m, 0.9, warmup=True)
    _steps(m, opt, _data(2))
    old = dict(averaged.state_dict())  # (a plain dict: no metadata, as the old layout had none for t)
    old["pu_ema_updates"] = torch.tensor(5)
    fresh_m = _bn_net()
    fresh = pu.ema(fresh_m, 0.9, warmup=True)
    keys = fresh.load_state_dict(_saved(old, tmp_path / "old.pt"))  # strict
    assert keys.missing_keys == keys.unexpected_keys == []
    assert rule_of(fresh).updates == 5
    assert_same(snapshot(averaged), snapshot(fresh))
    holder = nn.Module()
    holder.ema = fresh
    holder.load_state_dict({f"ema.{k}": (torch.tensor(7) if k == "pu_ema_updates" else v) for k, v in old.items()})
    assert rule_of(fresh).updates == 7
    stepper = pu.Stepper(fresh_m, torch.optim.SGD(fresh_m.parameters(), lr=0.1))
    state = stepper.state_dict()
    (key,) = [k for k in state["rules"] if k.endswith(":ema")]
    entry = state["rules"][key]
    state["rules"][key] = {**entry, "module": {**old, "pu_ema_updates": torch.tensor(9)}, "updates": 9}
    stepper.load_state_dict(_saved(state, tmp_path / "stepper.pt"))  # the old Stepper layout
    assert rule_of(fresh).updates == 9


def test_counter_is_read_and_set_through_the_rule_and_survives_moves():
    m = nn.Linear(3, 2)
    averaged = pu.ema(m, 0.9, warmup=True)
    rule = rule_of(averaged)
    rule.updates = 7
    assert rule.decay_at(rule.updates) == min(0.9, 8 / 17)
    assert averaged.state_dict()._metadata[""]["pu_ema_updates"] == 7
    averaged.to(torch.float64).to(torch.float32)  # no tensor to move: t stays
    m.double()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pu.step(m, opt):
        m(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    assert rule.updates == 8 and averaged.weight.dtype == torch.float64
    twin = copy.deepcopy(averaged)  # a deep copy carries its own t
    rule.updates = 1
    assert twin.state_dict()._metadata[""]["pu_ema_updates"] == 8
    with pytest.raises(ValueError, match="averaged copy"):
        pu.ema(averaged, 0.9)


def test_swa_utils_usage_on_the_copy_equals_averaged_model(tmp_path):
    """test/optim/test_swa_utils.py's patterns on a pu.ema copy under an attachment: the averages equal
    AveragedModel's, update_bn recomputes its statistics as on AveragedModel(...).module, and the whole
    copy pickles with its t."""
    m = pu.convert(_bn_net())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ours = pu.ema(m, 0.9)
    pu.attach(m, opt)
    swa = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    swa.update_parameters(m)  # its first update copies; ours starts from the copy
    for x in _data(3):
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        swa.update_parameters(m)
    for (k, a), b in zip(ours.state_dict().items(), swa.module.state_dict().values()):
        if a.is_floating_point():
            assert torch.equal(bits(a), bits(b)), k
    loader = _data(4)
    torch.optim.swa_utils.update_bn(loader, ours)
    torch.optim.swa_utils.update_bn(loader, swa.module)
    assert_same(snapshot(ours), snapshot(swa.module))  # num_batches_tracked too
    back = _saved(ours, tmp_path / "copy.pt", weights_only=False)
    assert back.state_dict()._metadata[""]["pu_ema_updates"] == 3
    assert_same(snapshot(back), snapshot(ours))


def test_a_rolled_back_commit_restores_the_counter():
    m = nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    averaged = pu.ema(m, 0.9)

    def fails(t):
        raise RuntimeError("boom")

    pu.constrain(m.weight, fails)  # after_grad, before the EMA: the commit rolls back
    with pytest.raises(RuntimeError, match="boom"):
        with pu.step(m, opt):
            m(torch.randn(2, 3)).sum().backward()
    assert rule_of(averaged).updates == 0 and averaged.state_dict()._metadata[""]["pu_ema_updates"] == 0


def test_timm_warmup_formula():
    m = nn.Linear(3, 3)
    rule = rule_of(pu.ema(m, 0.9999, warmup="timm"))
    assert rule.decay_at(0) == 0.0  # the first update copies
    assert rule.decay_at(1) == 1 - 2 ** (-2 / 3)
    assert rule.decay_at(31621) < 0.999 < rule.decay_at(31622)
    assert rule.decay_at(10**9) == 0.9999
    custom = rule_of(pu.ema(m, 0.99, warmup=pu.rules.ema.TimmWarmup(gamma=2.0, power=0.75, min_decay=0.5)))
    assert custom.decay_at(1) == 0.5 and custom.decay_at(10) == 1 - (1 + 10 / 2.0) ** -0.75
    with pytest.raises(ValueError, match="not a preset"):
        pu.ema(m, 0.9, warmup="keras")


def test_timm_warmup_equals_timm_model_ema_v3_bitwise():
    from frameworks import import_timm

    timm = import_timm()
    m = _bn_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    theirs = timm.utils.ModelEmaV3(m, decay=0.99, use_warmup=True)
    ours = pu.ema(m, 0.99, warmup="timm")
    stepper = pu.Stepper(m, opt)
    for step, x in enumerate(_data(6), start=1):
        with stepper:
            m(x).pow(2).mean().backward()
        opt.zero_grad()
        theirs.update(m, step=step)  # timm's train.py: step = updates so far, this one included
    ref = theirs.module.state_dict()
    for k, v in ours.state_dict().items():
        assert torch.equal(bits(v), bits(ref[k])), k


def _bf16_net():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).to(torch.bfloat16)


def test_float32_average_of_a_bfloat16_model():
    """a <- a * d + p * (1 - d) in float32, p promoted in the kernel; a bfloat16 EMA cannot hold the update."""
    m = _bf16_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    wide = pu.ema(m, 0.999, dtype=torch.float32)
    narrow = pu.ema(m, 0.999)
    assert wide[0].weight.dtype == torch.float32 and wide[1].num_batches_tracked.dtype == torch.int64
    ref = {k: v.detach().float().clone() for k, v in m.state_dict().items() if v.is_floating_point()}
    start = narrow[0].weight.detach().clone()
    for x in _data(4):
        with pu.step(m, opt):
            m(x.to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.zero_grad()
        w = 1 - 0.999  # the rule's weight, and its factors 1 - w and w (1 - w is 0.999 only by luck)
        for k, v in m.state_dict().items():
            if k in ref:
                ref[k].mul_(1 - w).add_(v, alpha=w)  # one tensor at a time: the same kernels
    got = wide.state_dict()
    for k, v in ref.items():
        assert got[k].dtype == torch.float32 and torch.equal(bits(got[k]), bits(v)), k
    assert torch.equal(wide[1].num_batches_tracked, m[1].num_batches_tracked)
    assert not torch.equal(wide[0].weight, start.float())  # moved
    assert torch.equal(narrow[0].weight, start)  # 0.001 * (p - a) is below bfloat16's resolution: stuck
    target = copy.deepcopy(m)
    target.load_state_dict(wide.state_dict())  # cast back by load_state_dict
    assert target[0].weight.dtype == torch.bfloat16


def test_float32_average_equals_timm_model_ema_v3_with_dtype():
    from frameworks import import_timm

    timm = import_timm()
    m = _bf16_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    theirs = timm.utils.ModelEmaV3(m, decay=0.99, dtype=torch.float32)
    theirs.update(m, step=1)  # timm's first update (step 1) copies; ours starts from the copy
    ours = pu.ema(m, 0.99, dtype=torch.float32)
    for step, x in enumerate(_data(4), start=2):
        with pu.step(m, opt):
            m(x.to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.zero_grad()
        theirs.update(m, step=step)
    ref = theirs.module.state_dict()
    for k, v in ours.state_dict().items():
        assert v.dtype == ref[k].dtype and torch.equal(bits(v), bits(ref[k])), k


def test_a_copy_cast_after_declaration_is_still_an_error_with_dtype():
    m = nn.Linear(3, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    averaged = pu.ema(m, 0.5, dtype=torch.float64)
    averaged.half()
    with pytest.raises(pu.UpdateError, match="should be cpu/float64/.* \\(as declared\\)"):
        with pu.step(m, opt):
            m(torch.randn(2, 3)).sum().backward()
    with pytest.raises(TypeError, match="floating"):
        pu.ema(m, 0.5, dtype=torch.int32)


def test_copy_on_another_device_is_averaged_there():
    """device=: the model's tensors are copied to the copy's device each commit (CPU here: the meta device
    stands in for another device; the values are checked on CUDA below where there is one)."""
    m = _bn_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    elsewhere = pu.ema(m, 0.9, device="meta", dtype=torch.float64)
    assert {t.device.type for t in elsewhere.state_dict().values()} == {"meta"}
    assert elsewhere[0].weight.dtype == torch.float64 and elsewhere[1].num_batches_tracked.dtype == torch.int64
    _steps(m, opt, _data(2))
    assert rule_of(elsewhere).updates == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: a CPU average of a GPU model")
def test_cpu_average_of_a_cuda_model_equals_the_average_on_the_gpu():
    m = _bn_net().cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    on_cpu = pu.ema(m, 0.9, device="cpu")
    on_gpu = pu.ema(m, 0.9)
    _steps(m, opt, [x.cuda() for x in _data(3)])
    assert on_cpu[0].weight.device.type == "cpu"
    for (k, a), b in zip(on_cpu.state_dict().items(), on_gpu.state_dict().values()):
        if a.is_floating_point():  # the same lerp on two devices: equal up to rounding (FMA on the GPU)
            torch.testing.assert_close(a, b.cpu(), rtol=1e-6, atol=1e-6, msg=k)
        else:
            assert torch.equal(a, b.cpu()), k


def _converted_net():
    torch.manual_seed(0)
    return pu.convert(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))


def _ema_steps(model, stepped, avg, n=3):
    """``n`` SGD steps of ``stepped`` (the model or its torch.compile wrapper) in pu.step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        with pu.step(stepped, opt):
            stepped(torch.randn(8, 4, generator=g)).square().sum().backward()
        opt.zero_grad()


def test_ema_of_a_compiled_module_averages_the_module_it_compiles():
    """``pu.ema(torch.compile(model))``: the copy is of ``model`` (no ``_orig_mod.`` keys), loads into the
    plain model strictly, and averages bitwise as ``pu.ema(model)`` does. (``torch.compile(model)``
    without a call compiles nothing.)"""
    ref = _converted_net()
    ref_avg = pu.ema(ref, 0.5)
    _ema_steps(ref, ref, ref_avg)
    m = _converted_net()
    compiled = torch.compile(m)
    avg = pu.ema(compiled, 0.5)
    assert type(avg) is nn.Sequential and list(avg.state_dict()) == list(m.state_dict())
    _ema_steps(m, m, avg)
    assert_same(snapshot(ref_avg), snapshot(avg))
    fresh = _converted_net()
    fresh.load_state_dict(avg.state_dict())  # strict
    assert_same(snapshot(ref_avg), snapshot(fresh))


@pytest.mark.compile
def test_ema_of_a_compiled_module_stepped_compiled():
    """The compiled module stepped (``backend="eager"``: traced, eager kernels): its steps own the
    module's tensors, so they apply the EMA of the module, bitwise the eager run's."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        ref = _converted_net()
        ref_avg = pu.ema(ref, 0.5)
        _ema_steps(ref, ref, ref_avg)
        m = _converted_net()
        compiled = torch.compile(m, backend="eager")
        avg = pu.ema(compiled, 0.5)
        _ema_steps(m, compiled, avg)
        assert_same(snapshot(ref, ref_avg), snapshot(m, avg))
    finally:
        torch._dynamo.reset()


def test_a_dcp_checkpoint_keeps_t_through_the_attachment_and_says_when_the_copy_alone_loses_it(tmp_path):
    """``torch.distributed.checkpoint`` rebuilds state dicts as plain dicts, dropping the metadata where the
    copy keeps t, and loads a ``Stateful`` into the state_dict it made itself. Saved and loaded with the
    attachment (t a plain entry of its state) beside the copy, t and the average come back bitwise, in
    either order of the keys (before, the copy loaded after the attachment took back the t its own
    state_dict held before the load: 0). The copy alone: the average loads, t stays, and that is warned."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import warnings

    def setup():
        pu.testing.reset()
        net = _bn_net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        return net, opt, pu.ema(net, 0.99, warmup=10), pu.attach(net, opt)

    net, opt, avg, att = setup()
    _steps(net, opt, _data(3))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # (one process)
        dcp.save({"pu": att, "swa": avg}, checkpoint_id=tmp_path / "ckpt")
        _net2, _opt2, avg2, att2 = setup()
        dcp.load({"pu": att2, "swa": avg2}, checkpoint_id=tmp_path / "ckpt")  # "pu" loads first, then "swa"
        assert rule_of(avg2).updates == 3
        assert_same(snapshot(avg), snapshot(avg2))
        _net3, _opt3, avg3, _att3 = setup()
        with pytest.warns(pu.AccountingWarning, match=r"loaded at tests/test_ema.py:\d+ .* t stays 0"):
            dcp.load({"swa": avg3}, checkpoint_id=tmp_path / "ckpt")
    assert rule_of(avg3).updates == 0
    assert_same(snapshot(avg), snapshot(avg3))  # (the average itself is there)


def test_torchs_dcp_load_recipe_with_the_copys_state_dict_resumes_like_the_uninterrupted_run(tmp_path):
    """torch's recipe for ``torch.distributed.checkpoint``: ``st = {"model": model.state_dict(), "ema":
    copy.state_dict(), "pu": attachment, ...}``, ``dcp.load(st)``, then each module loads its entry. The
    attachment restores t = 3; the copy then loads its own pre-load dict (made when t was 0, its tensors
    loaded in place): t stays 3, and the resumed warmup EMA equals the uninterrupted run bitwise. (Before,
    that load set t back to 0: the attachment's state_dict, taken by DCP in between, had made the copy
    make another state_dict, and only the last one was known as the copy's own.)"""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import warnings

    def setup():
        pu.testing.reset()
        torch.manual_seed(0)
        net = pu.convert(_bn_net())
        opt = torch.optim.SGD(net.parameters(), lr=0.1)  # (no state: a fresh one loads none)
        return net, opt, pu.ema(net, 0.99, warmup=10), pu.attach(net, opt)

    def train(net, opt, xs):
        for x in xs:
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    xs = _data(6)
    net, opt, avg, att = setup()
    train(net, opt, xs[:3])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # (one process)
        st = {"model": net.state_dict(), "ema": avg.state_dict(), "pu": att}
        dcp.save(st, checkpoint_id=tmp_path / "ckpt")
        train(net, opt, xs[3:])  # the uninterrupted run
        net2, opt2, avg2, att2 = setup()
        st = {"model": net2.state_dict(), "ema": avg2.state_dict(), "pu": att2}
        dcp.load(st, checkpoint_id=tmp_path / "ckpt")
    assert rule_of(avg2).updates == 3  # (the attachment's state)
    net2.load_state_dict(st["model"])
    avg2.load_state_dict(st["ema"])
    assert rule_of(avg2).updates == 3
    train(net2, opt2, xs[3:])
    assert rule_of(avg2).updates == 6
    assert_same(snapshot(net, avg, opt), snapshot(net2, avg2, opt2))
