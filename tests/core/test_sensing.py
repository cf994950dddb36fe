import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_aesgd.core.sensing import ArrivalModel, PeriodReport, batch_floor, check_plan_damping, damped_plan

plans = st.lists(st.integers(min_value=1, max_value=500), min_size=1, max_size=8)


def _report(size: int, seconds: float, steps: int = 1) -> PeriodReport:
    return PeriodReport(merge_weight=1.0, work=size * steps, planned=size * steps, steps=steps, active=seconds)


def test_a_report_travels_as_a_row_and_back():
    report = PeriodReport(2.0, work=8, planned=8, steps=2, active=0.5, loader=0.7, busy=0.25, stop=1.0)
    assert PeriodReport.from_row(report.as_row()) == report
    assert len(report.as_row()) == PeriodReport.size()
    assert report.seconds == 0.7  # the loader was slower than the replica: its time is what the period cost
    with pytest.raises(ValueError, match="numbers"):
        PeriodReport.from_row([1.0])


def test_the_arrival_model_recovers_each_replicas_speed_from_arrivals():
    model = ArrivalModel(2, smoothing=0.5)
    assert model.models() is None
    for size in (32, 64, 48):
        model.update([_report(size, 0.001 * size), _report(size, 0.004 * size)])  # replica 1 is 4× slower
    slow, fast = model.rates()[1], model.rates()[0]
    assert fast == pytest.approx(4 * slow)
    times = model.models()
    assert times is not None
    assert times[1].seconds(40) == pytest.approx(4 * times[0].seconds(40), rel=1e-6)


def test_unmeasured_reports_change_nothing():
    model = ArrivalModel(1)
    model.update([PeriodReport(1.0, work=10, planned=10, steps=0, active=1.0)])  # an interrupted period
    assert model.rates() == [0.0]


def test_the_arrival_model_resumes_from_its_state_and_ignores_another_replica_count():
    model = ArrivalModel(2)
    model.update([_report(32, 0.1), _report(32, 0.2)])
    restored = ArrivalModel(2)
    restored.load_state_dict(model.state_dict())
    assert restored.rates() == model.rates()
    other = ArrivalModel(3)
    other.load_state_dict(model.state_dict())
    assert other.rates() == [0.0, 0.0, 0.0]


@given(plans, plans, st.floats(min_value=0.01, max_value=1.0))
def test_a_damped_plan_keeps_the_total_and_moves_towards_the_target(current, target_shape, gain):
    target_shape = (target_shape * len(current))[: len(current)]
    total = sum(current)
    # The target: the same total, split in the shape drawn (at least 1 each where the total allows).
    weights = [size / sum(target_shape) for size in target_shape]
    target = [max(1, round(total * weight)) for weight in weights]
    target[0] += total - sum(target)
    if target[0] < 1:
        return
    moved = damped_plan(current, target, gain, dead_band=0.0)
    assert sum(moved) == total
    for size, goal, new in zip(current, target, moved, strict=True):
        assert min(size, goal) - 1 <= new <= max(size, goal) + 1


def test_a_damped_plan_stays_inside_the_dead_band():
    assert damped_plan([64, 64], [65, 63], gain=0.5, dead_band=0.03) == [64, 64]
    assert damped_plan([64, 64], [96, 32], gain=0.5, dead_band=0.03) == [80, 48]


def test_the_floor_is_a_share_of_the_equal_batch_and_never_below_min_batch():
    assert batch_floor(256, 4, min_batch=1, min_share=0.1) == 7
    assert batch_floor(256, 4, min_batch=16, min_share=0.1) == 16
    assert batch_floor(256, 4, min_batch=1, min_share=0.0) == 1


@pytest.mark.parametrize(
    ("min_share", "gain", "dead_band", "match"),
    [(1.5, 0.5, 0.03, "min_share"), (0.1, 0.0, 0.03, "plan_gain"), (0.1, 0.5, 1.0, "plan_dead_band")],
)
def test_damping_settings_are_checked_with_the_fix(min_share, gain, dead_band, match):
    with pytest.raises(ValueError, match=match):
        check_plan_damping(min_share, gain, dead_band)


def test_plans_do_not_collapse_when_steps_are_mostly_fixed_cost() -> None:
    # experiment=digits: 32 rows per replica, steps of 30-80 ms that hardly grow with the batch (its measured
    # fixed costs), the slowest replica's alone longer than the others' steps. Before, k stayed 0, each plan
    # moved work to the replica that looked fastest per sample, and the plan ended at [116, 4, 4, 4].
    from lightning_aesgd.core.planners import BalancedPlanner

    fixed, per_sample = [0.030, 0.045, 0.040, 0.080], [2e-5, 2e-5, 4e-5, 8e-5]
    jitter = [1.0, 1.06, 0.95, 1.03, 0.97, 1.08, 0.92, 1.01]
    total, floor = 128, batch_floor(128, 4, min_share=0.1)
    model, planner, plan = ArrivalModel(4), BalancedPlanner(min_batch=floor), [32] * 4
    for step in range(60):
        seconds = [
            (a + c * b) * jitter[(step + i) % len(jitter)]
            for i, (a, c, b) in enumerate(zip(fixed, per_sample, plan, strict=True))
        ]
        model.update([_report(size, s) for size, s in zip(plan, seconds, strict=True)])
        models = model.models()
        assert models is not None
        plan = damped_plan(plan, planner.plan(plan, models, total), 0.5, 0.03, floor)
    assert plan[3] == floor, "the replica whose fixed cost alone outlasts the others' steps gets the floor"
    assert max(plan[:3]) - min(plan[:3]) <= 4, f"the others keep about equal batches: {plan}"


def test_step_seconds_are_per_step_whatever_steps_a_report_spans():
    """Under gradient synchronisation a report spans several steps: a step's seconds, not the period's."""
    model = ArrivalModel(2, smoothing=0.0)
    model.update(
        [
            PeriodReport(1.0, work=300.0, planned=300.0, steps=3.0, active=0.3),
            PeriodReport(1.0, work=100.0, planned=100.0, steps=1.0, active=0.1),
        ]
    )
    assert model.step_seconds() == pytest.approx([0.1, 0.1])
    assert model.rates() == pytest.approx([1000.0, 1000.0])


def test_a_report_of_more_steps_weighs_as_that_many_reference_reports():
    """Reports come every lag + 1 steps until plans settle, then up to 8× as far apart: the averages remember steps,
    not reports, so that a warm-up of short reports does not outweigh the long ones that follow."""
    weighted, repeated = (ArrivalModel(1, smoothing=0.8, reference_steps=3) for _ in range(2))
    for model in (weighted, repeated):
        model.update([_report(64, 0.012 * 3, steps=3)])  # warm-up: slower steps
        model.update([_report(64, 0.011 * 3, steps=3)])
    weighted.update([_report(64, 0.010 * 12, steps=12)])  # 4 reference periods
    for _ in range(4):
        repeated.update([_report(64, 0.010 * 3, steps=3)])
    assert weighted.step_seconds() == pytest.approx(repeated.step_seconds(), rel=1e-9)
    assert weighted.rates() == pytest.approx(repeated.rates(), rel=1e-9)
    fitted, expected = weighted.models(), repeated.models()
    assert fitted is not None
    assert expected is not None
    assert fitted[0].seconds(64) == pytest.approx(expected[0].seconds(64), rel=1e-9)
    assert weighted.smoothing_now == pytest.approx(0.8**4)  # the dead band's smoothing (PlanLoop.dead_band)
    assert repeated.smoothing_now == 0.8
    with pytest.raises(ValueError, match="reference_steps"):
        ArrivalModel(1, reference_steps=0)


def test_without_a_reference_every_report_weighs_one():
    """An ArrivalModel built alone keeps beta per report, whatever the steps each report spans."""
    long, short = ArrivalModel(1, smoothing=0.8), ArrivalModel(1, smoothing=0.8)
    for model, steps in ((long, 12), (short, 3)):
        model.update([_report(64, 0.012 * steps, steps=steps)])
        model.update([_report(64, 0.010 * steps, steps=steps)])
    assert long.step_seconds() == pytest.approx(short.step_seconds(), rel=1e-12)
    restored = ArrivalModel(1, smoothing=0.8)
    restored.load_state_dict(long.state_dict())
    assert restored.smoothing_now == long.smoothing_now


def test_a_default_report_measures_nothing_and_says_finite_untracked_and_of_no_step():
    assert PeriodReport(2.0).as_row() == [2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0, -1.0]
    assert not PeriodReport(2.0).measured


@pytest.mark.parametrize(
    ("planned", "steps", "active", "measured"),
    [(1.0, 1.0, 0.1, True), (0.0, 1.0, 0.1, False), (8.0, 1.0, 0.0, False), (8.0, 0.0, 0.1, False)],
)
def test_a_report_is_measured_only_with_steps_samples_and_active_time(planned, steps, active, measured):
    report = PeriodReport(1.0, work=planned, planned=planned, steps=steps, active=active)
    assert report.measured is measured


def test_the_arrival_model_checks_its_replicas_and_reports():
    with pytest.raises(ValueError, match="at least one replica"):
        ArrivalModel(0)
    model = ArrivalModel(2)
    with pytest.raises(ValueError, match="one report per replica"):
        model.update([_report(8, 0.1)])
    ArrivalModel(1, reference_steps=0.5)  # any positive reference


def test_the_arrival_model_smooths_with_beta_0_8_by_default():
    model = ArrivalModel(1)
    model.update([_report(64, 1.0)])
    model.update([_report(64, 2.0)])
    # Bias-corrected average of two periods: (β·1 + 2) / (1 + β).
    assert model.step_seconds() == pytest.approx([(0.8 * 1.0 + 2.0) / 1.8])


def test_the_longest_report_of_a_merge_sets_the_smoothing():
    model = ArrivalModel(2, smoothing=0.8, reference_steps=3)
    model.update([_report(64, 0.03, steps=3), _report(64, 0.12, steps=12)])
    assert model.smoothing_now == pytest.approx(0.8**4)


def test_a_replica_not_measured_yet_has_no_model_and_zero_rates():
    model = ArrivalModel(2)
    model.update([_report(64, 0.1), PeriodReport(1.0)])
    assert model.models() is None
    assert model.step_seconds() == [pytest.approx(0.1), 0.0]
    assert model.rates() == [pytest.approx(640.0), 0.0]


def test_a_change_of_speed_restarts_the_estimates_at_its_second_period():
    """Two periods in a row beyond the threshold (25%) on the same side are a new level: the estimates restart there."""
    model = ArrivalModel(1, smoothing=0.8)
    for _ in range(5):
        model.update([_report(64, 0.064)])
        assert model.shifted == [False]
    model.update([_report(64, 0.128)])  # twice as slow: one period is not yet a new speed
    assert model.shifted == [False]
    # Bias-corrected average of five periods of 0.064 and one of 0.128: the weight of the newest is (1 − β)/(1 − β⁶).
    gain = 0.2 / (1 - 0.8**6)
    assert model.step_seconds() == pytest.approx([(1 - gain) * 0.064 + gain * 0.128])
    model.update([_report(64, 0.128)])
    assert model.shifted == [True]
    assert model.step_seconds() == pytest.approx([0.128])
    assert model.rates() == pytest.approx([500.0])


def test_a_replica_marked_stale_restarts_at_its_next_measured_period():
    model = ArrivalModel(2, smoothing=0.8)
    model.update([_report(64, 0.064), _report(64, 0.064)])
    model.restart_next(1)
    assert model.restarts_pending() == {1}
    model.update([_report(64, 0.070), PeriodReport(1.0)])  # replica 1 not measured: still pending
    assert model.restarts_pending() == {1}
    model.update([_report(64, 0.070), _report(64, 0.070)])
    assert model.restarts_pending() == set()
    assert model.step_seconds()[1] == pytest.approx(0.070)
    assert model.step_seconds()[0] < 0.070  # not restarted: still averaging the first period in


def test_the_noise_of_the_arrival_model_rests_on_periods_at_the_same_batch_and_survives_a_checkpoint():
    model = ArrivalModel(1)
    for seconds in (0.1, 0.11, 0.1):
        model.update([_report(64, seconds)])
    # Two differences of log 1.1: σ = median |d| / (0.6745·√2).
    assert model.noise() == pytest.approx([math.log(1.1) / (0.6744897501960817 * math.sqrt(2))])
    assert model.noise_known(2)
    assert not model.noise_known(3)
    model.restart_next(0)
    restored = ArrivalModel(1)
    restored.load_state_dict(model.state_dict())
    assert restored.noise() == model.noise()
    assert restored.noise_known(2)
    assert restored.restarts_pending() == {0}


def test_a_change_of_batch_explains_a_miss_as_large_as_the_change():
    """A fixed-cost step at a doubled batch misses the speed-proportional model by log 2, all of it explained."""
    model = ArrivalModel(1, smoothing=0.8)
    for _ in range(5):
        model.update([_report(64, 0.064)])
    for _ in range(2):
        model.update([_report(128, 0.064)])
        assert model.shifted == [False]


def test_damping_settings_accept_their_bounds():
    check_plan_damping(0.0, 1.0, 0.0)
    check_plan_damping(1.0, 1e-6, 0.99)


def test_the_floor_defaults_to_one_and_rounds_up_only_what_exceeds_a_whole_sample():
    assert batch_floor(256, 4) == 1
    assert batch_floor(256, 4, min_share=0.5) == 32  # exactly 32: not rounded up to 33
    assert batch_floor(256, 4, min_share=1.0) == 64
    with pytest.raises(ValueError, match="min_share"):
        batch_floor(256, 4, min_share=1.5)


def test_a_damped_plan_by_default_moves_half_way_beyond_a_three_percent_band_and_keeps_one_sample():
    assert damped_plan([100, 100], [102, 98]) == [100, 100]  # 2% is inside the default band
    assert damped_plan([100, 100], [104, 96]) == [102, 98]
    assert damped_plan([1, 99], [0, 100], gain=1.0, dead_band=0.0) == [1, 99]  # the default min_size of 1


def test_a_damped_plan_band_is_inclusive_and_a_full_gain_jumps_to_the_target():
    assert damped_plan([100, 100], [125, 75], gain=0.5, dead_band=0.25) == [100, 100]
    assert damped_plan([100, 100], [126, 74], gain=1.0, dead_band=0.25) == [126, 74]


@pytest.mark.parametrize(
    ("current", "target", "gain", "match"),
    [
        ([1, 2], [3], 0.5, "plans must match"),
        ([1, 2], [2, 2], 0.5, "plans must match"),
        ([1, 2], [2, 1], 0.0, "gain"),
        ([1, 2], [2, 1], 1.5, "gain"),
    ],
)
def test_a_damped_plan_checks_its_plans_and_gain(current, target, gain, match):
    with pytest.raises(ValueError, match=match):
        damped_plan(current, target, gain, dead_band=0.0)
