"""Sensing speed from arrivals: what each replica costs the others, and plans that follow it without running away.

A replica's busy time (forward, backward, optimizer step) misses slowness that lands elsewhere: data loading,
the user's hooks, CPU quotas and throttling that stall a process anywhere. What the other replicas feel is when
a replica *arrives* at the merge. So each replica reports, per merge period, its **active time**

    aᵢ = (arrival at this merge) − (release from the previous merge),

the wall time in which it did everything a step involves (data, hooks, compute, whatever slowed it), and not the
time it spent waiting for peers inside the merge. Where DataLoader workers prepare batches in parallel, their
production time ``ℓᵢ`` per period is reported too, and the period costs ``max(aᵢ, ℓᵢ)``. Every replica sends its
report inside the merge's own all-reduce (:class:`PeriodReport`, one row per replica), so every rank plans from
the same numbers without a collective of its own.

From the reports every rank fits the same per-replica step-time model ``tᵢ(b) = cᵢ·(kᵢ + b)`` to
``(planned batch, max(aᵢ, ℓᵢ) / steps)`` (:class:`ArrivalModel`) and asks the planner for a target; the plan
then moves part of the way (:func:`damped_plan`):

    b′ᵢ = bᵢ + γ·(targetᵢ − bᵢ), rounded to sum to M, unchanged while max |targetᵢ − bᵢ| / bᵢ < δ,

within ``[max(min_batch, ⌈φ·M/n⌉), max_batch]`` (:func:`batch_floor`), so that noise does not make plans
oscillate and no replica is starved to a useless batch. A replica that keeps arriving late has a larger ``aᵢ``
per sample, so its share falls until arrivals even out: the loop closes on the waiting the others see.
Method card: ``docs/methods/adaptive_sgd.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from lightning_aesgd.core.apportion import High, Low, apportion
from lightning_aesgd.core.noise import StepNoise, is_level_shift
from lightning_aesgd.core.speed import SpeedEstimator, StepTime, StepTimeEstimator

__all__ = ["ArrivalModel", "PeriodReport", "batch_floor", "check_plan_damping", "damped_plan"]


@dataclass(frozen=True)
class PeriodReport:
    """What one replica reports at a sync point about its period: the whole steps it completed since its last report.

    Attributes:
        merge_weight: the replica's merge weight for this merge.
        work: samples (or cost units) processed in the period.
        planned: planned batch sizes summed over the period's steps.
        steps: local steps the report measures; 0 when it measures nothing (no whole step since the last report,
            or idle steps beside working ones).
        active: wall seconds of the period's steps, each from its beginning to the next step's, less the time
            blocked on peers.
        loader: seconds the replica's data loader spent producing the period's batches (in its worker
            processes, where it has them).
        busy: seconds inside the optimizer step (forward, backward, update), for telemetry.
        wait_fraction: share of the period's wall time spent blocked on peers.
        stop: 1 when the replica was asked to stop (SIGTERM): every replica stops after this merge.
        finite: 0 when the replica's model was not finite at this merge: it is left out and restored.
        center_norm: the L2 norm of the merged model after the previous merge, as this replica computed it, for
            adaptive normalization (every replica reads rank zero's, so all decide alike); −1 when not tracked.
        first_step: the plans' key of the period's first step (−1 before any), so that a replica's speed model
            restarts on the first measured report that holds only steps after a change.
    """

    merge_weight: float
    work: float = 0.0
    planned: float = 0.0
    steps: float = 0.0
    active: float = 0.0
    loader: float = 0.0
    busy: float = 0.0
    wait_fraction: float = 0.0
    stop: float = 0.0
    finite: float = 1.0
    center_norm: float = -1.0
    first_step: float = -1.0

    @classmethod
    def size(cls) -> int:
        """Numbers per report row."""
        return _REPORT_SIZE

    @classmethod
    def field_index(cls, name: str) -> int:
        """Where field ``name`` sits in a row.

        Example:
            >>> PeriodReport.field_index("merge_weight"), PeriodReport.field_index("center_norm")
            (0, 10)
        """
        return _REPORT_FIELDS.index(name)

    def as_row(self) -> list[float]:
        """The report as a row of floats, in field order."""
        return [float(getattr(self, name)) for name in _REPORT_FIELDS]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> PeriodReport:
        """Read a row written by :meth:`as_row`."""
        if len(row) != _REPORT_SIZE:
            raise ValueError(f"A report row has {_REPORT_SIZE} numbers, got {len(row)}.")
        return cls(*row)

    @property
    def seconds(self) -> float:
        """What the period cost the replica: its active time, or its loader's time where that is longer.

        Loader workers prepare batches while the replica waits at merges, so a data pipeline slower than the
        replica's share shows in its arrivals only by what the workers failed to hide.
        """
        return max(self.active, self.loader)

    @property
    def measured(self) -> bool:
        """Whether the report holds a usable measurement."""
        return self.steps > 0 and self.active > 0 and self.planned > 0 and math.isfinite(self.active)


_REPORT_FIELDS = tuple(field.name for field in fields(PeriodReport))
_REPORT_SIZE = len(_REPORT_FIELDS)


class ArrivalModel:
    """Every replica's step-time model, speed and noise, fitted from the arrival reports all ranks share.

    Each rank updates its copy from the same reports in the same order, so all copies stay identical. A replica
    whose periods leave its model for a new level (:func:`~lightning_aesgd.core.noise.is_level_shift`: two in a
    row, beyond its noise and beyond what a change of its batch explains) has its estimates restarted there, so
    that a real change of speed is followed within a few periods instead of the smoothing's dozen; :attr:`shifted`
    says which replicas did at the latest update.

    The averages remember steps rather than reports: a report of ``s`` steps keeps the past with ``β^w``,
    ``w = max(1, s / reference_steps)``. Reports under gradient synchronisation come every ``lag + 1`` steps until
    the plan settles, then up to 8× as far apart (:func:`~lightning_aesgd.core.schedule.report_interval`); counted
    as one each, a dozen short reports of the warm-up (slow first steps) outweighed the long ones that followed for
    a hundred steps, the models lagged the replicas' real step times, and equal-looking stale models held the
    plan. Reports shorter than the reference (a fit's first) count as one: that keeps ``β`` per report where
    reports are frequent. :attr:`smoothing_now` is the smoothing the latest reports were averaged with, ``β^w``.

    Args:
        num_replicas: replicas reporting.
        smoothing: weight β of the past in the moving averages, per report of up to ``reference_steps`` steps.
        reference_steps: steps a report of weight 1 spans: the plan loop sets ``lag + 1`` under gradient
            synchronisation and the merge period under model merging; by default every report weighs 1.
    """

    def __init__(self, num_replicas: int, smoothing: float = 0.8, reference_steps: float = math.inf) -> None:
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got {num_replicas}")
        if not reference_steps > 0:
            raise ValueError(f"`reference_steps` must be > 0, got {reference_steps}")
        self.smoothing = smoothing
        self.reference_steps = reference_steps
        self.smoothing_now = smoothing
        self.step_time = [StepTimeEstimator(smoothing) for _ in range(num_replicas)]
        self.speed = [SpeedEstimator(smoothing) for _ in range(num_replicas)]
        self.step_noise = [StepNoise() for _ in range(num_replicas)]
        # Each replica's model as it was before its latest period, that model's batch b̄, and the period's miss.
        self._before: list[tuple[StepTime, float, float] | None] = [None] * num_replicas
        self._stale: set[int] = set()  # replicas whose next measurement restarts their estimates
        self.shifted = [False] * num_replicas
        self._models: list[StepTime] | None = None  # models() since the latest update; [] while one is missing

    @property
    def num_replicas(self) -> int:
        """Replicas modelled."""
        return len(self.step_time)

    def update(self, reports: Sequence[PeriodReport]) -> None:
        """Account one merge's reports (one per replica, in rank order); unmeasured reports are skipped."""
        if len(reports) != self.num_replicas:
            raise ValueError(f"need one report per replica ({self.num_replicas}), got {len(reports)}")
        self._models = None
        weights = []
        for rank, report in enumerate(reports):
            self.shifted[rank] = False
            if report.measured:
                # Per step, as reports may span several steps: the mean seconds are then a step's, not a period's.
                per_step = (report.planned / report.steps, report.work / report.steps, report.seconds / report.steps)
                weights.append(max(1.0, report.steps / self.reference_steps))
                self._account(rank, *per_step, weight=weights[-1])
        if weights:
            self.smoothing_now = self.smoothing ** max(weights)

    def _account(self, rank: int, size: float, work: float, seconds: float, weight: float) -> None:
        step_time, speed, noise = self.step_time[rank], self.speed[rank], self.step_noise[rank]
        model, before = step_time.model(), self._before[rank]
        if before is not None:
            # This period and the previous one, both against the model from before the previous one: that one's
            # slowness, averaged into the model since, would hide part of this one's (nearly half, for the long
            # reports of a settled plan), and a second miss that small passes for noise.
            reference, reference_size, previous_miss = before
            miss = _unexplained_miss(reference, size, seconds, reference_size)
            self.shifted[rank] = is_level_shift([previous_miss, miss], noise.relative)
        if model is not None:
            self._before[rank] = (
                model,
                step_time.mean_size,
                _unexplained_miss(model, size, seconds, step_time.mean_size),
            )
        if self.shifted[rank] or rank in self._stale:
            self._stale.discard(rank)
            step_time.restart(size, seconds, weight)
            speed.restart(work, seconds, weight)
            self._before[rank] = None
        else:
            step_time.update(size, seconds, weight)
            speed.update(work, seconds, weight)
        noise.update(size, seconds)

    def restarts_pending(self) -> set[int]:
        """The replicas whose next measured period restarts their estimates (probed, not measured yet)."""
        return set(self._stale)

    def restart_next(self, rank: int) -> None:
        """Start replica ``rank``'s estimates afresh at its next measured period (it was idle: they are stale)."""
        self._stale.add(rank)

    def models(self) -> list[StepTime] | None:
        """Every replica's fitted step-time model, or ``None`` until every replica has been measured."""
        if self._models is None:  # read several times a report (the plan, its checks, the report cadence)
            fitted = [estimator.model() for estimator in self.step_time]
            self._models = [] if any(model is None for model in fitted) else [m for m in fitted if m is not None]
        return list(self._models) if self._models else None

    def rates(self) -> list[float]:
        """Every replica's smoothed work per active second (0 where not measured yet)."""
        return [speed.rate or 0.0 for speed in self.speed]

    def step_seconds(self) -> list[float]:
        """Every replica's smoothed active seconds per step (0 where not measured yet)."""
        return [speed.mean_seconds or 0.0 for speed in self.speed]

    def noise_known(self, periods: int) -> bool:
        """Whether every replica's noise rests on at least ``periods`` comparable periods."""
        return all(noise.count >= periods for noise in self.step_noise)

    def noise(self) -> list[float]:
        """Every replica's relative step-time noise ``σᵢ`` (:class:`~lightning_aesgd.core.noise.StepNoise`)."""
        return [noise.relative for noise in self.step_noise]

    def state_dict(self) -> dict[str, Any]:
        """The estimators' state, for checkpoints."""
        return {
            "step_time": [estimator.state_dict() for estimator in self.step_time],
            "speed": [estimator.state_dict() for estimator in self.speed],
            "noise": [noise.state_dict() for noise in self.step_noise],
            "stale": sorted(self._stale),
            "smoothing_now": self.smoothing_now,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; ignored when it describes another number of replicas."""
        if len(state["step_time"]) != self.num_replicas:
            return
        self._models = None
        for estimator, saved in zip(self.step_time, state["step_time"], strict=True):
            estimator.load_state_dict(saved)
        for speed, saved in zip(self.speed, state["speed"], strict=True):
            speed.load_state_dict(saved)
        for noise, saved in zip(self.step_noise, state.get("noise") or [], strict=False):
            noise.load_state_dict(saved)
        self._stale = {int(rank) for rank in state.get("stale") or []}
        self.smoothing_now = float(state.get("smoothing_now", self.smoothing))


def _unexplained_miss(model: StepTime, size: float, seconds: float, model_size: float) -> float:
    """The part of a period's miss ``m = log(t / t̂(b))`` that no fixed cost could explain, signed as ``m``.

    The model reproduces the recent average step, of ``b̄ = model_size`` samples. For any true fixed cost ``a ≥ 0``,
    ``t(b)/t(b̄)`` lies between ``b/b̄`` and 1, and so does the model's own ratio: however wrong its fixed cost, its
    prediction for a new batch misses by at most ``|log(b/b̄)|``. Only the rest is a change of speed. Plans that move
    the batch at every report (a change of speed damped over several plans) then cannot hide a change larger than
    their moves, as they did when only periods at an unchanged batch were compared.
    """
    miss = math.log(seconds / model.seconds(size))
    allowance = abs(math.log(size / model_size))
    return math.copysign(max(abs(miss) - allowance, 0.0), miss)


def check_plan_damping(min_share: float, gain: float, dead_band: float) -> None:
    """Raise, naming the fix, unless ``0 ≤ min_share ≤ 1``, ``0 < gain ≤ 1`` and ``0 ≤ dead_band < 1``."""
    if not 0.0 <= min_share <= 1.0:
        raise ValueError(
            f"`min_share` is a fraction of the equal share M/n, got {min_share}. HINT: pass a value in [0, 1] "
            "(0.1 by default)."
        )
    if not 0.0 < gain <= 1.0:
        raise ValueError(
            f"`plan_gain` is the fraction of the way each plan moves, got {gain}. HINT: pass a value in (0, 1] "
            "(0.5 by default; 1 jumps to the planner's target)."
        )
    if not 0.0 <= dead_band < 1.0:
        raise ValueError(
            f"`plan_dead_band` is a relative tolerance, got {dead_band}. HINT: pass a value in [0, 1) (0.03 by "
            "default)."
        )


def batch_floor(total: int, num_replicas: int, min_batch: int = 1, min_share: float = 0.0) -> int:
    """The smallest batch any replica gets: ``max(min_batch, ⌈φ·M/n⌉)`` with ``φ = min_share``.

    Example:
        >>> batch_floor(256, 4, min_batch=1, min_share=0.1)
        7
    """
    if not 0.0 <= min_share <= 1.0:
        raise ValueError(f"`min_share` must be in [0, 1] (a fraction of the equal share), got {min_share}")
    return max(min_batch, math.ceil(min_share * total / num_replicas - 1e-9))


def damped_plan(
    current: Sequence[int],
    target: Sequence[int],
    gain: float = 0.5,
    dead_band: float = 0.03,
    min_size: Low = 1,
    max_size: High = None,
) -> list[int]:
    """Move the plan part of the way to ``target``: ``b′ = b + γ·(target − b)``, rounded to the same total.

    The plan stays as it is while every replica's relative move ``|targetᵢ − bᵢ| / bᵢ`` is below ``dead_band``.

    Example:
        >>> damped_plan([64, 64, 64, 64], [93, 93, 47, 23])
        [79, 79, 55, 43]
        >>> damped_plan([93, 93, 47, 23], [94, 92, 47, 23])
        [93, 93, 47, 23]
    """
    if len(current) != len(target) or sum(current) != sum(target):
        raise ValueError(f"plans must match in length and total, got {list(current)} and {list(target)}")
    if not 0.0 < gain <= 1.0:
        raise ValueError(f"`gain` must be in (0, 1], got {gain}")
    if all(abs(goal - size) <= dead_band * max(size, 1) for size, goal in zip(current, target, strict=True)):
        return list(current)
    moved = [size + gain * (goal - size) for size, goal in zip(current, target, strict=True)]
    return apportion(sum(current), moved, min_size, max_size)
