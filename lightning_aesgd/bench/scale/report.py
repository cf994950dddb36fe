"""The scale benchmark's outputs: the measured table, the simulated tables and ``scale.json``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_aesgd.bench.common import format_number, markdown_table, write_json
from lightning_aesgd.bench.scale.simulation import Simulation, speedup_bound
from lightning_aesgd.bench.slowness.cases import BATCH
from lightning_aesgd.bench.slowness.comparison import CaseResult

RESULTS_FILE = "scale.json"


def measured_table(results: Sequence[CaseResult]) -> str:
    """The measured counts as a markdown table."""
    header = (
        "replicas",
        "costs",
        "DDP samples/s",
        "adaptive samples/s",
        "÷ DDP",
        "bound Σv/(n·min v)",
        "efficiency DDP",
        "efficiency adaptive",
        "final plan",
    )
    rows = [
        [
            len(result.factors),
            "[" + ", ".join(f"{cost:g}" for cost in result.factors) + "]",
            f"{result.runs['ddp'].samples_per_second:.0f}",
            f"{result.runs['adaptive_elastic'].samples_per_second:.0f}",
            f"{result.ratio():.2f}",
            f"{speedup_bound(result.factors):.2f}",
            format_number(result.efficiency("ddp"), ".0%"),
            format_number(result.efficiency("adaptive_elastic"), ".0%"),
            str(result.runs["adaptive_elastic"].final_plan),
        ]
        for result in results
    ]
    return markdown_table(header, rows)


def simulated_table(simulations: Sequence[Simulation]) -> str:
    """Every simulated fleet as a row: step times, speedup against its bound, and the planning cost."""
    header = (
        "replicas",
        "costs drawn in",
        "fleet's max/min speed",
        "DDP ms/step",
        "adaptive ms/step",
        "speedup",
        "planning left out",
        "bound Σv/(n·min v)",
        "planning µs/step",
        "planning share",
    )
    rows = [
        [
            sim.replicas,
            f"[1, {sim.spread:g}]",
            f"{sim.realised_spread:.2f}",
            f"{sim.step_ms('ddp'):.1f}",
            f"{sim.step_ms('adaptive'):.1f}",
            f"{sim.speedup:.2f}",
            f"{sim.speedup_without_planning:.2f}",
            f"{sim.bound:.2f}",
            f"{sim.planning_us_per_step:.0f}",
            f"{sim.planning_share:.1%}",
        ]
        for sim in simulations
    ]
    return markdown_table(header, rows)


def sampler_table(sampler_us: dict[int, float]) -> str:
    """Rank zero's microseconds per batch of the real sampler, per number of replicas (every split checked)."""
    header = ("replicas", "step batch", "PlannedBatchSampler µs/batch (rank 0, split checked)")
    return markdown_table(header, [[n, BATCH * n, f"{us:.0f}"] for n, us in sampler_us.items()])


def write_report(
    out: Path,
    measured: Sequence[CaseResult],
    simulations: Sequence[Simulation],
    sampler_us: dict[int, float],
    settings: dict[str, Any],
) -> Path:
    """Write every figure and the settings to ``scale.json``; returns its path."""
    report = {
        "settings": settings,
        "measured": [_measured_record(result) for result in measured],
        "simulated": [
            {
                **asdict(sim),
                "speedup": sim.speedup,
                "bound": sim.bound,
                "planning_us_per_step": sim.planning_us_per_step,
            }
            for sim in simulations
        ],
        "sampler_us_per_batch": sampler_us,
    }
    return write_json(out / RESULTS_FILE, report)


def _measured_record(result: CaseResult) -> dict[str, Any]:
    record = asdict(result)
    return {**record, "ratio": result.ratio(), "ideal": result.ideal, "balanced_plan": result.balanced_plan}
