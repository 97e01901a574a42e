"""``python -m benchmarks --quick`` runs end to end.

A smoke test of the benchmark code, not a benchmark: ``--quick`` runs every
benchmark of the default set with tiny settings (one or two repeats, a tiny
MLP for the memory processes), and nothing here looks at a time or a ratio.
Marked ``benchmarks`` (~15 s): ``python -m pytest -m "not benchmarks"`` skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.benchmarks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_quick_run_prints_every_benchmark():
    out = _run("--quick")
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout[out.stdout.index("| benchmark |") :]
    for row in ("(a) launch-bound", "both torch.compile", "(b) ResNet-20", "(c) peak memory", "(d) rules"):
        assert row in table, row
    assert "memory: extra peak of a step" in table
    assert "checkpointed ResNet-20" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is missing")
def test_device_cuda_without_cuda_says_so():
    out = _run("--device", "cuda", "--only", "launch")
    assert out.returncode != 0
    assert "--device cuda: CUDA is not available" in out.stderr
    assert "Traceback" not in out.stderr


def _script(path: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``benchmarks/<path>`` with the eager backend (a smoke test: no inductor compile)."""
    out = subprocess.run(
        [sys.executable, f"benchmarks/{path}", *args, "--backend", "eager"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.compile
def test_compiled_split_runs_and_prints_every_part():
    out = _script("compiled_split.py", "--steps", "2")
    for part in ("forward", "backward", "step / commit", "whole step", "guard check, torch", "guard check, pu.step"):
        assert part in out.stdout, part


@pytest.mark.compile
def test_compiled_record_runs_and_prints_every_variant():
    out = _script("compiled_record.py", "--calls", "2")
    for variant in ("torch", "pu ", "pu, values only", "pu, nothing recorded"):
        assert f"  {variant}" in out.stdout, variant


def test_quick_peers_prints_every_pair_checked_bitwise():
    """``--only peers`` (benchmarks/peers.py, in ``--all``): every pair runs, and every row says that its
    sides were checked to compute bitwise the same state before they were timed."""
    out = _run("--quick", "--only", "peers")
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout[out.stdout.index("| benchmark |") :]
    rows = [line for line in table.splitlines() if line.startswith("| (e) peers")]
    for variant in (
        "pu.ema / timm ModelEmaV3",
        "pu.ema / AveragedModel",
        "Adam + pu.weight_decay / AdamW, no-decay group",
        "Adam + pu.weight_decay / AdamW |",
        "pu.constrain / loop",
        "pu.attach / hand-written |",
        "pu.attach / hand-written, timm EMA",
        "pu.attach / bare loop",
    ):
        assert any(variant in r for r in rows), variant
    for part in ("decay alone", "decay + batch norms", "decay + max-norm", "decay + EMA", "all: "):
        assert any(f"recipe, {part}" in r for r in rows), part
    assert len(rows) == 15 and all("checked: bitwise the same state" in r for r in rows), table


def test_peers_check_refuses_sides_that_compute_different_things(monkeypatch):
    """The check before the timing is not a formality: a side that skips the constraint (a silent no-op)
    stops the benchmark, naming the pair, the side and the tensor."""
    monkeypatch.syspath_prepend(ROOT)
    from benchmarks import peers

    a, b = peers.Heads(), peers.Heads()
    sides = {
        "loop": peers.Side(peers.norm_loop(peers.weights(a)), peers.tensors_of(a), peers.perturb_of(a, ws_only=True)),
        "no-op": peers.Side(lambda: None, peers.tensors_of(b), peers.perturb_of(b, ws_only=True)),
    }
    pair = peers.Pair("max_norm", sides, [("no-op", "loop", None)])
    with pytest.raises(RuntimeError, match=r"max_norm: no-op is not bitwise loop after 3 calls \(tensor 0 of 256"):
        peers.check(pair, "loop")
    del sides["no-op"]
    assert peers.check(pair, "loop").startswith("checked: bitwise")
