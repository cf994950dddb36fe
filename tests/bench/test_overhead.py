"""The overhead program: the planner and sampler timings, the tables, and a tiny run end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lightning_aesgd.bench import main
from lightning_aesgd.bench.overhead.local import planner_costs, sampler_costs
from lightning_aesgd.bench.overhead.merge import build_model
from lightning_aesgd.bench.overhead.report import overhead_table


def test_planner_and_sampler_costs_are_positive_microseconds():
    planner = planner_costs(iterations=4)
    assert planner["exchange_us_per_merge"] > 0
    assert planner["plan_us_per_merge"] > 0
    sampler = sampler_costs(dataset_size=512)
    assert all(sampler[key] > 0 for key in ("torch_us_per_batch", "elastic_us_per_batch"))


def test_a_parameter_count_builds_four_square_layers():
    model = build_model("1e4")
    assert len(list(model.children())) == 4
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(1e4, rel=0.05)


def test_overhead_table_flags_merges_above_the_target():
    merge = {"model": "1e6", "parameters": 1_002_000, "all_reduce_ms": 2.0, "merge_ms": 4.0, "ratio": 2.0}
    merge |= {"merge_no_momentum_ms": 2.5, "ratio_no_momentum": 1.25}
    planner = {"exchange_us_per_merge": 100.0, "plan_us_per_merge": 50.0}
    sampler = {"torch_us_per_batch": 9.9, "elastic_us_per_batch": 9.3, "elastic_cost_aware_us_per_batch": 70.5}
    text = overhead_table({"merges": [merge], "planner": planner, "sampler": sampler})
    assert "| 1e6 | 1,002,000 | 2.00 | 4.00 | 2.00 (above 1.5) | 2.50 | 1.25 |" in text
    assert "\n\n| per-step machinery (no communication) | µs |\n|---|---|\n" in text
    assert "| PlannedBatchSampler by cost, per batch | 70.5 |" in text


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tiny_overhead_measures_merges_planner_and_sampler(tmp_path: Path):
    assert main(["overhead", "--tiny", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "overhead.json").read_text())
    (merge,) = results["merges"]
    assert merge["merge_ms"] > 0
    assert merge["all_reduce_ms"] > 0
    assert math.isfinite(merge["ratio"])
    assert merge["merge_no_momentum_ms"] > 0
    assert math.isfinite(merge["ratio_no_momentum"])
    assert results["planner"]["exchange_us_per_merge"] > 0
    assert results["sampler"]["elastic_us_per_batch"] > 0
