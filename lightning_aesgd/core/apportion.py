"""Plans: how one step's global batch of ``M`` samples is split among replicas of unequal speed.

Replicas run in lockstep (one local update per step each) and ``M`` is constant, so a plan is a list of integer
batch sizes ``b_1..b_n`` with ``Σ b_i = M``. Everything here is deterministic: every rank computes the same plan
from the same all-gathered speeds. Method card: ``docs/methods/adaptive_sgd.md``.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import torch

from lightning_aesgd.core.weights import checked_weights

__all__ = ["apportion", "check_feasible", "ideal_shares", "in_multiples", "per_replica", "share_error", "split_by_cost"]


Low = int | Sequence[int]
"""A smallest size: one for every replica, or one per replica (a GPU's beside a CPU's)."""

High = int | None | Sequence[int | None]
"""A largest size (``None``: no limit): one for every replica, or one per replica."""


def per_replica(bound: Any, num_replicas: int, name: str = "bound") -> list[Any]:
    """A bound for each replica: the one given for all of them, or the list given, one per replica.

    Example:
        >>> per_replica(4, 3), per_replica([1, None], 2)
        ([4, 4, 4], [1, None])
    """
    if bound is None or isinstance(bound, numbers.Real):
        return [bound] * num_replicas
    values = list(bound)
    if len(values) != num_replicas:
        raise ValueError(
            f"`{name}` holds {len(values)} values for {num_replicas} replicas. HINT: give one value for every "
            "replica, or a list of one per replica (Trainer devices × num_nodes, in rank order)."
        )
    return values


def apportion(total: int, shares: Sequence[float], min_size: Low = 1, max_size: High = None) -> list[int]:
    """Split ``total`` into integer sizes proportional to ``shares`` (largest-remainder / Hamilton method).

    Each replica's quota is ``q_i = λ·s_i`` clamped to ``[min_size, max_size]``, with the scale ``λ`` chosen so
    that ``Σ q_i = total`` (water-filling: replicas whose quota crosses a bound are clamped and the remainder is
    redistributed among the others, until stable). Sizes are ``⌊q_i⌋`` plus one for the ``total − Σ⌊q_i⌋``
    largest fractional parts, lower index first on ties. Without binding bounds ``|size_i − total·s_i/Σs| < 1``.
    Zero shares receive ``min_size``, and take leftovers only once every positive share sits at ``max_size``.

    Arithmetic is exact, so that the sum is exactly ``total`` and ties are real ties: every share (a binary float)
    is an integer over one common power of two, and every quota an integer over one common denominator. Exact
    fractions (``fractions.Fraction``) gave the same sizes at 10 to 40 times the cost: 16 ms a plan at 256
    replicas.

    Args:
        total: The number to split, e.g. the global step batch ``M``.
        shares: Non-negative relative weights (speeds, fractions, ...), not all zero.
        min_size: Smallest size any replica may receive, or one per replica.
        max_size: Largest size any replica may receive (``None`` for no limit), or one per replica.

    Returns:
        One size per share, summing exactly to ``total``.

    Raises:
        ValueError: If the shares are invalid or the bounds cannot be met by any split of ``total``.

    Example:
        >>> apportion(10, [2.0, 1.0, 1.0])
        [5, 3, 2]
        >>> apportion(100, [10.0, 1.0, 1.0], min_size=20)
        [60, 20, 20]
        >>> apportion(100, [10.0, 1.0, 1.0], max_size=[50, None, None])
        [50, 25, 25]
    """
    weights, total = _integer_weights(checked_weights(shares)), whole(total, "total")
    lows, highs = check_feasible(total, len(weights), min_size, max_size)
    return _largest_remainder(*_bounded_quotas(total, weights, lows, highs))


def in_multiples(sizes: Sequence[int], multiple: int, max_size: High = None) -> list[int]:
    """Round a plan to multiples of ``multiple`` with the same total; 0 stays 0, and nothing else becomes 0.

    A replica of ``k`` learners splits its batch equally among them, so its batch must be a multiple of ``k``.
    Each size is rounded down, ``⌊b_i/k⌋·k`` (at least ``k`` for a replica that takes part). The blocks of
    ``k`` left over go one each to the largest remainders (lower index on ties), skipping sizes at
    ``max_size``; any still left go to the other replicas taking part, in the same order, where they have room.
    Blocks taken too many (sizes raised to ``k``) come back from the largest sizes.

    Args:
        sizes: the plan, summing to a multiple of ``multiple``.
        multiple: the block every size is made of (learners per replica).
        max_size: the largest size (``None``: no limit), or one per replica.

    Raises:
        ValueError: if the total is not a multiple of ``multiple``, or the blocks do not fit the bounds.

    Example:
        >>> in_multiples([5, 7, 4], 4), in_multiples([7, 1], 2)
        ([4, 8, 4], [6, 2])
        >>> in_multiples([5, 5, 5, 5, 4], 4, max_size=[5, 5, 5, 5, None])  # the capped remainders: the last takes it
        [4, 4, 4, 4, 8]
    """
    total = sum(sizes)
    if multiple < 1 or total % multiple:
        raise ValueError(f"A plan of {total} samples cannot be cut into blocks of {multiple}.")
    highs = per_replica(max_size, len(sizes), "max_batch")
    rounded = [0 if size == 0 else max(multiple, size - size % multiple) for size in sizes]
    left = (total - sum(rounded)) // multiple
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(sizes[i] % multiple), i))

    def has_room(i: int) -> bool:
        return highs[i] is None or rounded[i] + multiple <= highs[i]

    for i in by_remainder:
        if left > 0 and sizes[i] % multiple and has_room(i):
            rounded[i] += multiple
            left -= 1
    while left > 0:  # the sizes with remainders are at max_size: the other replicas taking part take the rest
        takers = [i for i in by_remainder if sizes[i] > 0 and has_room(i)][:left]
        if not takers:
            break
        for i in takers:
            rounded[i] += multiple
        left -= len(takers)
    while left < 0:
        largest = max(range(len(rounded)), key=lambda i: (rounded[i], -i))
        if rounded[largest] <= multiple:
            break
        rounded[largest] -= multiple
        left += 1
    if left:
        raise ValueError(
            f"A plan of {total} samples cannot give each of {sum(s > 0 for s in sizes)} replicas a multiple of "
            f"{multiple} within max_batch={max_size}."
        )
    return rounded


def split_by_cost(costs: Sequence[float] | torch.Tensor, shares: Sequence[float], min_size: Low = 1) -> list[int]:
    """Cut one step's ordered items into consecutive slices whose costs follow ``shares``.

    With per-item costs ``c_k`` (e.g. non-zeros of sparse rows) and prefix sums ``C_k = Σ_{j<k} c_j``, the
    ``i``-th cut targets ``B_i = C_N · Σ_{j≤i} s_j / Σ s`` and lands on the item boundary ``k`` with
    ``C_k`` nearest to ``B_i`` (the lower one on ties). Each slice's cost is then within one item's cost of
    its share ``C_N · s_i / Σ s``, so replicas finish the step at the same time when time follows cost
    (a sparse row costs what its non-zeros cost). Cuts are then pushed, first forward
    and then backward, so that every slice ``i`` holds at least ``min_size_i`` items; where the step holds fewer
    than ``Σ min_size_i`` items (a short final step), at least ``min(min_size_i, N // n)`` instead of failing.
    With zero total cost the counts fall back to :func:`apportion`.

    Args:
        costs: Non-negative, finite cost of each item, in the order the items are consumed.
        shares: Non-negative relative weights of the replicas, not all zero.
        min_size: Smallest number of items per slice, or one per slice.

    Returns:
        Counts ``c_1..c_n`` with ``Σ c_i = len(costs)``; replica ``i`` takes the next ``c_i`` items.

    Raises:
        ValueError: If costs or shares are invalid or ``min_size`` is negative.

    Example:
        >>> split_by_cost([1.0, 1.0, 1.0, 1.0, 4.0], [1.0, 1.0])
        [4, 1]
    """
    weights = checked_weights(shares)
    smallest = [int(low) for low in per_replica(min_size, len(weights), "min_size")]
    if min(smallest) < 0:
        raise ValueError(f"`min_size` must be >= 0, got {min_size}")
    prefix = _cost_prefix_sums(costs)
    num_items = prefix.numel() - 1
    if sum(smallest) > num_items:
        smallest = [min(low, num_items // len(weights)) for low in smallest]
    if prefix[-1].item() == 0.0:
        return apportion(num_items, weights, min_size=smallest)
    cuts = _spread_cuts(_nearest_cuts(prefix, weights), num_items, smallest)
    return [end - begin for begin, end in zip([0, *cuts], [*cuts, num_items], strict=True)]


def ideal_shares(speeds: Sequence[float]) -> list[float]:
    """Speed-proportional shares ``speed_i / Σ speed``: the split that balances step times.

    Example:
        >>> ideal_shares([3.0, 1.0])
        [0.75, 0.25]
    """
    checked = checked_weights(speeds)
    total_speed = math.fsum(checked)
    return [speed / total_speed for speed in checked]


def share_error(sizes: Sequence[int], speeds: Sequence[float]) -> float:
    """Largest relative deviation of a plan from the ideal: ``max_i |b_i/Σb − ideal_i| / ideal_i``.

    Raises:
        ValueError: If lengths differ, a speed is not positive (relative error undefined) or ``Σ sizes = 0``.

    Example:
        >>> share_error([75, 25], [1.0, 1.0])
        0.5
    """
    _check_same_length(sizes, speeds)
    ideal = ideal_shares(speeds)
    if min(ideal) <= 0.0:
        raise ValueError(f"`speeds` must all be > 0 for a relative error, got {list(speeds)}")
    total = sum(sizes)
    if total <= 0 or min(sizes) < 0:
        raise ValueError(f"`sizes` must be >= 0 with a positive sum, got {list(sizes)}")
    return max(abs(size / total - share) / share for size, share in zip(sizes, ideal, strict=True))


def check_feasible(total: int, num_replicas: int, min_size: Low, max_size: High) -> tuple[list[int], list[int | None]]:
    """Raise unless sizes within the bounds can sum to ``total``; return the bounds, one per replica, as ints.

    Bounds become plain ``int`` (numpy's integers too): the exact arithmetic of :func:`apportion` multiplies them by
    integers far beyond 64 bits, where a fixed-width integer would wrap around.
    """
    lows = [whole(low, "min_size") for low in per_replica(min_size, num_replicas, "min_size")]
    highs = [
        None if high is None else whole(high, "max_size") for high in per_replica(max_size, num_replicas, "max_size")
    ]
    if total < 0:
        raise ValueError(f"`total` must be >= 0, got {total}")
    for low, high in zip(lows, highs, strict=True):
        if low < 0 or (high is not None and high < low):
            raise ValueError(f"need 0 <= min_size <= max_size, got min_size={min_size}, max_size={max_size}")
    if sum(lows) > total:
        raise ValueError(
            f"{num_replicas} replicas × minimum size {min_size} exceeds the total {total}: "
            "lower the minimum batch size or raise the global batch size"
        )
    if None not in highs and sum(high for high in highs if high is not None) < total:
        raise ValueError(
            f"{num_replicas} replicas × maximum size {max_size} is less than the total {total}: "
            "raise the maximum batch size or lower the global batch size"
        )
    return lows, highs


def whole(value: Any, name: str) -> int:
    """``value`` as a plain ``int``, or a ``TypeError`` naming the fix: sizes and their bounds count samples.

    Example:
        >>> whole(7, "total")
        7
    """
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"`{name}` counts samples: it must be a whole number, got {value!r}. HINT: pass an int."
        ) from None


def _integer_weights(shares: Sequence[float]) -> list[int]:
    """The shares exactly, as integers in the same proportions: each float ``p/2ᵏ`` over the largest ``2ᵏ``.

    Example:
        >>> _integer_weights([0.5, 0.25, 3.0])
        [2, 1, 12]
    """
    ratios = [share.as_integer_ratio() for share in shares]
    denominator = max(q for _, q in ratios)  # every q is a power of two: the largest is a multiple of each
    return [p * (denominator // q) for p, q in ratios]


def _bounded_quotas(
    total: int, weights: Sequence[int], lows: Sequence[int], highs: Sequence[int | None]
) -> tuple[list[int], int]:
    """Water-fill: quotas ``clamp(λ·w_i, low_i, high_i)`` summing to ``total``, found by fixing clamped replicas.

    Returns the quotas as numerators over one common denominator. A replica fixed at a bound has an integer quota;
    the free ones share what the bounds leave, ``remaining·w_i / W`` with ``W`` the sum of their weights, so one
    round's ``W`` is the denominator of every quota and every comparison is between integers.
    """
    fixed: dict[int, int] = {}  # replica -> the bound it is held at
    free = list(range(len(weights)))
    while free:
        free_weights = [weights[i] for i in free]
        if sum(free_weights) == 0:
            # Only zero shares are left and every positive share is at `high`: they split the rest evenly.
            free_weights = [1] * len(free)
        remaining, scale = total - sum(fixed.values()), sum(free_weights)
        # Replica i's tentative quota is tentative[i] / scale; a clamped one moves to its bound.
        tentative = {i: remaining * weight for i, weight in zip(free, free_weights, strict=True)}
        clamped: dict[int, int] = {}
        for i, numerator in tentative.items():
            high = highs[i]
            if numerator < lows[i] * scale:
                clamped[i] = lows[i]
            elif high is not None and numerator > high * scale:
                clamped[i] = high
        surplus = sum(bound * scale - tentative[i] for i, bound in clamped.items())  # times `scale`
        newly_fixed = {
            i: bound for i, bound in clamped.items() if _stays_clamped(bound * scale > tentative[i], surplus)
        }
        if not newly_fixed:
            numerators = [fixed.get(i, 0) * scale for i in range(len(weights))]
            for i, numerator in tentative.items():
                numerators[i] = numerator
            return numerators, scale
        fixed.update(newly_fixed)
        free = [i for i in free if i not in newly_fixed]
    return [fixed[i] for i in range(len(weights))], 1


def _stays_clamped(raised: bool, surplus: int) -> bool:
    """Whether a clamped quota keeps its bound at the true scale ``λ*`` (``raised``: clamped up to its low).

    Raising quotas to ``low`` overshoots (``surplus > 0``): ``λ*`` is below the trial scale, so replicas under
    ``low`` stay there while those over ``high`` may come back within bounds; a deficit is the mirror image;
    with no surplus the trial scale is ``λ*`` and every clamp holds. Each round fixes at least one replica.
    """
    return surplus == 0 or (surplus > 0) == raised


def _largest_remainder(numerators: Sequence[int], denominator: int) -> list[int]:
    """Sizes ``⌊q_i⌋`` plus one for the largest remainders, lower index first on ties; ``q_i = n_i / denominator``."""
    sizes = [numerator // denominator for numerator in numerators]
    leftover = sum(numerators) // denominator - sum(sizes)
    by_remainder = sorted(range(len(numerators)), key=lambda i: (-(numerators[i] % denominator), i))
    for i in by_remainder[:leftover]:
        sizes[i] += 1
    return sizes


def _cost_prefix_sums(costs: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """``C_0 = 0, C_k = Σ_{j<k} c_j`` in float64 on the CPU, after checking that costs are usable."""
    cost = torch.as_tensor(costs).detach().to(device="cpu", dtype=torch.float64)
    if cost.dim() != 1:
        raise ValueError(f"`costs` must be one-dimensional, got shape {tuple(cost.shape)}")
    if not bool(torch.isfinite(cost).all()) or bool((cost < 0).any()):
        raise ValueError("`costs` must be finite and non-negative")
    return torch.cat([cost.new_zeros(1), torch.cumsum(cost, dim=0)])


def _nearest_cuts(prefix: torch.Tensor, weights: list[float]) -> list[int]:
    """Item boundaries whose prefix cost is nearest the cumulative share targets ``B_1..B_{n−1}``."""
    cumulative_share = torch.cumsum(torch.tensor(weights, dtype=torch.float64), dim=0)
    targets = prefix[-1] * cumulative_share[:-1] / cumulative_share[-1]
    above = torch.searchsorted(prefix, targets).clamp(max=prefix.numel() - 1)
    below = (above - 1).clamp(min=0)
    prefer_below = targets - prefix[below] <= prefix[above] - targets
    cuts: list[int] = torch.where(prefer_below, below, above).tolist()
    return cuts


def _spread_cuts(cuts: list[int], num_items: int, min_sizes: list[int]) -> list[int]:
    """Push cuts so that slice ``i`` has ``min_sizes[i]`` items; needs ``num_items >= sum(min_sizes)``.

    Slice ``i`` runs from cut ``i − 1`` (0 for the first) to cut ``i`` (``num_items`` for the last).
    """
    spread = list(cuts)
    for i in range(len(spread)):
        spread[i] = max(spread[i], (spread[i - 1] if i else 0) + min_sizes[i])
    for i in reversed(range(len(spread))):
        spread[i] = min(spread[i], (spread[i + 1] if i + 1 < len(spread) else num_items) - min_sizes[i + 1])
    return spread


def _check_same_length(first: Sequence[Any], second: Sequence[Any]) -> None:
    if len(first) != len(second):
        raise ValueError(f"need one entry per replica in both sequences, got lengths {len(first)} and {len(second)}")
