"""Tests for the paper's learning-rate factor: a linear warm-up ramp, then inverse-time decay."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_aesgd.core.lr import InverseTimeDecay, stale_update_scale

decays = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)
warmups = st.integers(min_value=0, max_value=50)
starts = st.floats(min_value=1e-3, max_value=1.0)


@given(decays, warmups, starts, st.integers(min_value=0, max_value=500))
def test_the_factor_is_in_0_1_rises_through_the_warm_up_and_falls_after(decay, warmup, start, step):
    schedule = InverseTimeDecay(decay, warmup, start)
    factor = schedule(step)
    assert 0.0 < factor <= 1.0
    if step + 1 < warmup:
        # Strictly, unless the ramp starts at the full rate or within rounding of it (a flat ramp).
        assert schedule(step + 1) > factor or 1.0 - start < 1e-12
    elif step >= warmup:
        assert schedule(step + 1) <= factor


@given(decays, warmups, starts)
def test_the_ramp_starts_at_its_start_and_the_decay_at_one(decay, warmup, start):
    schedule = InverseTimeDecay(decay, warmup, start)
    assert schedule(warmup) == 1.0
    assert schedule(0) == pytest.approx(start if warmup > 0 else 1.0)


@given(decays.filter(lambda d: d > 0), warmups, st.integers(min_value=1, max_value=500))
def test_after_the_warm_up_the_inverse_factor_grows_linearly_with_the_paper_formula(decay, warmup, t):
    # 1/f(w + t) = 1 + decay·t: the paper's 1/(1 + decay·(epoch − 10)), with t counted in steps.
    assert 1.0 / InverseTimeDecay(decay, warmup)(warmup + t) == pytest.approx(1.0 + decay * t)


def test_it_drives_a_torch_lambda_lr():
    parameter = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, InverseTimeDecay(decay=1.0, warmup_steps=2))
    rates = []
    for _ in range(4):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.01, 0.505, 1.0, 0.5])


@pytest.mark.parametrize(
    "options",
    [
        {"decay": -0.1},
        {"decay": float("nan")},
        {"decay": True},
        {"decay": 0.1, "warmup_steps": -1},
        {"decay": 0.1, "warmup_steps": 1.5},
        {"decay": 0.1, "warmup_start": True},
    ],
)
def test_bad_settings_are_refused(options):
    with pytest.raises(ValueError, match="HINT"):
        InverseTimeDecay(**options)


@pytest.mark.parametrize("start", [0.0, 1.5])
def test_the_ramp_start_is_in_0_1(start):
    with pytest.raises(ValueError, match="warmup_start"):
        InverseTimeDecay(0.1, 2, start)


def test_a_negative_step_is_refused():
    with pytest.raises(ValueError, match="0-based"):
        InverseTimeDecay(0.1)(-1)


def _delayed_descent_norm(curvature_step: float, delay: int, steps: int = 4000) -> float:
    """|x| after gradient descent on x²·λ/2 with the gradient of ``delay`` steps ago: x_{k+1} = x_k − ηλ·x_{k−τ}."""
    history = [1.0] * (delay + 1)
    for _ in range(steps):
        history.append(history[-1] - curvature_step * history[-1 - delay])
        history.pop(0)
    return abs(history[-1])


@given(st.floats(0.05, 1.95), st.integers(0, 3))
def test_a_step_size_stable_in_sync_stays_stable_when_stale_at_the_scaled_rate(sync_step, delay):
    """ηλ < 2 converges in sync; ηλ·s(τ) then converges with a τ-step delay (the delay's stability limit)."""
    assert _delayed_descent_norm(sync_step, 0) < 1e-3
    assert _delayed_descent_norm(sync_step * stale_update_scale(delay), delay) < 1e-3


@pytest.mark.parametrize("delay", [0, 1, 2, 3])
def test_the_scale_is_the_ratio_of_the_stability_limits(delay):
    """Just above 2·s(τ), τ-step-stale descent diverges: the scale cannot be larger."""
    assert _delayed_descent_norm(2.05 * stale_update_scale(delay), delay, steps=2000) > 1e3


def test_abs_sgds_one_step_delay_halves_the_rate():
    assert stale_update_scale(0) == 1.0
    assert stale_update_scale(1) == pytest.approx(0.5)


@pytest.mark.parametrize("delay", [-1, 1.5, True])
def test_the_scale_needs_a_whole_delay(delay):
    with pytest.raises(ValueError, match="whole number"):
        stale_update_scale(delay)


def test_without_a_warm_up_the_decay_starts_at_step_zero():
    # The defaults: no ramp (w = 0), so f(t) = 1 / (1 + decay·t) from the first step.
    schedule = InverseTimeDecay(decay=0.5)
    assert [schedule(t) for t in range(3)] == [1.0, pytest.approx(1 / 1.5), 0.5]
