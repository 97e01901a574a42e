"""``paramupdates-demo`` (or ``python -m paramupdates.demo``): a real training run, checked.

Trains a small convolutional network with batch norm on scikit-learn's 8x8
handwritten digits (1797 images that ship inside scikit-learn: nothing is
downloaded) with every block under activation checkpointing,
and, all through paramupdates:

* decoupled weight decay, ``p <- p * (1 - lr * rate)`` (phase ``before_grad``),
* ``Adam``'s gradient update (phase ``grad``), so Adam + ``pu.weight_decay`` is AdamW,
* a max-norm constraint on the classifier's rows (phase ``after_grad``),
* the batch-norm running statistics (``pu.nn.BatchNorm2d``, phase ``auxiliary``),
* an EMA copy of the weights and statistics (phase ``after_step``).

The same run is made three times in lockstep, on the same weights and batches:

``reference``  paramupdates batch norm, no checkpointing;
``pu``         paramupdates batch norm under ``pu.checkpoint``;
``torch``      ``torch.nn.BatchNorm2d`` under ``torch.utils.checkpoint``.

Gradients, hence weights, are the same in all three. The running statistics
are not: PyTorch's batch norm updates them again when the checkpointed block
is recomputed in backward (pytorch/pytorch#96136), so ``num_batches_tracked``
doubles and the statistics drift; paramupdates' equal the reference bitwise.
The demo prints that check, the step's schedule, the test accuracy of the
model and of its EMA copy, and writes a plot of the curves.

Needs the ``demo`` extra: ``pip install "paramupdates[demo]"`` (scikit-learn,
matplotlib, tqdm).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import paramupdates as pu

VARIANTS = ("reference", "pu", "torch")
LABELS = {
    "reference": "pu BatchNorm2d, no checkpointing (the reference)",
    "pu": "pu BatchNorm2d under pu.checkpoint",
    "torch": "torch BatchNorm2d under torch.utils.checkpoint",
}


def _need(module: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            f'paramupdates-demo needs {module.split(".")[0]!r}: pip install "paramupdates[demo]" ({exc})'
        ) from exc


# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------
def load_digits(seed: int, train_size: int | None = None) -> tuple[torch.Tensor, ...]:
    """8x8 digits as ``(x_train, y_train, x_test, y_test)``; x in [0, 1], shape (n, 1, 8, 8).

    A stratified 80/20 split fixed by ``seed``; ``train_size`` keeps the first
    ``train_size`` training images (for quick runs).
    """
    datasets = _need("sklearn.datasets")
    model_selection = _need("sklearn.model_selection")
    digits = datasets.load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_test = model_selection.train_test_split(
        list(range(len(y))), test_size=0.2, random_state=seed, stratify=digits.target
    )
    if train_size is not None:
        idx_train = idx_train[:train_size]
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


# ----------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------
class DigitsNet(nn.Module):
    """conv-BN-ReLU x3 (32, 32, 64 channels, two 2x2 max-pools) and a linear classifier.

    ``forward(x, segment)`` calls every block as ``segment(block, x)``:
    ``segment=None`` runs it plainly, ``pu.checkpoint`` or a
    ``torch.utils.checkpoint`` wrapper checkpoints it.
    """

    def __init__(self) -> None:
        super().__init__()

        def block(cin: int, cout: int, pool: bool) -> nn.Sequential:
            layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
            if pool:
                layers.append(nn.MaxPool2d(2))
            return nn.Sequential(*layers)

        self.blocks = nn.Sequential(block(1, 32, False), block(32, 32, True), block(32, 64, True))
        self.head = nn.Linear(64 * 2 * 2, 10)

    def forward(self, x: torch.Tensor, segment: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x) if segment is None else segment(blk, x)
        return self.head(x.flatten(1))


def _torch_checkpoint(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False)


SEGMENTS: dict[str, Callable[..., torch.Tensor] | None] = {
    "reference": None,
    "pu": pu.checkpoint,
    "torch": _torch_checkpoint,
}


@dataclass
class Run:
    """One variant: its model, optimizer, stepper, EMA copy and history."""

    name: str
    model: DigitsNet
    opt: torch.optim.Optimizer
    stepper: pu.Stepper
    ema: nn.Module
    loss: list[float] = field(default_factory=list)
    acc: list[float] = field(default_factory=list)
    ema_acc: list[float] = field(default_factory=list)
    running_mean: list[list[float]] = field(default_factory=list)


def make_runs(seed: int, lr: float, weight_decay: float, max_norm: float, ema_decay: float) -> dict[str, Run]:
    """Three variants from one initialisation; rules declared on each model."""
    torch.manual_seed(seed)
    base = DigitsNet()
    runs = {}
    for name in VARIANTS:
        model = copy.deepcopy(base)
        if name != "torch":
            pu.convert(model)  # torch.nn.BatchNorm2d -> pu.nn.BatchNorm2d, same tensors
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        # Declared rules: each runs once per optimizer update, in its phase.
        pu.weight_decay(model, weight_decay)  # before_grad; skips 1-D tensors (biases, BN scales)
        pu.constrain(model.head.weight, pu.max_norm(max_norm))  # after_grad; one norm per output unit
        averaged = pu.ema(model, ema_decay, warmup=True)  # after_step
        runs[name] = Run(name, model, opt, pu.Stepper(model, opt), averaged)
    return runs


# ----------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------
def train_step(run: Run, x: torch.Tensor, y: torch.Tensor) -> float:
    """One step as a paramupdates transaction; the commit steps the optimizer."""
    with run.stepper:
        run.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(run.model(x, SEGMENTS[run.name]), y)
        loss.backward()
    return float(loss.detach())


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was = model.training
    model.eval()
    try:
        return float((model(x).argmax(1) == y).float().mean())
    finally:
        model.train(was)


def _bn_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@dataclass
class Contrast:
    """Running statistics of a variant against the reference, over every batch-norm layer."""

    name: str
    num_batches_tracked: int
    steps: int
    max_mean_diff: float
    max_var_diff: float
    bitwise_equal: bool


def contrast(run: Run, ref: Run, steps: int) -> Contrast:
    mean_d = var_d = 0.0
    equal = True
    nbt = 0
    for (_, m), (_, r) in zip(_bn_layers(run.model), _bn_layers(ref.model)):
        mean_d = max(mean_d, float((m.running_mean - r.running_mean).abs().max()))
        var_d = max(var_d, float((m.running_var - r.running_var).abs().max()))
        equal = equal and all(
            torch.equal(getattr(m, b), getattr(r, b)) for b in ("running_mean", "running_var", "num_batches_tracked")
        )
        nbt = int(m.num_batches_tracked)
    return Contrast(run.name, nbt, steps, mean_d, var_d, equal)


@dataclass
class Result:
    """What :func:`run_demo` measured (the test reads it)."""

    runs: dict[str, Run]
    contrasts: dict[str, Contrast]
    steps: int
    seconds: float
    plot: str | None
    schedule: str
    n_test: int = 0

    def test_accuracy(self, variant: str = "pu", ema: bool = False) -> float:
        r = self.runs[variant]
        return (r.ema_acc if ema else r.acc)[-1]


def run_demo(
    *,
    epochs: int = 8,
    seed: int = 0,
    out: str = "paramupdates-demo-out",
    plot: bool = True,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 1e-2,
    max_norm: float = 3.0,
    ema_decay: float = 0.95,
    train_size: int | None = None,
    progress: bool = True,
    echo: Callable[[str], None] = print,
) -> Result:
    """Train the three variants in lockstep; return histories, contrasts and the plot path."""
    tqdm = _need("tqdm").tqdm
    t0 = time.perf_counter()
    x_train, y_train, x_test, y_test = load_digits(seed, train_size)
    runs = make_runs(seed, lr, weight_decay, max_norm, ema_decay)
    gen = torch.Generator().manual_seed(seed)
    n = len(y_train)
    echo(
        f"digits: {n} training / {len(y_test)} test images (8x8, 10 classes); "
        f"{epochs} epochs, batch {batch_size}; three variants in lockstep:"
    )
    for name in VARIANTS:
        echo(f"  {name:>9}: {LABELS[name]}")
    schedule = ""
    steps = 0
    for epoch in range(epochs):
        order = torch.randperm(n, generator=gen)
        batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{epochs}", unit="step", leave=True, disable=not progress)
        for idx in bar:
            x, y = x_train[idx], y_train[idx]
            losses = {name: train_step(r, x, y) for name, r in runs.items()}
            steps += 1
            for name, r in runs.items():
                r.loss.append(losses[name])
                r.running_mean.append(r.model.blocks[0][1].running_mean[:3].tolist())
            if not schedule:
                schedule = str(runs["pu"].stepper.schedule())
                bar.clear()
                echo("\nThe schedule of one step (pu variant), in commit order:")
                echo(schedule)
                echo("")
            bar.set_postfix(loss=f"{losses['pu']:.3f}")
        bar.close()
        for r in runs.values():
            r.acc.append(accuracy(r.model, x_test, y_test))
            r.ema_acc.append(accuracy(r.ema, x_test, y_test))
        if progress:
            echo(
                f"  epoch {epoch + 1}: test accuracy {100 * runs['pu'].acc[-1]:.1f} % "
                f"(EMA {100 * runs['pu'].ema_acc[-1]:.1f} %)"
            )
    contrasts = {name: contrast(r, runs["reference"], steps) for name, r in runs.items() if name != "reference"}
    path = None
    if plot:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "paramupdates-demo.png")
        write_plot(runs, path)
    return Result(runs, contrasts, steps, time.perf_counter() - t0, path, schedule, len(y_test))


# ----------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------
def report(res: Result) -> str:
    """The accuracy lines and the side-by-side checkpointing check."""
    lines = [
        "",
        f"Test accuracy ({res.n_test} held-out digits; the weights are the same in all three,",
        "only the running statistics that evaluation uses differ):",
    ]
    for name in VARIANTS:
        r = res.runs[name]
        lines.append(f"  {name:>9}: model {100 * r.acc[-1]:5.1f} %   EMA copy {100 * r.ema_acc[-1]:5.1f} %")
    lines += [
        "",
        f"Checkpointing check: running statistics of all {len(_bn_layers(res.runs['pu'].model))} batch-norm layers "
        f"after {res.steps} steps, against the reference without checkpointing:",
        f"  {'variant':>9}  {'num_batches_tracked':>19}  {'max |mean - ref|':>16}  {'max |var - ref|':>15}  verdict",
    ]
    for name in ("pu", "torch"):
        c = res.contrasts[name]
        times = c.num_batches_tracked / max(c.steps, 1)
        if c.bitwise_equal:
            verdict = "bitwise equal to the reference"
        else:
            verdict = f"WRONG: counted {times:g}x per step, statistics off"
        lines.append(
            f"  {name:>9}  {c.num_batches_tracked:>12} ({times:g}x)  {c.max_mean_diff:>16.3g}  {c.max_var_diff:>15.3g}  {verdict}"
        )
    lines.append(
        "  (torch.nn.BatchNorm2d updates its statistics again when torch.utils.checkpoint recomputes the block in"
    )
    lines.append(
        "   backward, pytorch/pytorch#96136; pu.checkpoint replays the recorded update instead of re-issuing it.)"
    )
    return "\n".join(lines)


def write_plot(runs: dict[str, Run], path: str) -> None:
    """Loss per step, test accuracy per epoch, first BN layer's running mean per step (Agg, no display)."""
    figure = _need("matplotlib.figure")
    fig = figure.Figure(figsize=(15, 4.2), layout="constrained")
    ax_loss, ax_acc, ax_rm = fig.subplots(1, 3)
    styles = {
        "reference": {"color": "tab:blue", "linewidth": 3.0, "alpha": 0.5},
        "pu": {"color": "tab:green", "linestyle": "--", "linewidth": 1.5},
        "torch": {"color": "tab:red", "linestyle": ":", "linewidth": 1.5},
    }
    for name, r in runs.items():
        ax_loss.plot(r.loss, label=name, **styles[name])
        epochs = range(1, len(r.acc) + 1)
        ax_acc.plot(epochs, [100 * a for a in r.acc], marker="o", label=f"{name} model", **styles[name])
        ax_acc.plot(
            epochs, [100 * a for a in r.ema_acc], marker="s", label=f"{name} EMA", **{**styles[name], "alpha": 0.3}
        )
        rm = list(zip(*r.running_mean))
        for c, series in enumerate(rm):
            ax_rm.plot(series, label=name if c == 0 else None, **styles[name])
    ax_loss.set(title="training loss (the same in all three)", xlabel="step", ylabel="cross-entropy", yscale="log")
    ax_acc.set(title="test accuracy", xlabel="epoch", ylabel="%")
    ax_rm.set(
        title="blocks.0 BN running_mean[0:3]\n(torch under checkpointing drifts; pu = reference)",
        xlabel="step",
        ylabel="running mean",
    )
    for ax in (ax_loss, ax_acc, ax_rm):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``paramupdates-demo`` / ``python -m paramupdates.demo``."""
    ap = argparse.ArgumentParser(
        prog="paramupdates-demo",
        description="Train a batch-norm CNN on scikit-learn's digits with paramupdates and check it against PyTorch.",
    )
    ap.add_argument("--epochs", type=int, default=8, help="training epochs (default 8)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the split, the initialisation and the batches")
    ap.add_argument(
        "--out", default="paramupdates-demo-out", help="directory of the plot (default ./paramupdates-demo-out)"
    )
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    ap.add_argument("--train-size", type=int, default=None, help="use only this many training images (quick runs)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the model is tiny)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    if args.epochs < 1:
        ap.error("--epochs must be >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        res = run_demo(
            epochs=args.epochs,
            seed=args.seed,
            out=args.out,
            plot=not args.no_plot,
            train_size=args.train_size,
            progress=not args.no_progress,
        )
    finally:
        torch.set_num_threads(threads)
    print(report(res))
    if res.plot:
        print(f"\nPlot: {os.path.abspath(res.plot)}")
    print(f"({res.steps} steps x 3 variants in {res.seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
