"""Speed of one replica: busy time per step and a smoothed rate of work (samples or cost units) per second.

Adaptive SGD (Ma, Rusu, Wu, Sim, arXiv:2110.07029) routes work in proportion to replica speed. Each replica
times its own busy region (forward, backward, optimizer step; not the wait at collectives) with
:class:`BusyTimer` and smooths the measurements with :class:`SpeedEstimator`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BusyTimer", "SpeedEstimator"]


class SpeedEstimator:
    """Smoothed speed ``rate = mean_work / mean_seconds`` from bias-corrected exponential moving averages.

    Work and busy seconds are averaged separately, like Adam's moments (Kingma & Ba, arXiv:1412.6980):
    ``m_t = β·m_{t−1} + (1 − β)·x_t`` with ``m_0 = 0``, reported as ``m̂_t = m_t / (1 − β^t)``, where
    ``β = smoothing``. The corrected averages are kept directly through the equivalent recurrence
    ``m̂_t = (1 − g_t)·m̂_{t−1} + g_t·x_t`` with gain ``g_t = (1 − β) / (1 − β^t)``. Since ``g_1 = 1`` the first
    average is the first measurement, so constant inputs give exactly ``work / seconds`` from the first update.

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

    @property
    def mean_work(self) -> float | None:
        """Bias-corrected average work per step, or ``None`` before the first update."""
        return self._mean_work if self._num_updates else None

    def update(self, work: float, seconds: float) -> None:
        """Add one step's measurement.

        Args:
            work: Samples (or cost units) processed in the step; finite and ``>= 0``.
            seconds: Busy seconds the step took; finite and ``> 0``.

        Raises:
            ValueError: If either value is out of range.
        """
        if not (math.isfinite(seconds) and seconds > 0.0):
            raise ValueError(f"`seconds` must be finite and > 0, got {seconds}")
        if not (math.isfinite(work) and work >= 0.0):
            raise ValueError(f"`work` must be finite and >= 0, got {work}")
        self._num_updates += 1
        self._mean_work = self._blend(self._mean_work, float(work))
        self._mean_seconds = self._blend(self._mean_seconds, float(seconds))

    def _blend(self, mean: float, value: float) -> float:
        """One step of the corrected average: ``(1 − g_t)·mean + g_t·value``."""
        if value == mean:
            return mean  # exact, where the weighted sum below could be off by an ulp
        beta, t = self.smoothing, self._num_updates
        denominator = 1.0 - beta**t
        # Both weights are computed without subtracting them from 1, and the sum has no negative term, so a
        # value far below the average (one very short step) loses no precision even when β is tiny.
        keep = beta * (1.0 - beta ** (t - 1)) / denominator
        gain = (1.0 - beta) / denominator
        return keep * mean + gain * value

    def state_dict(self) -> dict[str, float | int]:
        """Return the averages and the update count as plain Python numbers (checkpoint-safe)."""
        return {"num_updates": self._num_updates, "mean_work": self._mean_work, "mean_seconds": self._mean_seconds}

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


class BusyTimer:
    """Busy seconds of a code region, one measurement per ``start()``/``stop()`` pair.

    On CPU the region is timed with ``time.perf_counter`` and completes at ``stop()``. On CUDA, kernels run
    asynchronously, so each region records a pair of ``torch.cuda.Event(enable_timing=True)`` on the current
    stream and :meth:`pop_completed` only reads pairs whose end event has already happened (``query()``):
    the speed estimate lags a step or two instead of forcing a device synchronisation every step.

    Args:
        device: The device doing the work; CUDA devices are timed with events.

    Example:
        >>> timer = BusyTimer(torch.device("cpu"))
        >>> timer.start()
        >>> timer.stop()
        >>> len(timer.pop_completed())
        1
    """

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"cannot time {device}: CUDA is not available")
        self.device = device
        self._uses_events = device.type == "cuda"
        self._start_time: float | None = None
        self._start_event: torch.cuda.Event | None = None
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._completed: list[float] = []

    @property
    def is_running(self) -> bool:
        """Whether a region has started and not yet stopped."""
        return self._start_time is not None or self._start_event is not None

    @property
    def num_pending(self) -> int:
        """Regions stopped on CUDA whose end event has not been seen to complete yet."""
        return len(self._pending)

    def start(self) -> None:
        """Mark the beginning of a busy region.

        Raises:
            RuntimeError: If a region is already running.
        """
        if self.is_running:
            raise RuntimeError("BusyTimer.start() called twice: call stop() to end the running region first")
        if self._uses_events:
            self._start_event = self._record_event()
        else:
            self._start_time = time.perf_counter()

    def stop(self) -> None:
        """Mark the end of the running busy region.

        Raises:
            RuntimeError: If no region is running.
        """
        if self._start_event is not None:
            self._pending.append((self._start_event, self._record_event()))
            self._start_event = None
        elif self._start_time is not None:
            self._completed.append(time.perf_counter() - self._start_time)
            self._start_time = None
        else:
            raise RuntimeError("BusyTimer.stop() called without start(): call start() before the region")

    def pop_completed(self) -> list[float]:
        """Return the seconds of regions finished since the last call, oldest first; never synchronises.

        A region can measure ``0.0`` at the clock's resolution (a CUDA region that launched no kernel), which
        :meth:`SpeedEstimator.update` rejects: callers drop such a measurement together with its work.
        """
        # torch leaves Event.query and Event.__new__ unannotated, hence the ignores.
        while self._pending and all(event.query() for event in self._pending[0]):  # type: ignore[no-untyped-call]
            start, end = self._pending.popleft()
            self._completed.append(start.elapsed_time(end) / 1000.0)  # elapsed_time is in milliseconds
        completed, self._completed = self._completed, []
        return completed

    def _record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event


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

    @classmethod
    def from_speed(cls, speed: float) -> StepTime:
        """A replica without fixed cost at ``speed`` samples per second."""
        return cls(0.0, 1.0 / speed)


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
      plain speed-proportional planning. ``a`` is kept within ``[0, 0.95·t̄]``.

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

    def update(self, size: float, seconds: float) -> None:
        """Account one step of ``size`` samples that kept the device busy for ``seconds``."""
        if not (size > 0 and seconds > 0 and math.isfinite(size) and math.isfinite(seconds)):
            raise ValueError(f"need a positive size and duration, got size={size}, seconds={seconds}")
        new = (size, seconds, size * size, size * seconds, seconds * seconds, 1.0)
        beta = self.smoothing
        self._moments = [beta * m + (1 - beta) * x for m, x in zip(self._moments, new, strict=True)]
        self._refit_fixed_cost()

    def model(self) -> StepTime | None:
        """The fitted step-time model, or ``None`` before the first step."""
        if self._moments[5] == 0:
            return None
        size, seconds = self._moments[0] / self._moments[5], self._moments[1] / self._moments[5]
        per_sample = seconds / (self.fixed_samples + size)
        return StepTime(per_sample * self.fixed_samples, per_sample)

    def _refit_fixed_cost(self) -> None:
        size, seconds, size2, size_seconds, seconds2 = (m / self._moments[5] for m in self._moments[:5])
        size_var, seconds_var = size2 - size * size, seconds2 - seconds * seconds
        covariance = size_seconds - size * seconds
        if size_var <= (self.min_spread * size) ** 2 or seconds_var <= 0 or covariance <= 0:
            return
        if covariance * covariance < 0.9 * size_var * seconds_var:  # R² < 0.9
            return
        slope = covariance / size_var
        overhead = min(max(seconds - slope * size, 0.0), 0.95 * seconds)
        self.fixed_samples = overhead / ((seconds - overhead) / size)

    def state_dict(self) -> dict[str, Any]:
        """The moving averages and ``k``, for checkpoints."""
        return {"moments": list(self._moments), "fixed_samples": self.fixed_samples}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._moments = [float(m) for m in state["moments"]]
        self.fixed_samples = float(state["fixed_samples"])
