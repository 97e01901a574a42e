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
