"""Rule 6: when(False) records nothing, when(tensor) selects with torch.where, nesting ANDs."""

import pytest
import torch

import paramupdates as pu

from models import Counter


def test_when_false_records_nothing():
    m = Counter()
    m.eval()
    with pu.step(m) as s:
        m(torch.randn(2, 3))
        assert len(s.pending_schedule()) == 0
    assert len(s.schedule()) == 0
    assert int(m.count) == 0


def test_when_tensor_selects_without_host_sync():
    m = Counter()
    for flag, expect in ((True, 1), (False, 0)):
        m.count.zero_()
        with pu.step(m) as s:
            with pu.when(torch.tensor(flag)):
                pu.assign_add(m.count, 1)
        assert int(m.count) == expect
        assert [r.condition for r in s.schedule()] == ["when(tensor)"]


def test_when_tensor_masks_nonfinite_value_in_false_branch():
    m = Counter()
    with pu.step(m):
        with pu.when(torch.tensor(False)):
            pu.assign(m.acc, torch.full((2,), float("nan")))
    assert torch.equal(m.acc, torch.zeros(2))


@pytest.mark.parametrize(
    "outer,inner,expect",
    [
        (True, True, 1),
        (True, False, 0),
        (False, True, 0),
        (False, False, 0),
    ],
)
def test_nested_when_ands(outer, inner, expect):
    m = Counter()
    for mk_outer in (bool, torch.tensor):
        for mk_inner in (bool, torch.tensor):
            m.count.zero_()
            with pu.step(m):
                with pu.when(mk_outer(outer)):
                    with pu.when(mk_inner(inner)):
                        pu.assign_add(m.count, 1)
            assert int(m.count) == expect, (mk_outer, mk_inner)


def test_when_rejects_non_scalar_and_non_bool():
    with pytest.raises(ValueError, match="0-dim torch.bool"):
        with pu.when(torch.tensor([True, False])):
            pass
    with pytest.raises(ValueError, match="0-dim torch.bool"):
        with pu.when(torch.tensor(1.0)):
            pass
    with pytest.raises(TypeError):
        with pu.when("yes"):
            pass


def test_when_reads_see_conditional_value():
    m = Counter()
    with pu.step(m):
        with pu.when(torch.tensor(False)):
            pu.assign_add(m.count, 7)
        assert int(m.count) == 0
        with pu.when(torch.tensor(True)):
            pu.assign_add(m.count, 7)
        assert int(m.count) == 7
