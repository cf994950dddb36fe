import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lightning_aesgd.core.apportion import apportion, ideal_shares, in_multiples, share_error, split_by_cost

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
        # Raising the zero share to 2 overshoots by exactly one sample: the first replica comes back under its cap.
        (4, [1.0, 0.0], 2, 3, [2, 2]),
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
        (10, [1.0, -1.0], 1, None, "finite and non-negative"),
        (10, [1.0, math.nan], 1, None, "finite and non-negative"),
        (10, [1.0, math.inf], 1, None, "finite and non-negative"),
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


@given(item_costs, positive_shares, st.data())
def test_split_by_cost_meets_each_slices_own_minimum(costs: np.ndarray, shares: list[float], data) -> None:
    mins = data.draw(st.lists(st.integers(0, 8), min_size=len(shares), max_size=len(shares)))
    counts = split_by_cost(torch.from_numpy(costs), shares, mins)
    assert sum(counts) == len(costs)
    if sum(mins) <= len(costs):
        assert all(count >= low for count, low in zip(counts, mins, strict=True)), (counts, mins)
    else:  # a short step: each slice keeps what an equal split of it allows
        assert all(count >= min(low, len(costs) // len(shares)) for count, low in zip(counts, mins, strict=True))


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
        ([1.0, -1.0], [1.0], 1, "finite and non-negative"),
        ([1.0, math.nan], [1.0], 1, "finite and non-negative"),
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


def test_ideal_shares_and_share_error() -> None:
    assert ideal_shares([3.0, 1.0]) == [0.75, 0.25]
    assert share_error([750, 250], [3.0, 1.0]) == 0.0
    assert share_error([500, 500], [3.0, 1.0]) == pytest.approx(1.0)  # the slow replica got twice its share
    with pytest.raises(ValueError, match="must all be > 0"):
        share_error([1, 1], [1.0, 0.0])
    with pytest.raises(ValueError, match="positive sum"):
        share_error([0, 0], [1.0, 1.0])


@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    multiple=st.integers(1, 5),
)
def test_in_multiples_keeps_the_total_and_who_takes_part(sizes, multiple):
    sizes[0] += (-sum(sizes)) % multiple  # a total the blocks can make
    if sum(sizes) == 0 or sum(size > 0 for size in sizes) * multiple > sum(sizes):
        return
    rounded = in_multiples(sizes, multiple)
    assert sum(rounded) == sum(sizes)
    assert all(size % multiple == 0 for size in rounded)
    assert [size > 0 for size in rounded] == [size > 0 for size in sizes]
    if all(size == 0 or size >= multiple for size in sizes):  # nothing raised to a block: a rounding, no more
        assert all(abs(new - old) < multiple for new, old in zip(rounded, sizes, strict=True))
    if all(size % multiple == 0 for size in sizes):
        assert rounded == sizes


def test_in_multiples_respects_max_size_and_names_an_impossible_plan():
    assert in_multiples([3, 5], 2, max_size=4) == [4, 4]
    with pytest.raises(ValueError, match="blocks of 3"):
        in_multiples([4, 4], 3)
    with pytest.raises(ValueError, match="max_batch=4"):
        in_multiples([6, 6], 4, max_size=4)


@st.composite
def per_replica_problems(draw: st.DrawFn) -> tuple[int, list[float], list[int], list[int | None]]:
    """A feasible apportion problem whose bounds differ per replica: (total, shares, lows, highs)."""
    n = draw(st.integers(min_value=1, max_value=8))
    shares = draw(st.lists(share_values, min_size=n, max_size=n).filter(lambda s: sum(s) > 0))
    lows = draw(st.lists(st.integers(min_value=0, max_value=40), min_size=n, max_size=n))
    highs = [draw(st.none() | st.integers(min_value=low, max_value=low + 200)) for low in lows]
    highest = sum(h for h in highs if h is not None) if None not in highs else sum(lows) + 3000
    total = draw(st.integers(min_value=sum(lows), max_value=highest))
    return total, shares, lows, highs


@given(per_replica_problems())
def test_each_replica_stays_within_its_own_bounds(problem) -> None:
    total, shares, lows, highs = problem
    sizes = apportion(total, shares, lows, highs)
    assert sum(sizes) == total
    for size, low, high in zip(sizes, lows, highs, strict=True):
        assert low <= size
        assert high is None or size <= high


def test_bounds_per_replica_take_a_list_of_one_per_replica() -> None:
    assert apportion(100, [1.0, 1.0, 1.0], min_size=[50, 1, 1]) == [50, 25, 25]
    assert in_multiples([6, 6, 4], 4, max_size=[4, None, None]) == [4, 8, 4]
    with pytest.raises(ValueError, match=r"`min_size` holds 2 values for 3 replicas.*HINT"):
        apportion(10, [1.0, 1.0, 1.0], min_size=[1, 1])


def fraction_apportion(total: int, shares: list[float], min_size: int, max_size: int | None) -> list[int]:
    """The exact-fraction apportionment the integer one replaced (``fractions.Fraction`` throughout): the reference."""
    weights = [Fraction(share) for share in shares]
    fixed: dict[int, Fraction] = {}
    while len(fixed) < len(weights):
        free = {i: weight for i, weight in enumerate(weights) if i not in fixed}
        if sum(free.values()) == 0:
            free = dict.fromkeys(free, Fraction(1))
        remaining = total - sum(fixed.values(), Fraction(0))
        tentative = {i: remaining / sum(free.values()) * weight for i, weight in free.items()}
        high = math.inf if max_size is None else max_size
        clamped = {i: Fraction(min(max(q, min_size), high)) for i, q in tentative.items()}
        surplus = sum(clamped.values()) - remaining
        newly = {
            i: q
            for i, q in clamped.items()
            if q != tentative[i] and (surplus == 0 or (surplus > 0) == (q > tentative[i]))
        }
        if not newly:
            fixed.update(tentative)
        fixed.update(newly)
    quotas = [fixed[i] for i in range(len(weights))]
    sizes = [math.floor(q) for q in quotas]
    order = sorted(range(len(quotas)), key=lambda i: (sizes[i] - quotas[i], i))
    for i in order[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


@given(bounded_problems())
def test_apportion_gives_what_exact_fractions_give(problem: tuple[int, list[float], int, int | None]) -> None:
    # Integers over common denominators replaced Fraction arithmetic for speed; every size and tie must stay.
    total, shares, min_size, max_size = problem
    assert apportion(total, shares, min_size, max_size) == fraction_apportion(total, shares, min_size, max_size)


@given(st.lists(st.floats(min_value=1e-12, max_value=1e12), min_size=2, max_size=40), st.integers(40, 10_000))
def test_apportion_is_exact_across_magnitudes(shares: list[float], total: int) -> None:
    assert apportion(total, shares) == fraction_apportion(total, shares, 1, None)


def test_apportion_takes_numpy_integers_as_ints_and_refuses_fractional_totals() -> None:
    # Exact arithmetic multiplies the total and bounds by integers beyond 64 bits, where int64 wraps around.
    assert apportion(np.int64(1000), [2.0**-60, 3.0, 1.0], min_size=np.int64(1)) == [1, 749, 250]
    with pytest.raises(TypeError, match="whole number"):
        apportion(10.5, [1.0, 1.0])


def test_in_multiples_refuses_a_block_of_zero() -> None:
    with pytest.raises(ValueError, match="blocks of 0"):
        in_multiples([4, 4], 0)


def test_in_multiples_takes_back_blocks_raised_too_many_from_the_largest_size() -> None:
    # 1 and 1 are raised to a block of 4 each: 8 samples too many, taken back from the largest size (12 → 8).
    assert in_multiples([1, 1, 14], 4) == [4, 4, 8]
    # Of equally large sizes, the lower index gives a block back.
    assert in_multiples([1, 1, 13, 13], 4) == [4, 4, 8, 12]


def test_in_multiples_never_takes_a_replica_below_one_block() -> None:
    # Two replicas taking part need two blocks of 4, but the plan holds one: no replica may drop to 0.
    with pytest.raises(ValueError, match="2 replicas a multiple of 4"):
        in_multiples([2, 2], 4)


def test_split_by_cost_gives_each_slice_one_item_by_default() -> None:
    # All cost sits in the first item: without a floor of one the first slice would be empty ([0, 5]).
    assert split_by_cost([8.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0]) == [1, 4]


def test_split_by_cost_refuses_any_negative_minimum_of_one_per_slice() -> None:
    with pytest.raises(ValueError, match="min_size"):
        split_by_cost([1.0, 1.0], [1.0, 1.0], [1, -1])


def test_split_by_cost_keeps_the_minimums_whose_sum_is_exactly_the_step() -> None:
    # Equal costs would cut at 2; a minimum of 3 for the first slice pushes the cut to 3 (4 items, minimums 3 + 1).
    assert split_by_cost([1.0] * 4, [1.0, 1.0], [3, 1]) == [3, 1]


def test_share_error_takes_a_replica_with_no_samples_and_refuses_a_negative_size() -> None:
    # One sample in all, none for the second replica: each is half a step off its ideal half.
    assert share_error([1, 0], [1.0, 1.0]) == 1.0
    with pytest.raises(ValueError, match="positive sum"):
        share_error([3, -1], [1.0, 1.0])


def test_share_error_names_sequences_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="one entry per replica"):
        share_error([1, 1], [1.0])


@pytest.mark.parametrize(
    ("sizes", "caps", "expected"),
    [([5, 5, 5, 5, 4], [5, 5, 5, 5, None], [4, 4, 4, 4, 8]), ([7, 4, 5], [4, None, 4], [4, 8, 4])],
)
def test_in_multiples_gives_blocks_the_capped_remainders_cannot_take_to_the_others(sizes, caps, expected):
    """Equal speeds of 5 replicas at M = 24 with caps of 5 and 4 learners: the remainders' sizes are all at their
    caps, and the block they cannot take once made the plan fail though [4, 4, 4, 4, 8] fits."""
    assert in_multiples(sizes, 4, max_size=caps) == expected


@given(
    blocks=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    multiple=st.integers(1, 4),
    extra=st.lists(st.integers(0, 3), min_size=6, max_size=6),
    caps=st.lists(st.one_of(st.none(), st.integers(1, 30)), min_size=6, max_size=6),
)
def test_in_multiples_fails_only_where_no_plan_of_blocks_fits(blocks, multiple, extra, caps):
    """For a plan within its caps: where it returns, the plan is blocks within the caps with the same total; where
    it fails, no plan that gives each replica taking part at least one block within its cap has that total."""
    sizes = [b * multiple + (e % multiple if b else 0) for b, e in zip(blocks, extra, strict=False)]
    total = sum(sizes)
    if total % multiple:
        return
    caps = [None if cap is None else max(cap, size) for cap, size in zip(caps, sizes, strict=False)]  # a plan
    try:
        plan = in_multiples(sizes, multiple, max_size=caps)
    except ValueError:
        room = [
            0 if s == 0 else (total if cap is None else cap // multiple * multiple)
            for s, cap in zip(sizes, caps, strict=True)
        ]
        floors = [0 if s == 0 else multiple for s in sizes]
        assert sum(room) < total or any(r < f for r, f in zip(room, floors, strict=True)) or sum(floors) > total
        return
    assert sum(plan) == total
    assert all(p % multiple == 0 and (p == 0) == (s == 0) for p, s in zip(plan, sizes, strict=True))
    assert all(cap is None or p <= cap for p, cap in zip(plan, caps, strict=True))
