"""The placement benchmark's outputs: one markdown table per workload, ``placement.md`` and ``placement.json``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_aesgd.bench.common import markdown_table, write_json
from lightning_aesgd.bench.placement.benchmark import WorkloadResult
from lightning_aesgd.bench.placement.cases import BASELINE, DESCRIPTIONS, Case, Machine
from lightning_aesgd.bench.placement.figures import Row, Spread
from lightning_aesgd.bench.placement.workloads import on_test_split

RESULTS_FILE = "placement.json"
TABLE_FILE = "placement.md"

LEGEND = (
    "Throughput: samples per second of the training clock (validation off the clock); samples/step: the step "
    "batch of all replicas together (by default the loader's batch × replicas). Ratios (÷) and differences "
    "(−) pair each repeat with the GPU alone's under the same emulation and algorithm: median, and (min–max) over "
    "repeats where they differ; a time ratio exists where both reached the target. Rows marked *emulated* slow the "
    "GPU replica's compute F× (`step` mode, base 1) to stand for a weaker GPU; CPU replicas run at their real speed. "
    "That is emulation, not a measured weak GPU."
)


def workload_table(result: WorkloadResult) -> str:
    """The rows of one workload as a markdown table, or the reason it was skipped."""
    if result.skip is not None:
        return f"skipped: {result.skip}"
    target, metric = result.target, result.target.metric
    test = on_test_split(metric)
    header = [
        "algorithm",
        "placement",
        "replicas",
        "GPU",
        "samples/step",
        "samples/s",
        "÷ GPU alone",
        f"time to {target} (s)",
        "÷ GPU alone",
        f"final {metric}",
        "− GPU alone",
        test,
        "− GPU alone",
        "note",
    ]
    return markdown_table(header, [_cells(row, result.rows) for row in result.rows])


def spread_cell(spread: Spread | None, spec: str) -> str:
    """``median`` in ``spec``, then ``(min–max)`` where repeats differ; ``–`` without a figure, ``missed`` for ∞.

    Example:
        >>> spread_cell(Spread(1.0, 0.98, 1.03), ".2f"), spread_cell(Spread(4.0, 4.0, 4.0), ".1f")
        ('1.00 (0.98–1.03)', '4.0')
        >>> spread_cell(Spread(math.inf, 3.0, math.inf), ".1f"), spread_cell(None, ".1f")
        ('missed (3.0–missed)', '–')
    """
    if spread is None:
        return "–"
    median = _number(spread.median, spec)
    if spread.low == spread.high:
        return median
    return f"{median} ({_number(spread.low, spec)}–{_number(spread.high, spec)})"


def gpu_cell(case: Case) -> str:
    """How the case's GPU runs: real, emulated F× slower, or no GPU rank.

    Example:
        >>> gpu_cell(Case("gpu_cpu", 20.0, ("cuda:0", "cpu")))
        'emulated 20× slower'
        >>> gpu_cell(Case("cpu", 20.0, ("cpu",)))
        'none (nothing to slow)'
    """
    if case.emulated:
        return f"emulated {case.weak_gpu:g}× slower"
    if not any(device.startswith("cuda") for device in case.devices) and case.placement == "cpu":
        return "none (nothing to slow)" if case.weak_gpu > 1 else "none"
    return "real"


def write_report(
    out: Path, results: Sequence[WorkloadResult], machine: Machine, settings: dict[str, Any]
) -> list[Path]:
    """Write every figure and the settings to ``placement.json`` and the tables to ``placement.md``."""
    report = {
        "settings": settings,
        "machine": asdict(machine),
        "legend": LEGEND,
        "workloads": [_workload_record(result) for result in results],
    }
    json_path = write_json(out / RESULTS_FILE, report)
    table_path = out / TABLE_FILE
    table_path.write_text(markdown_report(results, machine) + "\n")
    return [json_path, table_path]


def markdown_report(results: Sequence[WorkloadResult], machine: Machine) -> str:
    """Every workload's table under its heading, after the machine and the legend."""
    parts = [f"Machine: {machine.cuda_count} CUDA GPU(s), {machine.cores} cores.", LEGEND]
    for result in results:
        parts += [f"### {result.workload} ({result.epochs} epoch(s), target {result.target})", workload_table(result)]
    return "\n\n".join(parts)


def _cells(row: Row, rows: Sequence[Row]) -> list[str]:
    case = row.case
    return [
        row.algorithm,
        DESCRIPTIONS[case.placement],
        _devices_cell(case),
        gpu_cell(case),
        spread_cell(row.samples_per_step, ".0f"),
        spread_cell(row.throughput, ".1f"),
        spread_cell(row.throughput_ratio, ".2f"),
        spread_cell(row.time_to_target, ".1f"),
        spread_cell(row.time_ratio, ".2f"),
        spread_cell(row.final_metric, ".4f"),
        spread_cell(row.final_difference, "+.4f"),
        spread_cell(row.test_metric, ".4f"),
        spread_cell(row.test_difference, "+.4f"),
        _note(row, rows),
    ]


def _devices_cell(case: Case) -> str:
    if not case.devices:
        return "auto (every GPU, CPU replicas on the spare cores)"
    threads = f" ({case.threads} threads each, as beside the GPU)" if case.threads is not None else ""
    return ", ".join(case.devices) + threads


def _note(row: Row, rows: Sequence[Row]) -> str:
    case = row.case
    if case.skip is not None:
        return f"skipped: {case.skip}"
    notes = []
    if row.errors:
        notes.append(f"failed {len(row.errors)} of {len(row.errors) + row.runs}: {row.errors[0]}")
    if case.placement == BASELINE:
        notes.append("baseline")
    elif not _baseline_ran(row, rows):
        notes.append("no GPU alone to compare with")
    if case.weak_gpu > 1 and not case.emulated:
        notes.append("the same runs as without emulation")
    return "; ".join(notes)


def _baseline_ran(row: Row, rows: Sequence[Row]) -> bool:
    return any(
        other.algorithm == row.algorithm
        and other.case.placement == BASELINE
        and other.case.weak_gpu == row.case.weak_gpu
        and other.runs > 0
        for other in rows
    )


def _number(value: float, spec: str) -> str:
    return "missed" if math.isinf(value) else format(value, spec)


def finite(value: Any) -> Any:
    """``value`` with every infinite or NaN float replaced by ``None`` (strict JSON has neither).

    A ``None`` time to target then reads "missed", as in the race's files.

    Example:
        >>> finite({"a": [1.0, math.inf], "b": math.nan})
        {'a': [1.0, None], 'b': None}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def _workload_record(result: WorkloadResult) -> dict[str, Any]:
    record: dict[str, Any] = finite(
        {
            "workload": result.workload,
            "target": str(result.target),
            "epochs": result.epochs,
            "skip": result.skip,
            "rows": [_row_record(row) for row in result.rows],
            "runs": [asdict(run) for run in result.runs],
        }
    )
    return record


def _row_record(row: Row) -> dict[str, Any]:
    record = asdict(row)
    case = record.pop("case")
    emulation = {"emulated": row.case.emulated, "factors": row.case.factors}
    return {"algorithm": record.pop("algorithm"), "case": row.case.name, **case, **emulation, **record}
