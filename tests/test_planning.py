import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lightning_aesgd.core.planning import (
    apportion,
    balance_step_times,
    ideal_shares,
    linear_lr_scale,
    share_error,
    split_by_cost,
)
from lightning_aesgd.core.policies import (
    AdditivePolicy,
    BalancedPolicy,
    ProportionalPolicy,
    StaticPolicy,
    get_plan_policy,
)
from lightning_aesgd.core.speed import StepTime

share_values = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
positive_shares = st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=1, max_size=12)


@st.composite
def bounded_problems(draw: st.DrawFn) -> tuple[int, list[float], int, int | None]:
    """A feasible apportion problem: (total, shares, min_size, max_size)."""
    n = draw(st.integers(min_value=1, max_value=12))
    shares = draw(st.lists(share_values, min_size=n, max_size=n).filter(lambda s: sum(s) > 0))
    min_size = draw(st.integers(min_value=0, max_value=50))
    max_size = draw(st.none() | st.integers(min_value=min_size, max_value=min_size + 300))
    highest_total = n * max_size if max_size is not None else n * min_size + 5000
    total = draw(st.integers(min_value=n * min_size, max_value=highest_total))
    return total, shares, min_size, max_size


def _times(speeds: list[float]) -> list[StepTime]:
    """Replicas without fixed per-step cost at the given speeds (zero speed: never finishes)."""
    return [StepTime.from_speed(speed) if speed > 0 else StepTime(0.0, math.inf) for speed in speeds]


def exact_quota(total: int, shares: list[float], i: int) -> Fraction:
    return Fraction(total) * Fraction(shares[i]) / sum(Fraction(s) for s in shares)


# ---------------------------------------------------------------------------------------------- apportion


@given(bounded_problems())
def test_apportion_sums_to_total(problem: tuple[int, list[float], int, int | None]) -> None:
    total, shares, min_size, max_size = problem
    assert sum(apportion(total, shares, min_size, max_size)) == total


@given(bounded_problems())
def test_apportion_respects_bounds(problem: tuple[int, list[float], int, int | None]) -> None:
    total, shares, min_size, max_size = problem
    sizes = apportion(total, shares, min_size, max_size)
    assert len(sizes) == len(shares)
    assert min(sizes) >= min_size
    if max_size is not None:
        assert max(sizes) <= max_size


@given(bounded_problems())
def test_apportion_larger_share_never_gets_smaller_size(problem: tuple[int, list[float], int, int | None]) -> None:
    total, shares, min_size, max_size = problem
    sizes = apportion(total, shares, min_size, max_size)
    for i, share_i in enumerate(shares):
        for j, share_j in enumerate(shares):
            if share_i > share_j:
                assert sizes[i] >= sizes[j], (i, j)


@given(st.integers(min_value=0, max_value=10**6), st.lists(share_values, min_size=1, max_size=12))
def test_apportion_within_one_of_exact_quota_without_bounds(total: int, shares: list[float]) -> None:
    if sum(shares) == 0:
        return
    sizes = apportion(total, shares, min_size=0)
    for i, size in enumerate(sizes):
        assert abs(size - exact_quota(total, shares, i)) < 1


@given(bounded_problems())
def test_apportion_equal_shares_differ_by_at_most_one(problem: tuple[int, list[float], int, int | None]) -> None:
    total, shares, min_size, max_size = problem
    sizes = apportion(total, [1.0] * len(shares), min_size, max_size)
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    ("total", "shares", "min_size", "max_size", "expected"),
    [
        (10, [2.0, 1.0, 1.0], 1, None, [5, 3, 2]),  # remainder tie goes to the lower index
        (5, [1.0, 1.0], 1, None, [3, 2]),
        (100, [10.0, 1.0, 1.0], 20, None, [60, 20, 20]),  # small shares raised to the minimum
        (100, [10.0, 1.0, 1.0], 1, 40, [40, 30, 30]),  # large share capped, the rest redistributed
        (100, [10.0, 5.0, 1.0], 20, 50, [50, 30, 20]),  # both bounds bind
        # At the first trial scale the two small shares fall below 20, but once the large one is capped the
        # true scale is higher and both are back within bounds: clamping all violators at once would be wrong.
        (100, [10.0, 1.0, 1.9], 20, 40, [40, 21, 39]),
        (10, [1.0, 0.0], 1, 6, [6, 4]),  # a zero share takes leftovers once positive shares are capped
        (10, [1.0, 0.0], 1, None, [9, 1]),
        (10, [1.0, 0.0], 0, None, [10, 0]),
        (0, [1.0, 2.0], 0, None, [0, 0]),
    ],
)
def test_apportion_known_splits(
    total: int, shares: list[float], min_size: int, max_size: int | None, expected: list[int]
) -> None:
    assert apportion(total, shares, min_size, max_size) == expected


def test_apportion_is_exact_for_huge_totals() -> None:
    total = 10**15 + 1
    sizes = apportion(total, [0.1, 0.2, 0.3, 0.4])
    assert sum(sizes) == total
    assert sizes == sorted(sizes)


@pytest.mark.parametrize(
    ("total", "shares", "min_size", "max_size", "match"),
    [
        (5, [1.0, 1.0, 1.0], 2, None, "lower the minimum batch size"),
        (10, [1.0, 1.0], 1, 4, "raise the maximum batch size"),
        (-1, [1.0], 0, None, "`total` must be >= 0"),
        (10, [], 1, None, "empty"),
        (10, [1.0, -1.0], 1, None, "finite and >= 0"),
        (10, [1.0, math.nan], 1, None, "finite and >= 0"),
        (10, [1.0, math.inf], 1, None, "finite and >= 0"),
        (10, [0.0, 0.0], 1, None, "all zero"),
        (10, [1.0], -1, None, "min_size"),
        (10, [1.0], 5, 4, "max_size"),
    ],
)
def test_apportion_rejects_invalid_input(
    total: int, shares: list[float], min_size: int, max_size: int | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        apportion(total, shares, min_size, max_size)


# ------------------------------------------------------------------------------------------ split_by_cost

item_costs = arrays(np.float64, st.integers(min_value=0, max_value=300), elements=st.floats(0.0, 100.0))


@given(item_costs, positive_shares, st.integers(min_value=0, max_value=8))
def test_split_by_cost_counts_sum_and_meet_minimum(costs: np.ndarray, shares: list[float], min_size: int) -> None:
    counts = split_by_cost(torch.from_numpy(costs), shares, min_size)
    assert len(counts) == len(shares)
    assert sum(counts) == len(costs)
    assert min(counts) >= min(min_size, len(costs) // len(shares))


@given(st.integers(min_value=0, max_value=2000), st.floats(0.01, 100.0), positive_shares)
def test_split_by_cost_with_equal_costs_matches_count_apportionment(
    num_items: int, cost: float, shares: list[float]
) -> None:
    counts = split_by_cost([cost] * num_items, shares, min_size=0)
    reference = apportion(num_items, shares, min_size=0)
    assert all(abs(a - b) <= 1 for a, b in zip(counts, reference, strict=True))


@given(item_costs, positive_shares)
def test_split_by_cost_slices_within_one_item_of_target_cost(costs: np.ndarray, shares: list[float]) -> None:
    counts = split_by_cost(costs.tolist(), shares, min_size=0)
    total_cost = float(costs.sum())
    largest_item = float(costs.max()) if len(costs) else 0.0
    ends = np.cumsum(counts)
    for count, end, share in zip(counts, ends, ideal_shares(shares), strict=True):
        slice_cost = float(costs[end - count : end].sum())
        assert abs(slice_cost - total_cost * share) <= largest_item + 1e-9 * max(total_cost, 1.0)


@pytest.mark.parametrize(
    ("costs", "shares", "min_size", "expected"),
    [
        ([1.0, 1.0, 1.0, 1.0, 4.0], [1.0, 1.0], 1, [4, 1]),  # the heavy item alone balances four light ones
        ([4.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0], 1, [1, 4]),
        ([1.0, 1.0, 1.0, 1.0, 4.0], [1.0, 1.0, 1.0], 1, [3, 1, 1]),  # cuts at costs 3 and 4 for targets 8/3, 16/3
        ([8.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0], 0, [0, 5]),  # boundary tie goes to the lower cut
        ([8.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0], 2, [2, 3]),  # cut pushed forward to give each slice two items
        ([0.0, 0.0, 0.0, 0.0, 8.0], [1.0, 1.0], 0, [4, 1]),
        ([0.0, 0.0, 0.0, 0.0, 8.0], [1.0, 1.0], 2, [3, 2]),  # cut pushed backward
        ([0.0] * 10, [1.0, 1.0, 2.0], 1, [3, 2, 5]),  # no cost at all: count apportionment
        ([1.0] * 5, [1.0, 1.0, 1.0], 4, [2, 1, 2]),  # short step: the minimum drops to 5 // 3
        ([], [1.0, 2.0], 1, [0, 0]),
    ],
)
def test_split_by_cost_known_splits(
    costs: list[float], shares: list[float], min_size: int, expected: list[int]
) -> None:
    assert split_by_cost(costs, shares, min_size) == expected


def test_split_by_cost_zero_total_cost_falls_back_to_apportion() -> None:
    assert split_by_cost(torch.zeros(97), [3.0, 1.0, 1.0]) == apportion(97, [3.0, 1.0, 1.0])


def test_split_by_cost_balances_a_large_skewed_step() -> None:
    generator = torch.Generator().manual_seed(0)
    costs = torch.randint(1, 200, (4096,), generator=generator).to(torch.float32)
    shares = [4.0, 2.0, 1.0, 1.0]
    counts = split_by_cost(costs, shares)
    slices = torch.split(costs.double(), counts)
    for piece, share in zip(slices, ideal_shares(shares), strict=True):
        assert abs(piece.sum().item() - costs.double().sum().item() * share) <= costs.max().item()


@pytest.mark.parametrize(
    ("costs", "shares", "min_size", "match"),
    [
        ([1.0, -1.0], [1.0], 1, "finite and >= 0"),
        ([1.0, math.nan], [1.0], 1, "finite and >= 0"),
        (torch.ones(2, 2), [1.0], 1, "one-dimensional"),
        ([1.0], [0.0, 0.0], 1, "all zero"),
        ([1.0], [1.0], -1, "min_size"),
    ],
)
def test_split_by_cost_rejects_invalid_input(
    costs: list[float] | torch.Tensor, shares: list[float], min_size: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        split_by_cost(costs, shares, min_size)


# ----------------------------------------------------------------------------------------------- policies


@given(st.lists(st.floats(min_value=0.1, max_value=10.0), min_size=1, max_size=8), st.integers(1000, 100_000))
def test_proportional_policy_reaches_ideal_in_one_plan(speeds: list[float], total: int) -> None:
    current = [total // len(speeds)] * len(speeds)
    sizes = ProportionalPolicy().plan(current, _times(speeds), total)
    assert sum(sizes) == total
    for size, share in zip(sizes, ideal_shares(speeds), strict=True):
        assert abs(size - total * share) < 1 + 1e-9
    assert share_error(sizes, speeds) <= 1 / (total * min(ideal_shares(speeds))) + 1e-9


def test_proportional_policy_respects_bounds() -> None:
    sizes = ProportionalPolicy(min_batch=100, max_batch=500).plan([250] * 4, _times([10.0, 1.0, 1.0, 0.1]), 1000)
    assert sizes == [500, 200, 200, 100]


def test_additive_policy_moves_each_size_by_exactly_one_step() -> None:
    policy = AdditivePolicy(step=32, min_batch=32, max_batch=1024)
    # Update rates speed/size: 1/256, 1/256, 0.5/256, 0.25/256 against a mean of 0.6875/256.
    assert policy.adjust([256] * 4, _times([1.0, 1.0, 0.5, 0.25])) == [288, 288, 224, 224]
    # The moves cancel, so renormalisation leaves them intact.
    assert policy.plan([256] * 4, _times([1.0, 1.0, 0.5, 0.25]), 1024) == [288, 288, 224, 224]


@given(
    st.lists(st.tuples(st.integers(64, 960), st.floats(0.01, 100.0)), min_size=2, max_size=8),
    st.integers(1, 32),
)
def test_additive_policy_step_direction_follows_update_share(pairs: list[tuple[int, float]], step: int) -> None:
    current = [size for size, _ in pairs]
    speeds = [speed for _, speed in pairs]
    adjusted = AdditivePolicy(step=step, min_batch=32, max_batch=1024).adjust(current, _times(speeds))
    update_rates = [speed / size for size, speed in pairs]
    mean_rate = sum(update_rates) / len(update_rates)
    for before, after, rate in zip(current, adjusted, update_rates, strict=True):
        if math.isclose(rate, mean_rate, rel_tol=1e-9):
            assert after == before
        else:
            assert after - before == (step if rate > mean_rate else -step)


def test_additive_policy_balanced_replicas_keep_their_sizes() -> None:
    policy = AdditivePolicy(step=32, min_batch=32, max_batch=1024)
    assert policy.plan([400, 200, 100], _times([4.0, 2.0, 1.0]), 700) == [400, 200, 100]


def test_additive_policy_clamps_to_bounds_and_renormalises() -> None:
    policy = AdditivePolicy(step=32, min_batch=32, max_batch=1024)
    assert policy.adjust([1024, 40], _times([10.0, 0.1])) == [1024, 32]
    sizes = policy.plan([700, 300, 24 + 32], _times([4.0, 1.0, 1.0]), 1056)
    assert sum(sizes) == 1056
    assert all(32 <= size <= 1024 for size in sizes)


def test_additive_policy_converges_to_equal_step_times() -> None:
    # Speeds in samples/s with a constant per-sample time, so a replica's step lasts size / speed.
    speeds = [1.0, 1.0, 0.5, 0.25]
    total = 4096
    policy = AdditivePolicy(step=16, min_batch=32, max_batch=4096)
    sizes = [total // 4] * 4

    def step_time_spread(plan: list[int]) -> float:
        times = [size / speed for size, speed in zip(plan, speeds, strict=True)]
        return max(times) / min(times) - 1

    assert step_time_spread(sizes) > 1.0
    spreads = []
    for _ in range(100):
        sizes = policy.plan(sizes, _times(speeds), total)
        assert sum(sizes) == total
        spreads.append(step_time_spread(sizes))
    assert max(spreads[-50:]) <= 0.10


def test_static_policy_ignores_speeds() -> None:
    policy = StaticPolicy()
    assert policy.plan([1, 1, 1, 1], _times([9.0, 1.0, 1.0, 1.0]), 1024) == [256] * 4
    assert policy.plan([1, 1, 1, 1], _times([1.0, 1.0, 1.0, 9.0]), 1024) == [256] * 4
    weighted = StaticPolicy(shares=[3.0, 1.0])
    assert weighted.plan([1, 1], _times([1.0, 100.0]), 1000) == [750, 250]


def test_get_plan_policy_builds_registered_policies() -> None:
    assert get_plan_policy("proportional", min_batch=4) == ProportionalPolicy(min_batch=4)
    assert get_plan_policy("additive", step=8) == AdditivePolicy(step=8)
    assert get_plan_policy("static") == StaticPolicy()
    assert get_plan_policy("balanced", max_batch=9) == BalancedPolicy(max_batch=9)
    with pytest.raises(ValueError, match="valid names: additive, balanced, proportional, static"):
        get_plan_policy("fastest")


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ProportionalPolicy(min_batch=0), "`min_batch` must be >= 1"),
        (lambda: ProportionalPolicy(min_batch=8, max_batch=4), "`max_batch` must be >= `min_batch`"),
        (lambda: AdditivePolicy(step=0), "`step` must be >= 1"),
        (lambda: AdditivePolicy(min_batch=64, max_batch=32), "`max_batch` must be >= `min_batch`"),
        (lambda: StaticPolicy(shares=[1.0, 0.0]), "must all be > 0"),
        (lambda: StaticPolicy(shares=[]), "empty"),
        (lambda: StaticPolicy(shares=[1.0, math.inf]), "finite and >= 0"),
    ],
)
def test_policies_reject_invalid_arguments(build: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ProportionalPolicy().plan([1, 1], _times([1.0]), 10), "one entry per replica"),
        (lambda: AdditivePolicy().plan([64, 64], _times([1.0, 1.0, 1.0]), 128), "one entry per replica"),
        (lambda: AdditivePolicy().adjust([64, 0], _times([1.0, 1.0])), "`current` batch sizes must be >= 1"),
        (lambda: StaticPolicy(shares=[1.0, 1.0]).plan([1, 1, 1], _times([1.0, 1.0, 1.0]), 9), "one entry per replica"),
        (lambda: ProportionalPolicy().plan([1, 1], _times([0.0, 0.0]), 10), "all zero"),
        (lambda: ProportionalPolicy(min_batch=8).plan([1, 1], _times([1.0, 1.0]), 10), "lower the minimum batch size"),
    ],
)
def test_policies_reject_inconsistent_plan_inputs(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------------ helpers


def test_linear_lr_scale() -> None:
    assert linear_lr_scale(512, 256) == 2.0
    assert linear_lr_scale(32, 1024) == 1 / 32
    with pytest.raises(ValueError, match="must be >= 1"):
        linear_lr_scale(0, 256)
    with pytest.raises(ValueError, match="must be >= 1"):
        linear_lr_scale(32, 0)


def test_ideal_shares_and_share_error() -> None:
    assert ideal_shares([3.0, 1.0]) == [0.75, 0.25]
    assert share_error([750, 250], [3.0, 1.0]) == 0.0
    assert share_error([500, 500], [3.0, 1.0]) == pytest.approx(1.0)  # the slow replica got twice its share
    with pytest.raises(ValueError, match="must all be > 0"):
        share_error([1, 1], [1.0, 0.0])
    with pytest.raises(ValueError, match="positive sum"):
        share_error([0, 0], [1.0, 1.0])


# ---------------------------------------------------------------------------------------------- balanced


@given(
    st.lists(st.tuples(st.floats(0.0, 0.05), st.floats(1e-5, 1e-2)), min_size=1, max_size=6),
    st.integers(64, 4096),
)
def test_balanced_sizes_sum_to_total_and_equalise_predicted_step_times(
    models: list[tuple[float, float]], total: int
) -> None:
    step_times = [StepTime(overhead, per_sample) for overhead, per_sample in models]
    sizes = balance_step_times(total, step_times)
    assert sum(sizes) == total
    assert min(sizes) >= 1
    times = [t.seconds(size) for t, size in zip(step_times, sizes, strict=True)]
    # Replicas above the minimum finish within one sample's time of each other; one at the minimum only
    # because its fixed cost alone reaches that common time.
    unclamped = [i for i, size in enumerate(sizes) if size > 1]
    if unclamped:
        common = max(times[i] for i in unclamped)
        slack = max(step_times[i].per_sample for i in range(len(sizes)))
        assert all(times[i] >= common - 2 * slack for i in unclamped)
        assert all(times[i] >= common - 2 * slack for i in range(len(sizes)) if sizes[i] == 1)


def test_balanced_equals_proportional_without_fixed_costs() -> None:
    speeds = [4.0, 2.0, 1.0, 1.0]
    assert BalancedPolicy().plan([256] * 4, _times(speeds), 1024) == ProportionalPolicy().plan(
        [256] * 4, _times(speeds), 1024
    )


def test_balanced_gives_the_rest_to_the_replicas_that_can_use_it() -> None:
    # Replica 1's fixed cost (0.1 s) exceeds what replica 0 needs for the whole step at 10 µs per sample.
    sizes = BalancedPolicy(min_batch=8).plan([512, 512], [StepTime(0.0, 1e-5), StepTime(0.1, 4e-5)], 1024)
    assert sizes == [1016, 8]
    # A smaller fixed cost leaves room: both finish together, near 0.003 + 4e-5·b₁ = 1e-5·b₀.
    sizes = BalancedPolicy().plan([512, 512], [StepTime(0.0, 1e-5), StepTime(0.003, 4e-5)], 1024)
    assert sizes[1] == pytest.approx((1024e-5 - 0.003) / 5e-5, abs=1)
