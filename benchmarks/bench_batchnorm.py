"""Overhead of pu.nn.BatchNorm2d in a pu.step over torch.nn.BatchNorm2d in a plain loop (CPU).

Runs both side by side, interleaved, on the same small CNN and data; prints
the median step time of each and their ratio. Also checkpointed variants.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import paramupdates as pu


def cnn(bn):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        bn(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        bn(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def main(steps: int = 60, reps: int = 5) -> None:
    torch.set_num_threads(1)
    x = torch.randn(32, 3, 16, 16)
    y = torch.randint(0, 10, (32,))
    ref, mod = cnn(nn.BatchNorm2d), cnn(pu.nn.BatchNorm2d)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.01)
    mopt = torch.optim.SGD(mod.parameters(), lr=0.01)
    stepper = pu.Stepper(mod, mopt)
    loss = nn.CrossEntropyLoss()

    def torch_step():
        ropt.zero_grad()
        loss(ref(x), y).backward()
        ropt.step()

    def pu_step():
        mopt.zero_grad()
        with stepper:
            loss(mod(x), y).backward()

    times = {"torch": [], "pu": []}
    for _ in range(3):
        torch_step()
        pu_step()
    for _ in range(reps):
        for name, fn in (("torch", torch_step), ("pu", pu_step)):
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - t0) / steps)
    t, p = statistics.median(times["torch"]), statistics.median(times["pu"])
    print(f"torch.nn.BatchNorm2d, plain loop : {t * 1e3:8.3f} ms/step")
    print(f"pu.nn.BatchNorm2d in pu.step     : {p * 1e3:8.3f} ms/step")
    print(f"ratio pu / torch                 : {p / t:8.3f}")


if __name__ == "__main__":
    main()
