"""Tests for merge weights: per-replica weights, normalisation, the adaptive nudge and the L2 trend flag."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_aesgd.core.weights import (
    MERGE_WEIGHTS,
    AdaptiveNormalization,
    L2Trend,
    linear_lr_scale,
    normalize,
    nudge_extremes,
    nudge_factor,
    replica_weight,
)

FAST = settings(deadline=None, max_examples=50)

non_negative = st.floats(min_value=0.0, max_value=1e6, allow_subnormal=False)
positive = st.floats(min_value=0.01, max_value=100.0)
norms = st.floats(min_value=0.0, max_value=1e6)


@st.composite
def weight_lists(draw: st.DrawFn, min_size: int = 1) -> list[float]:
    """Non-negative weights with at least one positive entry."""
    weights = draw(st.lists(non_negative, min_size=min_size, max_size=8))
    weights[draw(st.integers(min_value=0, max_value=len(weights) - 1))] = draw(positive)
    return weights


# ---------------------------------------------------------------------------------------------------------
# replica_weight


@pytest.mark.parametrize(
    ("weights", "expected"),
    [("samples", 96.0), ("updates", 3.0), ("uniform", 1.0)],
)
def test_replica_weight_counts_what_the_merge_weights_name(weights: str, expected: float) -> None:
    assert replica_weight(weights, num_samples=96.0, num_updates=3) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("weights", MERGE_WEIGHTS)
def test_replica_weight_of_a_replica_that_did_nothing_is_zero_unless_uniform(weights: str) -> None:
    expected = 1.0 if weights == "uniform" else 0.0
    assert replica_weight(weights, num_samples=0.0, num_updates=0) == expected  # type: ignore[arg-type]


def test_merge_weights_lists_every_choice() -> None:
    assert MERGE_WEIGHTS == ("samples", "updates", "uniform")


def test_replica_weight_rejects_unknown_merge_weights_and_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown merge weights 'batches'.*'samples', 'updates', 'uniform'"):
        replica_weight("batches", num_samples=1.0, num_updates=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("num_samples", "num_updates", "message"),
    [(-1.0, 1, "`num_samples` must be finite and >= 0"), (math.inf, 1, "`num_samples`"), (1.0, -1, "`num_updates`")],
)
@pytest.mark.parametrize("weights", MERGE_WEIGHTS)
def test_replica_weight_rejects_negative_counts(
    weights: str, num_samples: float, num_updates: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        replica_weight(weights, num_samples, num_updates)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------
# normalize


@FAST
@given(weight_lists())
def test_normalize_sums_to_one_and_keeps_proportions(weights: list[float]) -> None:
    shares = normalize(weights)
    assert math.fsum(shares) == pytest.approx(1.0, abs=1e-9)
    total = math.fsum(weights)
    assert shares == pytest.approx([weight / total for weight in weights], rel=1e-12, abs=1e-15)


@FAST
@given(weight_lists())
def test_normalize_preserves_order(weights: list[float]) -> None:
    shares = normalize(weights)
    for i in range(len(weights)):
        for j in range(len(weights)):
            if weights[i] < weights[j]:
                assert shares[i] <= shares[j]


def test_normalize_divides_by_the_sum() -> None:
    assert normalize([1.0, 3.0, 0.0]) == [0.25, 0.75, 0.0]


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([], "no weights"),
        ([0.0, 0.0], "all zero.*'uniform'"),
        ([1.0, -0.5], "non-negative"),
        ([1.0, math.nan], "finite"),
    ],
)
def test_normalize_rejects_invalid_weights(weights: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        normalize(weights)


# ---------------------------------------------------------------------------------------------------------
# nudge_extremes


@st.composite
def distinct_shares(draw: st.DrawFn) -> list[float]:
    """Normalised shares, all positive, not all equal: a fastest and a slowest replica exist."""
    weights = draw(st.lists(positive, min_size=2, max_size=8).filter(lambda ws: max(ws) > min(ws)))
    return normalize(weights)


@FAST
@given(weight_lists(), st.floats(min_value=0.0, max_value=0.9))
def test_nudge_keeps_the_sum_at_one_when_renormalizing(weights: list[float], boost: float) -> None:
    assert math.fsum(nudge_extremes(normalize(weights), boost)) == pytest.approx(1.0, abs=1e-9)


@FAST
@given(distinct_shares(), st.floats(min_value=0.01, max_value=0.9))
def test_nudge_raises_the_largest_share_and_lowers_the_smallest(shares: list[float], boost: float) -> None:
    nudged = nudge_extremes(shares, boost)
    largest, smallest = shares.index(max(shares)), shares.index(min(shares))
    assert nudged[largest] > shares[largest]
    assert nudged[smallest] < shares[smallest]


@FAST
@given(distinct_shares())
def test_nudge_without_renormalizing_reproduces_the_authors_code(shares: list[float]) -> None:
    nudged = nudge_extremes(shares, boost=0.1, renormalize=False)
    largest, smallest = shares.index(max(shares)), shares.index(min(shares))
    expected = list(shares)
    expected[largest] *= 1.1
    expected[smallest] *= 0.9
    assert nudged == expected
    # the code's weights sum to 1 + boost·(p_max − p_min)
    assert math.fsum(nudged) == pytest.approx(1.0 + 0.1 * (max(shares) - min(shares)), abs=1e-12)


def test_nudge_closed_form() -> None:
    # [0.2, 0.5, 0.3] → [0.18, 0.55, 0.3], sum 1.03.
    nudged = nudge_extremes([0.2, 0.5, 0.3])
    assert nudged == pytest.approx([0.18 / 1.03, 0.55 / 1.03, 0.3 / 1.03])


def test_nudge_breaks_ties_at_the_first_index() -> None:
    assert nudge_extremes([0.4, 0.1, 0.4, 0.1], renormalize=False) == pytest.approx([0.44, 0.09, 0.4, 0.1])


@pytest.mark.parametrize("shares", [[1.0], [0.25, 0.25, 0.25, 0.25]])
def test_nudge_leaves_shares_alone_without_a_fastest_replica(shares: list[float]) -> None:
    assert nudge_extremes(shares) == shares
    assert nudge_extremes(shares, renormalize=False) == shares


def test_nudge_does_not_modify_its_input() -> None:
    shares = [0.2, 0.8]
    nudge_extremes(shares)
    assert shares == [0.2, 0.8]


@pytest.mark.parametrize(
    ("shares", "boost", "message"),
    [
        ([0.5, 0.5], 1.0, r"`boost` must be in \[0, 1\).*0\.1"),
        ([0.5, 0.5], -0.1, r"`boost` must be in \[0, 1\)"),
        ([], 0.1, "no weights"),
        ([0.5, -0.5], 0.1, "non-negative"),
    ],
)
def test_nudge_rejects_invalid_arguments(shares: list[float], boost: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        nudge_extremes(shares, boost)


def test_nudge_factor_leaves_a_zero_weight_alone() -> None:
    # [0, 1, 2]: the smallest weight is 0, which no factor can scale; the largest gets 1 + boost.
    assert [nudge_factor([0.0, 1.0, 2.0], rank) for rank in range(3)] == [1.0, 1.0, pytest.approx(1.1)]


# ---------------------------------------------------------------------------------------------------------
# AdaptiveNormalization


def test_adaptive_normalization_nudges_from_the_first_step_past_its_warm_up() -> None:
    assert AdaptiveNormalization(enabled=True).factor(0, previous=[3.0, 1.0], local_steps=1) == pytest.approx(1.1)
    warm = AdaptiveNormalization(enabled=True, warmup_steps=4)
    assert [warm.factor(1, previous=[3.0, 1.0], local_steps=steps) for steps in (4, 5)] == [1.0, pytest.approx(0.9)]


@pytest.mark.parametrize(
    ("enabled", "previous", "decreased"),
    [(False, [3.0, 1.0], False), (True, [], False), (True, [3.0, 1.0], True)],
    ids=["disabled", "no-previous-merge", "norm-decreased"],
)
def test_adaptive_normalization_leaves_weights_alone_unless_every_condition_holds(
    enabled: bool, previous: list[float], decreased: bool
) -> None:
    normalization = AdaptiveNormalization(enabled=enabled)
    if decreased:
        normalization.observe(2.0)
        normalization.observe(1.0)
    assert normalization.factor(0, previous, local_steps=5) == 1.0
    assert normalization.weight(2.0, 0, previous, local_steps=5) == 2.0


def test_adaptive_normalization_follows_the_norm_trend_of_each_window() -> None:
    normalization = AdaptiveNormalization(enabled=True)
    normalization.observe(1.0)
    normalization.observe(-1.0)  # no norm measured: ignored
    assert normalization.trend.active
    normalization.observe(0.0)  # a norm of 0 is a measured one, and a decrease
    assert not normalization.trend.active
    assert normalization.factor(0, [3.0, 1.0], local_steps=5) == 1.0
    normalization.new_window()
    assert normalization.factor(0, [3.0, 1.0], local_steps=5) == pytest.approx(1.1)


def test_disabled_adaptive_normalization_does_not_track_the_norm() -> None:
    normalization = AdaptiveNormalization(enabled=False)
    normalization.observe(2.0)
    normalization.observe(1.0)
    assert normalization.state_dict() == {"previous_norm": None, "active": True}


def test_adaptive_normalization_resumes_from_its_state_dict() -> None:
    normalization = AdaptiveNormalization(enabled=True)
    normalization.observe(2.0)
    normalization.observe(1.0)
    assert normalization.state_dict() == {"previous_norm": 1.0, "active": False}
    restored = AdaptiveNormalization(enabled=True)
    restored.load_state_dict(normalization.state_dict())
    assert restored.factor(0, [3.0, 1.0], local_steps=5) == 1.0


# ---------------------------------------------------------------------------------------------------------
# L2Trend


def test_l2_trend_is_active_while_the_norm_does_not_decrease() -> None:
    trend = L2Trend()
    assert [trend.update(norm) for norm in (1.0, 1.0, 2.5, 3.0)] == [True, True, True, True]
    assert trend.active


def test_l2_trend_switches_off_for_good_at_the_first_decrease() -> None:
    trend = L2Trend()
    assert [trend.update(norm) for norm in (1.0, 2.0, 1.9, 5.0, 6.0)] == [True, True, False, False, False]


@FAST
@given(st.lists(norms, min_size=1, max_size=30))
def test_l2_trend_is_sticky(sequence: list[float]) -> None:
    trend = L2Trend()
    flags = [trend.update(norm) for norm in sequence]
    # active exactly up to the first decrease, inactive from then on
    first_drop = next((i for i in range(1, len(sequence)) if sequence[i] < sequence[i - 1]), len(sequence))
    assert flags == [i < first_drop for i in range(len(sequence))]


@FAST
@given(st.lists(norms, max_size=10), st.lists(norms, min_size=1, max_size=10))
def test_l2_trend_resumes_from_its_state_dict(before: list[float], after: list[float]) -> None:
    original = L2Trend()
    for norm in before:
        original.update(norm)
    restored = L2Trend()
    restored.load_state_dict(original.state_dict())
    assert [restored.update(norm) for norm in after] == [original.update(norm) for norm in after]


def test_l2_trend_state_dict_holds_plain_values() -> None:
    trend = L2Trend()
    assert trend.state_dict() == {"previous_norm": None, "active": True}
    trend.update(2.0)
    trend.update(1.0)
    assert trend.state_dict() == {"previous_norm": 1.0, "active": False}


def test_l2_trend_rejects_an_incomplete_state_dict() -> None:
    with pytest.raises(ValueError, match=r"missing \['active'\]"):
        L2Trend().load_state_dict({"previous_norm": 1.0})


@pytest.mark.parametrize("norm", [-1.0, math.nan, math.inf])
def test_l2_trend_rejects_invalid_norms(norm: float) -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        L2Trend().update(norm)


def test_linear_lr_scale() -> None:
    assert linear_lr_scale(512, 256) == 2.0
    assert linear_lr_scale(32, 1024) == 1 / 32
    assert linear_lr_scale(1, 4) == 0.25
    assert linear_lr_scale(4, 1) == 4.0
    with pytest.raises(ValueError, match="must be > 0"):
        linear_lr_scale(0, 256)
    with pytest.raises(ValueError, match="must be > 0"):
        linear_lr_scale(32, 0)
