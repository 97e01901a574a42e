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


def test_quick_peers_prints_every_pair_checked_bitwise(monkeypatch):
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
    assert len(rows) == 15, table
    # the README's test command installs only ``.[test]``: without timm its two pairs say why they did not
    # run (and how to install it), and every other pair is still checked bitwise before it is timed
    monkeypatch.syspath_prepend(ROOT)
    from benchmarks.peers import import_timm

    timm_rows = [r for r in rows if "timm" in r]
    assert len(timm_rows) == 3, table  # the two EMA pairs and the recipe with timm's EMA
    if import_timm()[0] is None:
        assert all("n/a" in r and ".[timm]" in r for r in timm_rows), table
    else:
        assert all("checked: bitwise the same state" in r for r in timm_rows), table
    assert all("checked: bitwise the same state" in r for r in rows if r not in timm_rows), table


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


def test_trace_calls_prints_every_path_and_the_long_functions():
    """``benchmarks/trace_calls.py`` (issue 40's traced path counts) runs and prints a count for each path."""
    out = subprocess.run(
        [sys.executable, "benchmarks/trace_calls.py", "--top", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r.split(" | ")[0].lstrip("| "): r.split(" | ")[1:4] for r in out.stdout.splitlines() if r.startswith("| ")}
    for path in (
        "(i) pu.assign in pu.step: open + issue + commit",
        "&nbsp;&nbsp;issue",
        "(ii) batch norm forward in pu.step",
        "(ii) that step's commit (3 statistics)",
        "(iii) weight-decay commit",
    ):
        calls, files, transitions = map(int, rows[path])
        assert calls > 0 and 0 < files <= calls and transitions < calls, path
    assert "functions over 60 lines in src/paramupdates: " in out.stdout


def test_trace_calls_counts_calls_into_the_package_only(monkeypatch, tmp_path):
    """What the counts mean: calls into paramupdates only, in order; files and transitions between them;
    a function of 61 lines is long, one of 60 is not."""
    monkeypatch.syspath_prepend(ROOT)
    from benchmarks import trace_calls as tc

    import paramupdates as pu

    assert tc.traced(lambda: torch.zeros(2).add_(1)) == []  # torch's own Python: not counted
    t = torch.zeros(2)
    events = tc.traced(lambda: pu.assign(t, torch.ones(2)))  # outside a step: written at once (rule 8)
    assert torch.equal(t, torch.ones(2))
    assert ("updates.py", "assign") == events[0] and all(not f.startswith("/") for f, _ in events)
    assert tc.transitions([("a.py", "f"), ("b.py", "g"), ("b.py", "h"), ("a.py", "k")]) == 2
    assert tc.files([("a.py", "f"), ("b.py", "g"), ("a.py", "k")]) == 2

    def lines(indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(58))

    ok = "def ok():\n" + lines("    ") + "    return 0\n"  # 60 lines
    long = "class C:\n    def long(self):\n" + lines("        ") + "        y = 1\n        return y\n"  # 61
    (tmp_path / "m.py").write_text(ok + "\n\n" + long)
    found = tc.long_functions(str(tmp_path))
    assert [(f, name, n) for f, _, name, n in found] == [("m.py", "C.long", 61)], found


def test_a_plain_models_step_calls_no_integration(monkeypatch):
    """Issue 40, item 2: on a model with no FSDP, no compile, no checkpoint and no parametrization, the
    traced paths (a pu.assign in pu.step, a batch norm's forward and commit, a weight-decay commit) make
    no call into ``integrations/``; a sharded model's updates do ask the sharding support
    (``Journal.sharding``: decided once per model index generation)."""
    monkeypatch.syspath_prepend(ROOT)
    from benchmarks import trace_calls as tc

    import paramupdates as pu
    from paramupdates import hooks

    # a parametrized model elsewhere in the process, its output alive: the parametrize integration's
    # resolver is registered and has something to look up (it must still not be asked about these)
    other = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(3, 3))
    att = pu.attach(other, torch.optim.SGD(other.parameters(), lr=0.1))
    alive = other.weight  # noqa: F841 - kept alive while the paths are traced
    att.detach()
    assert hooks.target_resolvers and hooks.sharding_support() is not None
    paths = tc.paths()
    assert len(paths) >= 4
    for p in paths:
        called = sorted({f"{f}:{q}" for f, q in p.events if f.startswith("integrations/")})
        assert p.events and called == [], f"{p.name}: {called}"
