"""Frozen time from a CPU quota: where the cgroup is, what it counts, and how the arrival clock charges it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_aesgd.engine import throttling
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
    arrivals.begin_step(new_epoch=True)
    with arrivals.step(1.0, 1):  # the fit's first step, unmeasured, took no time
        pass
    arrivals.begin_step()
    with arrivals.step(8.0, 8):
        clock.now = 0.1
        frozen.seconds = 0.02  # frozen while computing: already in the active wall time, not added again
        arrivals.begin_wait()
        clock.now, frozen.seconds = 0.5, 0.32  # 0.3 s of the 0.4 s wait frozen
        arrivals.end_wait()
    arrivals.begin_step()
    report = arrivals.arrive(1.0)
    assert report.active == pytest.approx(0.1 + 0.3)
    arrivals.release()  # a merge's wait: frozen there too, the running step's
    with arrivals.waiting():
        frozen.seconds = 0.42
    with arrivals.step(8.0, 8):  # its optimizer step: a step that trained
        pass
    arrivals.begin_step()
    assert arrivals.arrive(1.0).active == pytest.approx(0.1)


def test_without_a_throttle_waits_stay_waits():
    clock = Clock()
    arrivals = ArrivalClock(clock=clock)
    arrivals.attach(torch.device("cpu"))
    arrivals.begin_wait()
    clock.now = 0.5
    arrivals.end_wait()
    assert arrivals.arrive(1.0).active == pytest.approx(0.0)


def test_time_frozen_while_peers_wait_at_the_sync_point_counts_in_the_running_step():
    clock, frozen = Clock(), Frozen()
    arrivals = ArrivalClock(clock=clock, throttle=frozen)
    arrivals.attach(torch.device("cpu"))
    arrivals.begin_step(new_epoch=True)
    with arrivals.step(1.0, 1):  # the fit's first step, unmeasured, took no time
        pass
    arrivals.begin_step()
    with arrivals.step(8.0, 8):
        clock.now = 0.5
    arrivals.arrive(1.0)
    clock.now, frozen.seconds = 0.9, 0.25  # frozen for 0.25 s of the 0.4 s at the sync point
    arrivals.release()
    clock.now = 1.0
    arrivals.begin_step()
    assert arrivals.arrive(1.0).active == pytest.approx(0.5 + 0.1 + 0.25)


def test_a_colon_in_the_group_path_is_part_of_the_path_and_a_v2_line_needs_a_v2_root(tmp_path):
    assert cpu_stat_path("0::/jobs/a:b\n3:cpu:/c:d\n", tmp_path) == tmp_path / "cpu" / "c:d" / "cpu.stat"
    # A hybrid host lists the unified hierarchy (0::) too: without a v2 root its cpu group is v1's.
    assert cpu_stat_path("0::/\n3:cpu,cpuacct:/replica_1\n", tmp_path) == tmp_path / "cpu" / "replica_1" / "cpu.stat"
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    assert cpu_stat_path("0::/jobs/a:b\n", tmp_path) == tmp_path / "jobs" / "a:b" / "cpu.stat"


def _cgroup(tmp_path, monkeypatch, proc_cgroup: str) -> tuple[Path, Clock]:
    """A scripted ``/proc/self/cgroup`` and an empty cgroup root; the meter's monotonic clock is scripted too."""
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_cgroup)
    monkeypatch.setattr(throttling, "Path", lambda path: proc if path == "/proc/self/cgroup" else Path(path))
    clock = Clock()
    monkeypatch.setattr(throttling, "time", SimpleNamespace(monotonic=clock))
    root = tmp_path / "root"
    root.mkdir()
    return root, clock


def test_a_v1_group_reads_its_throttled_time_while_it_has_a_quota(tmp_path, monkeypatch):
    root, clock = _cgroup(tmp_path, monkeypatch, "0::/\n3:cpu,cpuacct:/replica_1\n")
    group = root / "cpu" / "replica_1"
    group.mkdir(parents=True)
    (group / "cpu.stat").write_text("nr_periods 10\nthrottled_time 2500000000\n")
    (group / "cpu.cfs_quota_us").write_text("50000\n")
    meter = ThrottleMeter(root)
    assert meter() == 2.5
    (group / "cpu.cfs_quota_us").write_text("-1\n")  # the quota lifted
    clock.now = 1.0
    assert meter() == 0.0


def test_a_v2_group_reads_its_throttled_time_while_it_has_a_quota_and_is_looked_up_again_each_second(
    tmp_path, monkeypatch
):
    root, clock = _cgroup(tmp_path, monkeypatch, "0::/jobs/replica_2\n")
    (root / "cgroup.controllers").write_text("cpu io\n")
    group = root / "jobs" / "replica_2"
    group.mkdir(parents=True)
    (group / "cpu.stat").write_text("usage_usec 9\nthrottled_usec 1500000\n")
    (group / "cpu.max").write_text("50000 100000\n")
    meter = ThrottleMeter(root)
    assert meter() == 1.5
    (group / "cpu.stat").write_text("usage_usec 9\nthrottled_usec 2000000\n")  # the counts are read every time
    (group / "cpu.max").write_text("max 100000\n")  # the quota lifted: seen at the next look-up of the group
    clock.now = 0.9
    assert meter() == 2.0
    clock.now = 1.0
    assert meter() == 0.0


def test_a_group_without_a_cpu_controller_or_a_readable_cpu_stat_reads_no_frozen_time(tmp_path, monkeypatch):
    root, clock = _cgroup(tmp_path, monkeypatch, "0::/\n")  # a v2 line, but no v2 root: no cpu group at all
    meter = ThrottleMeter(root)
    assert meter() == 0.0
    (root / "cgroup.controllers").write_text("cpu io\n")
    (root / "cpu.max").write_text("50000 100000\n")
    clock.now = 1.0
    assert meter() == 0.0  # a quota, but no cpu.stat
    (root / "cpu.stat").write_text("throttled_usec garbled\n")
    assert meter() == 0.0
