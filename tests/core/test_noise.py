"""Step-time noise, the dead band it sets, and changes of speed told apart from noise."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_aesgd.core.noise import StepNoise, is_level_shift, noise_band
from lightning_aesgd.core.sensing import ArrivalModel, PeriodReport


def _noisy_times(sigma: float, count: int, seed: int = 0, level: float = 0.005) -> list[float]:
    rng = random.Random(seed)
    return [level * math.exp(rng.gauss(0.0, sigma)) for _ in range(count)]


@pytest.mark.parametrize("sigma", [0.02, 0.1, 0.3])
def test_the_noise_of_log_normal_step_times_is_recovered(sigma):
    estimates = []
    for seed in range(20):
        noise = StepNoise()
        for seconds in _noisy_times(sigma, 33, seed):
            noise.update(64, seconds)
        estimates.append(noise.relative)
    assert sorted(estimates)[10] == pytest.approx(sigma, rel=0.2)  # the median of 20 windows of 32 differences


def test_a_change_of_speed_does_not_count_as_noise():
    noise = StepNoise()
    for seconds in [*_noisy_times(0.05, 20, level=0.005), *_noisy_times(0.05, 12, seed=1, level=0.020)]:
        noise.update(64, seconds)
    assert noise.relative < 0.1  # a 4x shift among 31 differences moves the median little


def test_periods_at_another_batch_size_are_not_compared():
    noise = StepNoise()
    for size, seconds in [(64, 0.005), (16, 0.00125), (16, 0.00125), (64, 0.005)]:
        noise.update(size, seconds)
    assert noise.relative == 0.0  # only the one pair at 16 samples, which agrees


def test_the_noise_survives_a_checkpoint():
    noise = StepNoise()
    for seconds in _noisy_times(0.1, 10):
        noise.update(8, seconds)
    restored = StepNoise()
    restored.load_state_dict(noise.state_dict())
    assert restored.relative == noise.relative
    restored.update(8, 0.005)
    noise.update(8, 0.005)
    assert restored.relative == noise.relative


@given(
    st.lists(st.floats(0.0, 2.0), min_size=1, max_size=8),
    st.floats(0.0, 0.99),
    st.floats(0.0, 0.5),
)
def test_the_band_lies_between_the_floor_and_the_cap_and_grows_with_the_noise(noise, smoothing, floor):
    band = noise_band(noise, smoothing, floor)
    assert floor <= band <= max(floor, 0.25)
    assert noise_band([2 * n for n in noise], smoothing, floor) >= band
    assert noise_band([0.0] * len(noise), smoothing, floor) == floor


def test_a_level_shift_is_two_misses_in_a_row_on_one_side_beyond_the_noise():
    assert is_level_shift([0.4, 0.5], noise=0.05)
    assert is_level_shift([-1.4, -1.3], noise=0.05)
    assert not is_level_shift([0.5], noise=0.05)  # one slow step is not a new speed
    assert not is_level_shift([0.4, -0.5], noise=0.05)
    assert not is_level_shift([0.4, 0.5], noise=0.2)  # within 4 sigma of a noisy replica


def _report(size: int, seconds: float) -> PeriodReport:
    return PeriodReport(merge_weight=1.0, work=size, planned=size, steps=1, active=seconds)


def test_the_arrival_model_restarts_a_replica_that_became_4x_slower_after_two_periods():
    model = ArrivalModel(2, smoothing=0.8)
    for _ in range(20):
        model.update([_report(64, 0.064), _report(64, 0.064)])
    model.update([_report(64, 0.064), _report(64, 0.256)])
    assert model.shifted == [False, False]  # one slow period may be a hiccup
    model.update([_report(64, 0.064), _report(64, 0.256)])
    assert model.shifted == [False, True]
    assert model.step_seconds()[1] == pytest.approx(0.256)  # the estimates start again at the new level
    models = model.models()
    assert models is not None
    assert models[1].seconds(64) == pytest.approx(0.256)


def test_a_new_plan_is_not_taken_for_a_change_of_speed():
    model = ArrivalModel(1, smoothing=0.8)
    for _ in range(10):
        model.update([_report(64, 0.064)])
    for _ in range(3):  # a batch of 8 with a large fixed cost: far from the proportional prediction, same speed
        model.update([_report(8, 0.040)])
        assert model.shifted == [False]


def test_a_replica_that_becomes_4x_slower_while_its_batch_moves_is_restarted_after_two_periods():
    """A plan made at the first slow period moves the batch; the change must still be told from the move."""
    model = ArrivalModel(2, smoothing=0.8)
    for _ in range(20):
        model.update([_report(64, 0.064), _report(64, 0.064)])
    model.update([_report(64, 0.064), _report(64, 0.256)])
    assert model.shifted == [False, False]
    model.update([_report(80, 0.080), _report(48, 0.192)])  # 4x slower at the batch a damped plan gave it
    assert model.shifted == [False, True]
    assert model.step_seconds()[1] == pytest.approx(0.192)


@given(
    fixed=st.floats(0.0, 1.0),
    per_sample=st.floats(1e-4, 1e-2),
    sizes=st.lists(st.integers(1, 1024), min_size=2, max_size=30),
    smoothing=st.floats(0.0, 0.95),
)
def test_no_batch_sizes_pass_for_a_change_of_speed_on_a_device_of_constant_speed(fixed, per_sample, sizes, smoothing):
    """For any fixed cost the model does not know, its miss on a new batch stays within what the move explains."""
    model = ArrivalModel(1, smoothing=smoothing)
    for size in sizes:
        model.update([_report(size, fixed + per_sample * size)])
        assert model.shifted == [False]


def test_the_noise_is_zero_until_two_periods_at_one_size_were_seen():
    noise = StepNoise()
    assert (noise.count, noise.relative) == (0, 0.0)
    noise.update(64, 0.005)
    assert (noise.count, noise.relative) == (0, 0.0)
    noise.update(64, 0.005 * math.exp(0.1))
    assert noise.count == 1
    assert noise.relative == pytest.approx(0.1 / (0.6744897501960817 * math.sqrt(2.0)))


def test_a_fresh_noise_survives_a_checkpoint():
    restored = StepNoise()
    restored.load_state_dict(StepNoise().state_dict())
    assert (restored.count, restored.relative) == (0, 0.0)
    restored.update(64, 0.005)
    assert restored.count == 0  # no period before this one to compare with


@pytest.mark.parametrize(
    ("differences", "median"),
    [([0.6, 0.1, 0.2], 0.2), ([0.8, 0.1, 0.4, 0.2], 0.3), ([0.5], 0.5), ([0.1, 0.7], 0.4)],
)
def test_the_noise_is_the_median_difference_over_0_6745_root_2(differences, median):
    noise = StepNoise()
    noise.load_state_dict({"differences": differences, "previous": None})
    assert noise.count == len(differences)
    assert noise.relative == pytest.approx(median / (0.6744897501960817 * math.sqrt(2.0)), rel=1e-12)


def test_without_replicas_the_band_is_its_floor():
    assert noise_band([], smoothing=0.8, floor=0.03) == 0.03


def test_a_level_shift_needs_both_misses_beyond_the_larger_of_threshold_and_4_sigma():
    # Without noise the limit is the threshold 0.25, which a miss must exceed, not just reach.
    assert not is_level_shift([0.2, 0.2], noise=0.0)
    assert not is_level_shift([0.25, 0.3], noise=0.0)
    assert not is_level_shift([0.3, 0.25], noise=0.0)
    assert is_level_shift([0.26, 0.26], noise=0.0)
    # With σ = 0.1 the limit is 4σ = 0.4.
    assert not is_level_shift([0.35, 0.35], noise=0.1)
    assert is_level_shift([0.45, 0.45], noise=0.1)


def test_too_few_misses_are_no_level_shift():
    assert is_level_shift([], noise=0.0) is False
    assert is_level_shift([5.0], noise=0.0) is False
