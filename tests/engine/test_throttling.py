"""Frozen time from a CPU quota: where the cgroup is, what it counts, and how the arrival clock charges it."""

from __future__ import annotations

import pytest
import torch

from lightning_aesgd.engine.arrivals import ArrivalClock
from lightning_aesgd.engine.throttling import ThrottleMeter, cpu_stat_path, throttled_seconds


def test_the_cpu_group_is_found_on_cgroup_v1_and_v2(tmp_path):
    v1 = "12:pids:/\n3:cpu,cpuacct:/aesgd_replica_1\n2:cpuacct:/\n"
    assert cpu_stat_path(v1, tmp_path) == tmp_path / "cpu" / "aesgd_replica_1" / "cpu.stat"
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    assert cpu_stat_path("0::/jobs/replica_2\n", tmp_path) == tmp_path / "jobs" / "replica_2" / "cpu.stat"
    assert cpu_stat_path("2:cpuacct:/\n", tmp_path / "nowhere") is None


def test_throttled_time_is_read_in_seconds_from_either_version():
    assert throttled_seconds("nr_periods 10\nnr_throttled 3\nthrottled_time 2500000000\n") == 2.5  # v1: ns
    assert throttled_seconds("usage_usec 9\nnr_throttled 3\nthrottled_usec 1500000\n") == 1.5  # v2: µs
    assert throttled_seconds("usage_usec 9\n") == 0.0


def test_a_process_without_a_readable_quota_reads_no_frozen_time(tmp_path):
    assert ThrottleMeter(root=tmp_path)() == 0.0  # no such hierarchy: never raises


class Frozen:
    """A scripted throttle: seconds frozen so far."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_frozen_time_inside_a_wait_is_the_replicas_own_active_time():
    """Frozen by its quota while blocked in the sum, the replica held the others up: it counts as active."""
    clock, frozen = Clock(), Frozen()
    arrivals = ArrivalClock(clock=clock, throttle=frozen)
    arrivals.attach(torch.device("cpu"))
    with arrivals.step(8.0, 8):
        clock.now = 0.1
        frozen.seconds = 0.02  # frozen while computing: already in the active wall time, not added again
        arrivals.begin_wait()
        clock.now, frozen.seconds = 0.5, 0.32  # 0.3 s of the 0.4 s wait frozen
        arrivals.end_wait()
    report = arrivals.arrive(1.0)
    assert report.active == pytest.approx(0.1 + 0.3)
    arrivals.release()  # a merge's wait: frozen there too, charged to the next period (this one is reported)
    with arrivals.waiting():
        frozen.seconds = 0.42
    assert arrivals.arrive(1.0).active == pytest.approx(0.1)


def test_without_a_throttle_waits_stay_waits():
    clock = Clock()
    arrivals = ArrivalClock(clock=clock)
    arrivals.attach(torch.device("cpu"))
    arrivals.begin_wait()
    clock.now = 0.5
    arrivals.end_wait()
    assert arrivals.arrive(1.0).active == pytest.approx(0.0)
