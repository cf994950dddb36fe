"""Merge weights: how much each replica's model counts in the weighted mean of a merge.

A replica weighs by the samples or the updates it processed since the last merge, or uniformly; Adaptive SGD's
adaptive normalization then nudges the largest weight up and the smallest down while the merged model's L2
norm keeps its initial trend. Pure functions of plain numbers, and the small state objects behind the nudge.
Method card: ``docs/methods/adaptive_sgd.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal, get_args

__all__ = [
    "MERGE_WEIGHTS",
    "AdaptiveNormalization",
    "L2Trend",
    "MergeWeights",
    "check_merge_weights",
    "checked_weights",
    "linear_lr_scale",
    "normalize",
    "nudge_extremes",
    "nudge_factor",
    "replica_weight",
]

MergeWeights = Literal["samples", "updates", "uniform"]
"""What a replica's merge weight counts: samples or updates since the last merge, or nothing (uniform)."""

MERGE_WEIGHTS: tuple[MergeWeights, ...] = get_args(MergeWeights)


def check_merge_weights(name: str) -> None:
    """Raise, naming the choices, unless ``name`` is one of :data:`MERGE_WEIGHTS`."""
    if name not in MERGE_WEIGHTS:
        raise ValueError(f"Unknown merge weights {name!r}. HINT: set merge_weights to one of {list(MERGE_WEIGHTS)}.")


def checked_weights(values: Sequence[float], *, positive_sum: bool = True) -> list[float]:
    """The weights (or shares) as floats, checked: at least one, all finite and non-negative, not all zero.

    The one check behind merge weights, plan shares and weighted means.

    Raises:
        ValueError: naming what is wrong (``positive_sum=False`` accepts weights that are all zero).
    """
    checked = [float(value) for value in values]
    if not checked:
        raise ValueError("Got no weights (an empty list). HINT: pass one weight (or share) per replica.")
    if not all(math.isfinite(value) and value >= 0.0 for value in checked):
        raise ValueError(
            f"Weights must be finite and non-negative, got {checked}. HINT: pass one such number (weight or share) "
            "per replica."
        )
    if positive_sum and math.fsum(checked) <= 0.0:
        raise ValueError(
            f"Weights are all zero ({checked}): no replica did any work since the last merge. "
            "HINT: merge only after at least one local step, or use merge_weights='uniform'."
        )
    return checked


def replica_weight(weights: MergeWeights, num_samples: float, num_updates: int) -> float:
    """The un-normalised merge weight of one replica.

    * ``"samples"``: the number of samples processed since the last merge, so that the merged model weighs
      every sample equally.
    * ``"updates"``: the number of local updates (batches) since the last merge; normalised,
      ``p_i = n_i / Σ_j n_j``.
    * ``"uniform"``: 1, plain model averaging.

    Args:
        weights: One of :data:`MERGE_WEIGHTS`.
        num_samples: Samples (or cost units) processed since the last merge; non-negative.
        num_updates: Local updates since the last merge; non-negative.

    Returns:
        The weight, before normalisation.

    Raises:
        ValueError: If ``weights`` is unknown or a count is negative.
    """
    if not (math.isfinite(num_samples) and num_samples >= 0):
        raise ValueError(f"`num_samples` must be finite and >= 0, got {num_samples}.")
    if num_updates < 0:
        raise ValueError(f"`num_updates` must be >= 0, got {num_updates}.")
    check_merge_weights(weights)
    if weights == "samples":
        return float(num_samples)
    if weights == "updates":
        return float(num_updates)
    return 1.0


def normalize(weights: Sequence[float]) -> list[float]:
    """Scale non-negative weights so that they sum to 1, keeping their order.

    Args:
        weights: One non-negative, finite weight per replica; at least one positive.

    Returns:
        The shares ``w_i / Σ_j w_j``.

    Raises:
        ValueError: If ``weights`` is empty, has a negative or non-finite entry, or sums to zero.
    """
    checked = checked_weights(weights)
    total = math.fsum(checked)
    return [weight / total for weight in checked]


def nudge_extremes(shares: Sequence[float], boost: float = 0.1, renormalize: bool = True) -> list[float]:
    """Adaptive SGD's "adaptive normalization": favour the fastest replica, discount the slowest.

    From Ma, Rusu, Wu, Sim, arXiv:2110.07029, 2021 (method card: ``docs/methods/adaptive_sgd.md``).

    ::

        p_max ← (1 + boost)·p_max,    p_min ← (1 − boost)·p_min

    Ties go to the first index holding the largest (smallest) share. When all shares are equal (a single
    replica included) there is no fastest or slowest replica, and nothing is nudged.

    Args:
        shares: Non-negative merge shares summing to 1, usually from :func:`normalize`.
        boost: Relative nudge in [0, 1).
        renormalize: Whether to rescale the result to sum to 1; without it the shares sum to
            ``1 + boost·(p_max − p_min)``.

    Returns:
        The nudged shares, as a new list.

    Raises:
        ValueError: If ``boost`` is outside [0, 1), the shares are empty, negative or non-finite, or they sum
            to zero while ``renormalize`` is set.
    """
    if not 0.0 <= boost < 1.0:
        raise ValueError(f"`boost` must be in [0, 1), got {boost}; the authors' code uses 0.1.")
    nudged = checked_weights(shares, positive_sum=False)
    largest, smallest = _first_argmax(nudged), _first_argmin(nudged)
    if nudged[largest] != nudged[smallest]:
        nudged[largest] *= 1.0 + boost
        nudged[smallest] *= 1.0 - boost
    return normalize(nudged) if renormalize else nudged


def nudge_factor(weights: Sequence[float], rank: int, boost: float = 0.1) -> float:
    """How much :func:`nudge_extremes` scales replica ``rank``'s weight: ``1 + boost``, ``1 − boost`` or 1.

    A replica that multiplies its own weight by this factor before a weighted mean gets exactly the
    renormalised nudge, because the mean divides by the sum of the scaled weights. The factor is decided from
    weights every replica already holds (those of the previous merge), so no extra collective is needed.

    Example:
        >>> [nudge_factor([3.0, 1.0, 2.0], rank) for rank in range(3)]
        [1.1, 0.9, 1.0]
    """
    nudged = nudge_extremes(weights, boost, renormalize=False)
    return nudged[rank] / weights[rank] if weights[rank] > 0 else 1.0


def _first_argmax(values: Sequence[float]) -> int:
    # max() returns the first of equal maxima, which makes ties deterministic.
    return max(range(len(values)), key=values.__getitem__)


def _first_argmin(values: Sequence[float]) -> int:
    return min(range(len(values)), key=values.__getitem__)


class L2Trend:
    """Whether the L2 norm of the merged model kept its non-decreasing trend over the current window.

    Active at the start of every window, inactive from the first merge of the window whose norm is smaller than
    the previous merge's. The authors' scheduler sets the flag again before every evaluation pass and their
    kernel latches it off within the pass (``GPUGDScheduler.cu``, ``GPUGD.cu``), so the nudge switches on and
    off with the norm's trend, window by window.

    Example:
        >>> trend = L2Trend()
        >>> [trend.update(norm) for norm in (1.0, 2.0, 2.0, 1.5, 3.0)]
        [True, True, True, False, False]
        >>> trend.new_window()
        >>> [trend.update(norm) for norm in (3.5, 4.0)]
        [True, True]
    """

    def __init__(self) -> None:
        self.previous_norm: float | None = None
        self.active = True

    def update(self, norm: float) -> bool:
        """Record the merged model's L2 norm at a merge.

        Args:
            norm: The L2 norm of the merged model; finite and non-negative.

        Returns:
            Whether the nudge is active at this merge.

        Raises:
            ValueError: If ``norm`` is negative or not finite.
        """
        if not (math.isfinite(norm) and norm >= 0.0):
            raise ValueError(f"An L2 norm must be finite and >= 0, got {norm}.")
        if self.previous_norm is not None and norm < self.previous_norm:
            self.active = False
        self.previous_norm = norm
        return self.active

    def new_window(self) -> None:
        """Start a window (the authors' evaluation pass): the trend is judged afresh from here."""
        self.active = True

    def state_dict(self) -> dict[str, float | bool | None]:
        """The tracker's state as plain Python values."""
        return {"previous_norm": self.previous_norm, "active": self.active}

    def load_state_dict(self, state_dict: Mapping[str, float | bool | None]) -> None:
        """Restore the state saved by :meth:`state_dict`.

        Raises:
            ValueError: If a key is missing.
        """
        missing = {"previous_norm", "active"} - set(state_dict)
        if missing:
            raise ValueError(f"L2Trend state is missing {sorted(missing)}; pass what `state_dict()` returned.")
        previous_norm = state_dict["previous_norm"]
        self.previous_norm = None if previous_norm is None else float(previous_norm)
        self.active = bool(state_dict["active"])


class AdaptiveNormalization:
    """Adaptive SGD's adaptive normalization of merge weights (method card: ``docs/methods/adaptive_sgd.md``).

    From Ma, Rusu, Wu, Sim, *Adaptive Elastic Training for Sparse Deep Learning on Heterogeneous Multi-GPU
    Servers*, arXiv:2110.07029, 2021.

    After the warm-up, while the merged model's L2 norm keeps its non-decreasing trend within the current
    window (:class:`L2Trend`; a window ends at every evaluation pass), the replica with the largest weight at
    the previous merge multiplies its weight by ``1 + boost`` and the one with the smallest by ``1 − boost``
    (:func:`nudge_factor`); the weighted mean then renormalises. Every replica decides from the previous
    merge's weights and rank zero's norm, which all hold: no extra collective.

    Args:
        enabled: apply the nudge at all (off: weights pass through unchanged).
        warmup_steps: local steps before the nudge may start.

    Example:
        >>> normalization = AdaptiveNormalization(enabled=True)
        >>> normalization.weight(2.0, rank=0, previous=[3.0, 1.0], local_steps=5)
        2.2
    """

    def __init__(self, enabled: bool = False, warmup_steps: int = 0) -> None:
        self.enabled = enabled
        self.warmup_steps = warmup_steps
        self.trend = L2Trend()

    def weight(self, own: float, rank: int, previous: Sequence[float], local_steps: int) -> float:
        """Replica ``rank``'s merge weight ``own``, nudged when the rule is on, past warm-up and trending."""
        return own * self.factor(rank, previous, local_steps)

    def factor(self, rank: int, previous: Sequence[float], local_steps: int) -> float:
        """What replica ``rank`` multiplies its merge weight by: :func:`nudge_factor` when nudging, else 1.

        Example:
            >>> normalization = AdaptiveNormalization(enabled=True)
            >>> normalization.factor(rank=1, previous=[3.0, 1.0], local_steps=5)
            0.9
        """
        if not (self.enabled and self.trend.active and local_steps > self.warmup_steps and previous):
            return 1.0
        return nudge_factor(previous, rank)

    def observe(self, merged_norm: float) -> None:
        """Record the merged model's L2 norm after a merge; a negative norm means none was measured."""
        if self.enabled and merged_norm >= 0.0:
            self.trend.update(merged_norm)

    def new_window(self) -> None:
        """An evaluation pass begins: judge the trend afresh."""
        self.trend.new_window()

    def state_dict(self) -> dict[str, float | bool | None]:
        """The trend's state (plain values)."""
        return self.trend.state_dict()

    def load_state_dict(self, state: Mapping[str, float | bool | None]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.trend.load_state_dict(state)


def linear_lr_scale(batch_size: float, nominal_batch_size: float) -> float:
    """Per-replica linear learning-rate factor ``b_i / B_ref``, so that ``lr_i = η·b_i/B_ref``.

    A replica taking a larger batch takes a proportionally larger step.

    Raises:
        ValueError: If either size is not positive.

    Example:
        >>> linear_lr_scale(512, 256)
        2.0
    """
    if batch_size <= 0 or nominal_batch_size <= 0:
        raise ValueError(f"batch sizes must be > 0, got batch_size={batch_size}, nominal={nominal_batch_size}")
    return batch_size / nominal_batch_size
