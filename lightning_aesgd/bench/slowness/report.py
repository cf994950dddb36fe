"""The slowness benchmark's outputs: a markdown table of the cases, one of the machinery, and the JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from lightning_aesgd.bench.common import format_number, markdown_table, write_json
from lightning_aesgd.bench.slowness.comparison import CaseResult
from lightning_aesgd.bench.slowness.runner import PLAN_CHECK_STEP, plan_check_step

RESULTS_FILE = "slowness.json"

_CASE_HEADER = (
    "case",
    "slowness in",
    "costs",
    "ms/step at cost 1",
    "DDP samples/s",
    "adaptive samples/s",
    "÷ DDP",
    "÷ DDP per repeat",
    "efficiency DDP",
    "efficiency adaptive",
    "first plan error (worst repeat)",
    "plan error at step {check}",
    "vs nominal 1/f",
    "slowest/fastest step",
    "smallest batch",
    "final plan",
)
_STRATEGIES = (
    ("ddp", "DDP, 4 replicas"),
    ("adaptive_elastic", "adaptive_elastic, 4 replicas"),
    ("ddp_one", "DDP, 1 replica"),
    ("adaptive_elastic_one", "adaptive_elastic, 1 replica"),
)


def write_report(
    out: Path, results: Sequence[CaseResult], machinery: dict[str, float] | None, steps: int, repeats: int
) -> Path:
    """Write every case's figures, the machinery figures and the settings to ``slowness.json``; returns its path."""
    cases = [_case_record(result) for result in results]
    report = {"cases": cases, "machinery": machinery, "steps": steps, "repeats": repeats}
    return write_json(out / RESULTS_FILE, report)


def _case_record(result: CaseResult) -> dict[str, object]:
    record = asdict(result)
    runs = record.pop("runs")
    return {**record, "balanced_plan": result.balanced_plan, "ideal": result.ideal, "runs": runs}


def table(results: Sequence[CaseResult], steps: int = PLAN_CHECK_STEP + 1) -> str:
    """The cases of runs of ``steps`` steps as a markdown table."""
    header = [name.format(check=plan_check_step(steps)) for name in _CASE_HEADER]
    return markdown_table(header, [_case_cells(result) for result in results])


def machinery_table(figures: dict[str, float]) -> str:
    """The per-step machinery figures as a markdown table."""
    header = (
        f"per step, near-empty model (median of {figures['repeats']:.0f})",
        "wall µs",
        "machinery µs",
        "CPU µs of rank 0",
        "machinery CPU µs",
        "wall ÷ DDP's, per repeat",
    )
    solo = (figures["solo_us_per_step"], figures["solo_cpu_us_per_step"])
    rows = [["one process, no strategy", f"{solo[0]:.0f}", "–", f"{solo[1]:.0f}", "–", "–"]]
    for name, label in _STRATEGIES:
        keys = (f"{name}_us_per_step", f"{name}_machinery_us", f"{name}_cpu_us_per_step", f"{name}_machinery_cpu_us")
        low, high = figures.get(f"{name}_vs_ddp_low"), figures.get(f"{name}_vs_ddp_high")
        versus = "–" if low is None or high is None else f"{low:.2f}-{high:.2f}"
        rows.append([label, *(f"{figures[key]:.0f}" for key in keys), versus])
    return markdown_table(header, rows)


def _case_cells(result: CaseResult) -> list[str]:
    ddp, adaptive = result.runs["ddp"], result.runs["adaptive_elastic"]
    return [
        result.case,
        result.mode + (" (1 worker)" if result.workers else ""),
        "[" + ", ".join(f"{f:g}" for f in result.factors) + "]",
        f"{result.step_ms:g}",
        f"{ddp.samples_per_second:.0f}",
        f"{adaptive.samples_per_second:.0f}",
        f"{result.ratio():.2f}",
        "{:.2f}-{:.2f}".format(*result.ratio_range()),
        format_number(result.efficiency("ddp"), ".0%"),
        format_number(result.efficiency("adaptive_elastic"), ".0%"),
        format_number(result.worst_first_plan_error(), ".0%"),
        format_number(result.plan_error(), ".0%"),
        format_number(result.nominal_plan_error(), ".0%"),
        format_number(adaptive.step_time_balance, ".2f"),
        str(adaptive.smallest_batch),
        str(adaptive.final_plan),
    ]
