"""Save and resume (determinism, rule 11): torch.save of model + optimizer + stepper state mid-training,
loaded into fresh objects, continues to a final state bitwise equal to an uninterrupted run
(CPU), including pu.nn.BatchNorm1d's running statistics and num_batches_tracked, the rules' state (an EMA-like shadow copy, call counters), the step
counters and the skipped-step count."""

from __future__ import annotations

import io

import pytest
import torch

import paramupdates as pu
from fault_models import Harness, data

from conftest import assert_same

N, CUT = 8, 4
NONFINITE = {1, 5}  # these steps issue an inf and are skipped (on_nonfinite="skip")


def _train(h: Harness, lo: int, hi: int) -> None:
    for i in range(lo, hi):
        h.m.fault = "nonfinite" if i in NONFINITE else None
        h.step(data(i))
    h.m.fault = None


EMA = pytest.param(True, marks=pytest.mark.skipif(not hasattr(pu, "ema"), reason="needs pu.ema"), id="ema")


@pytest.mark.parametrize("ema", [False, EMA])
@pytest.mark.parametrize("driver", ["step", "attach"])
def test_resume_is_bitwise_equal_to_uninterrupted(driver, ema):
    full = Harness(driver, on_nonfinite="skip", bn=True, ema=ema)
    try:
        _train(full, 0, N)
        want = full.everything()
    finally:
        full.close()
    assert ("steps", N - len(NONFINITE)) in want and ("skipped", len(NONFINITE)) in want

    first = Harness(driver, on_nonfinite="skip", bn=True, ema=ema)
    try:
        _train(first, 0, CUT)
        buf = io.BytesIO()
        torch.save(
            {"model": first.m.state_dict(), "optimizer": first.opt.state_dict(), "pu": first.owner.state_dict()}, buf
        )
    finally:
        first.close()

    fresh = Harness(
        driver, seed=123, on_nonfinite="skip", bn=True, ema=ema
    )  # different init: everything must come from the file
    try:
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        fresh.m.load_state_dict(saved["model"])
        fresh.opt.load_state_dict(saved["optimizer"])
        fresh.owner.load_state_dict(saved["pu"])
        assert fresh.owner.skipped_steps == 1 and fresh.shadow.n == CUT - 1
        _train(fresh, CUT, N)
        assert_same(want, fresh.everything())
    finally:
        fresh.close()


def test_resume_without_stepper_state_differs():
    """The check above can fail: dropping the rules' state on resume changes the result."""
    full = Harness("step", on_nonfinite="skip")
    try:
        _train(full, 0, N)
        want = full.everything()
    finally:
        full.close()
    first = Harness("step", on_nonfinite="skip")
    try:
        _train(first, 0, CUT)
        model, opt = first.m.state_dict(), first.opt.state_dict()
        model = {k: v.clone() for k, v in model.items()}
    finally:
        first.close()
    fresh = Harness("step", seed=123, on_nonfinite="skip")
    try:
        fresh.m.load_state_dict(model)
        fresh.opt.load_state_dict(opt)
        _train(fresh, CUT, N)
        with pytest.raises(AssertionError):
            assert_same(want, fresh.everything())
    finally:
        fresh.close()
