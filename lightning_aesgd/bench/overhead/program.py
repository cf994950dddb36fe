"""``python -m lightning_aesgd.bench overhead``: what the strategy's machinery costs, as JSON and a table.

(a) one merge against one plain all-reduce of the same bytes on 2 gloo processes (target: ratio ≤ 1.5);
(b) the planner's cost per merge and the sampler's cost per batch, in microseconds, without communication.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_aesgd.bench.common import comma_list, write_json
from lightning_aesgd.bench.overhead.local import planner_costs, sampler_costs
from lightning_aesgd.bench.overhead.merge import measure_merges
from lightning_aesgd.bench.overhead.report import MERGE_RATIO_TARGET, overhead_table

RESULTS_FILE = "overhead.json"


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
    """The overhead program's options."""
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
    results = {
        "merges": measure_merges(comma_list(options.sizes or scale.sizes), options.iterations or scale.iterations),
        "planner": planner_costs(scale.planner_iterations),
        "sampler": sampler_costs(scale.dataset_size),
        "merge_ratio_target": MERGE_RATIO_TARGET,
    }
    path = write_json(options.out / RESULTS_FILE, results)
    print(overhead_table(results))
    print(f"\nWrote {path}")
    return 0
