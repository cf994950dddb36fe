"""The benchmark's figures, drawn with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from lightning_aesgd.bench.race.recorder import RunKey, RunRecord
from lightning_aesgd.bench.race.suites import Target


def plot_metric_curves(records: Mapping[RunKey, RunRecord], profile: str, target: Target, out: Path) -> Path:
    """The target metric against training-clock time, one line per run of ``profile`` (repeat 0 labelled)."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    colors: dict[str, str] = {}
    for (run_profile, algorithm, repeat), record in records.items():
        points = [(v.clock, v.metrics[target.metric]) for v in record.validations if target.metric in v.metrics]
        if run_profile != profile or not points:
            continue
        color = colors.setdefault(algorithm, f"C{len(colors)}")
        times, values = zip(*points, strict=True)
        label = algorithm if repeat == 0 else None
        axes.plot(times, values, marker="o", color=color, alpha=1.0 if repeat == 0 else 0.35, label=label)
    axes.axhline(target.value, color="grey", linestyle="--", linewidth=1, label=f"target {target}")
    axes.set(xlabel="training clock (s, emulated devices)", ylabel=target.metric, title=f"{target.metric} — {profile}")
    axes.legend()
    axes.grid(alpha=0.3)
    return _save(figure, out / f"metric_{profile}.png")


def plot_batch_sizes(
    record: RunRecord, profile: str, algorithm: str, out: Path, factors: Sequence[float] | None = None
) -> Path | None:
    """Each replica's batch size against the step, from the run's plan book; ``None`` without plans.

    With the profile's ``factors`` fᵢ, dotted lines mark the speed-proportional sizes M·fᵢ⁻¹ / Σⱼ fⱼ⁻¹ (by count;
    a cost-aware split can differ from them by the rows' costs).
    """
    if record.plans is None:
        return None
    starts, sizes = list(record.plans["starts"]), [list(s) for s in record.plans["sizes"]]
    last_step = max(len(record.samples), starts[-1] + 1)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for replica in range(len(sizes[0])):
        per_plan = [plan[replica] for plan in sizes]
        color = f"C{replica}"
        # A step function: each plan holds from its first step to the next plan's.
        axes.step(
            [*starts, last_step], [*per_plan, per_plan[-1]], where="post", color=color, label=f"replica {replica}"
        )
        if factors is not None:
            ideal = sum(sizes[0]) / factors[replica] / sum(1 / f for f in factors)
            axes.axhline(ideal, color=color, linestyle=":", linewidth=1)
    axes.set(xlabel="step", ylabel="batch size", title=f"{algorithm}: per-replica batch size — {profile}")
    axes.legend()
    axes.grid(alpha=0.3)
    return _save(figure, out / f"batch_sizes_{profile}.png")


def _save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
