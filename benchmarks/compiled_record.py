"""What the recording costs in a compiled forward: the forward of benchmark (a), four ways.

    python benchmarks/compiled_record.py [--calls 400] [--backend inductor]

The model of benchmark (a) (``benchmarks/launch_bound.py``: 50 x (Linear(16) +
BatchNorm1d), batch 8), ``torch.compile(fullgraph=True)`` (inductor). Timed:
the compiled forward call alone (process CPU time, one thread), the variants
interleaved call by call; pu's inside a ``pu.Stepper`` step that is then
discarded, so that every call records into a fresh journal:

* ``torch``: ``torch.nn.BatchNorm1d``, which writes its running statistics
  into its buffers inside the graph;
* ``pu``: ``pu.nn.BatchNorm1d`` as it records: every statistic (150) is a graph
  output, and dynamo's replay of the recording makes a record for each batch norm
  call (its three statistics), an entry per statistic, and shows each statistic in the module's buffer
  slot (read-your-writes, rule 1);
* ``pu, values only`` (diagnostic): the recording, while dynamo traces, keeps
  only the values (one list extend per batch norm): still 150 outputs, no records,
  nothing shown. Not a working step (it could not commit): it separates what
  the outputs cost from what the records cost;
* ``pu, nothing recorded`` (diagnostic): the statistics are dead code (the
  floor of a forward that computes its batch statistics and keeps none).

On 2026-12-06 (torch 2.13.0+cpu, the development machine) the medians were
1.07 / 1.62 / 1.42 / 1.07 ms: the outputs cost ~0.35 ms (over 2 us a statistic,
where torch's in-graph writes cost nothing measurable) and the rows ~0.2 ms
(~0.15 ms since a batch norm call is one row, not three: 5b437ba).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

if __package__ in (None, ""):  # python benchmarks/compiled_record.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import paramupdates as pu
from benchmarks.launch_bound import build, data
from paramupdates.journal import Journal

_record_batch = Journal.record_batch
_KEPT: list[torch.Tensor] = []  # the values-only variant's values (a graph output each)


def _values_only(self, updates, origin, how):  # noqa: ANN001, ANN202 - a diagnostic stand-in
    if how.traced:
        _KEPT.extend([u[3] for u in updates])
        return True
    return _record_batch(self, updates, origin, how)


def _nothing(self, updates, origin, how):  # noqa: ANN001, ANN202 - a diagnostic stand-in
    return True if how.traced else _record_batch(self, updates, origin, how)


class _Discard(Exception):
    pass


def _variant(bn: type[nn.Module], backend: str, record=None):  # noqa: ANN001, ANN202
    """A timed call of the compiled forward (compiled now, with ``record`` as ``Journal.record_batch``)."""
    cpu = torch.device("cpu")
    x, _ = data(cpu)
    model, opt = build(bn, cpu)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    if bn is nn.BatchNorm1d:

        def call() -> float:
            t0 = time.process_time()
            compiled(x)
            return time.process_time() - t0

    else:
        stepper = pu.Stepper(model, opt)

        def call() -> float:
            try:
                with stepper:
                    t0 = time.process_time()
                    compiled(x)
                    took = time.process_time() - t0
                    raise _Discard
            except _Discard:
                pass
            return took

    Journal.record_batch = record if record is not None else _record_batch
    try:
        for _ in range(3):  # compile (with this recording) and warm up
            call()
    finally:
        Journal.record_batch = _record_batch
    return call


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    variants = {
        "torch": _variant(nn.BatchNorm1d, args.backend),
        "pu": _variant(pu.nn.BatchNorm1d, args.backend),
        "pu, values only": _variant(pu.nn.BatchNorm1d, args.backend, _values_only),
        "pu, nothing recorded": _variant(pu.nn.BatchNorm1d, args.backend, _nothing),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.calls):
        for name, call in variants.items():
            times[name].append(call())
    print(
        f"compiled forward of benchmark (a) ({args.backend}), torch {torch.__version__}, {args.calls} calls each, "
        "interleaved, process CPU time, us"
    )
    for name, ts in times.items():
        print(f"  {name:<22} min {min(ts) * 1e6:6.0f}   median {statistics.median(ts) * 1e6:6.0f}")


if __name__ == "__main__":
    main()
