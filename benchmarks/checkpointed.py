"""What correct running statistics under activation checkpointing cost (ResNet-20).

What is measured: the time of a training step of ResNet-20 with every residual
block checkpointed. PyTorch: ``torch.nn.BatchNorm2d``
under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, a plain
loop (its statistics are updated twice per step, pytorch/pytorch#96136).
paramupdates: ``pu.nn.BatchNorm2d`` under ``pu.checkpoint`` in a ``pu.step``
(statistics updated once, bitwise equal to the run without checkpointing).
The row reports the time ratio (pu over torch; no goal: the two do not compute
the same statistics) and the ``num_batches_tracked`` each ends with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from torch import nn

import paramupdates as pu

from .step_overhead import CPU, _data, build
from .timing import interleaved, ms, ratios


def available() -> str | None:
    """None if the benchmark can run, else why not."""
    if getattr(pu, "checkpoint", None) is None:
        return "pu.checkpoint not in this build"
    if getattr(getattr(pu, "nn", None), "BatchNorm2d", None) is None:
        return "pu.nn.BatchNorm2d not in this build"
    return None


def run(device: torch.device = CPU, repeats: int = 5, steps: int = 4) -> list[dict]:
    why = available()
    if why is not None:
        return [{"bench": "checkpointed ResNet-20", "variant": "pu vs torch checkpoint", "skip": why}]
    x, y = _data(device=device)
    m_t, o_t = build(nn.BatchNorm2d, device)
    m_p, o_p = build(pu.nn.BatchNorm2d, device)
    stepper = pu.Stepper(m_p, o_p)

    def torch_ckpt(blk, h):
        return tc.checkpoint(blk, h, use_reentrant=False)

    def torch_run() -> None:
        o_t.zero_grad(set_to_none=True)
        F.cross_entropy(m_t(x, segment=torch_ckpt), y).backward()
        o_t.step()

    def pu_run() -> None:
        with stepper:
            o_p.zero_grad(set_to_none=True)
            F.cross_entropy(m_p(x, segment=pu.checkpoint), y).backward()

    times = interleaved({"torch": torch_run, "pu": pu_run}, repeats=repeats, steps=steps)
    r = ratios(times, "pu", "torch")
    n = stepper.steps
    return [
        {
            "bench": "checkpointed ResNet-20 (every block)",
            "variant": "pu BN + pu.checkpoint / torch BN + torch checkpoint",
            "ratio": r,
            "goal": None,
            "note": (
                f"ratio of minima {r.of_min:.3f}; {ms(r.s)} vs {ms(r.base_s)} ms/step; after {n} steps "
                f"num_batches_tracked: pu {int(m_p.blocks[0].bn1.num_batches_tracked)}, "
                f"torch {int(m_t.blocks[0].bn1.num_batches_tracked)}"
            ),
        }
    ]
