"""Step-time noise and changes of speed: when a plan should stay, and when it must move at once.

Plans are made from smoothed step times, and smoothed noise still moves them: two equal replicas whose 5 ms steps
jitter by 15% get estimates that differ by several percent at any time, and a fixed dead band of 3% then moves
samples back and forth between them. So the dead band is scaled to what each replica's step times actually do
(:class:`StepNoise`, :func:`noise_band`), and a real change of speed, which a wide band and slow smoothing would
follow late, is recognised on its own (:func:`is_level_shift`) so that the estimates restart at the new level.

Noise is read from successive periods at the same planned batch: a change of plan moves the step time by design,
and a change of speed is one large difference among many small ones, which the median ignores. A moving spread
of the residuals instead counts every miss of a model still catching up with a change as noise, and its band then
blocks the very change it should follow.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

__all__ = ["NOISE_WINDOW", "StepNoise", "is_level_shift", "noise_band"]

NOISE_WINDOW = 32
"""Successive differences each replica's noise is read from."""

_MEDIAN_ABS_NORMAL = 0.6744897501960817
"""``median |x|`` for ``x ~ N(0, 1)``: turns a median absolute deviation into a standard deviation."""


class StepNoise:
    """One replica's relative step-time noise ``σ``: the spread of ``log t`` from period to period.

    From the last :data:`NOISE_WINDOW` successive periods at the same planned batch size,
    ``dₜ = log tₜ − log tₜ₋₁ ~ N(0, 2σ²)`` for white noise, so ``σ = median |dₜ| / (0.6745·√2)``: robust to the
    single large difference a change of speed makes. 0 until two such periods were seen.
    """

    def __init__(self, window: int = NOISE_WINDOW) -> None:
        self._differences: deque[float] = deque(maxlen=window)
        self._previous: tuple[float, float] | None = None  # (planned size, log seconds) of the latest period
        self._relative = 0.0  # σ of the differences held: read at every report, changed only by a new difference

    def update(self, size: float, seconds: float) -> None:
        """Account one period's planned batch (per step) and seconds (per step); both positive."""
        logged = math.log(seconds)
        if self._previous is not None and self._previous[0] == size:
            self._differences.append(abs(logged - self._previous[1]))
            self._relative = _sigma(self._differences)
        self._previous = (size, logged)

    @property
    def count(self) -> int:
        """Differences the estimate rests on."""
        return len(self._differences)

    @property
    def relative(self) -> float:
        """``σ``, the relative standard deviation of one period's step time."""
        return self._relative

    def state_dict(self) -> dict[str, object]:
        """The differences and the latest period, for checkpoints."""
        return {"differences": list(self._differences), "previous": self._previous}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what :meth:`state_dict` returned."""
        differences = state.get("differences") or []
        assert isinstance(differences, list)
        self._differences.clear()
        self._differences.extend(float(d) for d in differences)
        self._relative = _sigma(self._differences)
        previous = state.get("previous")
        self._previous = None if previous is None else (float(previous[0]), float(previous[1]))  # type: ignore[index]


def _sigma(differences: Sequence[float]) -> float:
    """``σ = median |dₜ| / (0.6745·√2)``; 0 without differences."""
    if not differences:
        return 0.0
    # statistics.median's own rule, without its checks: every replica's noise is read again at every report.
    ordered, middle = sorted(differences), len(differences) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return median / (_MEDIAN_ABS_NORMAL * math.sqrt(2.0))


def noise_band(noise: Sequence[float], smoothing: float, floor: float, z: float = 2.5, cap: float = 0.25) -> float:
    """The dead band of plans: how far two replicas' smoothed step times may differ by noise alone.

    An exponential moving average with weight ``β`` of the past keeps ``√((1 − β)/(1 + β))`` of a white noise's
    standard deviation; two replicas' estimates differ by ``√2`` times that. The band is ``z`` such standard
    deviations of the noisiest replica, never below ``floor`` (the configured ``plan_dead_band``) nor above
    ``cap`` (a plan that cannot move for 25% of imbalance costs more than the noise it ignores):

        ``band = clamp(z·√2·√((1 − β)/(1 + β))·max σᵢ, floor, max(floor, cap))``

    Example:
        >>> noise_band([0.0, 0.0], smoothing=0.8, floor=0.03)
        0.03
        >>> round(noise_band([0.05, 0.15], smoothing=0.8, floor=0.03), 3)
        0.177
    """
    loudest = max(noise, default=0.0)
    band = z * math.sqrt(2.0 * (1.0 - smoothing) / (1.0 + smoothing)) * loudest
    return min(max(band, floor), max(floor, cap))


def is_level_shift(misses: Sequence[float], noise: float, threshold: float = 0.25, z: float = 4.0) -> bool:
    """Whether a replica's latest periods left its model for a new level: a change of speed, not noise.

    ``misses`` are the latest periods' relative misses ``log(measured / predicted)`` (newest last). A shift is
    two in a row beyond ``max(threshold, z·σ)`` on the same side: one slow step (a page fault, a collection) is
    not a new speed, and noise alone crosses ``4σ`` twice in a row about once in 10⁹ periods.

    Example:
        >>> is_level_shift([1.3, 1.4], noise=0.05)
        True
        >>> is_level_shift([1.3, -0.1], noise=0.05)
        False
    """
    if len(misses) < 2:
        return False
    limit = max(threshold, z * noise)
    last, before = misses[-1], misses[-2]
    return abs(last) > limit and abs(before) > limit and (last > 0) == (before > 0)
