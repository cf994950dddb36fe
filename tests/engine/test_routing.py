"""Routing by measured speed: four routers exchange recorded (synthetic) timings through a fake group."""

from __future__ import annotations

import pytest
import torch
from helpers import RegressionData

from lightning_aesgd.core.apportion import share_error
from lightning_aesgd.core.planners import StaticPlanner
from lightning_aesgd.engine.loading import check_sample_costs, resolve_sample_costs
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.routing import HISTORY_LENGTH, Router
from lightning_aesgd.engine.sampler import StepRecord

STEP_BATCH = 256
SECONDS_PER_SAMPLE = 1e-3


class Clock:
    """A scripted wall clock: arrivals and releases happen when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _group(num_replicas: int, **router_kwargs) -> list[Router]:
    """Routers with scripted clocks, each attached as one replica of the group."""
    routers = [Router(PlanSettings(**router_kwargs), clock=Clock()) for _ in range(num_replicas)]
    for router in routers:
        router.attach(num_replicas, torch.device("cpu"))
        router.plan_book_for(STEP_BATCH, num_replicas, lag=3)
    return routers


def _run(routers, factors_at, steps: int, overhead: float = 0.0) -> list[tuple[int, ...]]:
    """Replica i arrives fᵢ·(overhead + size·t₁) after each release (t₁ the per-sample time); merge every step.

    Nothing is timed inside the optimizer step (the busy regions are empty): the routers see the replicas'
    speeds only through their arrivals, as with slowness in data loading, hooks or CPU quotas.
    """
    plans, now = [], 0.0
    for step in range(steps):
        sizes = routers[0].plan_book.sizes_at(step)
        for router in routers[1:]:
            assert router.plan_book.sizes_at(step) == sizes  # every replica slices the step the same way
        rows = []
        for rank, router in enumerate(routers):
            with router.timing(StepRecord(num_samples=sizes[rank], cost=float(sizes[rank]), planned=sizes[rank])):
                pass
            router.clock.now = now + factors_at(step)[rank] * (overhead + sizes[rank] * SECONDS_PER_SAMPLE)
            rows.append(router.report(merge_weight=1.0).as_row())
        now = max(router.clock.now for router in routers) + 1e-4
        for router in routers:
            router.clock.now = now
            router.receive(rows, step)
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
    assert plans[:3] == [(64, 64, 64, 64)] * 3  # the first plan is made at step 0 and applies after the lag of 3
    assert share_error(plans[3], _speeds(factors)) < 0.05


def test_a_plan_is_balanced_when_its_predicted_step_times_agree():
    """Judged on the latest plan (scheduled ones included) by every rank alike, from the same models."""
    adaptive = _group(4)
    assert not adaptive[0].balanced_within(0.1)  # nothing measured yet
    _run(adaptive, lambda step: (1, 1, 2, 4), steps=10)
    assert [router.balanced_within(0.1) for router in adaptive] == [True] * 4
    equal_split = _group(4, planner="static")  # keeps the equal split, which unequal replicas cannot balance
    _run(equal_split, lambda step: (1, 1, 2, 4), steps=10)
    assert [router.balanced_within(0.1) for router in equal_split] == [False] * 4


@pytest.mark.parametrize("planner", ["proportional", "balanced"])
def test_the_plan_follows_a_replica_that_becomes_4x_slower_within_30_steps(planner):
    def factors_at(step):
        return (1, 1, 1, 4) if step >= 40 else (1, 1, 1, 1)

    plans = _run(_group(4, planner=planner), factors_at, steps=70)
    assert share_error(plans[39], _speeds((1, 1, 1, 1))) < 0.05
    assert share_error(plans[45], _speeds((1, 1, 1, 4))) > 0.10  # the change takes time to show...
    assert share_error(plans[69], _speeds((1, 1, 1, 4))) < 0.10  # ...and is followed within 30 steps


def test_additive_planner_moves_towards_equal_step_times():
    factors = (1, 2)
    routers = _group(2, planner="additive", planner_options={"step": 8}, min_batch=8, max_batch=248)
    plans = _run(routers, lambda step: factors, steps=40)
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


def test_an_interrupted_period_reports_no_measurement_and_an_empty_one_restarts():
    (router,) = _group(1)
    with router.timing(StepRecord(num_samples=10, cost=10.0, planned=10)):
        pass
    router.clock.now = 1.0
    router.interrupt()  # e.g. validation ran
    router.clock.now = 1.5
    report = router.report(1.0)
    assert report.steps == 0
    assert not report.measured
    router.receive([report.as_row()], step=0)
    router.clock.now = 2.0
    router.interrupt()  # nothing ran since the release: the period restarts its clock
    router.clock.now = 2.25
    assert router.report(1.0).active == pytest.approx(0.25)


def test_any_replica_asking_to_stop_stops_every_replica():
    routers = _group(2)
    rows = [router.report(1.0, stop=rank == 1).as_row() for rank, router in enumerate(routers)]
    for router in routers:
        router.receive(rows, step=0)
    assert all(router.stop_requested for router in routers)


def test_a_very_slow_replica_keeps_the_floor_batch():
    factors = (1, 1, 1, 40)
    routers = _group(4, planner="proportional", min_share=0.25)
    plans = _run(routers, lambda step: factors, steps=40)
    floor = 16  # a quarter of the equal share 64
    assert routers[0].floor == floor
    assert plans[-1][3] == floor
    assert all(min(plan) >= floor for plan in plans)


def test_sample_costs_come_from_the_dataset_or_a_function():
    data = RegressionData(10)
    torch.testing.assert_close(resolve_sample_costs("dataset", data), data.sample_costs)
    torch.testing.assert_close(
        resolve_sample_costs(lambda d: [2.0] * len(d), data), torch.full((10,), 2.0, dtype=torch.float64)
    )
    assert resolve_sample_costs(None, data) is None
    with pytest.raises(TypeError, match="sample_costs"):
        resolve_sample_costs("dataset", list(range(3)))
    with pytest.raises(ValueError, match="non-negative"):
        resolve_sample_costs(lambda d: [-1.0] * len(d), data)


def test_static_shares_must_match_the_replica_count():
    router = Router(PlanSettings(planner="static", shares=[1, 2, 3]))
    with pytest.raises(ValueError, match="3 static shares for 2 replicas"):
        router.plan_book_for(12, 2, lag=2)


def test_auto_sample_costs_use_the_dataset_costs_where_present():
    data = RegressionData(10)
    torch.testing.assert_close(resolve_sample_costs("auto", data), data.sample_costs)
    assert resolve_sample_costs("auto", list(range(3))) is None


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


def test_a_restored_router_continues_with_the_same_plans_and_measurements():
    routers = _group(2, planner="balanced")
    _run(routers, lambda step: (1, 3), steps=12)
    shared, local = routers[1].shared_state(), routers[1].local_state()

    restored = Router(PlanSettings(planner="balanced"))
    restored.attach(2, torch.device("cpu"))
    restored.load_shared_state(shared)
    restored.load_local_state(local)
    restored.plan_book_for(STEP_BATCH, 2, lag=3)
    assert restored.model.models() == routers[1].model.models()
    assert restored.model.rates() == routers[1].model.rates()
    assert restored.plan_book.state_dict() == routers[1].plan_book.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"min_share": 1.5}, "min_share"), ({"plan_gain": 0.0}, "plan_gain"), ({"plan_dead_band": -0.1}, "dead_band")],
)
def test_bad_damping_options_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanSettings(**kwargs)


def test_a_pause_keeps_the_time_before_it_and_skips_the_time_during_it():
    (router,) = _group(1)
    router.clock.now = 0.0
    router.interrupt()
    with router.timing(StepRecord(num_samples=10, cost=10.0, planned=10)):
        pass
    router.clock.now = 0.3  # the step and its hooks
    router.pause()  # validation
    router.clock.now = 5.0
    router.resume()
    router.clock.now = 5.2  # the next step's data and compute
    report = router.report(1.0)
    assert report.measured
    assert report.active == pytest.approx(0.5)
    router.clock.now = 5.25
    router.receive([report.as_row()], step=0)
    assert router.latest_reports[0].active == pytest.approx(0.5)
    assert router.report(1.0).wait_fraction == pytest.approx(0.05 / 0.55)


def test_overlapped_reports_count_work_until_arrival_and_waiting_only_inside_waits():
    """Delayed gradient sums: a replica reports at its arrival and works on; its reports come back a step later
    (``released=False``), and only the time it blocks on peers (``waiting``) is left out of its active time."""
    (router,) = _group(1)
    router.clock.now = 0.0
    router.interrupt()
    with router.timing(StepRecord(num_samples=10, cost=10.0, planned=10)):
        router.clock.now = 0.4  # the step's last gradient bucket is ready: arrival, mid-step
        first = router.report(1.0)
        router.continue_after_arrival()
    assert (first.work, first.steps, first.active) == (10.0, 1.0, pytest.approx(0.4))
    with router.timing(StepRecord(num_samples=12, cost=12.0, planned=12)):
        router.clock.now = 0.5
        with router.waiting():  # the previous step's sums are not complete yet
            router.clock.now = 0.8
        router.clock.now = 1.0
        second = router.report(1.0)
        router.continue_after_arrival()
        router.receive([first.as_row()], step=1, released=False)  # the first report, back while step 2 ran
    assert (second.work, second.active) == (12.0, pytest.approx(0.3))
    assert router.latest_reports[0].work == 10.0
    third = router.report(1.0)
    assert third.wait_fraction == pytest.approx(0.3 / 0.6)  # the second period: 0.3 active, 0.3 waiting


def test_waiting_inside_a_pause_leaves_the_clock_paused():
    """A flush of delayed sums at validation waits on peers while validation has the clock paused."""
    (router,) = _group(1)
    router.clock.now = 0.0
    router.interrupt()
    router.clock.now = 0.2
    router.pause()
    with router.waiting():
        router.clock.now = 0.5
    router.clock.now = 3.0  # validation goes on
    router.resume()
    router.clock.now = 3.1
    assert router.report(1.0).active == pytest.approx(0.3)


def test_a_wait_split_across_calls_is_waiting_not_activity():
    """Synchronous gradient sums: blocked from the last bucket's arrival until the reducer releases the replica."""
    (router,) = _group(1)
    router.clock.now = 0.0
    router.interrupt()
    router.clock.now = 0.4
    router.begin_wait()
    router.clock.now = 0.9
    router.end_wait()
    router.clock.now = 1.0
    first = router.report(1.0)
    router.continue_after_arrival()
    assert first.active == pytest.approx(0.5)
    assert router.report(1.0).wait_fraction == pytest.approx(0.5 / 1.0)


def test_the_history_is_a_ring_so_memory_stays_flat():
    (router,) = _group(1)
    for step in range(HISTORY_LENGTH + 10):
        with router.timing(StepRecord(num_samples=10, cost=10.0, planned=10)):
            pass
        router.clock.now += 0.01
        router.receive([router.report(1.0).as_row()], step)
    assert len(router.history) == HISTORY_LENGTH
    assert router.history[-1][0] == HISTORY_LENGTH + 9


# Found by tests/test_fuzz.py: each of these used to pass construction and fail later, without naming the option
# (a comparison's TypeError, the speed estimator's "`smoothing`", the first plan's error after a training step).
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_batch": "1"}, TypeError, "`min_batch` is a batch size"),
        ({"min_batch": 1.5}, TypeError, "`min_batch` is a batch size"),
        ({"max_batch": 2.5}, TypeError, "`max_batch` is a batch size"),
        ({"min_share": "0.1"}, TypeError, "`min_share` must be a number"),
        ({"hold_steps": -1}, ValueError, "`hold_steps` counts steps"),
        ({"hold_steps": 2.5}, ValueError, "`hold_steps` counts steps"),
        ({"speed_smoothing": 1.0}, ValueError, "`speed_smoothing`"),
        ({"speed_smoothing": float("nan")}, ValueError, "`speed_smoothing`"),
        ({"planner": None}, TypeError, "`planner` must be a name or a Planner"),
        ({"planner": "static", "shares": "12"}, TypeError, "`shares` must be a list"),
        ({"planner": "static", "shares": ["a"]}, TypeError, "`shares` must all be numbers"),
        ({"planner": "static", "shares": [0.0]}, ValueError, "one finite share > 0"),
        ({"planner": "static", "shares": []}, ValueError, "one finite share > 0"),
        ({"shares": [1.0]}, ValueError, "fix the plan of the 'static' planner"),
    ],
)
def test_bad_plan_options_fail_at_construction_with_a_hint(kwargs, error, match):
    with pytest.raises(error, match=rf"{match}.*HINT"):
        PlanSettings(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "total", "replicas", "match"),
    [
        ({"planner": "static", "shares": [1, 2]}, 8, 1, r"2 static shares for 1 replicas.*HINT"),
        ({}, 3, 4, r"cannot give each of the 4 replicas one.*HINT: raise the strategy's step_batch_size"),
        ({"min_batch": 4}, 6, 2, r"min_batch=4 for each of 2 replicas exceeds the 6 samples.*HINT"),
        ({"max_batch": 2}, 8, 2, r"max_batch=2 for each of 2 replicas cannot hold the 8 samples.*HINT"),
        ({"planner": StaticPlanner((1.0, 2.0))}, 8, 1, r"failed a trial plan.*HINT"),
    ],
)
def test_options_that_do_not_fit_the_step_fail_when_the_plan_book_is_made(kwargs, total, replicas, match):
    router = Router(PlanSettings(**kwargs))
    with pytest.raises(ValueError, match=match):
        router.plan_book_for(total, replicas, lag=2)


class _WrongTotal:
    def plan(self, current, step_times, total):
        return [total + 1 for _ in current]


def test_a_planner_object_that_returns_a_wrong_plan_fails_before_training():
    with pytest.raises(ValueError, match=r"returned \[9\] for a trial plan of \[8\].*HINT"):
        Router(PlanSettings(planner=_WrongTotal())).plan_book_for(8, 1, lag=2)


def test_sample_costs_are_checked_at_construction_and_against_the_dataset():
    for spec in ("bogus", 1.0):
        with pytest.raises(ValueError, match=r"Unknown sample_costs.*HINT"):
            check_sample_costs(spec)
    with pytest.raises(ValueError, match=r"shape \(1,\) for a dataset of 10 samples.*HINT"):
        resolve_sample_costs(lambda dataset: [1.0], RegressionData(10))
