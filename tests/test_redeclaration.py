"""A rule declared again replaces the earlier one (a re-run notebook cell never applies a rule twice); the
same rule declared again changes nothing, quietly."""

from __future__ import annotations

import warnings

import pytest
import torch

import paramupdates as pu
from misuse_helpers import BNNet
from misuse_helpers import line_of as _line_of

from conftest import assert_same, snapshot


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
    assert len(wd) == 1 and wd[0].count(f"tests/test_redeclaration.py:{line}") == 2 and "'lin.weight'" in wd[0]
    mn = [m for m in msgs if m.startswith("pu.constrain(max_norm) declared")]
    assert len(mn) == 1 and mn[0].count(f"tests/test_redeclaration.py:{line + 1}") == 2
    assert all(w.filename.endswith("test_redeclaration.py") for w in record)  # points at the user's line


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


def test_the_replacement_warning_says_how_to_undeclare_each_kind_of_rule():
    """pu.ema returns the averaged copy, which has no .remove(): the warning names what works for it
    (pu.rules_of(copy) lists the rule, with .remove()), and doing so silences it. pu.weight_decay and
    pu.constrain return the rule: .remove() on it, or on what pu.rules_of(model) lists."""
    m = BNNet()
    first = pu.ema(m, 0.9)
    with pytest.warns(UserWarning) as record:
        pu.ema(m, 0.9)
    msg = str(record[0].message)
    assert "pu.rules_of(ema_copy) lists it" in msg and "the averaged copy that pu.ema returned" in msg
    assert not hasattr(first, "remove")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for r in pu.rules_of(pu.ema(BNNet(), 0.9)):  # (what the message says works)
            r.remove()
        second = pu.ema(m, 0.5)
        (rule,) = pu.rules_of(second)
        rule.remove()
        pu.ema(m, 0.5)  # the removed one is not replaced: no warning
    pu.weight_decay(m, 0.1)
    with pytest.warns(UserWarning) as record:
        pu.weight_decay(m, 0.2)
    msg = str(record[0].message)
    assert "pu.rules_of(model) lists the rules declared on the model, each with .remove()" in msg
    assert "pu.rules.ema" not in msg
