"""Small models and helpers shared by the misuse and lifecycle tests (one topic a file: threads,
non-finite values, a step's optimizer, attachments, re-declaration, serialization, model changes)."""

from __future__ import annotations

import sys
import threading

import torch
from torch import nn

import paramupdates as pu


def in_thread(fn, *args):
    """Run ``fn(*args)`` in a new thread; return its result, re-raise its exception."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            out["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "thread hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = pu.nn.BatchNorm1d(4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        pu.assign_add(self.calls, 1)
        return self.bn(self.lin(x))


# --- row 7: steps are per thread -------------------------------------------------------------------
def rules_model():
    torch.manual_seed(0)
    m = BNNet()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    pu.weight_decay(m, 0.1)
    pu.constrain(m.lin.weight, pu.max_norm(1.0))
    avg = pu.ema(m, 0.9)
    return m, opt, avg


def line_of(marker: str) -> int:
    """The line of the calling test file that holds ``# marker`` (once)."""
    path = sys._getframe(1).f_code.co_filename
    with open(path) as f:
        lines = [i for i, line in enumerate(f, 1) if "# " + marker in line]
    assert len(lines) == 1, marker
    return lines[0]


class Mixed(nn.Module):
    """Every kind of target: a pu.Parameter, a plain parameter, buffers (statistics rows and entries)."""

    def __init__(self):
        super().__init__()
        self.net = BNNet()
        self.scale = pu.Parameter(torch.ones(4), auxiliary=True)
        self.frozen = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x):
        y = self.net(x) * self.scale
        self.scale.assign(self.scale * 0.5)
        pu.assign_add(self.frozen, 1.0)
        return y


def committed(m):
    return [(k, v.detach().clone()) for k, v in m.state_dict().items()]
