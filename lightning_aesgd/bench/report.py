"""The benchmark's outputs: a markdown table and a JSON file holding every figure."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_aesgd.bench.analysis import BASELINE, AggregateFigures, RunFigures
from lightning_aesgd.bench.workloads import Target

RESULTS_FILE = "results.json"
TABLE_FILE = "results.md"

MACHINE_NOTE = "Devices are emulated (slowdown profiles); read ratios measured within this run, never absolute times."


def markdown_table(rows: Sequence[AggregateFigures], target: Target) -> str:
    """One line per (profile, algorithm): medians over repeats and ratios to DDP under the same profile.

    Columns: throughput in samples per training-clock second; efficiency = throughput / Σᵢ solo speed /
    (b·fᵢ); time to the target on the training clock; the target metric after the last epoch; throughput ÷ DDP's
    (above 1 is faster); time to target ÷ DDP's (below 1 is faster).
    """
    metric = target.metric
    header = [
        "profile",
        "algorithm",
        "samples/s",
        "efficiency",
        f"time to {target} (s)",
        f"final {metric}",
        f"throughput ÷ {BASELINE}",
        f"time to target ÷ {BASELINE}",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [
            row.profile,
            row.algorithm,
            _number(row.throughput, ".1f"),
            _number(row.efficiency, ".0%"),
            _number(row.time_to_target, ".1f", missing="not reached"),
            _number(row.final_metric, ".4f"),
            _number(row.throughput_vs_ddp, ".2f"),
            _number(row.time_to_target_vs_ddp, ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(
    out: Path,
    settings: dict[str, Any],
    runs: Sequence[RunFigures],
    rows: Sequence[AggregateFigures],
    table: str,
) -> list[Path]:
    """Write the JSON (settings, every run's figures, the medians) and the markdown table; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "note": MACHINE_NOTE,
        "settings": settings,
        "runs": [_finite(asdict(run)) for run in runs],
        "aggregate": [_finite(asdict(row)) for row in rows],
    }
    json_path, table_path = out / RESULTS_FILE, out / TABLE_FILE
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    table_path.write_text(f"{table}\n\n{MACHINE_NOTE}\n")
    return [json_path, table_path]


def _number(value: float | None, spec: str, missing: str = "–") -> str:
    if value is None or not math.isfinite(value):
        return missing
    return format(value, spec)


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN or infinity: write ``null`` instead."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
