"""Merge weights: how much each replica's model counts in the weighted mean of a merge.

Adaptive SGD's "normalized model merging" (Ma, Rusu, Wu, Sim, arXiv 2110.07029) weights replica ``i`` by its
share ``p_i = n_i / Σ_j n_j`` of the batches (model updates) processed since the last merge, and, while the
L2 norm of the merged model keeps its initial trend, nudges the fastest replica's share up and the slowest
one's down by 10 % ("adaptive normalization", authors' code YMA33/HeteroGPU,
``Scheduler/source/GPUGDScheduler.cu``). This module holds those rules as pure functions of plain numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal, get_args

__all__ = [
    "WEIGHT_POLICIES",
    "L2Trend",
    "WeightPolicy",
    "normalize",
    "nudge_extremes",
    "nudge_factor",
    "replica_weight",
]

WeightPolicy = Literal["samples", "updates", "uniform"]
"""What a replica's merge weight counts: samples or updates since the last merge, or nothing (uniform)."""

WEIGHT_POLICIES: tuple[WeightPolicy, ...] = get_args(WeightPolicy)


def replica_weight(policy: WeightPolicy, num_samples: float, num_updates: int) -> float:
    """The un-normalised merge weight of one replica.

    * ``"samples"``: the number of samples processed since the last merge, so that the merged model weighs
      every sample equally (the default of this project).
    * ``"updates"``: the number of local updates (batches) since the last merge; normalised, this is the
      paper's ``p_i = n_i / Σ_j n_j``.
    * ``"uniform"``: 1, plain model averaging (local SGD, EASGD, SMA).

    Args:
        policy: One of :data:`WEIGHT_POLICIES`.
        num_samples: Samples (or cost units) processed since the last merge; non-negative.
        num_updates: Local updates since the last merge; non-negative.

    Returns:
        The weight, before normalisation.

    Raises:
        ValueError: If ``policy`` is unknown or a count is negative.
    """
    if not (math.isfinite(num_samples) and num_samples >= 0):
        raise ValueError(f"`num_samples` must be finite and >= 0, got {num_samples}.")
    if num_updates < 0:
        raise ValueError(f"`num_updates` must be >= 0, got {num_updates}.")
    if policy == "samples":
        return float(num_samples)
    if policy == "updates":
        return float(num_updates)
    if policy == "uniform":
        return 1.0
    raise ValueError(f"Unknown weight policy {policy!r}; choose one of {list(WEIGHT_POLICIES)}.")


def normalize(weights: Sequence[float]) -> list[float]:
    """Scale non-negative weights so that they sum to 1, keeping their order.

    Args:
        weights: One non-negative, finite weight per replica; at least one positive.

    Returns:
        The shares ``w_i / Σ_j w_j``.

    Raises:
        ValueError: If ``weights`` is empty, has a negative or non-finite entry, or sums to zero.
    """
    if not weights:
        raise ValueError("`normalize` needs at least one weight.")
    if not all(math.isfinite(weight) and weight >= 0.0 for weight in weights):
        raise ValueError(f"Weights must be finite and non-negative, got {list(weights)}.")
    total = math.fsum(weights)
    if total <= 0.0:
        raise ValueError(
            f"Weights sum to zero ({list(weights)}): no replica did any work since the last merge. "
            "Merge only after at least one local step, or use the 'uniform' weight policy."
        )
    return [weight / total for weight in weights]


def nudge_extremes(shares: Sequence[float], boost: float = 0.1, renormalize: bool = True) -> list[float]:
    """Adaptive SGD's "adaptive normalization": favour the fastest replica, discount the slowest.

    ::

        p_max ← (1 + boost)·p_max,    p_min ← (1 − boost)·p_min

    as in the authors' code (``boost = 0.1``). Ties go to the first index holding the largest (smallest)
    share. When all shares are equal (a single replica included) there is no fastest or slowest replica,
    and nothing is nudged.

    Departure from the authors' code: the code does not renormalise, so its weights sum to
    ``1 + boost·(p_max − p_min) ≥ 1`` and the merged model is scaled up slightly. We renormalise by
    default, so that the merge stays a weighted *mean*; ``renormalize=False`` reproduces the code.

    Args:
        shares: Non-negative merge shares summing to 1, usually from :func:`normalize`.
        boost: Relative nudge in [0, 1).
        renormalize: Whether to rescale the result to sum to 1.

    Returns:
        The nudged shares, as a new list.

    Raises:
        ValueError: If ``boost`` is outside [0, 1), the shares are empty, negative or non-finite, or they sum
            to zero while ``renormalize`` is set.
    """
    if not 0.0 <= boost < 1.0:
        raise ValueError(f"`boost` must be in [0, 1), got {boost}; the authors' code uses 0.1.")
    nudged = _checked_copy(shares)
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


def _checked_copy(shares: Sequence[float]) -> list[float]:
    if not shares:
        raise ValueError("`nudge_extremes` needs at least one share.")
    if not all(math.isfinite(share) and share >= 0.0 for share in shares):
        raise ValueError(f"Shares must be finite and non-negative, got {list(shares)}.")
    return list(shares)


def _first_argmax(values: Sequence[float]) -> int:
    # max() returns the first of equal maxima, which makes ties deterministic.
    return max(range(len(values)), key=values.__getitem__)


def _first_argmin(values: Sequence[float]) -> int:
    return min(range(len(values)), key=values.__getitem__)


class L2Trend:
    """Whether the L2 norm of the merged model still follows its initial, non-decreasing trend.

    Adaptive SGD applies :func:`nudge_extremes` only while a flag ``l2_flag = +1``; the flag flips to −1 the
    first time the norm's trend reverses and stays there for the rest of training (authors' code,
    ``Algos/source/GPUGD.cu``: ``if (t_flag == -1 && l2_flag == 1) l2_flag = -1;``). The kernel computing the
    trend is missing from the code; here the trend is "non-decreasing", and the first merge whose norm is
    smaller than the previous one deactivates the nudge for good.

    Example:
        >>> trend = L2Trend()
        >>> [trend.update(norm) for norm in (1.0, 2.0, 2.0, 1.5, 3.0)]
        [True, True, True, False, False]
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
