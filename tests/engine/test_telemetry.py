"""Per-replica metrics and the end-of-fit summary, from the statistics replicas exchange at merges."""

from __future__ import annotations

import json
import math

import pytest

from lightning_aesgd.core.apportion import share_error
from lightning_aesgd.engine.plan_loop import ReplicaStats
from lightning_aesgd.engine.telemetry import replica_metrics, step_time_balance, summary_record, summary_table

STATS = [
    ReplicaStats(
        merge_weight=60,
        speed=600.0,
        samples=60,
        wait_fraction=0.1,
        step_seconds=0.10,
        busy_seconds=0.05,
        active_seconds=0.12,
        loader_seconds=0.03,
    ),
    ReplicaStats(
        merge_weight=20,
        speed=200.0,
        samples=20,
        wait_fraction=0.3,
        step_seconds=0.10,
        busy_seconds=0.05,
    ),
    ReplicaStats(
        merge_weight=20,
        speed=100.0,
        samples=20,
        wait_fraction=0.0,
        step_seconds=0.20,
        busy_seconds=0.05,
    ),
]


def test_replica_metrics_name_every_replica_and_normalise_shares_and_weights():
    metrics = replica_metrics(STATS, [60, 20, 20])
    assert metrics["aesgd/replica_0/share"] == pytest.approx(0.6)
    assert metrics["aesgd/replica_2/merge_weight"] == pytest.approx(0.2)
    assert metrics["aesgd/replica_1/samples_per_sec"] == 200.0
    assert metrics["aesgd/replica_2/step_seconds"] == 0.20
    assert (metrics["aesgd/replica_0/active_seconds"], metrics["aesgd/replica_0/loader_seconds"]) == (0.12, 0.03)
    # Target shares are 600:200:100 → 2/3, 2/9, 1/9; replica 2 holds 0.2, i.e. 80% too much.
    assert metrics["aesgd/share_error"] == pytest.approx(0.8)
    assert metrics["aesgd/step_time_balance"] == pytest.approx(2.0)


def test_plan_wide_metrics_wait_until_every_replica_has_a_speed():
    unmeasured = [*STATS[:2], ReplicaStats(1, 0.0, 0, 0.0, 0.0)]
    metrics = replica_metrics(unmeasured, [60, 20, 20])
    assert "aesgd/share_error" not in metrics
    assert math.isnan(step_time_balance(unmeasured))


def summary_table_of(stats, sizes, **options):
    return summary_table(summary_record(stats, sizes, **options))


def test_summary_table_lists_every_replica_and_the_balance():
    table = summary_table_of(STATS, [60, 20, 20], syncs=7, unit="samples")
    lines = table.splitlines()
    assert lines[1].split() == [
        "replica",
        "samples/s",
        "batch",
        "share",
        "target",
        "weight",
        "step",
        "ms",
        "busy",
        "ms",
        "waiting",
        "noise",
    ]
    assert len([line for line in lines if line.strip().startswith(("0 ", "1 ", "2 "))]) == 3
    assert "merges: 7" in table
    assert "2.00" in lines[-1]
    sums = summary_table_of(STATS, [60, 20, 20], syncs=7, sync_name="gradient sums")
    assert "gradient sums: 7" in sums
    assert "all arrive at gradient sums together" in sums
    assert "merges" not in sums


def test_a_replica_at_the_floor_that_is_still_late_is_named():
    late = [*STATS[:2], ReplicaStats(20, 10.0, 5, 0.0, 0.50)]
    table = summary_table_of(late, [60, 35, 5], syncs=3, floors=[5, 5, 5])
    assert "replica 2 sits at the smallest batch (5)" in table
    assert "5.0×" in table
    assert "sits at the smallest batch" not in summary_table_of(STATS, [60, 20, 20], syncs=3, floors=[5, 5, 5])


def test_the_summary_record_holds_what_the_table_shows_as_plain_json():
    record = summary_record(STATS, [60, 20, 20], syncs=7, unit="units", floors=[5, 5, 5], sync_name="gradient sums")
    assert json.loads(json.dumps(record, allow_nan=False)) == record
    assert (record["unit"], record["syncs"], record["sync_name"], record["starved"]) == (
        "units",
        7,
        "gradient sums",
        [],
    )
    assert [replica["batch"] for replica in record["replicas"]] == [60, 20, 20]
    assert record["replicas"][1]["share"] == pytest.approx(0.2)
    assert record["replicas"][1]["weight"] == pytest.approx(0.2)
    assert record["replicas"][0]["target"] == pytest.approx(600 / 900)
    assert record["step_time_balance"] == pytest.approx(2.0)
    assert record["share_error"] == pytest.approx(share_error([60, 20, 20], [600.0, 200.0, 100.0]))


def test_an_unmeasured_summary_record_has_no_nan():
    unmeasured = [*STATS[:2], ReplicaStats(1, 0.0, 0, 0.0, 0.0)]
    record = summary_record(unmeasured, [60, 20, 20], syncs=1)
    json.dumps(record, allow_nan=False)
    assert record["share_error"] is None
    assert record["step_time_balance"] is None
    assert [replica["target"] for replica in record["replicas"]] == [None, None, None]
    table = summary_table(record)  # renders without a target or a balance
    assert "merges: 1" in table
    assert "plan vs" not in table
