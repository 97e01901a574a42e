"""The benchmark model: a CIFAR-style ResNet-20 (21 batch-norm layers).

``resnet(bn)`` builds it with the batch-norm class ``bn``; ``pu_batchnorm()``
returns the update-safe batch norm to compare with ``torch.nn.BatchNorm2d``:
``paramupdates.nn.BatchNorm2d`` when the package has it, else
:class:`AssignBatchNorm2d` below (the same technique, written here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import paramupdates as pu


class AssignBatchNorm2d(nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` whose running statistics change through ``pu.assign``.

    PyTorch's kernel updates copies of the running buffers; the copies are
    assigned (phase ``auxiliary``), so inside a step nothing is written
    before commit. Used only if ``paramupdates.nn`` is not available.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        rm, rv = self.running_mean.clone(), self.running_var.clone()
        out = F.batch_norm(x, rm, rv, self.weight, self.bias, True, self.momentum, self.eps)
        with pu.when(self.training):
            pu.assign_add(self.num_batches_tracked, 1)
            pu.assign(self.running_mean, rm)
            pu.assign(self.running_var, rv)
        return out


def pu_batchnorm() -> tuple[type[nn.BatchNorm2d], str]:
    """The update-safe BatchNorm2d to benchmark, and its name for the table."""
    mod = getattr(pu, "nn", None)
    cls = getattr(mod, "BatchNorm2d", None)
    if cls is not None:
        return cls, "pu.nn.BatchNorm2d"
    return AssignBatchNorm2d, "benchmarks.models.AssignBatchNorm2d"


class Block(nn.Module):
    """Basic residual block: conv-bn-relu-conv-bn (+ projection shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int, bn: type[nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = bn(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = bn(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), bn(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.short(x))


class ResNet(nn.Module):
    """ResNet-20 for 3x32x32 inputs: stem + 3 stages of 3 blocks (16/32/64 channels)."""

    def __init__(self, bn: type[nn.Module] = nn.BatchNorm2d, width: int = 16, blocks: int = 3, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), bn(width), nn.ReLU())
        layers: list[nn.Module] = []
        cin = width
        for stage in range(3):
            cout = width * 2**stage
            for b in range(blocks):
                layers.append(Block(cin, cout, 2 if (b == 0 and stage > 0) else 1, bn))
                cin = cout
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, segment=None) -> torch.Tensor:
        x = self.stem(x)
        for blk in self.blocks:
            x = blk(x) if segment is None else segment(blk, x)
        return self.head(x.mean((2, 3)))


def resnet(bn: type[nn.Module], seed: int = 0) -> ResNet:
    """A ResNet-20 with ``bn`` layers; the same ``seed`` gives the same weights for any ``bn``."""
    torch.manual_seed(seed)
    return ResNet(bn)


def count_bn(model: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
