"""The arrival clock on a scripted host clock: what a period's report measures, and what it leaves out."""

from __future__ import annotations

import pytest
import torch

from lightning_aesgd.engine.arrivals import ArrivalClock


class Clock:
    """A scripted wall clock: arrivals and releases happen when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _arrivals() -> tuple[ArrivalClock, Clock]:
    clock = Clock()
    arrivals = ArrivalClock(clock=clock)
    arrivals.attach(torch.device("cpu"))  # the fit's first step begins now
    return arrivals, clock


def test_a_period_reports_its_work_steps_loader_time_and_active_time():
    arrivals, clock = _arrivals()
    for size in (10, 6):
        with arrivals.step(float(size), planned=size + 1, loader_seconds=0.05):
            clock.now += 0.2  # inside the optimizer step: busy
        clock.now += 0.1  # hooks and data loading between steps
    report = arrivals.arrive(0.5)
    assert (report.work, report.planned, report.steps, report.merge_weight) == (16.0, 18.0, 2.0, 0.5)
    assert report.loader == pytest.approx(0.1)
    assert report.busy == pytest.approx(0.4)
    assert report.active == pytest.approx(0.6)


def test_an_interrupted_period_reports_no_measurement_and_an_empty_one_restarts():
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        pass
    clock.now = 1.0
    arrivals.new_epoch()  # e.g. validation ran
    clock.now = 1.5
    report = arrivals.arrive(1.0)
    assert report.steps == 0
    assert not report.measured
    arrivals.release()
    clock.now = 2.0
    arrivals.new_epoch()  # nothing ran since the release: the period restarts its clock
    clock.now = 2.25
    assert arrivals.arrive(1.0).active == pytest.approx(0.25)


def test_a_pause_keeps_the_time_before_it_and_skips_the_time_during_it():
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        pass
    clock.now = 0.3  # the step and its hooks
    arrivals.pause()  # validation
    clock.now = 5.0
    arrivals.resume()
    clock.now = 5.2  # the next step's data and compute
    report = arrivals.arrive(1.0)
    assert report.measured
    assert report.active == pytest.approx(0.5)
    clock.now = 5.25  # waiting at the sync point for the slowest replica
    arrivals.release()
    assert arrivals.arrive(1.0).wait_fraction == pytest.approx(0.05 / 0.55)


def test_overlapped_reports_count_work_until_arrival_and_waiting_only_inside_waits():
    """Delayed gradient sums: a replica reports at its arrival and works on (no release); only the time it blocks
    on peers (``waiting``) is left out of its active time."""
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 0.4  # the step's last gradient bucket is ready: arrival, mid-step
        first = arrivals.arrive(1.0)
        arrivals.continue_after_arrival()
    assert (first.work, first.steps, first.active) == (10.0, 1.0, pytest.approx(0.4))
    with arrivals.step(12.0, 12):
        clock.now = 0.5
        with arrivals.waiting():  # the previous step's sums are not complete yet
            clock.now = 0.8
        clock.now = 1.0
        second = arrivals.arrive(1.0)
        arrivals.continue_after_arrival()
    assert (second.work, second.active) == (12.0, pytest.approx(0.3))
    third = arrivals.arrive(1.0)
    assert third.wait_fraction == pytest.approx(0.3 / 0.6)  # the second period: 0.3 active, 0.3 waiting


def test_waiting_inside_a_pause_leaves_the_clock_paused():
    """A flush of delayed sums at validation waits on peers while validation has the clock paused."""
    arrivals, clock = _arrivals()
    clock.now = 0.2
    arrivals.pause()
    with arrivals.waiting():
        clock.now = 0.5
    clock.now = 3.0  # validation goes on
    arrivals.resume()
    clock.now = 3.1
    assert arrivals.arrive(1.0).active == pytest.approx(0.3)


def test_a_wait_split_across_calls_is_waiting_not_activity():
    """Synchronous gradient sums: blocked from the last bucket's arrival until the reducer releases the replica."""
    arrivals, clock = _arrivals()
    clock.now = 0.4
    arrivals.begin_wait()
    clock.now = 0.9
    arrivals.end_wait()
    clock.now = 1.0
    first = arrivals.arrive(1.0)
    arrivals.continue_after_arrival()
    assert first.active == pytest.approx(0.5)
    assert arrivals.arrive(1.0).wait_fraction == pytest.approx(0.5 / 1.0)


def test_a_new_fit_forgets_the_periods_of_the_last():
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 1.0
    arrivals.detach()
    arrivals.attach(torch.device("cpu"))
    clock.now = 1.5
    report = arrivals.arrive(1.0)
    assert (report.work, report.steps, report.active) == (0.0, 0.0, pytest.approx(0.5))


def test_a_report_carries_the_stop_flag_finiteness_and_center_norm():
    arrivals, _ = _arrivals()
    report = arrivals.arrive(0.0, stop=True, finite=False, center_norm=3.5)
    assert (report.stop, report.finite, report.center_norm) == (1.0, 0.0, 3.5)


def test_a_wait_for_peers_inside_the_optimizer_step_is_not_busy_time():
    """DDP's reducer waits for the slowest replica inside the backward: that is waiting, not the replica's work."""
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 0.3  # forward and backward up to the last bucket
        arrivals.begin_wait()
        clock.now = 0.8  # the reducer waits for the slowest replica
        arrivals.end_wait()
        clock.now = 0.9  # the optimizer's update
        with arrivals.waiting():  # a delayed sum still in flight
            clock.now = 1.0
        clock.now = 1.1
    report = arrivals.arrive(1.0)
    assert report.busy == pytest.approx(1.1 - 0.5 - 0.1)
    assert report.active == pytest.approx(1.1 - 0.5 - 0.1)
    arrivals.continue_after_arrival()
    clock.now = 1.2
    arrivals.pause()  # a wait outside any step (a flush at validation) is no step's
    with arrivals.waiting():
        clock.now = 1.5
    arrivals.resume()
    with arrivals.step(10.0, 10):
        clock.now = 1.7
    assert arrivals.arrive(1.0).busy == pytest.approx(0.2)


def test_a_report_defaults_to_no_stop_a_finite_replica_and_no_center_norm():
    arrivals, _ = _arrivals()
    report = arrivals.arrive(1.0)
    assert (report.stop, report.finite, report.center_norm, report.wait_fraction) == (0.0, 1.0, -1.0, 0.0)


def test_pausing_twice_and_waiting_split_across_calls_inside_a_pause_leave_the_clock_paused():
    arrivals, clock = _arrivals()
    clock.now = 0.2
    arrivals.pause()
    arrivals.pause()  # a checkpoint inside validation
    arrivals.begin_wait()  # a flush of synchronous sums at validation
    clock.now = 0.5
    arrivals.end_wait()
    clock.now = 3.0
    arrivals.resume()
    clock.now = 3.1
    report = arrivals.arrive(1.0)
    assert report.active == pytest.approx(0.3)
    arrivals.release()
    assert arrivals.arrive(1.0).wait_fraction == 0.0  # the wait inside the pause was not the period's


def test_a_replica_paused_at_its_arrival_reports_the_time_before_the_pause_and_no_measurement():
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 0.4
    arrivals.pause()
    clock.now = 2.0
    report = arrivals.arrive(1.0)
    assert report.active == pytest.approx(0.4)
    assert (report.steps, report.measured) == (0.0, False)


def test_a_wait_for_peers_outside_the_optimizer_step_leaves_its_busy_time_whole():
    arrivals, clock = _arrivals()
    with arrivals.waiting():  # the previous step's delayed sums, awaited before the next step
        clock.now = 0.5
    with arrivals.step(10.0, 10):
        clock.now = 0.8
    report = arrivals.arrive(1.0)
    assert report.busy == pytest.approx(0.3)
    assert report.active == pytest.approx(0.3)


def test_a_period_with_no_time_at_all_reports_no_wait_fraction():
    arrivals, _ = _arrivals()
    arrivals.arrive(1.0)
    arrivals.release()  # nothing ran and nobody waited: the clock never moved
    assert arrivals.arrive(1.0).wait_fraction == 0.0


def test_a_period_mixing_idle_steps_with_working_ones_reports_no_steps_and_an_idle_one_reports_its_steps():
    """An idle step (planned 0) pays no fixed cost: beside working steps it would pull their average down."""
    arrivals, clock = _arrivals()
    with arrivals.step(0.0, 0):
        clock.now = 0.1
    with arrivals.step(8.0, 8):
        clock.now = 0.5
    assert arrivals.arrive(1.0).steps == 0.0
    arrivals.release()
    for _ in range(2):
        with arrivals.step(0.0, 0):
            clock.now += 0.1
    assert arrivals.arrive(1.0).steps == 2.0
