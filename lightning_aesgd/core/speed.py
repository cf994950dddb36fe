"""Speed of one replica: a smoothed rate of work (samples or cost units) per second, and step-time models.

:class:`SpeedEstimator` smooths work per second; :class:`StepTimeEstimator` fits ``t(b) = c·(k + b)`` to
``(batch size, seconds)`` pairs. Method card: ``docs/methods/adaptive_sgd.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SpeedEstimator", "StepTime", "StepTimeEstimator"]


class SpeedEstimator:
    """Smoothed speed ``rate = mean_work / mean_seconds`` from bias-corrected exponential moving averages.

    Work and busy seconds are averaged separately:
    ``m_t = β·m_{t−1} + (1 − β)·x_t`` with ``m_0 = 0``, reported as ``m̂_t = m_t / (1 − β^t)``, where
    ``β = smoothing``. The corrected averages are kept directly through the equivalent recurrence
    ``m̂_t = (1 − g_t)·m̂_{t−1} + g_t·x_t`` with gain ``g_t = (1 − β) / (1 − β^t)``. Since ``g_1 = 1`` the first
    average is the first measurement, so constant inputs give exactly ``work / seconds`` from the first update.

    A measurement of ``weight`` w (a period worth w updates) keeps the past with ``β^w``; the averages then carry
    their total weight ``W_t = β^w·W_{t−1} + (1 − β^w)``, and ``g_t = (1 − β^w) / W_t`` (``W_t = 1 − β^t`` for
    updates of weight 1).

    The rate is a ratio of averages rather than an average of per-step rates: one unusually short step
    would make a per-step rate huge, but only nudges the mean of the seconds.

    Args:
        smoothing: Weight ``β`` of the past, in ``[0, 1)``; 0 keeps only the latest step.

    Example:
        >>> estimator = SpeedEstimator(smoothing=0.5)
        >>> estimator.update(work=100, seconds=2.0)
        >>> estimator.rate
        50.0
    """

    def __init__(self, smoothing: float = 0.9) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"`smoothing` must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self._num_updates = 0
        self._mean_work = 0.0
        self._mean_seconds = 0.0
        self._total = 0.0  # total weight of the averages: 1 − β^t after t updates of weight 1

    @property
    def num_updates(self) -> int:
        """Number of measurements seen."""
        return self._num_updates

    @property
    def rate(self) -> float | None:
        """Work per busy second, or ``None`` before the first update."""
        if self._num_updates == 0:
            return None
        # The bias corrections of both averages are the same factor, so they cancel here.
        return self._mean_work / self._mean_seconds

    @property
    def mean_seconds(self) -> float | None:
        """Bias-corrected average busy seconds per step, or ``None`` before the first update."""
        # Unlike in `rate`, the bias correction matters here: without it early averages are too small.
        return self._mean_seconds if self._num_updates else None

    def update(self, work: float, seconds: float, weight: float = 1.0) -> None:
        """Add one measurement.

        Args:
            work: Samples (or cost units) processed; finite and ``>= 0``.
            seconds: Busy seconds they took; finite and ``> 0``.
            weight: How many updates' worth the measurement is (a period of several steps), at least 1: the past
                is kept with ``β^weight``.

        Raises:
            ValueError: If a value is out of range.
        """
        if not (math.isfinite(seconds) and seconds > 0.0):
            raise ValueError(f"`seconds` must be finite and > 0, got {seconds}")
        if not (math.isfinite(work) and work >= 0.0):
            raise ValueError(f"`work` must be finite and >= 0, got {work}")
        _check_weight(weight)
        self._num_updates += 1
        past = self.smoothing**weight
        # The total weight of the averages, 1 − β^t for t updates of weight 1: the bias correction.
        total = past * self._total + (1.0 - past)
        keep, gain = past * self._total / total, (1.0 - past) / total
        self._mean_work = self._blend(self._mean_work, float(work), keep, gain)
        self._mean_seconds = self._blend(self._mean_seconds, float(seconds), keep, gain)
        self._total = total

    def restart(self, work: float, seconds: float, weight: float = 1.0) -> None:
        """Forget the past and start again from this measurement (the replica's speed changed)."""
        self._num_updates, self._mean_work, self._mean_seconds, self._total = 0, 0.0, 0.0, 0.0
        self.update(work, seconds, weight)

    @staticmethod
    def _blend(mean: float, value: float, keep: float, gain: float) -> float:
        """One step of the corrected average: ``keep·mean + gain·value`` (``keep + gain = 1``)."""
        if value == mean:
            return mean  # exact, where the weighted sum below could be off by an ulp
        # Both weights are computed without subtracting them from 1, and the sum has no negative term, so a
        # value far below the average (one very short step) loses no precision even when β is tiny.
        return keep * mean + gain * value

    def state_dict(self) -> dict[str, float | int]:
        """Return the averages and the update count as plain Python numbers (checkpoint-safe)."""
        return {
            "num_updates": self._num_updates,
            "mean_work": self._mean_work,
            "mean_seconds": self._mean_seconds,
            "total_weight": self._total,
        }

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        """Restore what :meth:`state_dict` returned; ``smoothing`` stays as constructed.

        Raises:
            ValueError: If a key is missing or a value is out of range.
        """
        missing = {"num_updates", "mean_work", "mean_seconds"} - set(state)
        if missing:
            raise ValueError(f"speed estimator state lacks {sorted(missing)}")
        num_updates, mean_work, mean_seconds = int(state["num_updates"]), state["mean_work"], state["mean_seconds"]
        if num_updates < 0 or not all(math.isfinite(v) and v >= 0.0 for v in (mean_work, mean_seconds)):
            raise ValueError(f"invalid speed estimator state {dict(state)}")
        if num_updates > 0 and mean_seconds <= 0.0:
            raise ValueError(f"speed estimator state has updates but no busy time: {dict(state)}")
        self._num_updates, self._mean_work, self._mean_seconds = num_updates, float(mean_work), float(mean_seconds)
        # Checkpoints from before weighted updates hold only the count, each update of weight 1.
        total = float(state.get("total_weight", 1.0 - self.smoothing**num_updates))
        if not 0.0 <= total <= 1.0 or (num_updates > 0) != (total > 0.0):
            raise ValueError(f"invalid speed estimator state {dict(state)}: its total weight must be in (0, 1]")
        self._total = total


@dataclass(frozen=True)
class StepTime:
    """A replica's busy time per step as a function of its batch size: ``t(b) = overhead + per_sample·b``.

    Real steps have a fixed part (kernel launches, the optimizer's pass over every parameter, framework hooks)
    besides the part that grows with the batch. Plans that ignore it keep shrinking a slow replica's batch:
    a smaller batch looks slower per sample, so it is given even less.

    Attributes:
        overhead: seconds per step whatever the batch size (``a ≥ 0``).
        per_sample: seconds per sample (``c > 0``).
    """

    overhead: float
    per_sample: float

    def seconds(self, size: float) -> float:
        """Predicted busy seconds of a step of ``size`` samples."""
        return self.overhead + self.per_sample * size

    def speed_at(self, size: float) -> float:
        """Samples per second at batch ``size``: ``b / t(b)``."""
        return size / self.seconds(size)


class StepTimeEstimator:
    """Fits :class:`StepTime` to recent ``(batch size, busy seconds)`` pairs.

    The model is ``t(b) = c·(k + b)``: ``k`` is the fixed per-step cost expressed in samples' worth of work. A
    device that slows down or speeds up as a whole (another job lands on it) changes ``c`` but not ``k``, so ``k``
    is learnt rarely and ``c`` all the time:

    * ``c = t̄ / (k + b̄)`` always, from exponential moving averages ``b̄`` and ``t̄`` (weight ``1 − β`` for the
      newest step): the model reproduces the average recent step;
    * ``k = a/c'`` from a weighted least-squares line ``t = a + c'·b`` over the same averages, refitted only while
      the sizes vary (relative spread ``sd(b)/b̄ ≥ min_spread``) and the line explains them (``R² ≥ 0.9``) — not
      while plans have settled, nor while a change of speed mixes two regimes. Until then ``k = 0``, which is
      plain speed-proportional planning. ``a`` is kept within ``[0, 0.95·t̄]``;
    * where the sizes vary but no line explains the times, ``a`` is raised to the least fixed cost the spread of
      the times allows, ``(1 − ρ)·t̄`` with ``ρ = (sd(t)/t̄) / (sd(b)/b̄)``: steps that barely change with the
      batch (tiny batches, launch-bound steps) are fixed-cost steps, and reading them as per-sample work made
      every plan shrink the batches that looked slow until they reached the floor. A change of speed moves the
      times as much as the sizes (``ρ ≥ 1``) and teaches nothing.

    Args:
        smoothing: ``β`` in [0, 1).
        min_spread: relative spread of the batch sizes needed to refit ``k``.
    """

    def __init__(self, smoothing: float = 0.8, min_spread: float = 0.05) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"`smoothing` must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.min_spread = min_spread
        self._moments = [0.0] * 6  # b, t, b², b·t, t², and the total weight (for bias correction)
        self.fixed_samples = 0.0  # k

    def update(self, size: float, seconds: float, weight: float = 1.0) -> None:
        """Account one step of ``size`` samples that kept the device busy for ``seconds``.

        ``weight`` is how many updates' worth the measurement is (a period of several steps), at least 1: the past
        is kept with ``β^weight``.
        """
        if not (size > 0 and seconds > 0 and math.isfinite(size) and math.isfinite(seconds)):
            raise ValueError(f"need a positive size and duration, got size={size}, seconds={seconds}")
        _check_weight(weight)
        new = (size, seconds, size * size, size * seconds, seconds * seconds, 1.0)
        beta = self.smoothing**weight
        self._moments = [beta * m + (1 - beta) * x for m, x in zip(self._moments, new, strict=True)]
        self._refit_fixed_cost()

    def restart(self, size: float, seconds: float, weight: float = 1.0) -> None:
        """Forget the averages and start again from this step, keeping the fixed cost ``k`` (the speed changed).

        A device that slows down as a whole changes ``c``, not ``k``; the averages of the old speed would only
        drag the new model back towards it.
        """
        self._moments = [0.0] * 6
        self.update(size, seconds, weight)

    @property
    def mean_size(self) -> float:
        """The average recent batch ``b̄``, where the model reproduces the average step (0 before the first step)."""
        return self._moments[0] / self._moments[5] if self._moments[5] else 0.0

    def model(self) -> StepTime | None:
        """The fitted step-time model, or ``None`` before the first step."""
        if self._moments[5] == 0:
            return None
        size, seconds = self._moments[0] / self._moments[5], self._moments[1] / self._moments[5]
        per_sample = seconds / (self.fixed_samples + size)
        return StepTime(per_sample * self.fixed_samples, per_sample)

    def _refit_fixed_cost(self) -> None:
        size, seconds, size2, size_seconds, seconds2 = (m / self._moments[5] for m in self._moments[:5])
        size_var, seconds_var = size2 - size * size, max(seconds2 - seconds * seconds, 0.0)
        covariance = size_seconds - size * seconds
        if size_var <= (self.min_spread * size) ** 2:
            return
        if covariance > 0 and covariance * covariance >= 0.9 * size_var * seconds_var:  # the line explains it
            overhead = seconds - covariance / size_var * size
        else:
            # No line explains the steps, yet the sizes varied: the per-sample part can be no larger than the
            # times' spread allows (|slope| ≤ sd(t)/sd(b)), so at least (1 − ρ)·t̄ is fixed, with
            # ρ = (sd(t)/t̄) / (sd(b)/b̄). Steps that hardly change with the batch are fixed-cost steps; taking
            # them as per-sample work makes every plan shrink the batches that look slow, down to the floor.
            # Where the times vary as much as the sizes (a change of speed), ρ ≥ 1 and nothing is learnt.
            ratio = math.sqrt(seconds_var / size_var) * size / seconds
            if ratio >= 1.0 or (1.0 - ratio) * seconds <= self.fixed_samples * seconds / (self.fixed_samples + size):
                return
            overhead = (1.0 - ratio) * seconds
        overhead = min(max(overhead, 0.0), 0.95 * seconds)
        self.fixed_samples = overhead / ((seconds - overhead) / size)

    def state_dict(self) -> dict[str, Any]:
        """The moving averages and ``k``, for checkpoints."""
        return {"moments": list(self._moments), "fixed_samples": self.fixed_samples}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._moments = [float(m) for m in state["moments"]]
        self.fixed_samples = float(state["fixed_samples"])


def _check_weight(weight: float) -> None:
    """Raise unless ``weight`` is finite and at least 1 (below 1, ``β^weight`` may round to 1: no new weight)."""
    if not (math.isfinite(weight) and weight >= 1.0):
        raise ValueError(f"`weight` counts updates: it must be finite and >= 1, got {weight}")
