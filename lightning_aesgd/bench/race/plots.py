"""The benchmark's figures, drawn with matplotlib's Agg backend (no display needed).

Every line has a legend entry, the dotted targets included; legends sit to the right of the axes, never over the
data; the y-axes keep a minimum span (batch sizes from zero, metrics over at least a quarter of their scale), so
that run-to-run noise does not fill the plot; and the batch-size targets follow the profile's factors as they
change (the straggler profile's replica turning slower halfway).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from lightning_aesgd.bench.race.recorder import RunKey, RunRecord
from lightning_aesgd.bench.race.suites import Target
from lightning_aesgd.emulation.profiles import SlowdownProfile

METRIC_MIN_SPAN = 0.25
"""The metric axis spans at least this fraction of the largest magnitude plotted (e.g. 0.15 around a P@1 of 0.6)."""
_FIGSIZE = (8.5, 4.5)


def plot_metric_curves(records: Mapping[RunKey, RunRecord], profile: str, target: Target, out: Path) -> Path:
    """The target metric against training-clock time, one line per run of ``profile`` (repeat 0 labelled)."""
    return _save(metric_curves_figure(records, profile, target), out / f"metric_{profile}.png")


def metric_curves_figure(records: Mapping[RunKey, RunRecord], profile: str, target: Target) -> Figure:
    """The figure of :func:`plot_metric_curves`, not yet saved."""
    figure, axes = plt.subplots(figsize=_FIGSIZE)
    colors: dict[str, str] = {}
    values_plotted: list[float] = [target.value]
    for (run_profile, algorithm, repeat), record in records.items():
        points = [(v.clock, v.metrics[target.metric]) for v in record.validations if target.metric in v.metrics]
        if run_profile != profile or not points:
            continue
        color = colors.setdefault(algorithm, f"C{len(colors)}")
        times, values = zip(*points, strict=True)
        values_plotted += values
        label = algorithm if repeat == 0 else None
        axes.plot(times, values, marker="o", color=color, alpha=1.0 if repeat == 0 else 0.35, label=label)
    axes.axhline(target.value, color="grey", linestyle="--", linewidth=1, label=f"target {target}")
    axes.set(xlabel="training clock (s, emulated devices)", ylabel=target.metric, title=f"{target.metric} — {profile}")
    _keep_span(axes, values_plotted, METRIC_MIN_SPAN * max(abs(v) for v in values_plotted))
    _legend_outside(axes)
    axes.grid(alpha=0.3)
    return figure


def plot_batch_sizes(
    record: RunRecord,
    profile: str,
    algorithm: str,
    out: Path,
    slowdown: SlowdownProfile | Sequence[float] | None = None,
) -> Path | None:
    """Each replica's batch size against the step, from the run's plan book; ``None`` without plans.

    With the profile (a :class:`~lightning_aesgd.emulation.profiles.SlowdownProfile`, or its factors fᵢ), dotted lines
    mark the speed-proportional sizes M·fᵢ(t)⁻¹ / Σⱼ fⱼ(t)⁻¹ at each step t (by count; a cost-aware split can differ
    from them by the rows' costs), following the profile's changes of factors.
    """
    figure = batch_sizes_figure(record, profile, algorithm, slowdown)
    return None if figure is None else _save(figure, out / f"batch_sizes_{profile}.png")


def batch_sizes_figure(
    record: RunRecord, profile: str, algorithm: str, slowdown: SlowdownProfile | Sequence[float] | None = None
) -> Figure | None:
    """The figure of :func:`plot_batch_sizes`, not yet saved; ``None`` without plans."""
    if record.plans is None:
        return None
    starts, sizes = list(record.plans["starts"]), [list(s) for s in record.plans["sizes"]]
    last_step = max(len(record.samples), starts[-1] + 1)
    if slowdown is not None and not isinstance(slowdown, SlowdownProfile):
        slowdown = SlowdownProfile(tuple(slowdown))
    figure, axes = plt.subplots(figsize=_FIGSIZE)
    highest = max(max(plan) for plan in sizes)
    for replica in range(len(sizes[0])):
        per_plan = [plan[replica] for plan in sizes]
        color = f"C{replica}"
        # A step function: each plan holds from its first step to the next plan's.
        axes.step(
            [*starts, last_step], [*per_plan, per_plan[-1]], where="post", color=color, label=f"replica {replica}"
        )
        if slowdown is not None:
            steps, ideal = speed_proportional_sizes(slowdown, replica, sum(sizes[0]), last_step)
            axes.step(steps, ideal, where="post", color=color, linestyle=":", linewidth=1.5)
            highest = max(highest, *ideal)
    handles, _labels = axes.get_legend_handles_labels()
    if slowdown is not None:
        handles.append(Line2D([], [], color="grey", linestyle=":", linewidth=1.5, label="speed-proportional target"))
        for change in slowdown.changes:
            if change.step < last_step:
                handles.append(
                    axes.axvline(
                        change.step,
                        color=f"C{change.replica}",
                        linestyle="-.",
                        linewidth=1,
                        alpha=0.6,
                        label=f"step {change.step}: replica {change.replica} ×{change.factor:g}",
                    )
                )
    axes.set(xlabel="step", ylabel="batch size", title=f"{algorithm}: per-replica batch size — {profile}")
    # Sizes are shares of a fixed step batch: from zero, so that a plan's small corrections look small.
    axes.set_ylim(0, 1.1 * highest)
    _legend_outside(axes, handles)
    axes.grid(alpha=0.3)
    return figure


def speed_proportional_sizes(
    profile: SlowdownProfile, replica: int, step_batch: int, last_step: int
) -> tuple[list[int], list[float]]:
    """``replica``'s speed-proportional batch size M·fᵢ(t)⁻¹ / Σⱼ fⱼ(t)⁻¹ as a step function up to ``last_step``.

    Returns the steps where the size changes (0, each change of factors before ``last_step``, then ``last_step``)
    and the size from each of them on (the last repeated, for :meth:`matplotlib.axes.Axes.step`).

    Example:
        >>> from lightning_aesgd.emulation.profiles import SlowdownChange
        >>> profile = SlowdownProfile((1, 1), (SlowdownChange(step=10, replica=1, factor=3),))
        >>> speed_proportional_sizes(profile, replica=1, step_batch=64, last_step=20)
        ([0, 10, 20], [32.0, 16.0, 16.0])
    """
    steps = sorted({0, *(c.step for c in profile.changes if 0 < c.step < last_step)})
    sizes = []
    for step in steps:
        speeds = [1 / profile.factor(j, step) for j in range(profile.num_replicas)]
        sizes.append(step_batch * speeds[replica] / sum(speeds))
    return [*steps, last_step], [*sizes, sizes[-1]]


def _keep_span(axes: Axes, values: Sequence[float], minimum: float) -> None:
    """Widen the y-axis around ``values`` to at least ``minimum``, not below zero where every value is ≥ 0."""
    low, high = min(values), max(values)
    bottom, top = axes.get_ylim()
    if top - bottom >= minimum:
        return
    middle = (low + high) / 2
    bottom, top = middle - minimum / 2, middle + minimum / 2
    if low >= 0 > bottom:
        bottom, top = 0.0, minimum
    axes.set_ylim(bottom, top)


def _legend_outside(axes: Axes, handles: list[Artist] | None = None) -> None:
    """The legend to the right of the axes, where it cannot cover a line."""
    if handles is None:
        handles, _labels = axes.get_legend_handles_labels()
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def _save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    # "tight" keeps the legend beside the axes inside the image.
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path
