"""The demo (``paramupdates-demo``) at tiny size: it trains, plots, and detects PyTorch's double update.

The three variants train on the same batches from the same weights:
paramupdates without checkpointing (the reference), paramupdates under
``pu.checkpoint``, and ``torch.nn.BatchNorm2d`` under ``torch.utils.checkpoint``.
"""

import pytest
import torch

from conftest import bits

pytest.importorskip("sklearn", reason="the demo needs scikit-learn (pip install -e '.[demo]' or '.[test]')")
pytest.importorskip("matplotlib", reason="the demo needs matplotlib (pip install -e '.[demo]' or '.[test]')")
pytest.importorskip("tqdm", reason="the demo needs tqdm (pip install -e '.[demo]' or '.[test]')")

from paramupdates import demo  # noqa: E402


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The demo's result and what it echoed (with its progress bars, as run from the command line)."""
    out = tmp_path_factory.mktemp("demo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the demo's default; the model is tiny
    echoed: list[str] = []
    try:
        return demo.run_demo(epochs=2, train_size=640, out=str(out), progress=True, echo=echoed.append), echoed
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def result(ran):
    return ran[0]


def test_accuracy_above_chance(result):
    for name in demo.VARIANTS:
        assert result.test_accuracy(name) > 0.3, name  # 10 classes: chance is 0.1
        assert result.test_accuracy(name, ema=True) > 0.3, name
    assert len(result.runs["pu"].acc) == 2


def test_plot_written(result):
    assert result.plot is not None
    with open(result.plot, "rb") as f:
        head = f.read(8)
        rest = f.read()
    assert head == b"\x89PNG\r\n\x1a\n"
    assert len(rest) > 10_000


def test_checkpointing_contrast_detected(result):
    steps = result.steps
    assert steps == 2 * 10  # 640 images, batch 64, 2 epochs
    pu_c, torch_c = result.contrasts["pu"], result.contrasts["torch"]
    # paramupdates under checkpointing: statistics bitwise those without checkpointing
    assert pu_c.bitwise_equal and pu_c.num_batches_tracked == steps
    assert pu_c.max_mean_diff == 0.0 and pu_c.max_var_diff == 0.0
    # torch under checkpointing: every update made twice
    assert not torch_c.bitwise_equal
    assert torch_c.num_batches_tracked == 2 * steps
    assert torch_c.max_mean_diff > 0.0 and torch_c.max_var_diff > 0.0
    text = demo.report(result)
    assert "bitwise the reference: the model trained without checkpointing" in text
    assert "WRONG: not the model trained without checkpointing" in text
    assert "(2x)" in text and "Accuracy is not the measure" in text


def test_the_evaluated_model_is_the_reference_only_with_paramupdates(result):
    """The harm shown (earlier the demo showed accuracy only, where torch's variant
    scored higher): under torch's checkpointing the model evaluated after training is not the model
    trained without checkpointing; under pu.checkpoint it is, bitwise (test logits, model and EMA copy)."""
    ref, pu_run, tc = (result.runs[n] for n in demo.VARIANTS)
    assert len(pu_run.eval) == len(tc.eval) == 2
    for e, r in zip(pu_run.eval, ref.eval):
        assert torch.equal(bits(e.logits), bits(r.logits)) and torch.equal(bits(e.ema_logits), bits(r.ema_logits))
    pu_c, torch_c = result.contrasts["pu"], result.contrasts["torch"]
    assert pu_c.outputs_equal and pu_c.logit_diff == pu_c.ema_logit_diff == 0.0 and pu_c.preds_differ == 0
    assert not torch_c.outputs_equal and torch_c.logit_diff > 0.0 and torch_c.ema_logit_diff > 0.0
    assert torch_c.logit_diff == float((tc.eval[-1].logits - ref.eval[-1].logits).abs().max())
    # what the plot draws: the counter (2x for torch), the statistics' distance to the reference
    assert pu_run.counter == ref.counter == list(range(1, result.steps + 1))
    assert tc.counter == [2 * k for k in range(1, result.steps + 1)]
    assert set(pu_run.stat_diff) == {0.0} and max(tc.stat_diff) > 0.0


def test_weights_agree_only_statistics_differ(result):
    ref, pu_run, tc = (result.runs[n] for n in demo.VARIANTS)
    # pu and the reference: the whole state (weights, statistics, counters) and the EMA copy, bitwise
    for (k, a), (k2, b) in zip(pu_run.model.state_dict().items(), ref.model.state_dict().items()):
        assert k == k2 and torch.equal(bits(a), bits(b)), k
    for (k, a), (_, b) in zip(pu_run.ema.state_dict().items(), ref.ema.state_dict().items()):
        assert torch.equal(bits(a), bits(b)), f"ema {k}"
    # torch's double update leaves gradients, hence weights, alone: only the statistics are off
    for (k, a), (_, b) in zip(tc.model.named_parameters(), ref.model.named_parameters()):
        assert torch.equal(bits(a), bits(b)), k
    assert pu_run.loss == ref.loss == tc.loss


def test_schedule_lists_every_phase_in_order(result):
    s = result.schedule
    for word in ("weight_decay", "Adam.step", "max_norm", "running_mean", "num_batches_tracked", "ema"):
        assert word in s, word
    pos = [s.index(p) for p in ("before_grad", "grad ", "after_grad", "auxiliary", "after_step")]
    assert pos == sorted(pos)
    # origins point into the demo (user code shipped in the package), not at its caller
    wd_row = next(line for line in s.splitlines() if "weight_decay" in line)
    assert "paramupdates/demo.py:" in wd_row


def test_command_line(tmp_path, capsys):
    rc = demo.main(["--epochs", "1", "--train-size", "128", "--out", str(tmp_path), "--no-progress", "--seed", "3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Test accuracy" in out and "EMA copy" in out and "Accuracy is not the measure" in out
    assert "Checkpointing check" in out and "(2x)" in out and "not the model trained without checkpointing" in out
    assert "before_grad" in out  # the schedule is printed
    png = tmp_path / "paramupdates-demo.png"
    assert png.exists() and f"Plot: {png}" in out
    rc = demo.main(
        ["--epochs", "1", "--train-size", "64", "--out", str(tmp_path / "none"), "--no-plot", "--no-progress"]
    )
    assert rc == 0
    assert not (tmp_path / "none").exists()
    assert "Plot:" not in capsys.readouterr().out


def test_the_schedule_is_printed_after_the_first_epochs_progress_bar(ran):
    """Not inside the bar (which it broke in two): after the first epoch's bar closed and its line."""
    _, echoed = ran
    header = echoed.index("\nThe schedule of one step (pu variant), in commit order:")
    first_epoch = next(i for i, line in enumerate(echoed) if line.startswith("  epoch 1: test accuracy"))
    assert first_epoch < header and "after_step" in echoed[header + 1]
    assert not any(line.startswith("  epoch 2") for line in echoed[:header])


def test_the_plot_shows_an_exact_zero_as_zero(result):
    """A linear axis puts pu's exact 0 on the x-axis, where it reads as "small": the two difference panels
    are symlog (0 is its own tick), say "0 (bitwise)" beside pu's curve, and name the statistic."""
    fig = demo.write_plot(result.runs, result.plot)
    _, ax_stat, ax_out = fig.axes[:3]
    for ax in (ax_stat, ax_out):
        assert ax.get_yscale() == "symlog" and ax.get_ylim()[0] < 0.0
        assert any("0 (bitwise)" in t.get_text() for t in ax.texts)
    assert "running_mean" in ax_stat.get_ylabel() and "running_var" in ax_stat.get_ylabel()
    assert "logits" in ax_out.get_ylabel()
