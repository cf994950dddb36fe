"""The overhead measurements as markdown tables, against the merge's target ratio."""

from __future__ import annotations

from typing import Any

from lightning_aesgd.bench.common import markdown_table
from lightning_aesgd.bench.overhead.local import PERIOD

MERGE_RATIO_TARGET = 1.5
"""A merge should cost at most this many plain all-reduces of the same bytes."""

_MERGE_HEADER = (
    "model",
    "parameters",
    "all-reduce (ms)",
    "merge (ms)",
    "merge ÷ all-reduce",
    "merge without momentum (ms)",
    "÷ all-reduce",
)


def overhead_table(results: dict[str, Any]) -> str:
    """The measurements as markdown tables: the merges, then the per-step machinery."""
    merges = [
        [
            row["model"],
            f"{row['parameters']:,}",
            f"{row['all_reduce_ms']:.2f}",
            f"{row['merge_ms']:.2f}",
            _ratio(row["ratio"]),
            f"{row['merge_no_momentum_ms']:.2f}",
            _ratio(row["ratio_no_momentum"]),
        ]
        for row in results["merges"]
    ]
    return markdown_table(_MERGE_HEADER, merges) + "\n\n" + _machinery_table(results["planner"], results["sampler"])


def _machinery_table(planner: dict[str, float], sampler: dict[str, float]) -> str:
    exchange = (
        f"ArrivalClock.arrive + PlanLoop.receive (models, plan, schedule), per merge (every {PERIOD} steps in "
        "adaptive_sgd)"
    )
    rows = [
        (exchange, planner["exchange_us_per_merge"]),
        ("Planner.plan alone, per merge", planner["plan_us_per_merge"]),
        ("torch BatchSampler(DistributedSampler), per batch", sampler["torch_us_per_batch"]),
        ("PlannedBatchSampler by count, per batch", sampler["elastic_us_per_batch"]),
        ("PlannedBatchSampler by cost, per batch", sampler["elastic_cost_aware_us_per_batch"]),
    ]
    header = ("per-step machinery (no communication)", "µs")
    return markdown_table(header, [(label, f"{value:.1f}") for label, value in rows])


def _ratio(value: float) -> str:
    return f"{value:.2f}" if value <= MERGE_RATIO_TARGET else f"{value:.2f} (above {MERGE_RATIO_TARGET})"
