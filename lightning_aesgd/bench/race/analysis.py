"""From raw run records to the benchmark's figures: throughput, efficiency, time to target, ratios to DDP.

All times are training-clock seconds (see :mod:`lightning_aesgd.bench.race.recorder`) of emulated devices, so only
ratios measured in one benchmark run mean anything.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_aesgd.bench.race.recorder import RunRecord, Validation
from lightning_aesgd.bench.race.suites import Target
from lightning_aesgd.emulation.profiles import SlowdownProfile

BASELINE = "ddp"
"""The algorithm every other one is compared with under the same profile."""


@dataclass
class RunFigures:
    """The figures of one run (``None`` where a figure does not exist, e.g. a target never reached)."""

    profile: str
    algorithm: str
    repeat: int
    seconds: float = math.nan
    samples: int = 0
    throughput: float = math.nan
    throughput_after_first_step: float = math.nan
    step_seconds: float = math.nan
    ideal_throughput: float = math.nan
    efficiency: float = math.nan
    time_to_target: float | None = None
    final_metric: float | None = None
    record: str | None = None
    error: str | None = None


@dataclass
class AggregateFigures:
    """Medians over the repeats of one (profile, algorithm), and their ratios to DDP's medians."""

    profile: str
    algorithm: str
    repeats: int
    throughput: float
    throughput_after_first_step: float
    """The median over repeats of :func:`throughput_after_first_step`."""
    step_seconds: float
    """The median over repeats of each run's median step time (the per-step overhead, where steps are short)."""
    efficiency: float
    time_to_target: float | None
    final_metric: float | None
    throughput_vs_ddp: float | None = None
    time_to_target_vs_ddp: float | None = None
    throughput_vs_ddp_range: tuple[float, float] | None = None
    """The lowest and highest throughput ÷ DDP's of the same repeat: a claim beyond the spread lies outside it."""
    after_first_step_vs_ddp: float | None = None
    """The throughput after the first step ÷ DDP's: the device's warm-up left out (the plans' settling stays in)."""


def ideal_throughput(solo: float, profile: SlowdownProfile | None, num_replicas: int, samples: Sequence[int]) -> float:
    """The throughput of replicas that never wait: the sum of their solo speeds, over the run's steps.

    With solo speed v (one replica, no emulation) and replica i at factor b·fᵢ(s) in step s, the replicas
    together process R(s) = Σᵢ v / (b·fᵢ(s)) samples per second. Over steps of Mₛ samples the ideal is

        ideal = Σₛ Mₛ / Σₛ (Mₛ / R(s))

    which is simply R when the factors never change. Without a profile, R = n·v.
    """
    if profile is None:
        return num_replicas * solo
    rates = [sum(solo / profile.factor(i, step) for i in range(num_replicas)) for step in range(len(samples))]
    seconds = sum(m / rate for m, rate in zip(samples, rates, strict=True))
    return sum(samples) / seconds if seconds > 0 else math.nan


def time_to_target(validations: Sequence[Validation], target: Target) -> float | None:
    """Training-clock time of the first validation that meets ``target``; ``None`` if none does."""
    for validation in validations:
        value = validation.metrics.get(target.metric)
        if value is not None and target.reached(value):
            return validation.clock
    return None


def median_step_seconds(clock: Sequence[float]) -> float:
    """The median time between consecutive steps' ends on the training clock; NaN for fewer than two steps.

    The first step (its time includes the device's warm-up) and the odd stall (a collection, a slow batch) do not
    move it, so where steps last milliseconds it reads a strategy's per-step cost more finely than throughput.
    The steps are rank zero's: entrants compare only where each step holds the same samples on it (one replica).

    Example:
        >>> median_step_seconds([0.5, 0.625, 0.75, 1.25])
        0.125
    """
    return statistics.median(b - a for a, b in itertools.pairwise(clock)) if len(clock) >= 2 else math.nan


def throughput_after_first_step(clock: Sequence[float], samples: Sequence[int]) -> float:
    """Samples of every step but the first over the training clock from the first step's end; NaN for one step.

    The first step holds the device's warm-up (on a GPU, 1.3-2.1 s of CUDA's lazy start in every entrant of a
    race of replicas sharing one H100, where later steps take 10-50 ms), a cost that does not grow with the run:
    over a short race it pulls every entrant's throughput towards the same figure, and their ratio towards 1.

    Example:
        >>> throughput_after_first_step([2.0, 2.5, 3.0], [100, 100, 100])
        200.0
    """
    if len(clock) < 2 or not clock[-1] > clock[0]:
        return math.nan
    return sum(samples[1:]) / (clock[-1] - clock[0])


def final_metric(validations: Sequence[Validation], metric: str) -> float | None:
    """``metric`` at the last validation that logged it."""
    values = [v.metrics[metric] for v in validations if metric in v.metrics]
    return values[-1] if values else None


def run_figures(
    record: RunRecord, figures: RunFigures, solo: float, profile: SlowdownProfile | None, target: Target
) -> RunFigures:
    """Fill ``figures`` from ``record``: throughput = samples / training-clock seconds, efficiency = it / ideal."""
    figures.seconds = record.seconds
    figures.samples = record.total_samples
    figures.throughput = record.total_samples / record.seconds if record.seconds > 0 else math.nan
    figures.throughput_after_first_step = throughput_after_first_step(record.clock, record.samples)
    figures.step_seconds = median_step_seconds(record.clock)
    figures.ideal_throughput = ideal_throughput(solo, profile, record.world_size, record.samples)
    figures.efficiency = figures.throughput / figures.ideal_throughput
    figures.time_to_target = time_to_target(record.validations, target)
    figures.final_metric = final_metric(record.validations, target.metric)
    return figures


def aggregate(runs: Sequence[RunFigures]) -> list[AggregateFigures]:
    """Medians over repeats per (profile, algorithm), in first-seen order, with ratios to DDP's medians.

    A target missed in a repeat counts as an infinite time, so the median time exists only when most repeats
    reached the target. Failed runs are left out.
    """
    groups: dict[tuple[str, str], list[RunFigures]] = {}
    for run in runs:
        if run.error is None:
            groups.setdefault((run.profile, run.algorithm), []).append(run)
    result = [_medians(profile, algorithm, group) for (profile, algorithm), group in groups.items()]
    baselines = {row.profile: row for row in result if row.algorithm == BASELINE}
    for row in result:
        baseline = baselines.get(row.profile)
        if baseline is not None:
            row.throughput_vs_ddp = _ratio(row.throughput, baseline.throughput)
            row.after_first_step_vs_ddp = _ratio(row.throughput_after_first_step, baseline.throughput_after_first_step)
            row.time_to_target_vs_ddp = _ratio(row.time_to_target, baseline.time_to_target)
            row.throughput_vs_ddp_range = _repeat_range(
                groups[(row.profile, row.algorithm)], groups[(row.profile, BASELINE)]
            )
    return result


def _repeat_range(group: Sequence[RunFigures], baseline: Sequence[RunFigures]) -> tuple[float, float] | None:
    """The lowest and highest throughput ratio of a repeat to DDP's repeat of the same index (run beside it)."""
    reference = {run.repeat: run.throughput for run in baseline}
    ratios = [_ratio(run.throughput, reference.get(run.repeat)) for run in group]
    known = [ratio for ratio in ratios if ratio is not None]
    return (min(known), max(known)) if known else None


def _medians(profile: str, algorithm: str, group: Sequence[RunFigures]) -> AggregateFigures:
    times = [math.inf if run.time_to_target is None else run.time_to_target for run in group]
    finals = [run.final_metric for run in group if run.final_metric is not None]
    median_time = statistics.median(times)
    return AggregateFigures(
        profile=profile,
        algorithm=algorithm,
        repeats=len(group),
        throughput=statistics.median(run.throughput for run in group),
        throughput_after_first_step=_finite_median([run.throughput_after_first_step for run in group]),
        step_seconds=_finite_median([run.step_seconds for run in group]),
        efficiency=statistics.median(run.efficiency for run in group),
        time_to_target=median_time if math.isfinite(median_time) else None,
        final_metric=statistics.median(finals) if finals else None,
    )


def _finite_median(values: Sequence[float]) -> float:
    """The median of the finite values (a run of one step has no step time); NaN if there is none."""
    finite = [value for value in values if math.isfinite(value)]
    return statistics.median(finite) if finite else math.nan


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or not reference > 0 or not math.isfinite(value / reference):
        return None
    return value / reference
