import json
import math
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_aesgd.core.speed import SpeedEstimator, StepTime, StepTimeEstimator

work_values = st.floats(min_value=1e-3, max_value=1e9)
second_values = st.floats(min_value=1e-6, max_value=1e4)
smoothing_values = st.floats(min_value=0.0, max_value=0.999)


def steady_estimator(smoothing: float, work: float, seconds: float, num_updates: int) -> SpeedEstimator:
    estimator = SpeedEstimator(smoothing)
    for _ in range(num_updates):
        estimator.update(work, seconds)
    return estimator


# ------------------------------------------------------------------------------------------ SpeedEstimator


def test_speed_estimator_has_no_estimate_before_first_update() -> None:
    estimator = SpeedEstimator()
    assert estimator.rate is None
    assert estimator.mean_seconds is None
    assert estimator.num_updates == 0


@given(work_values, second_values, smoothing_values, st.integers(min_value=1, max_value=50))
def test_speed_estimator_constant_input_is_exact_from_first_update(
    work: float, seconds: float, smoothing: float, num_updates: int
) -> None:
    estimator = SpeedEstimator(smoothing)
    for _ in range(num_updates):
        estimator.update(work, seconds)
        assert estimator.rate == work / seconds
        assert estimator.mean_seconds == seconds
    assert estimator.num_updates == num_updates


@given(st.lists(st.tuples(work_values, second_values), min_size=1, max_size=50), smoothing_values)
def test_speed_estimator_rate_is_finite_and_positive(steps: list[tuple[float, float]], smoothing: float) -> None:
    estimator = SpeedEstimator(smoothing)
    for work, seconds in steps:
        estimator.update(work, seconds)
        assert estimator.rate is not None
        assert math.isfinite(estimator.rate)
        assert estimator.rate > 0.0
        lowest = min(w / s for w, s in steps)
        highest = max(w / s for w, s in steps)
        assert lowest * (1 - 1e-9) <= estimator.rate <= highest * (1 + 1e-9)


def test_speed_estimator_applies_bias_correction() -> None:
    estimator = SpeedEstimator(smoothing=0.5)
    estimator.update(work=10.0, seconds=1.0)
    estimator.update(work=10.0, seconds=3.0)
    # Raw EMA: 0.5 then 0.25 + 1.5 = 1.75; corrected by 1 − 0.5² = 0.75.
    assert estimator.mean_seconds == pytest.approx(1.75 / 0.75)
    assert estimator.rate == pytest.approx(10.0 / (1.75 / 0.75))


def test_speed_estimator_with_zero_smoothing_keeps_only_latest_step() -> None:
    estimator = SpeedEstimator(smoothing=0.0)
    estimator.update(work=10.0, seconds=1.0)
    estimator.update(work=30.0, seconds=2.0)
    assert estimator.rate == 15.0


def test_speed_estimator_tracks_a_slowdown_in_predicted_steps() -> None:
    smoothing, work, seconds, slowdown, tolerance = 0.5, 100.0, 1.0, 4.0, 0.10
    # Long after the change's start the corrected gain is 1 − β, so mean_seconds after k slow steps is
    # seconds·(slowdown − (slowdown − 1)·β^k) and the rate is within `tolerance` of the new one once
    # slowdown / (slowdown − (slowdown − 1)·β^k) <= 1 + tolerance, i.e. β^k <= (slowdown − slowdown/1.1)/3.
    bound = (slowdown - slowdown / (1 + tolerance)) / (slowdown - 1)
    needed = math.ceil(math.log(bound) / math.log(smoothing))
    assert needed == 4
    estimator = steady_estimator(smoothing, work, seconds, num_updates=60)
    new_rate = work / (seconds * slowdown)
    for k in range(1, needed + 1):
        estimator.update(work, seconds * slowdown)
        assert estimator.rate is not None
        within = abs(estimator.rate / new_rate - 1) <= tolerance
        assert within == (k >= needed), k


def test_speed_estimator_is_robust_to_one_unusually_short_step() -> None:
    estimator = steady_estimator(0.9, work=100.0, seconds=1.0, num_updates=60)
    estimator.update(work=100.0, seconds=1e-6)
    # A ratio of averages moves by about 1/β; an average of per-step rates would jump by ~10⁷.
    assert estimator.rate is not None
    assert 100.0 < estimator.rate <= 100.0 / 0.9 * 1.01


@pytest.mark.parametrize(
    ("work", "seconds", "match"),
    [
        (1.0, 0.0, "seconds"),
        (1.0, -1.0, "seconds"),
        (1.0, math.nan, "seconds"),
        (1.0, math.inf, "seconds"),
        (-1.0, 1.0, "work"),
        (math.nan, 1.0, "work"),
        (math.inf, 1.0, "work"),
    ],
)
def test_speed_estimator_rejects_invalid_measurements(work: float, seconds: float, match: str) -> None:
    estimator = SpeedEstimator()
    with pytest.raises(ValueError, match=match):
        estimator.update(work, seconds)
    assert estimator.num_updates == 0


def test_speed_estimator_accepts_zero_work() -> None:
    estimator = SpeedEstimator()
    estimator.update(0.0, 1.0)
    assert estimator.rate == 0.0


@pytest.mark.parametrize("smoothing", [-0.1, 1.0, 1.5, math.nan])
def test_speed_estimator_rejects_invalid_smoothing(smoothing: float) -> None:
    with pytest.raises(ValueError, match="smoothing"):
        SpeedEstimator(smoothing)


def test_speed_estimator_state_dict_round_trip() -> None:
    estimator = SpeedEstimator(smoothing=0.8)
    for work, seconds in [(100.0, 1.0), (120.0, 0.5), (80.0, 2.0)]:
        estimator.update(work, seconds)
    state = estimator.state_dict()
    assert all(type(value) in (int, float) for value in state.values())
    restored = SpeedEstimator(smoothing=0.8)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    assert restored.rate == estimator.rate
    estimator.update(90.0, 1.5)
    restored.update(90.0, 1.5)
    assert restored.state_dict() == estimator.state_dict()


@given(
    st.lists(st.tuples(work_values, second_values, st.integers(min_value=1, max_value=4)), min_size=1, max_size=12),
    smoothing_values,
)
def test_speed_estimator_update_of_weight_k_is_k_updates(
    steps: list[tuple[float, float, int]], smoothing: float
) -> None:
    """A period of k reference periods' steps keeps the past with β^k: as if it had been reported k times."""
    weighted, repeated = SpeedEstimator(smoothing), SpeedEstimator(smoothing)
    for work, seconds, weight in steps:
        weighted.update(work, seconds, weight=weight)
        for _ in range(weight):
            repeated.update(work, seconds)
    assert weighted.rate == pytest.approx(repeated.rate, rel=1e-9)
    assert weighted.mean_seconds == pytest.approx(repeated.mean_seconds, rel=1e-9)


def test_a_long_period_moves_the_speed_further_than_a_short_one() -> None:
    short, long = SpeedEstimator(0.8), SpeedEstimator(0.8)
    for estimator in (short, long):
        for _ in range(10):
            estimator.update(100.0, 2.0)  # warm-up: slow
    short.update(100.0, 1.0, weight=1.0)
    long.update(100.0, 1.0, weight=8.0)
    assert long.mean_seconds == pytest.approx(1.0 + 0.8**8 * (1.0 - 0.8**10) / (1.0 - 0.8**18))
    assert long.mean_seconds < 1.2 < short.mean_seconds


@pytest.mark.parametrize("weight", [0.5, 0.0, -1.0, math.inf, math.nan])
def test_speed_and_step_time_estimators_reject_a_weight_that_is_not_positive(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        SpeedEstimator().update(1.0, 1.0, weight=weight)
    with pytest.raises(ValueError, match="weight"):
        StepTimeEstimator().update(1.0, 1.0, weight=weight)


def _mean_step_seconds(estimator: SpeedEstimator | StepTimeEstimator) -> float | None:
    if isinstance(estimator, SpeedEstimator):
        return estimator.mean_seconds
    model = estimator.model()
    return None if model is None else model.seconds(64)


@pytest.mark.parametrize("estimator_type", [SpeedEstimator, StepTimeEstimator])
def test_a_restart_keeps_the_weight_of_the_measurement_it_starts_from(
    estimator_type: type[SpeedEstimator] | type[StepTimeEstimator],
) -> None:
    """A change of speed seen on a long report restarts the averages with that report's weight, not one update's."""
    weighted, repeated = estimator_type(0.8), estimator_type(0.8)
    weighted.restart(64, 2.0, weight=8)
    repeated.restart(64, 2.0)
    for _ in range(7):
        repeated.update(64, 2.0)
    for estimator in (weighted, repeated):
        estimator.update(64, 1.0)
    assert _mean_step_seconds(weighted) == pytest.approx(_mean_step_seconds(repeated), rel=1e-12)


@pytest.mark.parametrize("total", [-0.1, 1.5, 0.0])
def test_speed_estimator_rejects_a_state_whose_total_weight_cannot_be(total: float) -> None:
    state = steady_estimator(0.8, 100.0, 1.0, num_updates=3).state_dict()
    state["total_weight"] = total
    with pytest.raises(ValueError, match="total weight"):
        SpeedEstimator(0.8).load_state_dict(state)


def test_speed_estimator_loads_a_state_saved_before_weighted_updates() -> None:
    estimator = steady_estimator(0.8, 100.0, 1.0, num_updates=3)
    state = estimator.state_dict()
    del state["total_weight"]
    restored = SpeedEstimator(0.8)
    restored.load_state_dict(state)
    assert restored.state_dict() == pytest.approx(estimator.state_dict())


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"num_updates": 1, "mean_work": 1.0}, "lacks"),
        ({"num_updates": -1, "mean_work": 1.0, "mean_seconds": 1.0}, "invalid"),
        ({"num_updates": 1, "mean_work": math.nan, "mean_seconds": 1.0}, "invalid"),
        ({"num_updates": 1, "mean_work": 1.0, "mean_seconds": 0.0}, "no busy time"),
    ],
)
def test_speed_estimator_rejects_invalid_state(state: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeedEstimator().load_state_dict(state)


def test_step_time_model_recovers_overhead_and_per_sample_cost() -> None:
    estimator = StepTimeEstimator(smoothing=0.8)
    assert estimator.model() is None
    for size in [100, 400, 200, 800, 300, 600] * 3:
        estimator.update(size, 0.02 + 1e-4 * size)
    model = estimator.model()
    assert model is not None
    assert model.overhead == pytest.approx(0.02, rel=1e-6)
    assert model.per_sample == pytest.approx(1e-4, rel=1e-6)
    assert model.speed_at(800) == pytest.approx(800 / 0.1)


def test_step_time_model_keeps_its_fixed_cost_ratio_when_the_device_slows_down() -> None:
    estimator = StepTimeEstimator(smoothing=0.5)
    for size in [100, 400, 200, 800]:
        estimator.update(size, 0.02 + 1e-4 * size)
    for _ in range(50):  # the plan has settled: one size, now a slower device
        estimator.update(500, 2 * (0.02 + 1e-4 * 500))
    model = estimator.model()
    assert model is not None
    # The fixed cost is learnt as 200 samples' worth; a device twice as slow keeps that ratio.
    assert estimator.fixed_samples == pytest.approx(200, rel=1e-3)
    assert model.overhead == pytest.approx(0.04, rel=1e-3)
    assert model.per_sample == pytest.approx(2e-4, rel=1e-3)


def test_step_time_model_learns_a_fixed_cost_from_steps_that_do_not_grow_with_the_batch() -> None:
    # Digits at 32 rows per replica: shrinking the batch from 32 to 16 leaves the step at 35 ms ± 3 %. No line
    # explains that noise (R² ≈ 0), and before, k stayed 0: the step counted as per-sample work, so a replica
    # that looked slow got ever smaller batches.
    estimator = StepTimeEstimator(smoothing=0.8)
    for size, jitter in zip([32, 28, 24, 20, 16, 16, 16], [1.0, 1.03, 0.98, 1.02, 0.97, 1.01, 1.0], strict=True):
        estimator.update(size, 0.035 * jitter)
    model = estimator.model()
    assert model is not None
    assert model.overhead > 0.8 * model.seconds(16), "most of a step is fixed cost"
    assert model.seconds(32) < 1.2 * model.seconds(16)


def test_step_time_model_learns_no_fixed_cost_from_a_change_of_speed() -> None:
    # A device that becomes 3× slower while the plans cut its batch: the times move more than the sizes.
    estimator = StepTimeEstimator(smoothing=0.8)
    for size, per_sample in [(64, 1e-3), (64, 1e-3), (64, 3e-3), (48, 3e-3), (36, 3e-3), (30, 3e-3), (26, 3e-3)]:
        estimator.update(size, per_sample * size)
    assert estimator.fixed_samples == 0.0


def test_step_time_model_without_size_variation_is_speed_proportional() -> None:
    estimator = StepTimeEstimator()
    for _ in range(5):
        estimator.update(256, 0.5)
    assert estimator.model() == StepTime(0.0, 0.5 / 256)


def test_step_time_state_round_trip_and_invalid_input() -> None:
    estimator = StepTimeEstimator()
    for size in (10, 40, 20):
        estimator.update(size, 0.01 + 0.001 * size)
    restored = StepTimeEstimator()
    restored.load_state_dict(estimator.state_dict())
    assert restored.model() == estimator.model()
    with pytest.raises(ValueError, match="positive size"):
        estimator.update(0, 1.0)
    with pytest.raises(ValueError, match="smoothing"):
        StepTimeEstimator(smoothing=1.0)


def test_both_estimators_smooth_with_their_documented_default_beta() -> None:
    speed, step_time = SpeedEstimator(), StepTimeEstimator()
    for seconds in (1.0, 3.0):
        speed.update(10.0, seconds)
        step_time.update(64, seconds)
    # Bias-corrected average of two steps: (β·t₁ + t₂) / (1 + β), β = 0.9 and 0.8.
    assert speed.mean_seconds == pytest.approx((0.9 * 1.0 + 3.0) / 1.9)
    model = step_time.model()
    assert model is not None
    assert model.seconds(64) == pytest.approx((0.8 * 1.0 + 3.0) / 1.8)


def test_a_fresh_speed_estimator_state_loads() -> None:
    restored = SpeedEstimator()
    restored.load_state_dict(SpeedEstimator().state_dict())
    assert restored.rate is None


def test_a_step_time_restart_forgets_the_past_and_the_mean_size_follows_the_batches() -> None:
    estimator = StepTimeEstimator(smoothing=0.5)
    assert estimator.mean_size == 0.0
    estimator.update(64, 1.0)
    estimator.update(128, 1.0)
    assert estimator.mean_size == pytest.approx((0.5 * 64 + 128) / 1.5)
    estimator.restart(32, 2.0)
    assert estimator.mean_size == pytest.approx(32)
    model = estimator.model()
    assert model is not None
    assert model.seconds(32) == pytest.approx(2.0)


def test_step_time_model_learns_nothing_from_sizes_within_the_minimum_spread() -> None:
    # Sizes 100 and 102 vary by about 1% (< 5%): a line through them would be noise, so k stays 0.
    estimator = StepTimeEstimator(smoothing=0.8)
    for size in [100, 102] * 5:
        estimator.update(size, 0.02 + 1e-4 * size)
    assert estimator.fixed_samples == 0.0
    # 100 and 108: about 4%, still under; 100 and 112: about 6%, over, and the line's 200 samples are learnt.
    for sizes, fixed_samples in [([100, 108], 0.0), ([100, 112], 200.0)]:
        estimator = StepTimeEstimator(smoothing=0.8)
        for size in sizes * 5:
            estimator.update(size, 0.02 + 1e-4 * size)
        assert estimator.fixed_samples == pytest.approx(fixed_samples)


def test_step_time_model_raises_a_learnt_fixed_cost_when_steps_stop_growing_with_the_batch() -> None:
    estimator = StepTimeEstimator(smoothing=0.8)
    for size in [100, 400, 200, 800, 300, 600] * 3:
        estimator.update(size, 0.02 + 1e-4 * size)
    assert estimator.fixed_samples == pytest.approx(200)
    for size, seconds in [(300, 0.07), (500, 0.065)] * 3:  # no line: barely longer at a larger batch
        estimator.update(size, seconds)
    assert estimator.fixed_samples > 300


def test_step_time_model_keeps_the_fixed_cost_below_95_percent_of_the_step() -> None:
    estimator = StepTimeEstimator(smoothing=0.8)
    for size in [100, 400, 200, 800] * 3:
        estimator.update(size, 0.05 + 1e-9 * size)  # a line, but nearly all fixed cost
    model = estimator.model()
    assert model is not None
    assert model.overhead == pytest.approx(0.95 * model.seconds(estimator.mean_size))


def test_a_fresh_and_a_restarted_speed_estimator_count_from_zero() -> None:
    assert SpeedEstimator().state_dict() == {
        "num_updates": 0,
        "mean_work": 0.0,
        "mean_seconds": 0.0,
        "total_weight": 0.0,
    }
    estimator = steady_estimator(0.8, 100.0, 1.0, num_updates=3)
    estimator.restart(50.0, 2.0)
    assert estimator.num_updates == 1
    assert estimator.rate == 25.0


def test_speed_estimator_states_after_one_update_or_at_full_weight_load() -> None:
    for smoothing, num_updates in [(0.8, 1), (0.0, 3)]:  # total weight 0.2, then exactly 1
        state = steady_estimator(smoothing, 100.0, 1.0, num_updates).state_dict()
        restored = SpeedEstimator(smoothing)
        restored.load_state_dict(state)
        assert restored.state_dict() == state


@pytest.mark.parametrize(
    "state",
    [
        {"num_updates": 1, "mean_work": -1.0, "mean_seconds": 1.0},
        {"num_updates": 1, "mean_work": 1.0, "mean_seconds": math.inf},
    ],
)
def test_speed_estimator_rejects_a_negative_or_infinite_average(state: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="invalid"):
        SpeedEstimator().load_state_dict(state)


def test_step_time_estimator_keeps_exponential_moving_moments() -> None:
    # Weight 1 − β = 0.5 for the first step: b, t, b², b·t, t² and the total weight, halved.
    estimator = StepTimeEstimator(smoothing=0.5)
    estimator.update(10, 2.0)
    assert estimator.state_dict()["moments"] == [5.0, 1.0, 50.0, 10.0, 2.0, 0.5]


def test_step_time_estimator_takes_zero_smoothing_and_refuses_a_step_of_no_time() -> None:
    estimator = StepTimeEstimator(smoothing=0.0)  # keeps only the latest step
    estimator.update(64, 1.0)
    estimator.update(32, 2.0)
    assert estimator.model() == StepTime(0.0, 2.0 / 32)
    with pytest.raises(ValueError, match="positive size and duration"):
        estimator.update(8, 0.0)


def test_step_time_model_fits_a_noisy_line_by_least_squares() -> None:
    # R² ≈ 0.99 ≥ 0.9: the fixed cost is the intercept of the weighted least-squares line through the steps (the
    # spread bound of the no-line branch, sd(t)/sd(b) ≥ slope, would give a smaller one).
    noise = [3e-4, -3e-4, -2e-4, 2e-4, 1e-4, -1e-4] * 3
    steps = [(size, 0.002 + 1e-4 * size + n) for size, n in zip([10, 40, 20, 80, 30, 60] * 3, noise, strict=True)]
    beta = 0.8
    weights = [beta ** (len(steps) - 1 - j) for j in range(len(steps))]

    def mean(f: Callable[[float, float], float]) -> float:
        return sum(w * f(b, t) for w, (b, t) in zip(weights, steps, strict=True)) / sum(weights)

    size, seconds = mean(lambda b, t: b), mean(lambda b, t: t)
    slope = (mean(lambda b, t: b * t) - size * seconds) / (mean(lambda b, t: b * b) - size * size)
    estimator = StepTimeEstimator(smoothing=beta)
    for step in steps:
        estimator.update(*step)
    model = estimator.model()
    assert model is not None
    assert model.overhead == pytest.approx(seconds - slope * size, rel=1e-6)


def test_step_time_model_without_a_line_takes_the_least_fixed_cost_the_spread_allows() -> None:
    # From 16 to 32 samples the step got shorter (noise): no line. The per-sample part is at most |Δt|/|Δb|, so
    # the fixed cost is at least t̄ − |Δt|/|Δb|·b̄, with b̄ and t̄ weighted 0.8 : 1.
    estimator = StepTimeEstimator(smoothing=0.8)
    estimator.update(16, 0.032)
    estimator.update(32, 0.028)
    size, seconds = (0.8 * 16 + 32) / 1.8, (0.8 * 0.032 + 0.028) / 1.8
    model = estimator.model()
    assert model is not None
    assert model.overhead == pytest.approx(seconds - 0.004 / 16 * size, rel=1e-9)
