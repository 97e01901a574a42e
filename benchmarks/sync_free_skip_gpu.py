"""GPU check: ``on_nonfinite="skip"`` and ``scaler=`` make no host sync with a fused optimizer (issue 39).

``python benchmarks/sync_free_skip_gpu.py`` (CUDA): a model with update-safe batch norm, ``pu.weight_decay``,
``pu.constrain`` (``max_norm``, ``clamp``, a callable), ``pu.ema`` (no warmup) and updates issued in the
forward, with ``AdamW(fused=True)``, trained under ``torch.cuda.set_sync_debug_mode("error")`` (torch raises
at any operation that makes the host wait for the GPU: ``.item()``, a device-to-host copy, a synchronize)
through

* ``pu.step(on_nonfinite="skip")`` and ``pu.attach(on_nonfinite="skip")``,
* ``pu.step(scaler=)`` and ``pu.attach(scaler=)`` with a ``torch.amp.GradScaler("cuda")`` (and ``"skip"``),

over good steps, a step with a NaN gradient, one with a NaN pending value and (with the scaler) one whose
scaled loss overflows. Only the training steps run under the guard: the first steps (the rules' plans,
the optimizer's state) run before it. Then, with the guard off, it checks that every skipped step left
the model, the EMA copy and the optimizer's state bitwise as before it, and that each run ends bitwise
where the same run with the synced skip ends (the optimizer made to look like one without
``found_inf``).

Nothing depends on this script (the tests count host syncs on CPU: ``tests/test_no_sync.py``); it is what
to run where a GPU is lent. ``--device cpu`` runs the same program without the guard (a dry run of the
script itself). Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # python benchmarks/sync_free_skip_gpu.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn

import paramupdates as pu

WARMUP = 3
BATCHES = (None, "grad", None, "value", None, "overflow", None, "grad", None)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.bn = pu.nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 4)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor, bad: str | None = None) -> torch.Tensor:
        pu.assign_add(self.seen, float("nan") if bad == "value" else 1.0)
        pu.assign(self.lin.bias, self.lin.bias * 0.5, phase="after_grad")
        return self.out(self.bn(self.lin(x)).relu())


def _state(m: nn.Module, avg: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Clones of everything a skipped step must leave as it was (no host read)."""
    out = [t.detach().clone() for t in m.state_dict().values()]
    out += [t.detach().clone() for t in avg.state_dict().values()]
    out += [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def run(device: torch.device, how: str, scaler: bool, on_device: bool, guard: bool) -> tuple[list, list, list]:
    """One training run; returns the state after each step, the skipped steps' (before, after), and the
    errors the guard raised (a host sync inside the commit)."""
    pu.testing.reset()
    torch.manual_seed(0)
    m = Net().to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    if not on_device:
        opt._step_supports_amp_scaling = False  # type: ignore[attr-defined]  # the synced skip, as before
    pu.weight_decay(m, 0.1)
    pu.constrain(m.lin.weight, pu.max_norm(0.5))
    pu.constrain(m.out.bias, pu.clamp(-0.05, 0.05))
    pu.constrain(m.out.weight, lambda w: w * 0.99)
    avg = pu.ema(m, 0.9)
    sc = torch.amp.GradScaler(device.type, init_scale=2.0**10) if scaler else None
    owner = (
        pu.attach(m, opt, on_nonfinite="skip", scaler=sc)
        if how == "attach"
        else pu.Stepper(m, opt, on_nonfinite="skip", scaler=sc)
    )
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 16, generator=g).to(device), torch.randn(64, 4, generator=g).to(device))]
    batches *= WARMUP + len(BATCHES)
    bads = (None,) * WARMUP + BATCHES
    states, skipped, errors = [], [], []
    for i, ((x, y), bad) in enumerate(zip(batches, bads)):
        if bad == "overflow" and not scaler:
            bad = "grad"
        before = _state(m, avg, opt) if bad else None
        guarded = guard and i >= WARMUP
        try:
            if guarded:
                torch.cuda.set_sync_debug_mode("error")
            _one_step(m, opt, owner, sc, x, y, bad, how)
        except RuntimeError as exc:  # a host sync under the guard
            errors.append(f"step {i} ({bad or 'good'}): {exc}")
        finally:
            if guarded:
                torch.cuda.set_sync_debug_mode("default")
        states.append(_state(m, avg, opt))
        if before is not None:
            skipped.append((i, before, states[-1]))
    return states, skipped, errors


def _one_step(m, opt, owner, sc, x, y, bad, how) -> None:
    opt.zero_grad()

    def backward() -> None:
        loss = nn.functional.mse_loss(m(x, bad), y) * (2.0**120 if bad == "overflow" else 1.0)
        (sc.scale(loss) if sc is not None else loss).backward()
        if bad == "grad":
            m.lin.weight.grad[0, 0] = float("nan")

    if how == "attach":
        backward()
        if sc is not None:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
    else:
        with owner:
            backward()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu: a dry run without the guard")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing checked (run where a GPU is lent, or --device cpu for a dry run)")
        return 2
    guard = device.type == "cuda"
    failures = 0
    cases: list[tuple[str, bool]] = [(h, s) for h in ("step", "attach") for s in (False, True)]
    for how, scaler in cases:
        name = f"pu.{how}(on_nonfinite='skip'{', scaler=' if scaler else ''})"
        states, skipped, errors = run(device, how, scaler, on_device=True, guard=guard)
        synced, _, _ = run(device, how, scaler, on_device=False, guard=False)
        checks = [
            ("no host sync in any step (set_sync_debug_mode('error'))" if guard else "dry run (no guard)", not errors),
            ("every skipped step left everything bitwise as before", all(_equal(b, a) for _, b, a in skipped)),
            ("every step bitwise the synced skip's", all(_equal(a, b) for a, b in zip(states, synced))),
        ]
        for what, passed in checks:
            failures += not passed
            print(f"{'PASS' if passed else 'FAIL'}  {name}: {what}")
        for e in errors[:3]:
            print(f"      {e.splitlines()[0]}")
    print("all passed" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
