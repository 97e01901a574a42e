"""A training script for test_determinism.py: prints a hash of every state byte and the schedule.

Run as ``python tests/determinism_script.py`` from the repository root; two runs
(in separate processes, with different PYTHONHASHSEED) must print the same text.
"""

from __future__ import annotations

import hashlib

import torch

from fault_models import Harness, data


def digest(items: list) -> str:
    h = hashlib.sha256()
    for k, v in items:
        h.update(str(k).encode())
        if torch.is_tensor(v):
            t = v.detach().contiguous().reshape(-1)
            h.update(str((t.dtype, tuple(v.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.is_floating_point() else t.numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def main() -> None:
    for driver in ("step", "attach"):
        h = Harness(driver, on_nonfinite="skip", bn=True)
        for i in range(6):
            h.m.fault = "nonfinite" if i == 2 else None
            h.step(data(i))
        print(f"{driver} state sha256 {digest(h.everything())}")
        print(f"{driver} steps {h.owner.steps} skipped {h.owner.skipped_steps}")
        print(h.owner.schedule())
        h.close()


if __name__ == "__main__":
    main()
