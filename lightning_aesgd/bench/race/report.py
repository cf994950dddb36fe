"""The race's outputs: a markdown table and a JSON file holding every figure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_aesgd.bench.common import format_number, markdown_table, write_json
from lightning_aesgd.bench.race.analysis import BASELINE, AggregateFigures, RunFigures
from lightning_aesgd.bench.race.suites import Target

RESULTS_FILE = "results.json"
TABLE_FILE = "results.md"

MACHINE_NOTE = "Devices are emulated (slowdown profiles); read ratios measured within this run, never absolute times."


def race_table(rows: Sequence[AggregateFigures], target: Target) -> str:
    """One line per (profile, algorithm): medians over repeats and ratios to DDP under the same profile.

    Columns: throughput in samples per training-clock second; the median step time (the first step's warm-up
    and the odd stall left out: with one replica, where steps last milliseconds, the per-step overhead);
    efficiency = throughput / Σᵢ solo speed / (b·fᵢ); time to the target on the training clock; the target metric
    after the last epoch; throughput ÷ DDP's (above 1 is faster), and the range of its ratios repeat by repeat;
    the same ratio from the first step's end (the device's warm-up left out, the plans' settling kept); time to
    target ÷ DDP's (below 1 is faster).
    """
    metric = target.metric
    header = [
        "profile",
        "algorithm",
        "samples/s",
        "step ms (median)",
        "efficiency",
        f"time to {target} (s)",
        f"final {metric}",
        f"throughput ÷ {BASELINE}",
        "per repeat",
        f"÷ {BASELINE} after step 1",
        f"time to target ÷ {BASELINE}",
    ]
    return markdown_table(header, [_cells(row) for row in rows])


def failed_runs(runs: Sequence[RunFigures]) -> str:
    """Lines for beneath the table naming each failed run (it has no row) and its error's last line; "" if none.

    A race whose candidate failed in every repeat would otherwise show DDP's row alone, as if nothing else ran.
    """
    lines = [
        f"- {run.profile} / {run.algorithm} / repeat {run.repeat}: {run.error.strip().splitlines()[-1]}"
        for run in runs
        if run.error
    ]
    return "\n".join(["Failed runs, left out of the table:", *lines]) if lines else ""


def _cells(row: AggregateFigures) -> list[str]:
    return [
        row.profile,
        row.algorithm,
        format_number(row.throughput, ".1f"),
        format_number(1000 * row.step_seconds, ".2f"),
        format_number(row.efficiency, ".0%"),
        format_number(row.time_to_target, ".1f", missing="not reached"),
        format_number(row.final_metric, ".4f"),
        format_number(row.throughput_vs_ddp, ".2f"),
        _range(row.throughput_vs_ddp_range),
        format_number(row.after_first_step_vs_ddp, ".2f"),
        format_number(row.time_to_target_vs_ddp, ".2f"),
    ]


def _range(bounds: tuple[float, float] | None) -> str:
    return "–" if bounds is None else f"{bounds[0]:.2f}-{bounds[1]:.2f}"


def write_results(
    out: Path,
    settings: dict[str, Any],
    runs: Sequence[RunFigures],
    rows: Sequence[AggregateFigures],
    table: str,
) -> list[Path]:
    """Write the JSON (settings, every run's figures, the medians) and the markdown table; returns the paths."""
    results = {
        "note": MACHINE_NOTE,
        "settings": settings,
        "runs": [_finite(asdict(run)) for run in runs],
        "aggregate": [_finite(asdict(row)) for row in rows],
    }
    json_path, table_path = write_json(out / RESULTS_FILE, results), out / TABLE_FILE
    table_path.write_text(f"{table}\n\n{MACHINE_NOTE}\n")
    return [json_path, table_path]


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN or infinity: write ``null`` instead."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
