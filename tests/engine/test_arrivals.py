"""The arrival clock on a scripted host clock: what a report of whole steps measures, and what it leaves out."""

from __future__ import annotations

import pytest
import torch

from lightning_aesgd.engine.arrivals import ArrivalClock


class Clock:
    """A scripted wall clock: steps begin, arrive and are released when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fit_start(unmeasured_step: int | None = None) -> tuple[ArrivalClock, Clock]:
    """A clock attached for a fit whose first step begins now, as the engine begins it (a new epoch)."""
    clock = Clock()
    arrivals = ArrivalClock(clock=clock, unmeasured_step=unmeasured_step)
    arrivals.attach(torch.device("cpu"))
    arrivals.begin_step(new_epoch=True)
    return arrivals, clock


def _arrivals() -> tuple[ArrivalClock, Clock]:
    """A clock at the beginning of a fit's second step, the first (which no report measures) having taken no time."""
    arrivals, clock = _fit_start()
    with arrivals.step(1.0, 1):
        pass
    arrivals.begin_step()
    return arrivals, clock


def _whole_step(arrivals: ArrivalClock, clock: Clock, work: float, until: float) -> None:
    """A step of ``work`` samples that runs until ``until``; the next step then begins."""
    with arrivals.step(work, int(work)):
        clock.now = until
    arrivals.begin_step()


def test_a_report_carries_the_whole_steps_before_it_with_their_work_loader_time_and_active_time():
    arrivals, clock = _arrivals()
    for size in (10, 6):
        with arrivals.step(float(size), planned=size + 1, loader_seconds=0.05):
            clock.now += 0.2  # inside the optimizer step: busy
        clock.now += 0.1  # the hooks after the step, the next batch's fetch
        arrivals.begin_step()
    clock.now += 0.3  # the running step's forward and backward: its report is the next
    report = arrivals.arrive(0.5)
    assert (report.work, report.planned, report.steps, report.merge_weight) == (16.0, 18.0, 2.0, 0.5)
    assert report.loader == pytest.approx(0.1)
    assert report.busy == pytest.approx(0.4)
    assert report.active == pytest.approx(0.6)


def test_each_step_is_timed_with_its_own_batch_from_its_beginning_to_the_next_steps():
    """The slowness after a step's sync point (its update, an ``on_train_batch_end`` hook) is that step's: where it
    grows with the batch, a period from one sync point to the next would pair the old batch's tail with the new
    batch at a plan change, and read the difference as a fixed cost per step."""
    arrivals, clock = _arrivals()
    reports = []
    for size in (10, 40, 40):
        with arrivals.step(float(size), size):
            clock.now += 0.01 * size  # forward and backward: 0.01 s per sample
            reports.append(arrivals.arrive(1.0))  # the sync point, mid-step
            arrivals.release()
        clock.now += 0.05 * size  # the hook after the step: 0.05 s per sample
        arrivals.begin_step()
    assert [(report.work, report.steps) for report in reports] == [(0.0, 0.0), (10.0, 1.0), (40.0, 1.0)]
    assert reports[1].active == pytest.approx(0.6)
    assert reports[2].active == pytest.approx(2.4)


def test_a_report_names_the_first_step_it_measures_in_the_plans_numbering_or_none():
    """The plan loop restarts a replica's speed model on the first report that holds only steps after a change."""
    clock = Clock()
    arrivals = ArrivalClock(clock=clock)
    arrivals.attach(torch.device("cpu"))
    assert arrivals.arrive(1.0).first_step == -1  # nothing measured
    for key in (40, 41, 42, 43):  # a fit resumed at step 40: the keys are the engine's, not the clock's count
        arrivals.begin_step(new_epoch=key == 42, key=key)
        with arrivals.step(8.0, 8):
            clock.now += 0.1
    arrivals.begin_step(key=44)
    assert arrivals.arrive(1.0).first_step == 42  # 40: the fit's first step; 41 ran into a new epoch
    assert arrivals.arrive(1.0).first_step == -1
    arrivals, clock = _arrivals()  # no keys given: the steps begun in this fit, counted from 0
    _whole_step(arrivals, clock, 8.0, 0.1)
    assert arrivals.arrive(1.0).first_step == 1


def test_a_fits_first_step_and_its_unmeasured_step_are_reported_by_none():
    """A fit's first step carries one-time costs; DDP's reducer rebuilds its buckets in a fit's second forward, a
    broadcast that waits for the slowest."""
    arrivals, clock = _fit_start(unmeasured_step=1)
    assert arrivals.arrive(1.0).steps == 0.0  # nothing whole yet
    _whole_step(arrivals, clock, 10.0, until=2.0)  # the first step: lazy initialisation, first allocations
    with arrivals.step(12.0, 12):
        clock.now = 3.0  # the bucket rebuild held this replica for the slowest
    assert arrivals.arrive(1.0).steps == 0.0
    arrivals.begin_step()
    _whole_step(arrivals, clock, 14.0, until=3.5)
    third = arrivals.arrive(1.0)
    assert (third.work, third.steps, third.active) == (14.0, 1.0, pytest.approx(0.5))


def test_without_an_unmeasured_step_the_fits_second_step_is_its_first_reported():
    arrivals, clock = _fit_start()
    _whole_step(arrivals, clock, 10.0, until=2.0)
    _whole_step(arrivals, clock, 12.0, until=2.4)
    second = arrivals.arrive(1.0)
    assert (second.work, second.steps, second.active) == (12.0, 1.0, pytest.approx(0.4))


def test_the_step_running_into_a_new_epoch_is_not_reported_and_those_before_it_are():
    arrivals, clock = _arrivals()
    _whole_step(arrivals, clock, 10.0, until=0.2)
    with arrivals.step(8.0, 8):
        clock.now = 0.4
    clock.now = 3.0  # the epoch-end hooks, the loader's workers starting again
    arrivals.begin_step(new_epoch=True)
    clock.now = 3.1
    report = arrivals.arrive(1.0)
    assert (report.work, report.steps, report.active) == (10.0, 1.0, pytest.approx(0.2))


def test_a_pause_keeps_the_time_before_it_and_skips_the_time_during_it():
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        pass
    clock.now = 0.3  # the step and its hooks
    arrivals.pause()  # validation
    clock.now = 5.0
    arrivals.begin_step()  # the next step starts the clock again
    clock.now = 5.2
    report = arrivals.arrive(1.0)
    assert (report.steps, report.active) == (1.0, pytest.approx(0.3))


def test_a_clock_resumed_inside_a_step_counts_the_time_on_either_side_of_the_pause():
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 0.1
        arrivals.pause()  # a checkpoint written from a hook
        clock.now = 2.0
        arrivals.resume()
        clock.now = 2.25
    arrivals.begin_step()
    assert arrivals.arrive(1.0).active == pytest.approx(0.35)


def test_a_merge_after_the_update_counts_its_wait_as_waiting_and_the_hooks_after_it_as_the_steps():
    """Model merging: the replica arrives after its update and blocks on peers until the merge releases it."""
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 0.4
    arrivals.arrive(1.0)
    clock.now = 1.4  # the merge waits for the slowest replica
    arrivals.release()
    clock.now = 1.5  # the hooks after the step
    arrivals.begin_step()
    with arrivals.step(10.0, 10):
        clock.now = 1.9
    report = arrivals.arrive(1.0)
    assert (report.work, report.active) == (10.0, pytest.approx(0.5))
    assert report.wait_fraction == pytest.approx(1.0 / 1.5)


def test_overlapped_reports_count_work_until_the_step_ends_and_waiting_only_inside_waits():
    """Delayed gradient sums: a replica reports at its arrival and works on (no release); only the time it blocks
    on peers (``waiting``) is left out of its active time."""
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 0.4  # the step's last gradient bucket is ready: arrival, mid-step
        arrivals.arrive(1.0)
        clock.now = 0.5  # the update
    arrivals.begin_step()
    with arrivals.step(12.0, 12):
        with arrivals.waiting():  # the previous step's sums are not complete yet
            clock.now = 0.8
        clock.now = 1.0
        first = arrivals.arrive(1.0)
        clock.now = 1.1
    arrivals.begin_step()
    assert (first.work, first.active, first.wait_fraction) == (10.0, pytest.approx(0.5), 0.0)
    second = arrivals.arrive(1.0)
    assert (second.work, second.active) == (12.0, pytest.approx(0.3))
    assert second.wait_fraction == pytest.approx(0.3 / 0.6)


def test_waiting_inside_a_pause_leaves_the_clock_paused():
    """A flush of delayed sums at validation waits on peers while validation has the clock paused."""
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 0.2
    arrivals.pause()
    with arrivals.waiting():
        clock.now = 0.5
    clock.now = 3.0  # validation goes on
    arrivals.resume()
    clock.now = 3.1
    arrivals.begin_step()
    report = arrivals.arrive(1.0)
    assert (report.active, report.wait_fraction) == (pytest.approx(0.3), 0.0)


def test_a_wait_split_across_calls_is_waiting_not_activity():
    """Synchronous gradient sums: blocked from the last bucket's arrival until the reducer releases the replica."""
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 0.4
        arrivals.arrive(1.0)
        arrivals.begin_wait()
        clock.now = 0.9
        arrivals.end_wait()
        clock.now = 1.0
    arrivals.begin_step()
    report = arrivals.arrive(1.0)
    assert report.active == pytest.approx(0.5)
    assert report.wait_fraction == pytest.approx(0.5 / 1.0)


def test_a_new_fit_forgets_the_steps_of_the_last():
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 1.0
    arrivals.detach()
    arrivals.attach(torch.device("cpu"))
    arrivals.begin_step(new_epoch=True)
    _whole_step(arrivals, clock, 11.0, until=1.2)  # the new fit's first step: its one-time costs, unmeasured
    _whole_step(arrivals, clock, 12.0, until=1.5)
    report = arrivals.arrive(1.0)
    assert (report.work, report.steps, report.active) == (12.0, 1.0, pytest.approx(0.3))


def test_a_restart_forgets_the_steps_since_the_latest_report_and_times_from_now():
    """A replica that sat steps out: its idle steps are no training."""
    arrivals, clock = _arrivals()
    for _ in range(3):
        clock.now += 0.01
        arrivals.begin_step()
    clock.now = 5.0  # the handoff
    arrivals.restart()
    _whole_step(arrivals, clock, 10.0, until=5.3)
    report = arrivals.arrive(1.0)
    assert (report.work, report.steps, report.active) == (10.0, 1.0, pytest.approx(0.3))


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
    arrivals.begin_step()
    report = arrivals.arrive(1.0)
    assert report.busy == pytest.approx(1.1 - 0.5 - 0.1)
    assert report.active == pytest.approx(1.1 - 0.5 - 0.1)
    clock.now = 1.2
    arrivals.pause()  # a wait outside any step (a flush at validation) is no step's
    with arrivals.waiting():
        clock.now = 1.5
    arrivals.resume()
    _whole_step(arrivals, clock, 10.0, until=1.7)
    assert arrivals.arrive(1.0).busy == pytest.approx(0.2)


def test_a_report_defaults_to_no_stop_a_finite_replica_and_no_center_norm():
    arrivals, _ = _arrivals()
    report = arrivals.arrive(1.0)
    assert (report.stop, report.finite, report.center_norm, report.wait_fraction) == (0.0, 1.0, -1.0, 0.0)


def test_pausing_twice_and_waiting_split_across_calls_inside_a_pause_leave_the_clock_paused():
    arrivals, clock = _arrivals()
    with arrivals.step(10.0, 10):
        clock.now = 0.2
        arrivals.pause()
        arrivals.pause()  # a checkpoint inside validation
        arrivals.begin_wait()  # a flush of synchronous sums at validation
        clock.now = 0.5
        arrivals.end_wait()
        clock.now = 3.0
        arrivals.resume()
        clock.now = 3.1
    arrivals.begin_step()
    report = arrivals.arrive(1.0)
    assert report.active == pytest.approx(0.3)
    assert report.wait_fraction == 0.0  # the wait inside the pause was not the step's


def test_a_replica_paused_at_its_arrival_reports_its_whole_steps_and_stays_paused():
    arrivals, clock = _arrivals()
    _whole_step(arrivals, clock, 10.0, until=0.4)
    with arrivals.step(10.0, 10):
        clock.now = 0.5
    arrivals.pause()
    clock.now = 2.0
    report = arrivals.arrive(1.0)  # a merge at validation
    assert (report.steps, report.active) == (1.0, pytest.approx(0.4))
    clock.now = 2.5
    arrivals.release()
    clock.now = 2.75
    arrivals.begin_step()
    after = arrivals.arrive(1.0)  # the step from 0.4: 0.1 s before the pause, none during it or its merge
    assert (after.active, after.wait_fraction) == (pytest.approx(0.1), 0.0)


def test_a_wait_for_peers_outside_the_optimizer_step_leaves_its_busy_time_whole():
    arrivals, clock = _arrivals()
    with arrivals.waiting():  # the previous step's delayed sums, awaited before the next step
        clock.now = 0.5
    _whole_step(arrivals, clock, 10.0, until=0.8)
    report = arrivals.arrive(1.0)
    assert report.busy == pytest.approx(0.3)
    assert report.active == pytest.approx(0.3)


def test_a_period_with_no_time_at_all_reports_no_wait_fraction():
    arrivals, _ = _arrivals()
    arrivals.arrive(1.0)
    arrivals.release()  # nothing ran and nobody waited: the clock never moved
    arrivals.begin_step()
    assert arrivals.arrive(1.0).wait_fraction == 0.0


def test_a_period_mixing_idle_steps_with_working_ones_reports_no_steps_and_an_idle_one_reports_its_steps():
    """An idle step (planned 0) pays no fixed cost: beside working steps it would pull their average down."""
    arrivals, clock = _arrivals()
    _whole_step(arrivals, clock, 0.0, until=0.1)
    _whole_step(arrivals, clock, 8.0, until=0.5)
    assert arrivals.arrive(1.0).steps == 0.0
    for _ in range(2):
        with arrivals.step(0.0, 0):
            clock.now += 0.1
        arrivals.begin_step()
    assert arrivals.arrive(1.0).steps == 2.0


def test_without_an_unmeasured_step_a_fits_second_step_is_reported_like_any():
    """Model merging has no DDP reducer: its second step is its own."""
    arrivals, clock = _arrivals()
    _whole_step(arrivals, clock, 12.0, until=0.3)
    report = arrivals.arrive(1.0)
    assert (report.work, report.steps, report.active) == (12.0, 1.0, pytest.approx(0.3))


def test_a_replica_that_sat_out_a_fits_first_steps_has_its_first_step_with_samples_unmeasured():
    """A resumed fit whose plans leave a replica out: its first step with samples carries the one-time costs."""
    arrivals, clock = _fit_start()
    for _ in range(3):  # steps sat out: Lightning's step without the strategy's optimizer step
        clock.now += 0.01
        arrivals.begin_step()
    arrivals.restart()  # back in
    _whole_step(arrivals, clock, 10.0, until=clock.now + 2.0)  # the first allocations, the optimizer's state
    _whole_step(arrivals, clock, 12.0, until=clock.now + 0.3)
    report = arrivals.arrive(1.0)
    assert (report.work, report.steps, report.active) == (12.0, 1.0, pytest.approx(0.3))


def test_a_restart_keeps_the_running_steps_key():
    """The replica catches up at the beginning of a step, which then trains: the next report begins with it."""
    clock = Clock()
    arrivals = ArrivalClock(clock=clock)
    arrivals.attach(torch.device("cpu"))
    for key in (100, 101, 102):
        arrivals.begin_step(key=key)
        if key == 102:
            arrivals.restart()
        with arrivals.step(8.0, 8):
            clock.now += 0.1
    arrivals.begin_step(key=103)
    report = arrivals.arrive(1.0)
    assert (report.steps, report.first_step) == (1.0, 102)


def test_a_step_without_an_optimizer_step_is_not_reported():
    """A replica sitting out runs Lightning's step without the strategy's optimizer step: its time trained nothing,
    whether or not a restart follows (validation or a checkpoint may have caught it up before its segment's end)."""
    arrivals, clock = _arrivals()
    _whole_step(arrivals, clock, 10.0, until=0.2)
    clock.now = 5.0  # a step sat out
    arrivals.begin_step()
    report = arrivals.arrive(1.0)
    assert (report.work, report.steps, report.active) == (10.0, 1.0, pytest.approx(0.2))
