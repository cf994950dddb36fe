"""From run records to the placement table's figures: medians, spreads, and ratios to the GPU alone.

Every ratio and difference pairs repeat ``r`` of a case with repeat ``r`` of the GPU alone under the same
emulation (runs are interleaved, so a pair shares the machine's state); the table gives their median and, with
several repeats, their range (min–max), against which a claim such as "at least 0.98× the GPU alone" is judged.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lightning_aesgd.bench.placement.cases import Case
from lightning_aesgd.bench.race.analysis import final_metric, time_to_target
from lightning_aesgd.bench.race.recorder import RunRecord
from lightning_aesgd.bench.race.suites import Target


@dataclass
class RunFigures:
    """The figures of one run (``None`` where a figure does not exist, e.g. a target never reached)."""

    algorithm: str
    case: str
    repeat: int
    seconds: float = math.nan
    samples: int = 0
    samples_per_step: float = math.nan
    throughput: float = math.nan
    time_to_target: float | None = None
    final_metric: float | None = None
    test_metric: float | None = None
    record: str | None = None
    error: str | None = None


def run_figures(record: RunRecord, figures: RunFigures, target: Target, test: float | None) -> RunFigures:
    """Fill ``figures`` from ``record`` (samples per training-clock second, time to ``target``) and ``test``.

    The median samples per step is the step batch: ``hogbatch`` and ``adaptive_elastic`` consume the loader's batch
    times the replicas per step unless ``step_batch_size`` is set, so placements with more replicas take larger
    steps (and fewer per epoch), which the table shows beside their throughput.
    """
    figures.seconds = record.seconds
    figures.samples = record.total_samples
    figures.samples_per_step = statistics.median(record.samples) if record.samples else math.nan
    figures.throughput = record.total_samples / record.seconds if record.seconds > 0 else math.nan
    figures.time_to_target = time_to_target(record.validations, target)
    figures.final_metric = final_metric(record.validations, target.metric)
    figures.test_metric = test
    return figures


@dataclass(frozen=True)
class Spread:
    """The median and range of a figure over repeats; ``math.inf`` stands for a target missed."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        """The spread of ``values``, ``None`` without any.

        Example:
            >>> Spread.of([3.0, 1.0, 2.0])
            Spread(median=2.0, low=1.0, high=3.0)
        """
        return cls(statistics.median(values), min(values), max(values)) if values else None


@dataclass
class Row:
    """One case of one algorithm: its medians and spreads, and its ratios and differences to the GPU alone."""

    algorithm: str
    case: Case
    runs: int = 0
    errors: list[str] = field(default_factory=list)
    samples_per_step: Spread | None = None
    throughput: Spread | None = None
    throughput_ratio: Spread | None = None
    time_to_target: Spread | None = None
    time_ratio: Spread | None = None
    final_metric: Spread | None = None
    final_difference: Spread | None = None
    test_metric: Spread | None = None
    test_difference: Spread | None = None


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference`` where both are finite and the reference positive; ``None`` otherwise.

    Example:
        >>> ratio(3.0, 2.0), ratio(3.0, None), ratio(math.inf, 2.0)
        (1.5, None, None)
    """
    if value is None or reference is None or not (math.isfinite(value) and math.isfinite(reference)):
        return None
    return value / reference if reference > 0 else None


def difference(value: float | None, reference: float | None) -> float | None:
    """``value − reference`` where both exist.

    Example:
        >>> round(difference(0.81, 0.8), 6), difference(None, 0.8)
        (0.01, None)
    """
    return None if value is None or reference is None else value - reference


def paired(
    runs: Sequence[RunFigures],
    references: Sequence[RunFigures],
    figure: Callable[[RunFigures], float | None],
    compare: Callable[[float | None, float | None], float | None],
) -> list[float]:
    """``compare`` of ``figure`` over the repeats both lists measured (same repeat index), where it exists."""
    by_repeat = {run.repeat: run for run in references}
    pairs = [(run, by_repeat.get(run.repeat)) for run in runs]
    values = [compare(figure(run), figure(reference)) for run, reference in pairs if reference is not None]
    return [value for value in values if value is not None]


def summarise(algorithm: str, case: Case, runs: Sequence[RunFigures], baseline: Sequence[RunFigures] | None) -> Row:
    """``case``'s row from its runs and the GPU alone's (same algorithm and emulation; ``None``: it did not run)."""
    row = Row(algorithm, case, errors=[run.error for run in runs if run.error is not None])
    done = [run for run in runs if run.error is None]
    row.runs = len(done)
    if not done:
        return row
    row.samples_per_step = Spread.of([run.samples_per_step for run in done])
    row.throughput = Spread.of([run.throughput for run in done])
    row.time_to_target = Spread.of([_time(run) for run in done])
    row.final_metric = Spread.of([run.final_metric for run in done if run.final_metric is not None])
    row.test_metric = Spread.of([run.test_metric for run in done if run.test_metric is not None])
    reference = [run for run in baseline or () if run.error is None]
    if reference:
        row.throughput_ratio = Spread.of(paired(done, reference, lambda run: run.throughput, ratio))
        row.time_ratio = Spread.of(paired(done, reference, lambda run: run.time_to_target, ratio))
        row.final_difference = Spread.of(paired(done, reference, lambda run: run.final_metric, difference))
        row.test_difference = Spread.of(paired(done, reference, lambda run: run.test_metric, difference))
    return row


def _time(run: RunFigures) -> float:
    """The time to target, infinite where missed (so that a median over repeats exists only if most reached it)."""
    return math.inf if run.time_to_target is None else run.time_to_target
