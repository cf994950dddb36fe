"""Planners: how the next plan follows the replicas' measured step times.

Every rank calls the same planner with the same all-gathered :class:`~lightning_aesgd.core.speed.StepTime`
models and gets the same plan. A plan is a list of integer batch sizes, one per replica, summing exactly to the
global step batch ``M``. Method card: ``docs/methods/adaptive_sgd.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_aesgd.core.apportion import High, Low, _check_same_length, apportion, check_feasible, per_replica
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.core.weights import checked_weights

__all__ = [
    "PLANNERS",
    "AdditivePlanner",
    "BalancedPlanner",
    "Planner",
    "ProportionalPlanner",
    "StaticPlanner",
    "admitted_replicas",
    "balance_step_times",
    "balanced_step_time",
    "get_planner",
    "water_level",
]


class Planner(Protocol):
    """A rule that turns the current plan and the replicas' measured step times into the next plan."""

    def plan(self, current: Sequence[int], step_times: Sequence[StepTime], total: int) -> list[int]:
        """Return the next batch sizes, one per replica, summing exactly to ``total``.

        Args:
            current: The batch sizes in use, one per replica.
            step_times: Each replica's measured busy time per step as a function of its batch size.
            total: The global step batch ``M``.
        """
        ...


def speeds_at(current: Sequence[int], step_times: Sequence[StepTime]) -> list[float]:
    """Each replica's samples per second at its current batch size."""
    _check_same_length(current, step_times)
    return [t.speed_at(max(size, 1)) for size, t in zip(current, step_times, strict=True)]


def balance_step_times(
    total: int, step_times: Sequence[StepTime], min_size: Low = 1, max_size: High = None
) -> list[int]:
    """Batch sizes, summing to ``total``, whose predicted step times are as equal as the bounds allow.

    With ``tᵢ(b) = aᵢ + cᵢ·b`` the common step time ``T`` solves ``Σᵢ clamp((T − aᵢ)/cᵢ, min, max) = total``
    (water filling: the left side is piecewise linear in ``T``, solved exactly by :func:`water_level`); the
    real-valued sizes are then
    rounded by :func:`apportion`. Without overheads this is the speed-proportional split; with them, a replica
    whose fixed cost alone exceeds ``T`` gets the minimum, and the others share the rest so that they finish
    together. Where that replica's step at the minimum outlasts ``T``, it sets the step time whatever the plan:
    the others then get batches as equal as they can take without outlasting it (more work on the fastest
    would buy nothing, and split fixed-cost steps, as digits' are, to a single replica).

    Example:
        >>> balance_step_times(100, [StepTime(0.0, 1.0), StepTime(0.0, 3.0)])
        [75, 25]
        >>> balance_step_times(100, [StepTime(0.0, 1.0), StepTime(120.0, 1.0)], min_size=2)
        [98, 2]
        >>> balance_step_times(120, [StepTime(30.0, 0.1), StepTime(45.0, 0.1), StepTime(80.0, 0.1)], min_size=4)
        [58, 58, 4]

    The bounds may differ per replica (``min_size=[1, 8]``): each replica's size stays within its own.
    """
    lows, caps = check_feasible(total, len(step_times), min_size, max_size)
    if sum(lows) == total:
        return lows  # no choice left (all zero at a total of 0, which no share could apportion)
    highs = [total if cap is None else cap for cap in caps]

    def sizes_at(time: float) -> list[float]:
        return [
            min(max((time - t.overhead) / t.per_sample, low), high)
            for t, low, high in zip(step_times, lows, highs, strict=True)
        ]

    step = water_level(total, [(-t.overhead / t.per_sample, 1.0 / t.per_sample) for t in step_times], lows, highs)
    # A replica whose step at the smallest batch already outlasts T sets the step time itself: every replica
    # may then take up to what it does in that time, and more work on the others buys nothing. Of those plans,
    # the one closest to equal batches is kept (what a replica's fixed cost alone cannot change, no plan fixes).
    slowest = max(t.seconds(low) for t, low in zip(step_times, lows, strict=True))
    if slowest <= step:
        return apportion(total, sizes_at(step), lows, caps)
    capacities = sizes_at(slowest)
    level = water_level(total, [(0.0, 1.0)] * len(capacities), lows, capacities)
    levelled = [max(min(level, capacity), low) for capacity, low in zip(capacities, lows, strict=True)]
    return apportion(total, levelled, lows, caps)


def water_level(
    total: float, lines: Sequence[tuple[float, float]], lows: Sequence[float], highs: Sequence[float]
) -> float:
    """The ``x`` at which ``Σᵢ clamp(αᵢ + βᵢ·x, lowᵢ, highᵢ)`` reaches ``total``, for lines ``(αᵢ, βᵢ)``, ``βᵢ > 0``.

    The sum is piecewise linear and non-decreasing in ``x``: replica ``i`` leaves its low at ``(lowᵢ − αᵢ)/βᵢ`` and
    reaches its high at ``(highᵢ − αᵢ)/βᵢ``. A binary search over those 2n breakpoints, summing at each, finds the
    segment where the sum reaches ``total``, and the segment's line is solved: ``O(n log n)``, where bisection on
    ``x`` took 100 passes over every replica (9 ms a plan at 256 replicas). Each sum is taken afresh, never as a
    running total (``math.fsum`` where signs mix), so replicas whose speeds differ by 10¹⁵ lose nothing to
    cancellation, as a running slope lost a slow replica's to a fast one's.
    Where the bounds cannot reach ``total``, the last breakpoint; where the lows already do, the first.

    Example:
        >>> water_level(100, [(0.0, 1.0), (0.0, 3.0)], [1, 1], [100, 100])  # sizes x and 3x: 25 and 75
        25.0
    """
    bounded = list(zip(lines, lows, highs, strict=True))

    def filled(x: float) -> float:
        # Clamped sizes are never negative: a plain sum cancels nothing.
        return sum(min(max(alpha + beta * x, low), high) for (alpha, beta), low, high in bounded)

    points = sorted({(bound - alpha) / beta for (alpha, beta), low, high in bounded for bound in (low, high)})
    if filled(points[0]) >= total:
        return points[0]
    if filled(points[-1]) < total:
        return points[-1]
    short, reached = 0, len(points) - 1  # filled(points[short]) < total <= filled(points[reached])
    while reached - short > 1:
        middle = (short + reached) // 2
        short, reached = (short, middle) if filled(points[middle]) >= total else (middle, reached)
    left, right = points[short], points[reached]
    # No breakpoint lies between left and right: each replica is at a bound, or on its line, all the way across.
    inside = (left + right) / 2
    on_lines = [(alpha, beta) for (alpha, beta), low, high in bounded if low < alpha + beta * inside < high]
    at_bounds = math.fsum(
        low if alpha + beta * inside <= low else high
        for (alpha, beta), low, high in bounded
        if not low < alpha + beta * inside < high
    )
    slope = math.fsum(beta for _, beta in on_lines)
    if slope <= 0:
        return right
    level = (total - at_bounds - math.fsum(alpha for alpha, _ in on_lines)) / slope
    return min(max(level, left), right)


def balanced_step_time(total: int, step_times: Sequence[StepTime], min_size: Low = 1, max_size: High = None) -> float:
    """The predicted step time of :func:`balance_step_times`' plan: its slowest replica's.

    Example:
        >>> balanced_step_time(100, [StepTime(0.0, 1.0), StepTime(0.0, 3.0)])
        75.0
    """
    sizes = balance_step_times(total, step_times, min_size, max_size)
    return max(time.seconds(size) for time, size in zip(step_times, sizes, strict=True))


def admitted_replicas(
    total: int, step_times: Sequence[StepTime], min_size: Low = 1, max_size: High = None, margin: float = 0.1
) -> list[bool]:
    """Which replicas shorten the step: the others get no work (as Adaptive Hogbatch places work by speed).

    Every replica of a synchronous step holds the others at the sync point, so one whose step at the smallest
    batch outlasts what the others need for the whole step batch makes every step slower than leaving it out.
    Replicas are ranked by their step at ``min_size``, slowest first, and the ``k`` slowest are left out for the
    ``k`` whose balanced step time of the rest (:func:`balanced_step_time`), ``T_k``, is the shortest, counting
    only improvements by more than ``margin``: ``k`` moves from ``b`` to a larger ``k`` only if
    ``T_k < (1 − margin)·T_b`` (relative: 10%, so that noise in the models, CPU quotas' above all, does not leave
    out a replica whose help is real but small). Several equally slow replicas thus leave together: leaving out one
    of them alone shortens nothing while the others still hold the step. One replica always stays. The search stops
    where no larger ``k`` can win, with the same choice as trying every ``k``.

    Example:
        >>> admitted_replicas(96, [StepTime(0.0, 1.0), StepTime(0.0, 1.0), StepTime(0.0, 50.0)], min_size=4)
        [True, True, False]
        >>> admitted_replicas(96, [StepTime(0.0, 1.0), StepTime(0.0, 1.0), StepTime(0.0, 2.0)], min_size=4)
        [True, True, True]
        >>> admitted_replicas(128, [StepTime(0.0, 1.0)] * 2 + [StepTime(0.0, 50.0)] * 2, min_size=4)
        [True, True, False, False]
    """
    lows = per_replica(min_size, len(step_times), "min_size")
    highs = per_replica(max_size, len(step_times), "max_size")

    def step_time(ranks: list[int]) -> float:
        models = [step_times[i] for i in ranks]
        return balanced_step_time(total, models, [lows[i] for i in ranks], [highs[i] for i in ranks])

    def can_hold_the_step(ranks: list[int]) -> bool:
        return None in [highs[i] for i in ranks] or sum(highs[i] for i in ranks) >= total

    slowest_first = sorted(range(len(step_times)), key=lambda i: -step_times[i].seconds(lows[i]))
    rounding = _largest_sample_times(step_times, slowest_first)
    best = 0  # replicas left out, slowest first
    best_time = time = step_time(slowest_first)
    for left_out in range(1, len(slowest_first)):
        # A plan's step time lies within one sample of the best real-valued plan's, T*, of the slowest replica
        # planned (the plan rounds each size up by at most one). Once the next replica to leave does not hold the
        # step at its floor, nor does any after it: every replica left takes more than its floor, and leaving out
        # more only takes capacity away, so T* grows from here on. No larger k can then win unless one sample of
        # rounding could carry it past the margin. Without this stop each plan of n replicas cost n balanced plans
        # (64 replicas: about 15 ms a plan).
        previous, lowest_ahead = slowest_first[left_out - 1], time - rounding[left_out - 1]
        if step_times[previous].seconds(lows[previous]) < lowest_ahead and lowest_ahead >= (1 - margin) * best_time:
            break
        rest = slowest_first[left_out:]
        if not can_hold_the_step(rest):
            break
        if (time := step_time(rest)) < (1 - margin) * best_time:
            best, best_time = left_out, time
    chosen = set(slowest_first[best:])
    return [i in chosen for i in range(len(step_times))]


def _largest_sample_times(step_times: Sequence[StepTime], order: Sequence[int]) -> list[float]:
    """For each position in ``order``, the largest time of one sample among the replicas from there on."""
    largest, running = [], 0.0
    for rank in reversed(order):
        running = max(running, step_times[rank].seconds(1) - step_times[rank].seconds(0))
        largest.append(running)
    return largest[::-1]


@dataclass(frozen=True)
class ProportionalPlanner:
    """Batch size proportional to measured speed at the current size: ``b_i = apportion(M, speed_i)``.

    If a replica's per-sample time does not depend on its batch size, ``b_i ∝ speed_i`` makes every replica's
    step last ``b_i / speed_i = M / Σ speed``: balance in one plan. With fixed per-step costs its fixed point is
    still equal step times, reached over several plans; :class:`BalancedPlanner` solves for it directly.

    Args:
        min_batch: Smallest batch per replica (each replica makes one update per step, so at least 1).
        max_batch: Largest batch per replica, e.g. the device's memory limit; ``None`` for no limit.
    """

    min_batch: Low = 1
    max_batch: High = None

    def __post_init__(self) -> None:
        _check_batch_bounds(self)

    def plan(self, current: Sequence[int], step_times: Sequence[StepTime], total: int) -> list[int]:
        """Return ``apportion(total, speeds, min_batch, max_batch)`` with the speeds at the current sizes."""
        return apportion(total, speeds_at(current, step_times), self.min_batch, self.max_batch)


@dataclass(frozen=True)
class BalancedPlanner:
    """Sizes whose predicted step times are equal: :func:`balance_step_times`.

    Every replica finishes its step together, so all make the same number of updates per unit of time; computed
    in one plan from the fitted ``a + c·b`` step-time models, fixed per-step costs included. Without fixed costs
    it is :class:`ProportionalPlanner`.

    Args:
        min_batch: Smallest batch per replica.
        max_batch: Largest batch per replica; ``None`` for no limit.
    """

    min_batch: Low = 1
    max_batch: High = None

    def __post_init__(self) -> None:
        _check_batch_bounds(self)

    def plan(self, current: Sequence[int], step_times: Sequence[StepTime], total: int) -> list[int]:
        """Return the balanced split of ``total``; ``current`` only fixes the replica count."""
        _check_same_length(current, step_times)
        return balance_step_times(total, step_times, self.min_batch, self.max_batch)


@dataclass(frozen=True)
class AdditivePlanner:
    """Adaptive SGD's additive batch-size rule, on the update shares replicas would have running freely.

    From Ma, Rusu, Wu, Sim, arXiv:2110.07029, 2021 (method card: ``docs/methods/adaptive_sgd.md``).

    With ``u_i = speed_i / b_i`` (updates per second) and ``p_i = u_i / Σ u``::

        b_i ← clamp(b_i + step·sign(p_i − 1/n), min_batch, max_batch),   then  apportion(M, b, min_batch, max_batch)

    The fixed point is ``p_i = 1/n``: every replica takes the same time per step.

    Args:
        step: Additive change per plan.
        min_batch: Smallest batch per replica.
        max_batch: Largest batch per replica; ``None`` for no limit.
    """

    step: int = 32
    min_batch: Low = 32
    max_batch: High = 1024

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"`step` must be >= 1, got {self.step}. HINT: the additive rule's step is a batch size.")
        _check_batch_bounds(self)

    def adjust(self, current: Sequence[int], step_times: Sequence[StepTime]) -> list[int]:
        """Apply ``b_i ± step`` by the sign of ``p_i − 1/n``, clamped to the bounds, before renormalisation."""
        if any(size < 1 for size in current):
            raise ValueError(f"`current` batch sizes must be >= 1, got {list(current)}")
        speeds = checked_weights(speeds_at(current, step_times))
        update_rates = [speed / size for speed, size in zip(speeds, current, strict=True)]
        mean_rate = math.fsum(update_rates) / len(update_rates)
        lows = per_replica(self.min_batch, len(current), "min_batch")
        uppers = [math.inf if high is None else high for high in per_replica(self.max_batch, len(current), "max_batch")]
        return [
            int(min(max(size + self.step * _direction(rate, mean_rate), low), upper))
            for size, rate, low, upper in zip(current, update_rates, lows, uppers, strict=True)
        ]

    def plan(self, current: Sequence[int], step_times: Sequence[StepTime], total: int) -> list[int]:
        """Return :meth:`adjust` renormalised to sum exactly to ``total``."""
        return apportion(total, self.adjust(current, step_times), self.min_batch, self.max_batch)


@dataclass(frozen=True)
class StaticPlanner:
    """Fixed shares regardless of speed: ``b_i = apportion(M, shares)``; equal shares mean what DDP means.

    Args:
        shares: Positive relative share per replica; ``None`` for equal shares.
    """

    shares: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if self.shares is not None:
            checked = tuple(checked_weights(self.shares))
            if min(checked) <= 0.0:
                raise ValueError(
                    f"static `shares` must all be > 0, got {list(checked)}. HINT: give every replica a positive share."
                )
            object.__setattr__(self, "shares", checked)

    def plan(self, current: Sequence[int], step_times: Sequence[StepTime], total: int) -> list[int]:
        """Return ``apportion(total, shares)``; the measurements are ignored."""
        _check_same_length(current, step_times)
        shares = self.shares if self.shares is not None else [1.0] * len(current)
        _check_same_length(current, shares)
        return apportion(total, shares)


PLANNERS: dict[str, Callable[..., Planner]] = {
    "additive": AdditivePlanner,
    "balanced": BalancedPlanner,
    "proportional": ProportionalPlanner,
    "static": StaticPlanner,
}


def get_planner(name: str, **kwargs: Any) -> Planner:
    """Build the planner registered as ``name`` (balanced, proportional, additive, static) with ``kwargs``.

    Raises:
        ValueError: If ``name`` is not registered.
    """
    if name not in PLANNERS:
        raise ValueError(
            f"Unknown planner {name!r}; valid names: {', '.join(sorted(PLANNERS))}. HINT: pass one of these names "
            "or a Planner object."
        )
    return PLANNERS[name](**kwargs)


def _check_batch_bounds(planner: Any) -> None:
    """Check a planner's bounds, each one value or one per replica, and keep lists as tuples (it is frozen)."""
    lows, highs = planner.min_batch, planner.max_batch
    lengths = {len(bound) for bound in (lows, highs) if bound is not None and not isinstance(bound, int)}
    if len(lengths) > 1:
        raise ValueError(
            f"`min_batch` and `max_batch` hold values for {sorted(lengths)} replicas. HINT: give one per replica in "
            "both, or one value for all."
        )
    count = lengths.pop() if lengths else 1
    for min_batch, max_batch in zip(per_replica(lows, count), per_replica(highs, count), strict=True):
        if min_batch < 1:
            raise ValueError(
                f"`min_batch` must be >= 1 (every replica makes one update per step), got {min_batch}. HINT: use "
                "min_batch=1 for no lower bound."
            )
        if max_batch is not None and max_batch < min_batch:
            raise ValueError(
                f"`max_batch` must be >= `min_batch` ({min_batch}) or None, got {max_batch}. HINT: raise max_batch, "
                "or set it to None for no upper bound."
            )
    for name in ("min_batch", "max_batch"):
        if isinstance(getattr(planner, name), list):
            object.__setattr__(planner, name, tuple(getattr(planner, name)))


def _direction(rate: float, mean_rate: float) -> int:
    """+1 if a replica would make more than its ``1/n`` share of updates, −1 if fewer, 0 if balanced."""
    # Rates equal up to rounding (e.g. speeds exactly proportional to sizes) count as balanced.
    if math.isclose(rate, mean_rate, rel_tol=1e-9, abs_tol=0.0):
        return 0
    return 1 if rate > mean_rate else -1
