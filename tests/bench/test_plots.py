"""The benchmark's figures: targets in the legend, legends off the data, honest y-axes, and the
straggler's targets following its slowdown."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from lightning_aesgd.bench.race.plots import (
    METRIC_MIN_SPAN,
    batch_sizes_figure,
    metric_curves_figure,
    plot_batch_sizes,
    plot_metric_curves,
)
from lightning_aesgd.bench.race.recorder import RunRecord, Validation
from lightning_aesgd.bench.race.suites import Target
from lightning_aesgd.emulation.profiles import SlowdownChange, SlowdownProfile

TARGET = Target("val/p@1", 0.6)
STRAGGLER = SlowdownProfile((1, 1, 1, 1), (SlowdownChange(step=14, replica=3, factor=4),), base=6)


def _plans(steps: int = 28) -> RunRecord:
    # Equal shares of 256 until the planner sees replica 3 slow down, then a smaller share for it.
    return RunRecord(
        world_size=4,
        samples=[256] * steps,
        plans={"starts": [0, 16], "sizes": [[64, 64, 64, 64], [74, 74, 74, 34]]},
    )


def _metric_records() -> dict:
    def record(values: list[float]) -> RunRecord:
        return RunRecord(
            validations=[
                Validation(clock=i + 1.0, step=i, epoch=i, metrics={TARGET.metric: v}) for i, v in enumerate(values)
            ]
        )

    # Noise of ±0.005 around 0.61: auto-scaling would stretch it over the whole axis.
    return {
        ("strong", "adaptive_sgd", 0): record([0.610, 0.612, 0.608]),
        ("strong", "ddp", 0): record([0.607, 0.611, 0.609]),
    }


def _legend_labels(figure: Figure) -> list[str]:
    [axes] = figure.axes
    return [text.get_text() for text in axes.get_legend().get_texts()]


def _legend_is_outside_the_axes(figure: Figure) -> bool:
    [axes] = figure.axes
    renderer = figure.canvas.get_renderer()
    legend = axes.get_legend().get_window_extent(renderer)
    return legend.x0 >= axes.get_window_extent(renderer).x1


def test_the_batch_size_targets_have_a_legend_entry_and_the_legend_is_off_the_data():
    figure = batch_sizes_figure(_plans(), "strong", "adaptive_sgd", (1, 1, 2, 4))
    assert figure is not None
    labels = _legend_labels(figure)
    assert labels[:4] == [f"replica {i}" for i in range(4)]
    assert "speed-proportional target" in labels
    assert _legend_is_outside_the_axes(figure)
    plt.close(figure)


def test_batch_sizes_start_at_zero():
    figure = batch_sizes_figure(_plans(), "strong", "adaptive_sgd", (1, 1, 2, 4))
    assert figure is not None
    bottom, top = figure.axes[0].get_ylim()
    assert bottom == 0
    assert top >= 74  # the largest size plotted
    plt.close(figure)


def test_the_straggler_targets_follow_the_slowdown():
    figure = batch_sizes_figure(_plans(), "straggler", "adaptive_sgd", STRAGGLER)
    assert figure is not None
    [axes] = figure.axes
    dotted = [line for line in axes.get_lines() if line.get_linestyle() == ":"]
    assert len(dotted) == 4
    straggler = dotted[3]
    # Equal shares (64 of 256) before step 14; 1/4 ÷ (3 + 1/4) of 256 after it.
    assert list(straggler.get_xdata()) == [0, 14, 28]
    assert list(straggler.get_ydata()) == pytest.approx([64.0, 256 / 13, 256 / 13])
    assert list(dotted[0].get_ydata()) == pytest.approx([64.0, 256 * 4 / 13, 256 * 4 / 13])
    assert "step 14: replica 3 ×4" in _legend_labels(figure)
    plt.close(figure)


def test_the_metric_axis_does_not_stretch_noise_and_the_target_is_in_the_legend():
    figure = metric_curves_figure(_metric_records(), "strong", TARGET)
    bottom, top = figure.axes[0].get_ylim()
    assert top - bottom >= METRIC_MIN_SPAN * 0.612 - 1e-9
    assert bottom <= 0.6 <= top  # the target is on the plot
    assert _legend_labels(figure) == ["adaptive_sgd", "ddp", f"target {TARGET}"]
    assert _legend_is_outside_the_axes(figure)
    plt.close(figure)


def test_the_figures_are_written_with_their_legends(tmp_path: Path):
    metric = plot_metric_curves(_metric_records(), "strong", TARGET, tmp_path)
    sizes = plot_batch_sizes(_plans(), "straggler", "adaptive_sgd", tmp_path, STRAGGLER)
    assert sizes is not None
    for path in (metric, sizes):
        width, height = plt.imread(path).shape[1::-1]
        assert width > height > 0  # the legend beside the axes widened the image
    assert plot_batch_sizes(RunRecord(), "strong", "ddp", tmp_path) is None
