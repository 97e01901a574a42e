"""``paramupdates-demo`` (or ``python -m paramupdates.demo``): a real training run, checked.

Trains a small convolutional network with batch norm on scikit-learn's 8x8
handwritten digits (1797 images that ship inside scikit-learn: nothing is
downloaded) with every block under activation checkpointing,
and, all through paramupdates:

* decoupled weight decay, ``p <- p * (1 - lr * rate)`` (phase ``before_grad``),
* ``Adam``'s gradient update (phase ``grad``), so Adam + ``pu.weight_decay`` is AdamW with
  biases and batch-norm scales not decayed (the default ``exclude``; ``exclude=None`` is plain AdamW),
* a max-norm constraint on the classifier's rows (phase ``after_grad``),
* the batch-norm running statistics (``pu.nn.BatchNorm2d``, phase ``auxiliary``),
* an EMA copy of the weights and statistics (phase ``after_step``).

The same run is made three times in lockstep, on the same weights and batches:

``reference``  paramupdates batch norm, no checkpointing;
``pu``         paramupdates batch norm under ``pu.checkpoint``;
``torch``      ``torch.nn.BatchNorm2d`` under ``torch.utils.checkpoint``, its forward and backward
               plain PyTorch (outside the step, which then commits the same rules and
               optimizer update: inside a step, paramupdates gives a torch.nn batch norm
               back the statistics the recomputation found, and the variant would not
               show PyTorch's own behaviour).

Gradients, hence weights, are the same in all three. The running statistics
are not: PyTorch's batch norm updates them again when the checkpointed block
is recomputed in backward (pytorch/pytorch#96136), so ``num_batches_tracked``
doubles (a schedule read from it runs at twice the speed) and the statistics
follow each batch with momentum ``1 - (1 - 0.1)**2 = 0.19`` instead of 0.1;
paramupdates' equal the reference bitwise.

The harm is not a lower accuracy (on 360 test digits, one digit is 0.28 %, and
statistics that are off may score higher or lower by chance): it is that the
model evaluated after training with checkpointing, a memory optimisation that
should change nothing, is not the model trained without it. The demo prints
what differs from the reference (the counter, the statistics, the evaluation
outputs of the model and of its EMA copy on the test set: logits, predictions,
test loss), the step's schedule and the test accuracies, and plots the first three.

Needs the ``demo`` extra: ``pip install "paramupdates[demo]"`` (scikit-learn,
matplotlib, tqdm).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import paramupdates as pu

VARIANTS = ("reference", "pu", "torch")
LABELS: Mapping[str, str] = MappingProxyType(
    {
        "reference": "pu BatchNorm2d, no checkpointing (the reference)",
        "pu": "pu BatchNorm2d under pu.checkpoint",
        "torch": "torch BatchNorm2d under torch.utils.checkpoint",
    }
)


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


SEGMENTS: Mapping[str, Callable[..., torch.Tensor] | None] = MappingProxyType(
    {"reference": None, "pu": pu.checkpoint, "torch": _torch_checkpoint}
)


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
    counter: list[int] = field(default_factory=list)  # blocks.0's num_batches_tracked, per step
    stat_diff: list[float] = field(default_factory=list)  # max |running stat - reference's|, per step
    eval: list[Eval] = field(default_factory=list)  # the test set, per epoch


@dataclass
class Eval:
    """The model and its EMA copy evaluated on the test set (eval mode: the running statistics)."""

    logits: torch.Tensor
    ema_logits: torch.Tensor
    labels: torch.Tensor

    def accuracy(self, ema: bool = False) -> float:
        return float(((self.ema_logits if ema else self.logits).argmax(1) == self.labels).float().mean())

    def loss(self, ema: bool = False) -> float:
        return float(F.cross_entropy(self.ema_logits if ema else self.logits, self.labels))


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
    """One step as a paramupdates transaction; the commit steps the optimizer. The ``torch`` variant
    runs its forward and backward as plain PyTorch, before its step (what PyTorch alone does)."""
    plain = run.name == "torch"
    with contextlib.nullcontext() if plain else run.stepper:
        run.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(run.model(x, SEGMENTS[run.name]), y)
        loss.backward()
    if plain:
        with run.stepper:
            pass  # the commit: weight decay, Adam, the constraint, the EMA
    return float(loss.detach())


@torch.no_grad()
def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` in eval mode (normalized with the running statistics), the train flag restored."""
    was = model.training
    model.eval()
    try:
        return model(x)
    finally:
        model.train(was)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits_of(model, x).argmax(1) == y).float().mean())


def stat_diff(run: Run, ref: Run) -> float:
    """The largest ``|running_mean - ref|`` or ``|running_var - ref|`` over every batch-norm layer."""
    d = 0.0
    for (_, m), (_, r) in zip(_bn_layers(run.model), _bn_layers(ref.model)):
        d = max(
            d, float((m.running_mean - r.running_mean).abs().max()), float((m.running_var - r.running_var).abs().max())
        )
    return d


def _bn_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@dataclass
class Contrast:
    """A variant against the reference: its running statistics (every batch-norm layer) and what the
    model and its EMA copy output on the test set in eval mode."""

    name: str
    num_batches_tracked: int
    steps: int
    max_mean_diff: float
    max_var_diff: float
    bitwise_equal: bool
    logit_diff: float = 0.0  # max |logits - reference's| on the test set, the model
    ema_logit_diff: float = 0.0  # the same for the EMA copy
    preds_differ: int = 0  # test images whose predicted class differs from the reference's
    ema_preds_differ: int = 0
    outputs_equal: bool = True  # the model's and the EMA copy's test logits bitwise the reference's


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
    c = Contrast(run.name, nbt, steps, mean_d, var_d, equal)
    if run.eval and ref.eval:
        e, r = run.eval[-1], ref.eval[-1]
        c.logit_diff = float((e.logits - r.logits).abs().max())
        c.ema_logit_diff = float((e.ema_logits - r.ema_logits).abs().max())
        c.preds_differ = int((e.logits.argmax(1) != r.logits.argmax(1)).sum())
        c.ema_preds_differ = int((e.ema_logits.argmax(1) != r.ema_logits.argmax(1)).sum())
        c.outputs_equal = torch.equal(e.logits, r.logits) and torch.equal(e.ema_logits, r.ema_logits)
    return c


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


def _lockstep(runs: dict[str, Run], x: torch.Tensor, y: torch.Tensor, bar: Any) -> None:
    """One training step of every variant on the same batch, and what each run records of it."""
    losses = {name: train_step(r, x, y) for name, r in runs.items()}
    for name, r in runs.items():
        r.loss.append(losses[name])
        r.counter.append(int(r.model.blocks[0][1].num_batches_tracked))
        r.stat_diff.append(stat_diff(r, runs["reference"]))
    bar.set_postfix(loss=f"{losses['pu']:.3f}")


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
            _lockstep(runs, x_train[idx], y_train[idx], bar)
            steps += 1
            if not schedule:
                schedule = str(runs["pu"].stepper.schedule())
        bar.close()
        for r in runs.values():
            r.eval.append(Eval(logits_of(r.model, x_test), logits_of(r.ema, x_test), y_test))
            r.acc.append(r.eval[-1].accuracy())
            r.ema_acc.append(r.eval[-1].accuracy(ema=True))
        if progress:
            echo(
                f"  epoch {epoch + 1}: test accuracy {100 * runs['pu'].acc[-1]:.1f} % "
                f"(EMA {100 * runs['pu'].ema_acc[-1]:.1f} %)"
            )
        if epoch == 0:  # (after the first epoch's bar closed: never inside it)
            echo("\nThe schedule of one step (pu variant), in commit order:")
            echo(schedule)
            echo("")
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
    """What checkpointing changed, variant by variant against the reference, and the accuracies."""
    n_bn = len(_bn_layers(res.runs["pu"].model))
    n = res.n_test
    lines = [
        "",
        f"Checkpointing check: what each variant's model is after {res.steps} steps, against the reference",
        "trained without checkpointing (the weights are bitwise the same in all three; checkpointing trades",
        "compute for memory and should change nothing else):",
        f"  {'variant':>9}  {'BN counter':>12}  {'max |running stat - ref|':>24}  {'eval logits max |diff|':>22}"
        f"  {'test predictions':>16}  {'test loss':>15}",
        f"  {'':>9}  {'':>12}  {'mean':>11}  {'var':>11}  {'model':>10}  {'EMA copy':>10}  {'that differ':>16}"
        f"  {'model / EMA':>15}",
    ]
    for name in VARIANTS:
        r = res.runs[name]
        e = r.eval[-1] if r.eval else None
        loss = f"{e.loss():.4f} / {e.loss(ema=True):.4f}" if e is not None else "-"
        if name == "reference":
            nbt = int(r.model.blocks[0][1].num_batches_tracked)
            lines.append(
                f"  {name:>9}  {nbt:>7} (1x)  {'-':>11}  {'-':>11}  {'-':>10}  {'-':>10}  {'-':>16}  {loss:>15}"
            )
            continue
        c = res.contrasts[name]
        times = c.num_batches_tracked / max(c.steps, 1)
        if c.bitwise_equal and c.outputs_equal:
            verdict = "bitwise the reference: the model trained without checkpointing"
        else:
            verdict = "WRONG: not the model trained without checkpointing"
        differ = f"{c.preds_differ} of {n}" + (f" (EMA {c.ema_preds_differ})" if c.ema_preds_differ else "")
        lines.append(
            f"  {name:>9}  {c.num_batches_tracked:>7} ({times:g}x)  {c.max_mean_diff:>11.3g}  {c.max_var_diff:>11.3g}"
            f"  {c.logit_diff:>10.3g}  {c.ema_logit_diff:>10.3g}  {differ:>16}  {loss:>15}  {verdict}"
        )
    lines += [
        f"  (all {n_bn} batch-norm layers; eval mode normalizes with the running statistics. torch.nn.BatchNorm2d",
        "   updates them again when torch.utils.checkpoint recomputes the block in backward, pytorch/pytorch#96136:",
        "   num_batches_tracked counts 2x, so a schedule or warmup read from it runs at twice the speed, and the",
        "   statistics follow each batch with momentum 1 - (1 - 0.1)^2 = 0.19 instead of 0.1. pu.checkpoint replays",
        "   the recorded update instead of re-issuing it.)",
        "",
        f"Test accuracy ({n} held-out digits). Accuracy is not the measure here: one digit is"
        f" {100 / max(n, 1):.2f} %, and statistics",
        "that are off may score higher or lower by chance; what matters is that under torch's checkpointing the",
        "model you evaluate is not the model you trained (above).",
    ]
    for name in VARIANTS:
        r = res.runs[name]
        lines.append(f"  {name:>9}: model {100 * r.acc[-1]:5.1f} %   EMA copy {100 * r.ema_acc[-1]:5.1f} %")
    return "\n".join(lines)


def write_plot(runs: dict[str, Run], path: str) -> Any:
    """What checkpointing changed, per variant (Agg, no display): the batch-norm counter per step, the
    running statistics against the reference per step, the test-set eval outputs against the reference
    per epoch (the two differences on a symlog scale, where 0 is exactly 0). Returns the figure."""
    figure = _need("matplotlib.figure")
    fig = figure.Figure(figsize=(15, 4.2), layout="constrained")
    ax_count, ax_stat, ax_out = fig.subplots(1, 3)
    styles = {
        "reference": {"color": "tab:blue", "linewidth": 3.0, "alpha": 0.5},
        "pu": {"color": "tab:green", "linestyle": "--", "linewidth": 1.5},
        "torch": {"color": "tab:red", "linestyle": ":", "linewidth": 2.0},
    }
    ref = runs["reference"]
    for name, r in runs.items():
        steps = range(1, len(r.counter) + 1)
        ax_count.plot(steps, r.counter, label=name, **styles[name])
        if name == "reference":
            continue
        ax_stat.plot(steps, r.stat_diff, label=name, **styles[name])
        epochs = range(1, len(r.eval) + 1)
        model_d = [float((e.logits - q.logits).abs().max()) for e, q in zip(r.eval, ref.eval)]
        ema_d = [float((e.ema_logits - q.ema_logits).abs().max()) for e, q in zip(r.eval, ref.eval)]
        ax_out.plot(epochs, model_d, marker="o", label=f"{name} model", **styles[name])
        ax_out.plot(epochs, ema_d, marker="s", label=f"{name} EMA copy", **{**styles[name], "alpha": 0.4})
    ax_count.set(
        title="blocks.0 BN num_batches_tracked\n(torch under checkpointing counts every step twice)",
        xlabel="step",
        ylabel="counter",
    )
    ax_stat.set(
        title="running statistics vs the reference\n(all BN layers; symlog scale: 0 is exactly 0)",
        xlabel="step",
        ylabel="max |running_mean, running_var - reference's|",
    )
    ax_out.set(
        title="the evaluated model vs the reference\n(test set, eval mode; symlog scale: 0 is exactly 0)",
        xlabel="epoch",
        ylabel="max |test logits - reference's|",
    )
    ax_out.set_xticks(range(1, len(ref.eval) + 1))  # (whole epochs)
    pu_run = runs["pu"]
    pu_out = [float((e.logits - q.logits).abs().max()) for e, q in zip(pu_run.eval, ref.eval)]
    _zero_is_zero(ax_stat, [d for r in runs.values() for d in r.stat_diff], set(pu_run.stat_diff) == {0.0})
    _zero_is_zero(
        ax_out,
        [float((e.logits - q.logits).abs().max()) for r in runs.values() for e, q in zip(r.eval, ref.eval)],
        set(pu_out) == {0.0},
    )
    for ax in (ax_count, ax_stat, ax_out):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return fig


def _zero_is_zero(ax: Any, values: list[float], pu_is_zero: bool) -> None:
    """A symlog y-axis whose linear part lies below every nonzero ``values``, so that exactly 0 is its own
    tick and not "small"; where pu's curve is 0 at every point, say so beside it."""
    nonzero = [abs(v) for v in values if v != 0.0]
    lin = 10.0 ** math.floor(math.log10(min(nonzero))) if nonzero else 1.0
    ax.set_yscale("symlog", linthresh=lin)
    ax.set_ylim(bottom=-0.3 * lin)
    if pu_is_zero:
        ax.annotate(
            "pu: 0 (bitwise) at every point",
            xy=(0.5, 0.0),
            xycoords=("axes fraction", "data"),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            color="tab:green",
            fontsize=9,
        )


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
