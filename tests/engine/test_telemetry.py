"""Per-replica metrics and the end-of-fit summary, from the statistics replicas exchange at merges."""

from __future__ import annotations

import json
import math

import pytest

from lightning_aesgd.core.apportion import share_error
from lightning_aesgd.engine.plan_loop import ReplicaStats
from lightning_aesgd.engine.telemetry import (
    replica_metrics,
    starved_replicas,
    step_time_balance,
    summary_record,
    summary_table,
)

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


def _stats(*step_seconds, speed=100.0):
    return [ReplicaStats(1, speed, 1, 0.0, seconds) for seconds in step_seconds]


def test_a_left_out_replica_is_flagged_and_kept_out_of_the_plan_wide_metrics():
    """Its stale speed would count against a plan that gives it nothing; a batch of one still takes part."""
    metrics = replica_metrics(STATS, [99, 1, 0])
    assert [metrics[f"aesgd/replica_{rank}/left_out"] for rank in range(3)] == [0.0, 0.0, 1.0]
    assert metrics["aesgd/share_error"] == pytest.approx(share_error([99, 1], [600.0, 200.0]))
    assert metrics["aesgd/step_time_balance"] == pytest.approx(1.0)  # 0.10 s and 0.10 s; the left-out one's 0.20 out


def test_slow_speeds_below_one_sample_per_second_are_speeds_all_the_same():
    slow = [ReplicaStats(1, 0.5, 1, 0.0, 2.0), ReplicaStats(1, 0.25, 1, 0.0, 4.0)]
    assert replica_metrics(slow, [2, 1])["aesgd/step_time_balance"] == pytest.approx(2.0)
    assert summary_record(slow, [2, 1], syncs=1)["step_time_balance"] == pytest.approx(2.0)


def test_a_summary_before_any_sample_or_weight_reports_zero_shares_and_weights():
    record = summary_record([ReplicaStats(0, 0.0, 0, 0.0, 0.0)] * 2, [0, 0], syncs=0)
    assert [(replica["share"], replica["weight"]) for replica in record["replicas"]] == [(0.0, 0.0)] * 2


def test_every_row_of_the_summary_table_lines_up_under_its_header():
    lines = summary_table_of(STATS, [60, 20, 20], syncs=7).splitlines()
    header, rule, rows = lines[1], lines[2], lines[3:6]
    assert len(rule) == len(header)
    for row in rows:
        assert len(row) == len(header)
        # every column's value ends where its header's name ends
        ends = [
            i + 1 for i, char in enumerate(header) if char != " " and (i + 1 == len(header) or header[i + 1] == " ")
        ]
        assert all(row[end - 1] != " " for end in ends)
    assert rows[0].split()[4] == "0.667"  # replica 0's target share: 600 of 900 samples/s


def test_the_summary_table_names_the_learners_per_replica_and_what_each_count_measured():
    record = summary_record(STATS, [60, 20, 20], syncs=7)
    assert "learners" not in summary_table(record)
    record["learners"] = {"per_replica": 2, "measured": [1200.0, 2300.5]}
    assert "learners per replica: 2 (auto; the job's samples/s by learners per replica: 1: 1,200, 2: 2,300)" in (
        summary_table(record)
    )
    record["learners"] = {"per_replica": 3, "measured": []}  # a fixed count: nothing measured
    assert "learners per replica: 3" in summary_table(record).splitlines()


def test_nobody_is_named_starved_until_every_replica_has_a_speed():
    unmeasured = [*STATS[:2], ReplicaStats(1, 0.0, 0, 0.0, 0.0)]
    assert summary_record(unmeasured, [80, 20, 0], syncs=1)["starved"] == []


def test_a_left_out_replica_is_named_with_the_step_of_the_others_taking_part():
    lines = starved_replicas(_stats(0.1, 0.3, 2.0), [50, 14, 0])
    assert lines == [
        "replica 2 is left out of the steps: at its latest measurement its steps took 2000.0 ms, longer than the "
        "others need for the whole step batch (300.0 ms a step); it is probed now and then and let back in when it "
        "would help (leave_out_stragglers)."
    ]
    assert starved_replicas(_stats(0.1, 0.3), [1, 1]) == []  # a batch of one is work


def test_a_replica_at_its_floor_is_named_late_against_the_slowest_replica_taking_part():
    floors = [1, 1, 1]
    # Replica 1 at its floor, 0.4 s against 0.1 s: late. The left-out replica's stale 1 s is no measure.
    assert "replica 1 sits at the smallest batch (1)" in "".join(
        starved_replicas(_stats(0.1, 0.4, 1.0), [63, 1, 0], floors)
    )
    # Against the slowest of the others (0.5 s), not the fastest: 0.52 s is not 10% longer.
    assert starved_replicas(_stats(0.1, 0.5, 0.52), [62, 1, 1], floors) == []
    assert starved_replicas(_stats(0.5, 0.55), [63, 1], floors) == []  # exactly 10% longer is not late
    assert starved_replicas(_stats(0.5, 0.53), [63, 1], floors) == []
    assert starved_replicas(_stats(0.0, 0.4), [63, 1], floors) == []  # nothing to compare with yet
    assert starved_replicas(_stats(0.1, 0.4), [63, 1]) == []  # no floors: a batch of one is not the floor
