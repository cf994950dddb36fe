"""``python -m lightning_aesgd.bench overhead``: what the strategy's machinery costs, as JSON and a table.

(a) one merge against one plain all-reduce of the same bytes on 2 gloo processes (target: ratio ≤ 1.5);
(b) the planner's cost per merge and the sampler's cost per batch, in microseconds, without communication.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_aesgd.bench.overhead_local import PERIOD, planner_costs, sampler_costs
from lightning_aesgd.bench.overhead_merge import measure_merges

RESULTS_FILE = "overhead.json"
MERGE_RATIO_TARGET = 1.5


@dataclass(frozen=True)
class Scale:
    """How much to measure: model sizes, timed merges per size, planner calls, sampler dataset size."""

    sizes: str
    iterations: int
    planner_iterations: int
    dataset_size: int


FULL = Scale(sizes="xmc_mini,1e6,1e7", iterations=20, planner_iterations=2000, dataset_size=100_000)
TINY = Scale(sizes="1e4", iterations=3, planner_iterations=50, dataset_size=2_000)


def build_parser() -> argparse.ArgumentParser:
    """The overhead subcommand's options."""
    parser = argparse.ArgumentParser(prog="aesgd-bench overhead", description=__doc__)
    sizes_help = f"comma list: xmc_mini, xmc_eurlex or parameter counts (default {FULL.sizes})"
    parser.add_argument("--sizes", help=sizes_help)
    parser.add_argument("--iterations", type=int, help=f"timed merges per size (default {FULL.iterations})")
    parser.add_argument("--out", type=Path, default=Path("bench_results") / "overhead", help="output directory")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long configuration (tests)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table, write the JSON; returns the exit status."""
    options = build_parser().parse_args(argv)
    scale = TINY if options.tiny else FULL
    sizes = [s.strip() for s in (options.sizes or scale.sizes).split(",") if s.strip()]
    results = {
        "merges": measure_merges(sizes, options.iterations or scale.iterations),
        "planner": planner_costs(scale.planner_iterations),
        "sampler": sampler_costs(scale.dataset_size),
        "merge_ratio_target": MERGE_RATIO_TARGET,
    }
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.out / RESULTS_FILE
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(overhead_table(results))
    print(f"\nWrote {path}")
    return 0


def _ratio(value: float) -> str:
    return f"{value:.2f}" if value <= MERGE_RATIO_TARGET else f"{value:.2f} (above {MERGE_RATIO_TARGET})"


def overhead_table(results: dict[str, Any]) -> str:
    """The measurements as markdown tables."""
    lines = [
        "| model | parameters | all-reduce (ms) | merge (ms) | merge ÷ all-reduce "
        "| merge without momentum (ms) | ÷ all-reduce |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["merges"]:
        lines.append(
            f"| {row['model']} | {row['parameters']:,} | {row['all_reduce_ms']:.2f} | {row['merge_ms']:.2f} | "
            f"{_ratio(row['ratio'])} | {row['merge_no_momentum_ms']:.2f} | {_ratio(row['ratio_no_momentum'])} |"
        )
    planner, sampler = results["planner"], results["sampler"]
    lines += [
        "",
        "| per-step machinery (no communication) | µs |",
        "|---|---|",
        f"| Router.report + receive (models, plan, schedule), per merge (every {PERIOD} steps in adaptive_sgd) | "
        f"{planner['exchange_us_per_merge']:.1f} |",
        f"| planner policy.plan alone, per merge | {planner['plan_us_per_merge']:.1f} |",
        f"| torch BatchSampler(DistributedSampler), per batch | {sampler['torch_us_per_batch']:.1f} |",
        f"| ElasticBatchSampler by count, per batch | {sampler['elastic_us_per_batch']:.1f} |",
        f"| ElasticBatchSampler by cost, per batch | {sampler['elastic_cost_aware_us_per_batch']:.1f} |",
    ]
    return "\n".join(lines)
