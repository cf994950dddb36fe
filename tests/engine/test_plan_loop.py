"""Plans from measured speed: four replicas' plan loops exchange scripted reports of their steps."""

from __future__ import annotations

import logging
import math
import pickle
import random

import pytest

from lightning_aesgd.core.apportion import share_error
from lightning_aesgd.core.merge import ElasticAverage
from lightning_aesgd.core.planners import StaticPlanner
from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.engine.admission import (
    LOCKSTEP_PROBE_REPORTS,
    MIN_PROBE_INTERVAL,
    SITTING_OUT_PROBE_REPORTS,
    Admission,
    probe_interval,
)
from lightning_aesgd.engine.model_merge import TrainingAlone
from lightning_aesgd.engine.plan_loop import HISTORY_LENGTH, PlanLoop, PlanRecord, check_learner_blocks
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.sampler import PlanBook

STEP_BATCH = 256
SECONDS_PER_SAMPLE = 1e-3


class Replica:
    """One replica's plan loop, fed scripted reports of one step each: the step of the sync point it reports at.

    The strategy's arrival clock reports a step whole at the next sync point, a step later; its accounting (whole
    steps, waits, pauses) is tested in ``test_arrivals.py``.
    """

    def __init__(self, num_replicas: int, lag: int = 3, **settings) -> None:
        self.plans = PlanLoop(PlanSettings(**settings))
        self.plans.attach(num_replicas)
        self.plans.plan_book_for(STEP_BATCH, num_replicas, lag=lag)

    def receive(self, rows, step: int) -> None:
        self.plans.receive(rows, step)


def _report(size: int, seconds: float, step: int, stop: bool = False) -> list[float]:
    """The report of one whole step, ``step``, of ``size`` samples that took ``seconds``, less its waits for peers."""
    stopping = float(stop)
    return PeriodReport(1.0, float(size), size, steps=1.0, active=seconds, stop=stopping, first_step=step).as_row()


def _group(num_replicas: int, lag: int = 3, **settings) -> list[Replica]:
    return [Replica(num_replicas, lag, **settings) for _ in range(num_replicas)]


def _run(replicas, factors_at, steps, overhead=0.0, noise=0.0, seed=0, start=0, late=0):
    """Replica i's step takes fᵢ·(overhead + size·t₁) (t₁ the per-sample time); a report every step.

    With ``noise`` σ, each arrival time is multiplied by a log-normal factor ``exp(N(0, σ²))``. With ``late`` 1 a
    sync point reports the step before it, as the arrival clock does (a step is whole once the next begins).

    Nothing is timed inside the optimizer step (no busy time): the plan loops see the replicas' speeds only through
    their step times, as with slowness in data loading, hooks or CPU quotas.
    """
    plans, rng = [], random.Random(seed)
    for step in range(start, start + steps):
        sizes = replicas[0].plans.plan_book.sizes_at(step)
        for replica in replicas[1:]:
            assert replica.plans.plan_book.sizes_at(step) == sizes  # every replica slices the step the same way
        measured = step - late
        rows = [PeriodReport(1.0).as_row()] * len(replicas)  # nothing whole yet
        if measured >= 0:
            reported = replicas[0].plans.plan_book.sizes_at(measured)
            rows = []
            for rank in range(len(replicas)):
                jitter = math.exp(rng.gauss(0.0, noise)) if noise else 1.0
                seconds = jitter * factors_at(measured)[rank] * (overhead + reported[rank] * SECONDS_PER_SAMPLE)
                rows.append(_report(reported[rank], seconds, measured))
        for replica in replicas:
            replica.receive(rows, step)
        plans.append(sizes)
    return plans


def _speeds(factors):
    return [1 / f for f in factors]


@pytest.mark.parametrize("planner", ["proportional", "balanced"])
def test_shares_converge_to_the_speed_proportional_ideal_within_30_steps(planner):
    factors = (1, 1, 2, 4)
    plans = _run(_group(4, planner=planner), lambda step: factors, steps=30)
    assert share_error(plans[0], _speeds(factors)) > 0.5  # starts equal, far from the ideal
    assert share_error(plans[-1], _speeds(factors)) < 0.10
    # Damped: no plan overshoots the ideal on the way (the slowest replica's batch only ever falls).
    slowest = [plan[3] for plan in plans]
    assert slowest == sorted(slowest, reverse=True)


@pytest.mark.parametrize("planner", ["proportional", "balanced"])
def test_the_first_plan_moves_all_the_way_from_the_initial_split(planner):
    """The equal split is a guess: the first measurements replace it at once (no damping against a guess)."""
    factors = (1, 1, 2, 4)
    plans = _run(_group(4, planner=planner), lambda step: factors, steps=6)
    # A clear imbalance (4x) is planned for at step 0, before the noise is known; it applies after the lag of 3.
    assert plans[:3] == [(64, 64, 64, 64)] * 3
    assert share_error(plans[3], _speeds(factors)) < 0.05


def test_a_mild_imbalance_waits_for_the_noise_before_the_first_plan():
    plans = _run(_group(4, planner="proportional"), lambda step: (1, 1, 1, 1.3), steps=8)
    # Not at step 0: the first plan waits for NOISE_PERIODS comparable periods (step 3), then the lag of 3.
    assert plans[: 3 + 3] == [(64, 64, 64, 64)] * 6
    assert plans[6] != (64, 64, 64, 64)


def test_an_imbalance_past_twice_the_fastest_is_planned_for_before_the_noise_is_known():
    """2.5x apart: noise of a few tens of percent does not explain it, so the first plan comes at step 0."""
    plans = _run(_group(4, planner="proportional"), lambda step: (1, 1, 1, 2.5), steps=4)
    assert plans[:3] == [(64, 64, 64, 64)] * 3  # planned at step 0, applied after the lag of 3
    assert plans[3][3] < 64


def test_a_plan_loop_without_settings_plans_with_the_default_settings():
    plans = PlanLoop()
    assert plans.settings == PlanSettings()
    plans.attach(2)
    assert plans.plan_book_for(STEP_BATCH, 2, lag=1).latest == (128, 128)


def test_a_new_fit_of_as_many_replicas_keeps_the_speed_models_and_another_count_starts_afresh():
    replicas = _group(2)
    _run(replicas, lambda step: (1, 3), steps=6)
    plans = replicas[0].plans
    learned = plans.arrival_model
    assert learned is not None
    plans.attach(2)
    assert plans.arrival_model is learned
    plans.attach(3)
    assert plans.arrival_model is not learned
    assert plans.arrival_model is not None
    assert plans.arrival_model.num_replicas == 3


def test_sitting_out_segments_set_where_probes_fall_and_how_long_they_hold_even_in_a_fresh_plan_book():
    plans = PlanLoop(PlanSettings())
    plans.attach(2)
    plans.segment_steps = 8
    plans.plan_book_for(STEP_BATCH, 2, lag=1)  # a fresh book, with a fresh admission: the segments still hold
    assert (plans.admission.align, plans.admission.probe_reports) == (8, SITTING_OUT_PROBE_REPORTS)
    plans.segment_steps = 0  # no replica sits out: probes may fall on any step
    assert (plans.admission.align, plans.admission.probe_reports) == (1, LOCKSTEP_PROBE_REPORTS)


def test_forbidding_leave_out_warns_once_and_only_where_replicas_could_have_been_left_out(caplog):
    for leave_out, warnings in ((True, 1), (False, 0)):
        caplog.clear()
        plans = PlanLoop(PlanSettings(leave_out_stragglers=leave_out))
        with caplog.at_level(logging.WARNING, logger="lightning_aesgd.engine.plan_loop"):
            plans.forbid_leaving_out("its training step communicates")
            plans.forbid_leaving_out("another reason")
        assert [record.getMessage() for record in caplog.records] == [
            "Every replica stays in the steps (leave_out_stragglers is off for this fit): its training step "
            "communicates."
        ] * warnings
        assert plans.leaving_out_forbidden == "another reason"


def test_the_stats_carry_each_replicas_latest_period_as_measured():
    replicas = _group(2)
    plans = _run(replicas, lambda step: (1, 3), steps=4, overhead=0.002)
    stats = replicas[0].plans.stats()
    for rank, factor in enumerate((1, 3)):  # one step a period: its active time, not smoothed
        expected = factor * (0.002 + plans[-1][rank] * SECONDS_PER_SAMPLE)
        assert stats[rank].active_seconds == pytest.approx(expected)
        assert stats[rank].loader_seconds == 0.0  # no loader workers here


def test_the_stats_give_each_periods_seconds_per_step_and_zeros_for_a_period_of_no_steps():
    plans = PlanLoop(PlanSettings())
    plans.attach(3)
    plans.plan_book_for(255, 3, lag=2)
    four_steps = PeriodReport(0.5, work=340.0, planned=340.0, steps=4, active=0.4, busy=0.2, loader=0.08)
    one_step = PeriodReport(0.5, work=85.0, planned=85.0, steps=1, active=0.1, busy=0.06, loader=0.01)
    plans.receive([four_steps.as_row(), PeriodReport(0.5, finite=0.0).as_row(), one_step.as_row()], step=0)
    measured, idle, single = plans.stats()
    seconds = (measured.busy_seconds, measured.active_seconds, measured.loader_seconds)
    assert seconds == pytest.approx((0.05, 0.1, 0.02))
    assert (single.busy_seconds, single.active_seconds, single.loader_seconds) == pytest.approx((0.06, 0.1, 0.01))
    assert (idle.busy_seconds, idle.active_seconds, idle.loader_seconds) == (0.0, 0.0, 0.0)
    assert (measured.finite, idle.finite) == (True, False)


def test_equal_replicas_one_sample_apart_are_balanced_as_whole_samples_allow():
    """255 samples: 128 and 127. One sample more on the quicker would reverse the times, so they agree exactly."""
    plans = PlanLoop(PlanSettings())
    plans.attach(2)
    plans.plan_book_for(255, 2, lag=2)
    assert plans.plan_book.latest == (128, 127)
    for step in range(4):
        rows = [PeriodReport(0.5, work=n, planned=n, steps=1, active=n * 1e-3).as_row() for n in (128.0, 127.0)]
        plans.receive(rows, step)
    assert plans.balanced_within(0.0)
    assert plans.plan_book.latest == (128, 127)


def test_the_models_count_a_report_of_lag_plus_one_steps_or_a_merge_period_as_one():
    """Reports of the settled plan come up to 8x further apart than lag + 1 steps: they weigh as that many."""
    replica = Replica(2)  # lag 3
    assert replica.plans.arrival_model is not None
    assert replica.plans.arrival_model.reference_steps == 4
    # Under model merging a report spans a merge period: 8 steps weigh as one report there.
    replica.plans.plan_book_for(STEP_BATCH, 2, lag=3, report_steps=8)
    assert replica.plans.arrival_model.reference_steps == 8


def test_the_dead_band_widens_where_long_reports_weigh_more():
    """A report of 8 reference periods keeps 0.8**8 of the past: its noise stays in the estimates, so the band that
    keeps equal replicas' plans apart from noise is wider than with 3-step reports of the same noise."""
    bands = []
    for steps in (3, 24):
        plans = PlanLoop(PlanSettings())
        plans.attach(2)
        plans.plan_book_for(STEP_BATCH, 2, lag=2)
        for period, jitter in enumerate([1.0, 1.05, 0.97, 1.04, 0.96, 1.03]):
            work, active = 128.0 * steps, 0.01 * jitter * steps
            row = PeriodReport(0.5, work=work, planned=work, steps=steps, active=active)
            plans.receive([row.as_row(), row.as_row()], period * steps)
        bands.append(plans.dead_band)
    assert bands[0] < bands[1] <= 0.25


def test_a_left_out_replicas_noise_does_not_widen_the_others_dead_band():
    bands = []
    for jitters in ([1.0] * 6, [1.0, 1.6, 0.7, 1.5, 0.6, 1.4]):
        plans = PlanLoop(PlanSettings())
        plans.attach(3)
        plans.plan_book_for(STEP_BATCH, 3, lag=2)
        plans.plan_book.schedule(1, [128, 128, 0])  # replica 2 is left out from step 1 on
        for step, jitter in enumerate(jitters):
            steady = PeriodReport(0.5, work=128.0, planned=128.0, steps=1, active=0.01 * (1 + 0.01 * (step % 2)))
            noisy = PeriodReport(0.5, work=128.0, planned=128.0, steps=1, active=0.5 * jitter)
            plans.receive([steady.as_row(), steady.as_row(), noisy.as_row()], step)
        bands.append(plans.dead_band)
    assert bands[0] == bands[1]


def test_a_plan_is_balanced_when_its_predicted_step_times_agree():
    """Judged on the latest plan (scheduled ones included) by every rank alike, from the same models."""
    adaptive = _group(4)
    assert not adaptive[0].plans.balanced_within(0.1)  # nothing measured yet
    _run(adaptive, lambda step: (1, 1, 2, 4), steps=10)
    assert [replica.plans.balanced_within(0.1) for replica in adaptive] == [True] * 4
    equal_split = _group(4, planner="static")  # keeps the equal split, which unequal replicas cannot balance
    _run(equal_split, lambda step: (1, 1, 2, 4), steps=10)
    assert [replica.plans.balanced_within(0.1) for replica in equal_split] == [False] * 4


@pytest.mark.parametrize("planner", ["proportional", "balanced"])
def test_the_plan_follows_a_replica_that_becomes_4x_slower_within_10_steps(planner):
    def factors_at(step):
        return (1, 1, 1, 4) if step >= 40 else (1, 1, 1, 1)

    plans = _run(_group(4, planner=planner), factors_at, steps=70)
    assert share_error(plans[39], _speeds((1, 1, 1, 1))) < 0.05
    assert share_error(plans[41], _speeds((1, 1, 1, 4))) > 0.10  # the change takes two periods to show...
    assert share_error(plans[49], _speeds((1, 1, 1, 4))) < 0.10  # ...and the plans' lag of 3 to apply


@pytest.mark.parametrize("first_slow_factor", [4, 2.5, 1.5])
@pytest.mark.parametrize("smoothing", [0.8, 0.5])
def test_with_a_plan_lag_of_one_a_4x_slowdown_is_followed_within_3_steps(first_slow_factor, smoothing):
    """Gradient synchronisation plans one step ahead, so the plan made at the first slow period (damped: the speed
    has not been seen to change yet) moves the batch before the second. The change must still be detected there,
    and the plan move all the way, not a damped step per report (13 steps here; ~40 of a benchmark's 3-step reports).
    The first slow period may be slow for part of its steps only; a smoothing of 0.5 weighs it as a long report of
    a settled plan does, averaged into the models before the second period is compared with them."""

    def factors_at(step):
        return (1, 1, 1, 4 if step > 40 else first_slow_factor if step == 40 else 1)

    replicas = _group(4, lag=1, planner="proportional", speed_smoothing=smoothing)
    plans = _run(replicas, factors_at, steps=60)
    assert share_error(plans[40], _speeds((1, 1, 1, 1))) < 0.05
    assert all(share_error(plan, _speeds((1, 1, 1, 4))) < 0.10 for plan in plans[43:])


@pytest.mark.parametrize("planner", ["proportional", "balanced"])
def test_noisy_equal_replicas_keep_plans_within_5_percent_of_each_other(planner):
    plans = _run(_group(4, planner=planner), lambda step: (1, 1, 1, 1), steps=300, noise=0.15)
    assert all(max(plan) <= 1.05 * min(plan) for plan in plans[50:])


class _Counting:
    """A planner that counts how often it is asked (and plans as the wrapped one)."""

    def __init__(self, planner) -> None:
        self.planner, self.calls = planner, 0

    def plan(self, current, step_times, total):
        self.calls += 1
        return self.planner.plan(current, step_times, total)


@pytest.mark.parametrize("forbidden", [False, True], ids=["may leave out", "leaving out forbidden"])
@pytest.mark.parametrize("noise", [0.0, 0.15])
def test_a_named_planner_is_not_asked_while_the_plans_predicted_step_times_agree(noise, forbidden):
    """Equal replicas: the plan in force is balanced, so no sync point pays for planning (it costs far more than
    the check), whether or not replicas may be left out."""
    replicas = _group(4)
    for replica in replicas:
        replica.plans.planner = _Counting(replica.plans.planner)
        if forbidden:
            replica.plans.forbid_leaving_out("a test")
    plans = _run(replicas, lambda step: (1, 1, 1, 1), steps=30, noise=noise)
    assert [replica.plans.planner.calls for replica in replicas] == [0] * 4
    assert set(plans) == {(64, 64, 64, 64)}


def test_a_4x_slowdown_is_followed_within_10_steps_through_15_percent_noise():
    def factors_at(step):
        return (1, 1, 1, 4) if step >= 100 else (1, 1, 1, 1)

    plans = _run(_group(4, planner="proportional"), factors_at, steps=130, noise=0.15, seed=1)
    assert all(max(plan) <= 1.05 * min(plan) for plan in plans[50:100])
    assert all(share_error(plan, _speeds((1, 1, 1, 4))) < 0.25 for plan in plans[110:])


def test_additive_planner_moves_towards_equal_step_times():
    factors = (1, 2)
    replicas = _group(2, planner="additive", planner_options={"step": 8}, min_batch=8, max_batch=248)
    plans = _run(replicas, lambda step: factors, steps=40)
    times = [size * f for size, f in zip(plans[-1], factors, strict=True)]
    assert plans[0] == (128, 128)
    assert max(times) / min(times) < 1.15


def test_hold_steps_keep_the_first_plan_through_the_warm_up_then_adapt():
    factors = (1, 2)
    held = _run(_group(2, planner="additive", hold_steps=10), lambda step: factors, steps=40)
    free = _run(_group(2, planner="additive"), lambda step: factors, steps=40)
    assert free[8] != (128, 128)  # adapts from the first measurements...
    assert set(held[: 10 + 3]) == {(128, 128)}  # ...or not before step 10 (+ the lag of 3)
    assert held[-1][0] > held[-1][1]  # then it does


@pytest.mark.parametrize("planner", ["proportional", "balanced", "additive", "static"])
def test_every_planner_plans_within_the_strategy_default_bounds(planner):
    # The strategy passes min_batch=1, max_batch=None (no limit); every planner must accept them.
    plans = _run(_group(2, planner=planner, min_batch=1, max_batch=None), lambda step: (1, 3), steps=12)
    assert all(sum(plan) == STEP_BATCH and min(plan) >= 1 for plan in plans)
    if planner != "static":
        assert plans[-1][0] > plans[-1][1]  # the faster replica gets the larger batch


def test_static_planner_never_changes_the_plan():
    plans = _run(_group(2, planner="static", shares=[3, 1]), lambda step: (1, 5), steps=10)
    assert set(plans) == {(192, 64)}


def test_any_replica_asking_to_stop_stops_every_replica():
    replicas = _group(2)
    rows = [_report(64, 0.1, 0, stop=rank == 1) for rank in range(len(replicas))]
    for replica in replicas:
        replica.receive(rows, step=0)
    assert all(replica.plans.stop_requested for replica in replicas)


def test_no_replica_asking_to_stop_keeps_every_replica_training():
    replicas = _group(2)
    _run(replicas, lambda step: (1, 2), steps=3)
    assert not any(replica.plans.stop_requested for replica in replicas)


def test_without_leaving_stragglers_out_a_very_slow_replica_keeps_the_floor_batch():
    factors = (1, 1, 1, 40)
    replicas = _group(4, planner="proportional", min_share=0.25, leave_out_stragglers=False)
    plans = _run(replicas, lambda step: factors, steps=40)
    floor = 16  # a quarter of the equal share 64
    assert replicas[0].plans.floors == [floor] * 4
    assert plans[-1][3] == floor
    assert all(min(plan) >= floor for plan in plans)


@pytest.mark.parametrize("planner", ["proportional", "balanced"])
def test_a_replica_50x_slower_gets_no_work_within_20_steps_and_is_probed_rarely(planner):
    factors = (1, 1, 50)
    plans = _run(_group(3, planner=planner), lambda step: factors, steps=1200)
    assert all(plan[2] == 0 for plan in plans[20:50])
    assert all(sum(plan) == STEP_BATCH for plan in plans)
    probes = [step for step in range(20, 1200) if plans[step][2] > 0]
    # The first probe comes MIN_PROBE_INTERVAL steps after the first verdict (one period's hiccup must not hold a
    # replica out for long); the next one as the budget allows, from the probe's own measurement.
    assert probes[0] < 20 + MIN_PROBE_INTERVAL < 600 < probes[-1]
    # Probed now and then; each probe holds a few steps up by 2.5 step times: at most about 2% of the time.
    assert 0 < len(probes) * 2.5 <= 0.025 * 1180
    assert all(plans[step][2] <= 9 for step in probes)  # at the floor: a tenth of the equal share 85


def test_a_replica_left_out_for_one_periods_hiccup_is_back_at_its_first_probe():
    # Equal replicas; replica 1's first measured period is 40x longer (a first kernel load, a page-fault storm).
    plans = _run(_group(2, planner="proportional"), lambda step: (1, 40) if step < 4 else (1, 1), steps=200)
    out = [step for step, plan in enumerate(plans) if plan[1] == 0]
    assert out, "left out on that period's verdict"
    assert max(out) < out[0] + MIN_PROBE_INTERVAL + 10  # back at its first probe, not after the budget's interval
    assert max(plans[-1]) <= 1.1 * min(plans[-1])


def test_a_left_out_replica_that_becomes_fast_is_let_back_in_at_its_next_probe():
    def factors_at(step):
        return (1, 1, 50) if step < 60 else (1, 1, 1)

    replicas = _group(3, planner="proportional")
    plans = _run(replicas, factors_at, steps=1600)
    assert plans[59][2] == 0
    back = next(step for step in range(60, 1600) if plans[step][2] > 0)
    assert all(plan[2] > 0 for plan in plans[back:])
    assert max(plans[-1]) <= 1.1 * min(plans[-1])  # equal again


def test_a_restored_plan_loop_keeps_probing_a_left_out_replica():
    replicas = _group(3, planner="proportional")
    _run(replicas, lambda step: (1, 1, 50), steps=40)
    saved = replicas[0].plans.state_dict()
    assert saved["admission"]["probe_at"]  # the left-out replica's probe is scheduled...
    restored = PlanLoop(PlanSettings(planner="proportional"))
    restored.attach(3)
    restored.load_state_dict(saved)
    restored.plan_book_for(STEP_BATCH, 3, lag=3)
    assert restored.admission.probe_at == replicas[0].plans.admission.probe_at  # ...and survives a checkpoint
    assert restored.plan_book.latest[2] == 0


def test_a_loop_that_may_not_leave_replicas_out_lets_them_back_in():
    replicas = _group(3, planner="proportional")
    plans = _run(replicas, lambda step: (1, 1, 50), steps=30)
    assert plans[-1][2] == 0
    for replica in replicas:
        replica.plans.forbid_leaving_out("a test")
    later = _run(replicas, lambda step: (1, 1, 50), steps=20, start=30)
    assert later[-1][2] > 0


def test_a_probe_waiting_for_its_measurement_keeps_the_plan_unsettled():
    replicas = _group(3, planner="proportional")
    _run(replicas, lambda step: (1, 1, 50), steps=30)
    loop = replicas[0].plans
    assert loop.plan_book.latest[2] == 0
    assert loop.balanced_within(0.1)  # the replicas taking part agree: reports may be spaced out
    loop.arrival_model.restart_next(2)  # as a probe does
    assert not loop.balanced_within(0.1)  # until it is measured, reports stay frequent


def test_a_static_plan_or_a_planner_object_never_leaves_a_replica_out():
    factors = (1, 1, 50)
    static = _run(_group(3, planner="static"), lambda step: factors, steps=40)
    own = _run(_group(3, planner=StaticPlanner([1, 1, 1])), lambda step: factors, steps=40)
    assert all(min(plan) > 0 for plan in static + own)


class _Scripted:
    """A planner object whose plan the test sets."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def plan(self, current, step_times, total):
        return list(self.sizes)


def test_a_planner_object_is_asked_at_every_sync_point_and_its_plans_are_never_damped():
    """Waiting for the noise, the dead band and damping (a gain below 1 after the first plan) are the named planners':
    an object's plan is scheduled at once and applies exactly."""
    planner = _Scripted([192, 64])
    replicas = _group(2, planner=planner)
    plans = _run(replicas, lambda step: (1, 1), steps=5)
    assert plans[3:] == [(192, 64)] * 2
    planner.sizes = [64, 192]
    plans = _run(replicas, lambda step: (1, 1), steps=5, start=5)
    assert plans[3:] == [(64, 192)] * 2


def test_a_plan_equal_to_the_one_in_force_schedules_nothing():
    """The book stays unrevised, so the first plan that moves still moves all the way from the initial split."""
    replicas = _group(2, planner=StaticPlanner([1.0, 1.0]))
    _run(replicas, lambda step: (1, 2), steps=5)
    assert not replicas[0].plans.plan_book.revised


def _step_times(plan, factors, overhead):
    return [f * (overhead + size * SECONDS_PER_SAMPLE) for size, f in zip(plan, factors, strict=True)]


def test_with_fixed_step_costs_the_balanced_planner_equalises_step_times():
    # A fixed cost of 10 samples' worth per step: a small batch is slow per sample, which misleads a plan that
    # only looks at samples per second; the balanced planner models the fixed part.
    factors, overhead = (1, 1, 2, 4), 10 * SECONDS_PER_SAMPLE
    balanced = _run(_group(4, planner="balanced"), lambda step: factors, steps=40, overhead=overhead)
    times = _step_times(balanced[-1], factors, overhead)
    assert max(times) / min(times) < 1.05
    # The closed form: fᵢ(a + c·bᵢ) = T for all i with Σ bᵢ = 256 → T = (256c + 4a) / Σ(1/fᵢ) with a = 10c.
    common = (STEP_BATCH + 4 * 10) * SECONDS_PER_SAMPLE / sum(1 / f for f in factors)
    assert max(times) == pytest.approx(common, rel=0.05)


def test_a_restored_plan_loop_continues_with_the_same_plans_and_measurements():
    replicas = _group(2, planner="balanced")
    _run(replicas, lambda step: (1, 3), steps=12)
    saved = replicas[1].plans

    restored = PlanLoop(PlanSettings(planner="balanced"))
    restored.attach(2)
    restored.load_state_dict(saved.state_dict())
    restored.plan_book_for(STEP_BATCH, 2, lag=3)
    assert restored.arrival_model.models() == saved.arrival_model.models()
    assert restored.arrival_model.rates() == saved.arrival_model.rates()
    assert restored.plan_book.state_dict() == saved.plan_book.state_dict()
    assert restored.merge_weights == saved.merge_weights == [1.0, 1.0]


def test_a_loop_that_missed_sync_points_takes_its_peers_plans_and_keeps_the_steps_its_sampler_served():
    """The sitting-out handoff: the shared state carries the plans too, and the sampler's position stays its own."""
    replicas = _group(2)
    _run(replicas, lambda step: (1, 3), steps=6)
    peer = replicas[0].plans
    missed = Replica(2)
    missed.plans.plan_book.sizes_at(4)  # its sampler drew steps 0 to 4 already
    missed.plans.adopt_shared_state(pickle.loads(pickle.dumps(peer.shared_state())))
    book = missed.plans.plan_book
    assert book.state_dict() == peer.plan_book.state_dict() != PlanBook([128, 128]).state_dict()
    assert book.last_served_step == 4
    assert missed.plans.arrival_model.rates() == peer.arrival_model.rates()
    mine, theirs = missed.plans.shared_state(), peer.shared_state()
    for name in ("merge_weights", "next_plan", "speed_changed", "left_out_once", "restart_from"):
        assert mine[name] == theirs[name], name


def test_a_state_loaded_once_the_plan_book_exists_applies_at_once():
    replicas = _group(2, planner="balanced")
    _run(replicas, lambda step: (1, 3), steps=12)
    saved = replicas[1].plans
    (restored,) = _group(1)
    restored.plans.attach(2)
    restored.plans.plan_book_for(STEP_BATCH, 2, lag=3)
    restored.plans.load_state_dict(saved.state_dict())
    assert restored.plans.plan_book.state_dict() == saved.plan_book.state_dict()
    assert restored.plans.arrival_model.rates() == saved.arrival_model.rates()


def test_a_state_saved_before_any_plan_or_measurement_restores_nothing_and_fails_nothing():
    empty = PlanLoop(PlanSettings()).state_dict()
    assert (empty["plans"], empty["arrivals"]) == (None, None)
    replicas = _group(2)
    _run(replicas, lambda step: (1, 3), steps=6)
    loop = replicas[0].plans
    plans, rates = loop.plan_book.state_dict(), loop.arrival_model.rates()
    loop.load_state_dict(empty)
    assert (loop.plan_book.state_dict(), loop.arrival_model.rates()) == (plans, rates)


def test_saved_merge_weights_for_another_number_of_replicas_are_not_taken():
    replicas = _group(2)
    _run(replicas, lambda step: (1, 3), steps=3)
    loop = replicas[0].plans
    loop.load_state_dict({**loop.state_dict(), "merge_weights": [0.2, 0.3, 0.5]})
    assert loop.merge_weights == [1.0, 1.0]
    loop.load_state_dict({**loop.state_dict(), "merge_weights": [0.4, 0.6]})
    assert loop.merge_weights == [0.4, 0.6]
    unattached = PlanLoop(PlanSettings())  # no fit attached: no replica count to check the weights against
    unattached.load_state_dict(loop.state_dict())
    unattached.plan_book_for(STEP_BATCH, 2, lag=3)
    assert unattached.merge_weights == []


def test_saved_plans_for_another_step_batch_are_replaced_by_a_fresh_plan():
    replicas = _group(2, planner="balanced")
    _run(replicas, lambda step: (1, 3), steps=12)
    restored = PlanLoop(PlanSettings(planner="balanced"))
    restored.attach(2)
    restored.load_state_dict(replicas[0].plans.state_dict())
    assert restored.plan_book_for(STEP_BATCH // 2, 2, lag=3).latest == (64, 64)


def test_saved_plans_that_split_a_learner_are_replaced_by_a_fresh_plan():
    replicas = _group(2, planner="balanced")
    _run(replicas, lambda step: (1, 2.7), steps=12)
    saved = replicas[0].plans.state_dict()
    assert saved["plans"]["sizes"][-1] == [187, 69]  # for one learner each
    restored = PlanLoop(PlanSettings(planner="balanced"))
    restored.learners = 4
    restored.attach(2)
    restored.load_state_dict(saved)
    assert restored.plan_book_for(STEP_BATCH, 2, lag=3).latest == (128, 128)


def test_each_replica_keeps_its_own_batch_bounds():
    factors = (1, 1, 1, 8)  # the slowest replica is held at its own floor; the fastest at its own cap
    bounds = {"min_batch": [1, 1, 1, 24], "max_batch": [60, None, None, None], "leave_out_stragglers": False}
    replicas = _group(4, planner="balanced", **bounds)
    plans = _run(replicas, lambda step: factors, steps=40)
    assert replicas[0].plans.floors == [7, 7, 7, 24]  # min_share 0.1 of 64, or the replica's own min_batch
    assert all(plan[3] >= 24 and plan[0] <= 60 for plan in plans)
    assert plans[-1] == (60, 86, 86, 24), "the capped replica's extra samples go to the others"


def test_the_history_is_a_ring_of_typed_records_so_memory_stays_flat():
    (replica,) = _group(1)
    for step in range(HISTORY_LENGTH + 10):
        replica.receive([_report(10, 0.01, step)], step)
    assert len(replica.plans.history) == HISTORY_LENGTH
    latest = replica.plans.history[-1]
    assert isinstance(latest, PlanRecord)
    assert (latest.step, latest.sizes) == (HISTORY_LENGTH + 9, (STEP_BATCH,))
    assert latest.speeds[0] == pytest.approx(10 / 0.01)


def test_a_loop_before_its_first_fit_answers_every_query_as_nothing_planned():
    plans = PlanLoop(PlanSettings(plan_dead_band=0.07))
    assert plans.next_probe() is None
    assert plans.lone_taker(0) is None
    assert plans.dead_band == 0.07
    assert not plans.balanced_within(0.5)
    assert plans.stats() == []
    plans.attach(2)  # models, but no plan book yet
    assert plans.dead_band == 0.07


def test_the_slowest_step_time_is_of_the_replicas_the_latest_plan_gives_work():
    plans = PlanLoop()
    assert plans.slowest_step_seconds() == 0.0  # no models, no plan book yet
    plans.attach(3)
    assert plans.slowest_step_seconds() == 0.0  # no plan book yet
    replicas = _group(3, max_batch=150)  # the fastest replica is capped: the other's steps stay longer
    assert replicas[0].plans.slowest_step_seconds() == 0.0  # nothing measured yet
    _run(replicas, lambda step: (1, 3, 50), steps=20)
    loop = replicas[0].plans
    seconds = loop.arrival_model.step_seconds()
    assert loop.plan_book.latest[::2] == (150, 0)  # replica 2 is left out: its 50x slower steps do not count
    assert seconds[1] > 1.5 * seconds[0]
    assert loop.slowest_step_seconds() == seconds[1]


def test_stats_describe_every_replica_as_the_latest_sync_point_saw_it():
    replicas = _group(2)
    assert replicas[0].plans.stats() == []  # nothing received yet
    _run(replicas, lambda step: (1, 3), steps=20)
    fast, slow = replicas[0].plans.stats()
    assert fast.speed == pytest.approx(3 * slow.speed, rel=0.05)
    assert fast.step_seconds == pytest.approx(slow.step_seconds, rel=0.1)  # balanced by the plans
    assert (fast.finite, slow.finite, fast.merge_weight) == (True, True, 1.0)


@pytest.mark.parametrize(
    ("kwargs", "total", "replicas", "match"),
    [
        ({"planner": "static", "shares": [1, 2]}, 8, 1, r"2 static shares for 1 replicas.*HINT"),
        ({}, 3, 4, r"cannot give each of the 4 replicas one.*HINT: raise the strategy's step_batch_size"),
        ({"min_batch": 4}, 6, 2, r"min_batch=4 for 2 replicas \(8 samples\) exceeds the 6 samples.*HINT"),
        ({"min_batch": [4, 3]}, 6, 2, r"min_batch=\[4, 3\] for 2 replicas \(7 samples\) exceeds the 6.*HINT"),
        ({"max_batch": 2}, 8, 2, r"max_batch=2 for 2 replicas cannot hold the 8 samples.*HINT"),
        ({"max_batch": [2, 5]}, 8, 2, r"max_batch=\[2, 5\] for 2 replicas cannot hold the 8 samples.*HINT"),
        ({"max_batch": [2, None, 4]}, 8, 2, r"`max_batch` holds 3 values for 2 replicas.*HINT.*rank order"),
        ({"min_share": [0.1]}, 8, 2, r"`min_share` holds 1 values for 2 replicas.*HINT"),
        ({"min_batch": [1, 5], "max_batch": [8, 4]}, 8, 2, r"`min_batch` \(5\) or None, got 4.*HINT"),
        ({"planner": StaticPlanner((1.0, 2.0))}, 8, 1, r"failed a trial plan.*HINT"),
    ],
)
def test_options_that_do_not_fit_the_step_fail_when_the_plan_book_is_made(kwargs, total, replicas, match):
    with pytest.raises(ValueError, match=match):
        PlanLoop(PlanSettings(**kwargs)).plan_book_for(total, replicas, lag=2)


class _WrongTotal:
    def plan(self, current, step_times, total):
        return [total + 1 for _ in current]


def test_a_step_that_learners_cannot_share_equally_fails_with_the_fix():
    check_learner_blocks(256, 2, learners=2)
    with pytest.raises(ValueError, match=r"Steps of 255 samples cannot be split equally among the 2 learners.*HINT"):
        check_learner_blocks(255, 2, learners=2)


def test_a_planner_object_that_returns_a_wrong_plan_fails_before_training():
    with pytest.raises(ValueError, match=r"returned \[9\] for a trial plan of \[8\].*HINT"):
        PlanLoop(PlanSettings(planner=_WrongTotal())).plan_book_for(8, 1, lag=2)


def test_a_lone_replica_is_named_and_its_reports_wait_until_a_probe_is_due():
    replicas = _group(2, planner="proportional")
    plans = _run(replicas, lambda step: (1, 50), steps=40)
    loop = replicas[0].plans
    assert plans[-1] == (STEP_BATCH, 0)
    assert loop.lone_taker(39) == 0
    assert loop.lone_taker(0) is None  # both replicas had samples in the first plan
    due = loop.admission.probe_at[1]
    assert loop.reports_can_wait(due - 1)
    assert not loop.reports_can_wait(due)  # the probe is planned from the reports at this sync point


def test_training_alone_follows_one_taker_from_merge_to_merge():
    alone = TrainingAlone()
    for taker in (0, 0, 0):
        alone.observe(taker)
    assert (alone.taker, alone.steps) == (0, 3)
    alone.observe(1)  # another replica had every sample of this step: not the same lone replica
    assert alone.taker is None
    alone.merged()
    alone.observe(None)  # several takers
    assert alone.taker is None
    alone.merged()
    alone.observe(1)
    alone.owes_merge = True
    restored = TrainingAlone()
    restored.load_state_dict(alone.state_dict())
    assert (restored.taker, restored.steps, restored.owes_merge) == (1, 1, True)


def test_only_a_plain_average_leaves_a_lone_replica_as_it_is():
    assert ElasticAverage(alpha=1.0, momentum=0.0).replaces_replicas_with_mean
    assert not ElasticAverage(alpha=1.0, momentum=0.3).replaces_replicas_with_mean
    assert not ElasticAverage(alpha=0.5).replaces_replicas_with_mean


@pytest.mark.parametrize("late", [0, 1])
def test_when_a_replica_is_first_left_out_the_others_models_follow_their_new_speed_at_once(late):
    """Replica 3 shares the cores with the others: while it works they run 1.3x slower. Left out, they speed up by
    barely more than a level shift's threshold, which the plans' moves of their batches would hide, so their models
    restart from the first report that measures only steps without it: where the sync points report the step
    before them (``late``), not the report that still holds the last step with it."""
    replicas, overhead = _group(4, planner="proportional"), 100 * SECONDS_PER_SAMPLE  # mostly fixed cost

    def factors_at(step):
        contention = 1.3 if replicas[0].plans.plan_book.sizes_at(step)[3] > 0 else 1.0
        return (contention, contention, 2 * contention, 4)

    plans: list = []
    while len(plans) < late + 1 or plans[-1 - late][3] > 0:
        plans += _run(replicas, factors_at, steps=1, overhead=overhead, start=len(plans), late=late)
    assert len(plans) < 20
    loop = replicas[0].plans
    models, sizes, measured = loop.arrival_model.models(), plans[-1 - late], len(plans) - 1 - late
    for rank in range(3):
        seconds = factors_at(measured)[rank] * (overhead + sizes[rank] * SECONDS_PER_SAMPLE)
        assert models[rank].seconds(sizes[rank]) == pytest.approx(seconds, rel=0.01)
    assert not loop.arrival_model.restarts_pending()


@pytest.mark.parametrize("slow_from", range(1, 8))
def test_a_replica_left_out_soon_after_another_is_never_left_waiting_for_a_restart(slow_from):
    """The first leaving restarts the others' models a few steps later; one of them left out meanwhile must not wait
    for a restart while it idles (it could not sit out, and reports would stay frequent)."""
    replicas = _group(4, planner="proportional")
    loop, left_out = replicas[0].plans, set()
    for step in range(40):
        _run(replicas, lambda step: (1, 1, 50, 1 if step < slow_from else 50), steps=1, start=step)
        latest = loop.plan_book.latest
        assert all(latest[rank] > 0 for rank in loop.arrival_model.restarts_pending()), (step, latest)
        left_out |= {rank for rank, size in enumerate(latest) if size == 0}
    assert left_out == {2, 3}


def test_a_replica_left_out_before_reports_reach_its_restart_is_not_restarted_while_it_idles():
    """Reports 8 steps apart (a merge period): the others' restart, due 3 steps after the first leaving, is still
    ahead when the next report leaves replica 3 out too; replica 3 then idles, with nothing of it to restart."""
    replicas = _group(4, planner="proportional")
    loop = replicas[0].plans
    for report in range(4):
        _run(replicas, lambda step: (1, 1, 50, 1 if step == 0 else 50), steps=1, start=8 * report)
        latest = loop.plan_book.latest
        assert all(latest[rank] > 0 for rank in loop.arrival_model.restarts_pending()), (report, latest)
    assert latest[2:] == (0, 0)


def test_a_plan_made_while_a_probe_waits_for_its_measurement_keeps_the_probe_in():
    """Replica 0 slows down 4x right after replica 2's probe is planned: the plan that follows at once still gives
    the probe its batch, as replica 2 is judged on its stale model only once its probe period is reported."""
    replicas = _group(3, planner="proportional")
    loop, probe = replicas[0].plans, []
    for step in range(60):
        _run(replicas, lambda step: (4 if probe and step > probe[0] else 1, 1, 50), steps=1, start=step)
        if 2 in loop.arrival_model.restarts_pending():
            if not probe:
                probe.append(step)
            assert loop.plan_book.latest[2] > 0, step
    assert probe


def test_a_resumed_fit_takes_a_probe_verdict_for_no_first_leaving():
    """Only a replica's first leaving in a fit restarts the others' models; a resumed fit whose plans already leave
    it out must not take its next probe's verdict for one."""
    replicas = _group(3, planner="proportional")
    _run(replicas, lambda step: (1, 1, 20), steps=40)
    saved = replicas[0].plans.state_dict()
    for replica in replicas:
        replica.plans = PlanLoop(PlanSettings(planner="proportional"))
        replica.plans.attach(3)
        replica.plans.load_state_dict(saved)
        replica.plans.plan_book_for(STEP_BATCH, 3, lag=3)
    model, restarted = replicas[0].plans.arrival_model, []
    restart_next = model.restart_next
    model.restart_next = lambda rank: (restarted.append(rank), restart_next(rank))
    plans = _run(replicas, lambda step: (1, 1, 20), steps=760, start=40)
    assert any(plan[2] > 0 for plan in plans)  # probed, and left out again
    assert plans[-1][2] == 0
    assert set(restarted) == {2}  # the probe's own restart only


def test_a_new_fit_after_a_rewound_one_takes_plans_for_its_early_steps():
    # Lightning's lr_find fits 30 steps, then rewinds the loop to step 0 for the fit that follows.
    plans = PlanLoop(PlanSettings())
    plans.attach(2)
    book = plans.plan_book_for(16, 2, lag=2)
    for step in range(30):
        book.sizes_at(step)
    plans.attach(2)  # the next fit, on the same Trainer
    assert plans.plan_book_for(16, 2, lag=2) is book
    book.schedule(2, [12, 4])  # refused as late (step 29 served) before the new fit forgot the old one's steps
    assert book.sizes_at(2) == (12, 4)


_ONE_SLOW = [StepTime(0.0, 1.0), StepTime(0.0, 1.0), StepTime(0.0, 50.0)]


def test_a_left_out_replica_waits_for_its_probe_then_is_probed_then_waits_the_budgets_interval():
    """Admission with its defaults: the first probe comes MIN_PROBE_INTERVAL steps after the verdict, and holds."""
    admission, floors, caps = Admission(), [4] * 3, [None] * 3
    assert admission.decide(3, _ONE_SLOW, [40, 40, 40], floors, caps, lag=2) == [True, True, False]
    assert admission.probe_at == {2: 3 + MIN_PROBE_INTERVAL}
    assert admission.decide(10, _ONE_SLOW, [60, 60, 0], floors, caps, lag=2) == [True, True, False]
    assert admission.probe_at == {2: 3 + MIN_PROBE_INTERVAL}  # not put off by a verdict before it is due
    assert admission.decide(3 + MIN_PROBE_INTERVAL, _ONE_SLOW, [60, 60, 0], floors, caps, lag=2) == [True] * 3
    assert (admission.probe_at, admission.probed) == ({}, {2})
    # Measured as slow again: the next probe comes after the interval that keeps probes within the budget.
    assert admission.decide(60, _ONE_SLOW, [58, 58, 4], floors, caps, lag=2) == [True, True, False]
    holds = LOCKSTEP_PROBE_REPORTS * (2 + 1)
    interval = probe_interval(120, _ONE_SLOW, [True, True, False], 2, floors, caps, holds)
    assert interval > MIN_PROBE_INTERVAL
    assert admission.probe_at == {2: 60 + interval}
    # Fast again, and judged to help: its pending probe is dropped.
    assert admission.decide(70, [StepTime(0.0, 1.0)] * 3, [60, 60, 0], floors, caps, lag=2) == [True] * 3
    assert admission.probe_at == {}


def test_a_left_out_replica_without_a_scheduled_probe_is_not_probed_but_given_one():
    """A checkpoint that predates the probe schedule: the replica stays out and its probe is planned."""
    admission = Admission()
    assert admission.decide(10, _ONE_SLOW, [60, 60, 0], [4] * 3, [None] * 3, lag=2) == [True, True, False]
    assert admission.probe_at == {2: 10 + MIN_PROBE_INTERVAL}


def test_missing_probes_are_scheduled_only_for_left_out_replicas_without_one():
    admission = Admission()
    admission.probe_at = {3: 20}
    admission.schedule_missing_probes([4, 0, 1, 0], step=10)
    assert admission.probe_at == {1: 10 + MIN_PROBE_INTERVAL, 3: 20}


def test_the_next_probe_is_the_earliest_among_the_replicas_still_left_out():
    admission = Admission()
    admission.probe_at = {1: 90, 2: 70, 3: 40}
    assert admission.next_probe([4, 0, 0, 4]) == 70  # replica 3's plan gives it work again
    assert admission.next_probe([4, 4, 4, 4]) is None


def test_a_replica_is_left_out_only_where_that_shortens_the_step_by_more_than_a_tenth():
    """Replica 2's step takes 60 s more than the others' (its batch at the floor of 4): with it the balanced step of
    120 samples takes 64 s, without it 60 s, a tenth shorter only from an extra 66.7 s on."""
    fast = [StepTime(0.0, 1.0), StepTime(0.0, 1.0)]
    decide = Admission().decide
    assert decide(3, [*fast, StepTime(60.0, 1.0)], [40, 40, 40], [4] * 3, [None] * 3, lag=2) == [True] * 3
    assert decide(3, [*fast, StepTime(80.0, 1.0)], [40, 40, 40], [4] * 3, [None] * 3, lag=2) == [True, True, False]


def test_after_the_first_plan_a_mild_change_is_followed_by_damped_moves():
    """A replica 2x slower turns 1.85x: too little to count as a change of speed, so each plan moves its batch by
    ``plan_gain`` of the way to the target (a gain of 1 moves all of it at once)."""

    def factors_at(step):
        return (1, 1, 1, 1.85) if step >= 30 else (1, 1, 1, 2)

    moves = {}
    for gain in (1.0, 0.5):
        plans = _run(_group(4, planner="proportional", plan_gain=gain), factors_at, steps=50)
        before = plans[29][3]
        first_move = next(plan[3] for plan in plans[30:] if plan[3] != before)
        moves[gain] = first_move - before
    assert 0 < moves[0.5] < moves[1.0]
