import math
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_aesgd.core.apportion import ideal_shares, share_error
from lightning_aesgd.core.planners import (
    AdditivePlanner,
    BalancedPlanner,
    ProportionalPlanner,
    StaticPlanner,
    admitted_replicas,
    balance_step_times,
    balanced_step_time,
    get_planner,
    water_level,
)
from lightning_aesgd.core.speed import StepTime


def _times(speeds: list[float]) -> list[StepTime]:
    """Replicas without fixed per-step cost at the given speeds (zero speed: never finishes)."""
    return [StepTime(0.0, 1.0 / speed) if speed > 0 else StepTime(0.0, math.inf) for speed in speeds]


# ----------------------------------------------------------------------------------------------- planners


@given(st.lists(st.floats(min_value=0.1, max_value=10.0), min_size=1, max_size=8), st.integers(1000, 100_000))
def test_proportional_planner_reaches_ideal_in_one_plan(speeds: list[float], total: int) -> None:
    current = [total // len(speeds)] * len(speeds)
    sizes = ProportionalPlanner().plan(current, _times(speeds), total)
    assert sum(sizes) == total
    for size, share in zip(sizes, ideal_shares(speeds), strict=True):
        assert abs(size - total * share) < 1 + 1e-9
    assert share_error(sizes, speeds) <= 1 / (total * min(ideal_shares(speeds))) + 1e-9


def test_proportional_planner_respects_bounds() -> None:
    sizes = ProportionalPlanner(min_batch=100, max_batch=500).plan([250] * 4, _times([10.0, 1.0, 1.0, 0.1]), 1000)
    assert sizes == [500, 200, 200, 100]


def test_additive_planner_moves_each_size_by_exactly_one_step() -> None:
    planner = AdditivePlanner(step=32, min_batch=32, max_batch=1024)
    # Update rates speed/size: 1/256, 1/256, 0.5/256, 0.25/256 against a mean of 0.6875/256.
    assert planner.adjust([256] * 4, _times([1.0, 1.0, 0.5, 0.25])) == [288, 288, 224, 224]
    # The moves cancel, so renormalisation leaves them intact.
    assert planner.plan([256] * 4, _times([1.0, 1.0, 0.5, 0.25]), 1024) == [288, 288, 224, 224]


@given(
    st.lists(st.tuples(st.integers(64, 960), st.floats(0.01, 100.0)), min_size=2, max_size=8),
    st.integers(1, 32),
)
def test_additive_planner_step_direction_follows_update_share(pairs: list[tuple[int, float]], step: int) -> None:
    current = [size for size, _ in pairs]
    speeds = [speed for _, speed in pairs]
    adjusted = AdditivePlanner(step=step, min_batch=32, max_batch=1024).adjust(current, _times(speeds))
    update_rates = [speed / size for size, speed in pairs]
    mean_rate = sum(update_rates) / len(update_rates)
    for before, after, rate in zip(current, adjusted, update_rates, strict=True):
        if math.isclose(rate, mean_rate, rel_tol=1e-9):
            assert after == before
        else:
            assert after - before == (step if rate > mean_rate else -step)


def test_additive_planner_balanced_replicas_keep_their_sizes() -> None:
    planner = AdditivePlanner(step=32, min_batch=32, max_batch=1024)
    assert planner.plan([400, 200, 100], _times([4.0, 2.0, 1.0]), 700) == [400, 200, 100]


def test_additive_planner_clamps_to_bounds_and_renormalises() -> None:
    planner = AdditivePlanner(step=32, min_batch=32, max_batch=1024)
    assert planner.adjust([1024, 40], _times([10.0, 0.1])) == [1024, 32]
    sizes = planner.plan([700, 300, 24 + 32], _times([4.0, 1.0, 1.0]), 1056)
    assert sum(sizes) == 1056
    assert all(32 <= size <= 1024 for size in sizes)


def test_additive_planner_converges_to_equal_step_times() -> None:
    # Speeds in samples/s with a constant per-sample time, so a replica's step lasts size / speed.
    speeds = [1.0, 1.0, 0.5, 0.25]
    total = 4096
    planner = AdditivePlanner(step=16, min_batch=32, max_batch=4096)
    sizes = [total // 4] * 4

    def step_time_spread(plan: list[int]) -> float:
        times = [size / speed for size, speed in zip(plan, speeds, strict=True)]
        return max(times) / min(times) - 1

    assert step_time_spread(sizes) > 1.0
    spreads = []
    for _ in range(100):
        sizes = planner.plan(sizes, _times(speeds), total)
        assert sum(sizes) == total
        spreads.append(step_time_spread(sizes))
    assert max(spreads[-50:]) <= 0.10


def test_static_planner_ignores_speeds() -> None:
    planner = StaticPlanner()
    assert planner.plan([1, 1, 1, 1], _times([9.0, 1.0, 1.0, 1.0]), 1024) == [256] * 4
    assert planner.plan([1, 1, 1, 1], _times([1.0, 1.0, 1.0, 9.0]), 1024) == [256] * 4
    weighted = StaticPlanner(shares=[3.0, 1.0])
    assert weighted.plan([1, 1], _times([1.0, 100.0]), 1000) == [750, 250]


def test_get_planner_builds_registered_planners() -> None:
    assert get_planner("proportional", min_batch=4) == ProportionalPlanner(min_batch=4)
    assert get_planner("additive", step=8) == AdditivePlanner(step=8)
    assert get_planner("static") == StaticPlanner()
    assert get_planner("balanced", max_batch=9) == BalancedPlanner(max_batch=9)
    with pytest.raises(ValueError, match="valid names: additive, balanced, proportional, static"):
        get_planner("fastest")


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ProportionalPlanner(min_batch=0), "`min_batch` must be >= 1"),
        (lambda: ProportionalPlanner(min_batch=8, max_batch=4), "`max_batch` must be >= `min_batch`"),
        (lambda: AdditivePlanner(step=0), "`step` must be >= 1"),
        (lambda: AdditivePlanner(min_batch=64, max_batch=32), "`max_batch` must be >= `min_batch`"),
        (lambda: StaticPlanner(shares=[1.0, 0.0]), "must all be > 0"),
        (lambda: StaticPlanner(shares=[]), "empty"),
        (lambda: StaticPlanner(shares=[1.0, math.inf]), "finite and non-negative"),
    ],
)
def test_planners_reject_invalid_arguments(build: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ProportionalPlanner().plan([1, 1], _times([1.0]), 10), "one entry per replica"),
        (lambda: AdditivePlanner().plan([64, 64], _times([1.0, 1.0, 1.0]), 128), "one entry per replica"),
        (lambda: AdditivePlanner().adjust([64, 0], _times([1.0, 1.0])), "`current` batch sizes must be >= 1"),
        (lambda: StaticPlanner(shares=[1.0, 1.0]).plan([1, 1, 1], _times([1.0, 1.0, 1.0]), 9), "one entry per replica"),
        (lambda: ProportionalPlanner().plan([1, 1], _times([0.0, 0.0]), 10), "all zero"),
        (lambda: ProportionalPlanner(min_batch=8).plan([1, 1], _times([1.0, 1.0]), 10), "lower the minimum batch size"),
    ],
)
def test_planners_reject_inconsistent_plan_inputs(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


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
    if not unclamped:
        return
    slack = max(step_times[i].per_sample for i in range(len(sizes)))
    common = max(times[i] for i in unclamped)
    equal_times = all(times[i] >= common - 2 * slack for i in unclamped) and all(
        times[i] >= common - 2 * slack for i in range(len(sizes)) if sizes[i] == 1
    )
    # Or a replica's fixed cost alone sets the step time: nobody else takes longer, and batches are as equal as
    # that allows (a batch below the largest only where two more samples would outlast that time).
    slowest_at_minimum = max(t.seconds(1) for t in step_times)
    largest = max(sizes)
    level = max(times) <= slowest_at_minimum + 2 * slack and all(
        sizes[i] >= largest - 1 or step_times[i].seconds(sizes[i] + 2) > slowest_at_minimum for i in unclamped
    )
    assert equal_times or level


def test_balanced_keeps_batches_equal_where_a_fixed_cost_sets_the_step_time() -> None:
    # Digits on 4 emulated replicas (experiment=digits): steps of a few ms of work and 30-80 ms of fixed cost,
    # one replica slower at its smallest batch than the others at any. Before, all work went to the fastest.
    times = [StepTime(0.030, 2e-5), StepTime(0.045, 2e-5), StepTime(0.040, 4e-5), StepTime(0.080, 8e-5)]
    assert BalancedPlanner(min_batch=4).plan([32] * 4, times, 128) == [42, 41, 41, 4]


def test_balanced_equals_proportional_without_fixed_costs() -> None:
    speeds = [4.0, 2.0, 1.0, 1.0]
    assert BalancedPlanner().plan([256] * 4, _times(speeds), 1024) == ProportionalPlanner().plan(
        [256] * 4, _times(speeds), 1024
    )


def test_balanced_gives_the_rest_to_the_replicas_that_can_use_it() -> None:
    # Replica 1's fixed cost (0.1 s) exceeds what replica 0 needs for the whole step at 10 µs per sample.
    sizes = BalancedPlanner(min_batch=8).plan([512, 512], [StepTime(0.0, 1e-5), StepTime(0.1, 4e-5)], 1024)
    assert sizes == [1016, 8]
    # A smaller fixed cost leaves room: both finish together, near 0.003 + 4e-5·b₁ = 1e-5·b₀.
    sizes = BalancedPlanner().plan([512, 512], [StepTime(0.0, 1e-5), StepTime(0.003, 4e-5)], 1024)
    assert sizes[1] == pytest.approx((1024e-5 - 0.003) / 5e-5, abs=1)


@given(
    lows=st.lists(st.integers(1, 30), min_size=2, max_size=6),
    per_sample=st.lists(st.floats(1e-4, 1e-2), min_size=6, max_size=6),
    overhead=st.lists(st.floats(0.0, 0.05), min_size=6, max_size=6),
)
def test_balanced_and_admitted_replicas_keep_each_replicas_own_bounds(lows, per_sample, overhead) -> None:
    n = len(lows)
    times = [StepTime(a, c) for a, c in zip(overhead[:n], per_sample[:n], strict=False)]
    highs = [low + 100 for low in lows]
    total = sum(lows) + 50 * n
    sizes = BalancedPlanner(min_batch=lows, max_batch=highs).plan([1] * n, times, total)
    assert sum(sizes) == total
    assert all(low <= size <= high for size, low, high in zip(sizes, lows, highs, strict=True))
    assert any(admitted_replicas(total, times, lows, highs))


@given(
    fast=st.integers(2, 4),
    slow=st.integers(2, 5),
    factor=st.floats(50.0, 100.0),  # at the floor, slower than the fast replicas' whole step
    overhead=st.floats(0.0, 0.01),
)
def test_equally_slow_stragglers_leave_together(fast: int, slow: int, factor: float, overhead: float) -> None:
    """Leaving out one of several equal stragglers shortens nothing while the others hold the step: the rule must
    look past that plateau (it once stopped there, and kept them all at the floor for good)."""
    times = [StepTime(overhead, 1e-4)] * fast + [StepTime(overhead * factor, 1e-4 * factor)] * slow
    total = 64 * (fast + slow)
    assert admitted_replicas(total, times, min_size=8) == [True] * fast + [False] * slow


@given(
    per_sample=st.lists(st.floats(1e-5, 1e-2), min_size=2, max_size=6),
    overhead=st.lists(st.floats(0.0, 0.05), min_size=6, max_size=6),
    margin=st.floats(0.0, 0.5),
)
def test_the_admitted_replicas_never_lengthen_the_step_and_gain_more_than_the_margin(
    per_sample: list[float], overhead: list[float], margin: float
) -> None:
    times = [StepTime(a, c) for a, c in zip(overhead, per_sample, strict=False)]
    total, low = 64 * len(times), 4
    chosen = admitted_replicas(total, times, min_size=low, margin=margin)
    kept = [time for time, admitted in zip(times, chosen, strict=True) if admitted]
    everyone = balanced_step_time(total, times, [low] * len(times), [None] * len(times))
    with_kept = balanced_step_time(total, kept, [low] * len(kept), [None] * len(kept))
    assert kept
    if len(kept) < len(times):
        assert with_kept < (1 - margin) * everyone
    slowest_kept = max(time.seconds(low) for time in kept)
    assert all(time.seconds(low) >= slowest_kept for time, admitted in zip(times, chosen, strict=True) if not admitted)


def test_a_replica_whose_own_floor_outlasts_the_step_is_left_out_and_its_cap_kept() -> None:
    times = [StepTime(0.0, 1.0), StepTime(0.0, 1.0), StepTime(0.0, 1.0)]
    assert admitted_replicas(96, times, min_size=[1, 1, 80]) == [True, True, False]
    assert admitted_replicas(96, times, min_size=[1, 1, 80], max_size=[40, 40, None]) == [True, True, True]
    additive = AdditivePlanner(step=8, min_batch=[8, 8, 40], max_batch=[64, 64, 64])
    assert additive.plan([32, 32, 32], times, 96) == [28, 28, 40]


def _admitted_by_every_k(total, times, lows, highs, margin):
    """The rule as stated: T_k for every k of slowest replicas left out, the shortest by more than the margin."""
    slowest_first = sorted(range(len(times)), key=lambda i: -times[i].seconds(lows[i]))

    def step_time(ranks):
        return balanced_step_time(total, [times[i] for i in ranks], [lows[i] for i in ranks], [highs[i] for i in ranks])

    best, best_time = 0, step_time(slowest_first)
    for left_out in range(1, len(times)):
        rest = slowest_first[left_out:]
        if None not in [highs[i] for i in rest] and sum(highs[i] for i in rest) < total:
            break
        if (time := step_time(rest)) < (1 - margin) * best_time:
            best, best_time = left_out, time
    return [i in set(slowest_first[best:]) for i in range(len(times))]


@given(
    fleet=st.lists(
        st.tuples(st.floats(0.0, 0.05), st.floats(1e-5, 1e-2), st.integers(1, 16), st.sampled_from([1, 2, 50])),
        min_size=1,
        max_size=12,
    ),
    per_replica=st.integers(0, 64),
    margin=st.sampled_from([0.0, 0.1, 0.3]),
    capped=st.booleans(),
)
def test_admission_stops_early_only_where_no_more_left_out_could_win(fleet, per_replica, margin, capped) -> None:
    """It stops once the rest's slowest replica no longer holds the step at its floor and one sample of the plans'
    rounding could not carry a larger k past the margin (without the stop, planning 64 replicas cost 64 balanced
    plans): the same choice as trying every k, at any margin and batch."""
    times = [StepTime(overhead * slowness, per_sample * slowness) for overhead, per_sample, _, slowness in fleet]
    lows = [low for _, _, low, _ in fleet]
    total = sum(lows) + per_replica * len(fleet)
    highs = [low + 2 * per_replica for low in lows] if capped else [None] * len(fleet)
    expected = _admitted_by_every_k(total, times, lows, highs, margin)
    assert admitted_replicas(total, times, lows, highs, margin) == expected


@st.composite
def water_problems(draw: st.DrawFn) -> tuple[float, list[tuple[float, float]], list[float], list[float]]:
    """Lines ``(α, β)`` with bounds, and a total the bounds can reach."""
    n = draw(st.integers(1, 12))
    lines = [(draw(st.floats(-1e3, 1e3)), draw(st.floats(1e-3, 1e3))) for _ in range(n)]
    lows = [draw(st.integers(0, 50)) for _ in range(n)]
    highs = [low + draw(st.integers(0, 500)) for low in lows]
    total = draw(st.floats(sum(lows), sum(highs)))
    return total, lines, [float(low) for low in lows], [float(high) for high in highs]


@given(water_problems())
def test_water_level_is_where_the_clamped_sum_first_reaches_the_total(problem) -> None:
    total, lines, lows, highs = problem

    def filled(x: float) -> float:
        return sum(min(max(a + b * x, low), high) for (a, b), low, high in zip(lines, lows, highs, strict=True))

    level = water_level(total, lines, lows, highs)
    scale = max(1.0, abs(level), *(abs(a) / b for a, b in lines))
    assert filled(level) == pytest.approx(total, rel=1e-9, abs=1e-6 * scale)
    first = min((low - a) / b for (a, b), low in zip(lines, lows, strict=True))
    if level > first + 1e-6 * scale:  # the smallest such x: a little less falls short
        assert filled(level - 1e-6 * scale) < total


def test_balanced_plans_hold_where_speeds_differ_by_1e15_or_the_floors_take_everything() -> None:
    # Sums taken as running totals lost a slow replica's slope to a fast one's (found in review): a worse plan, or a
    # division by zero. At a total its floors take whole, every replica sits at its floor, zeros included.
    assert balance_step_times(50, [StepTime(0.0, 1e-16), StepTime(0.0, 1.0)], 0, [10, 100]) == [10, 40]
    fast = StepTime(0.7272772337629, 1.8417238682387558e-17)
    mixed = [StepTime(0.6626413407502934, 0.5097926495396711), fast, StepTime(0.0, 1.4977639153824007)]
    assert balance_step_times(11, mixed, [3, 0, 0], [8, 11, 9]) == [3, 7, 1]
    assert balance_step_times(0, [StepTime(0.3, 1e-3), StepTime(0.0, 1.0)], 0) == [0, 0]


def test_admission_looks_past_a_replica_whose_samples_round_the_step_up() -> None:
    """Hypothesis's case: a replica with no fixed cost but a third of a second per sample holds the balanced step at
    4 of its samples while 4 replicas stay in; leaving it out too shortens the step by less than one of its samples
    but more than the margin against the best so far. The stop once ended the search before it (4 left out)."""
    fleet = [
        (0.027941511672329906, 0.0016414605135759975, 3, 50),
        (0.01704576264038508, 0.0032785567940183907, 10, 50),
        (0.044752219977099716, 0.0021250991642553048, 10, 2),
        (0.0, 0.008014757913462435, 4, 1),
        (0.03603991469646139, 0.006120500949714203, 5, 50),
        (0.01704576264038508, 0.0032785567940183907, 10, 50),
        (0.015716780223246987, 0.009925151198845229, 10, 1),
        (0.044752219977099716, 0.0021250991642553048, 10, 2),
        (0.008949593720634565, 0.007061365785514746, 1, 50),
        (2.6984541093435733e-108, 0.006664218007691755, 1, 50),
        (0.03603991469646139, 0.006120500949714203, 5, 50),
        (0.00808465085868251, 0.0038419270597306364, 3, 50),
    ]
    times = [StepTime(overhead * slowness, per_sample * slowness) for overhead, per_sample, _, slowness in fleet]
    lows = [low for _, _, low, _ in fleet]
    admitted = admitted_replicas(sum(lows) + 59 * len(fleet), times, lows, None, margin=0.3)
    assert admitted == [False, False, True, True, False, False, True, True, False, False, False, False]


def test_water_level_is_the_first_breakpoint_where_the_lows_already_reach_the_total() -> None:
    # Replica 0 is pinned at 5 (low = high), replica 1 sits at its low of 8 until x = 8: the sum is 13 from x = 5 on.
    assert water_level(13, [(0.0, 1.0), (0.0, 1.0)], [5, 8], [5, 20]) == 5.0


def test_proportional_planner_rates_each_replica_at_its_current_batch() -> None:
    # With a fixed cost the speed depends on the batch: 300 / (1 + 3) = 75 and 100 / 1 = 100 samples per second.
    times = [StepTime(1.0, 0.01), StepTime(0.0, 0.01)]
    assert ProportionalPlanner().plan([300, 100], times, 700) == [300, 400]
    # A replica at 0 (back from being left out) is rated at one sample: equal speeds, equal halves.
    assert ProportionalPlanner().plan([0, 100], _times([1.0, 1.0]), 100) == [50, 50]


def test_water_level_is_the_first_x_where_the_bounds_whole_sum_is_reached() -> None:
    # Replica 1 is pinned at 8 (low = high): the sum reaches 5 + 8 = 13, the highs' sum, at x = 5, not at its
    # last breakpoint x = 8.
    assert water_level(13, [(0.0, 1.0), (0.0, 1.0)], [0, 8], [5, 8]) == 5.0


def test_balanced_step_time_counts_a_floor_of_one_sample_by_default() -> None:
    # Replica 1's fixed cost alone outlasts the step: at the default floor it still takes one sample, 1000 + 1.
    assert balanced_step_time(100, [StepTime(0.0, 1.0), StepTime(1000.0, 1.0)]) == 1001.0


def test_admission_by_default_holds_each_replica_to_one_sample_and_a_ten_percent_margin() -> None:
    # At a floor of one sample the slow replica's step lasts 1000 s: leaving it out shortens the step to 10 s.
    assert admitted_replicas(10, [StepTime(0.0, 1.0), StepTime(0.0, 1000.0)]) == [True, False]
    # Leaving out a replica whose floor lasts 107 + 1 s shortens the step to 100 s: 7.4%, under the default 10%.
    times = [StepTime(0.0, 1.0), StepTime(107.0, 1.0)]
    assert admitted_replicas(100, times) == [True, True]
    assert admitted_replicas(100, times, margin=0.05) == [True, False]


def test_admission_leaves_out_a_replica_when_the_others_caps_hold_the_step_exactly() -> None:
    times = [StepTime(0.0, 1.0), StepTime(0.0, 1.0), StepTime(0.0, 1000.0)]
    assert admitted_replicas(80, times, max_size=[40, 40, None]) == [True, True, False]


def test_admission_keeps_a_replica_whose_leaving_shortens_nothing_at_zero_margin() -> None:
    # At a floor of 0 the slow replica's share rounds to 0: the step lasts 10 s with it and without it.
    times = [StepTime(0.0, 1.0), StepTime(1.0, 1000.0)]
    assert admitted_replicas(10, times, min_size=0, margin=0.0) == [True, True]


def test_additive_planner_defaults_and_its_smallest_batches() -> None:
    planner = AdditivePlanner()  # step 32 within [32, 1024]
    assert planner.adjust([256, 256], _times([1.0, 3.0])) == [224, 288]
    assert planner.adjust([40, 1000], _times([0.1, 10.0])) == [32, 1024]
    # A batch of one sample is a valid current size; no largest batch means no clamp from above.
    assert AdditivePlanner(min_batch=1).adjust([1, 1], _times([1.0, 1.0])) == [1, 1]
    assert AdditivePlanner(max_batch=None).adjust([1000, 1000], _times([1.0, 3.0])) == [968, 1032]


def test_planner_bounds_keep_lists_as_tuples_and_allow_a_fixed_batch() -> None:
    planner = BalancedPlanner(min_batch=[1, 2], max_batch=[8, None])
    assert (planner.min_batch, planner.max_batch) == ((1, 2), (8, None))
    assert hash(planner) == hash(BalancedPlanner(min_batch=(1, 2), max_batch=(8, None)))
    assert ProportionalPlanner(min_batch=8, max_batch=8).plan([8, 8], _times([1.0, 3.0]), 16) == [8, 8]
    with pytest.raises(ValueError, match="`min_batch` and `max_batch` hold values for \\[2, 3\\] replicas"):
        ProportionalPlanner(min_batch=[1, 1], max_batch=[4, 4, 4])
