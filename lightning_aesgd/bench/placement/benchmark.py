"""The placement benchmark: every case of every algorithm on every workload, repeated, interleaved, tabled.

Runs are interleaved (for each repeat, for each algorithm, for each case) so that drift of a shared machine hits
every placement alike, and each case is compared with the GPU alone of the same repeat. Cases with the same
overrides are one run (the CPU replicas alone have no GPU rank for the weak GPU to slow).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path

from lightning_aesgd.bench.placement.cases import Case, Machine, baseline_of, build_cases
from lightning_aesgd.bench.placement.figures import Row, RunFigures, run_figures, summarise
from lightning_aesgd.bench.placement.runner import fit_and_test
from lightning_aesgd.bench.placement.workloads import TEST_BATCHES_TINY, WORKLOADS, on_test_split, unavailable
from lightning_aesgd.bench.race.runner import compose_config
from lightning_aesgd.bench.race.suites import Target

TINY_EPOCHS = 1

RunKey = tuple[str, tuple[tuple[str, ...], int | None], int]
"""(algorithm, the case's run key, repeat)."""


@dataclass
class PlacementSettings:
    """What to run; see ``python -m lightning_aesgd.bench placement --help``."""

    workloads: list[str]
    algorithms: list[str]
    placements: list[str]
    weak_gpu: float
    repeats: int
    out: Path
    epochs: int | None = None
    targets: dict[str, Target] = field(default_factory=dict)
    """Targets by workload name, in place of the workload's own."""
    overrides: list[str] = field(default_factory=list)
    tiny: bool = False


@dataclass
class WorkloadResult:
    """One workload's cases, its rows (one per algorithm and case) and every run, or why it was skipped."""

    workload: str
    target: Target
    epochs: int
    cases: list[Case]
    skip: str | None = None
    rows: list[Row] = field(default_factory=list)
    runs: list[RunFigures] = field(default_factory=list)


def run_workload(settings: PlacementSettings, name: str, machine: Machine) -> WorkloadResult:
    """Every case of every algorithm on workload ``name``, ``settings.repeats`` times; skipped without its data."""
    workload = WORKLOADS[name]
    target = settings.targets.get(name) or Target.parse(workload.target)
    epochs = settings.epochs or (TINY_EPOCHS if settings.tiny else workload.epochs)
    cases = build_cases(machine, settings.weak_gpu, settings.placements)
    result = WorkloadResult(name, target, epochs, cases, skip=unavailable(name))
    if result.skip is not None:
        print(f"{name}: skipped, {result.skip}", flush=True)
        return result
    base = [*workload.overrides(settings.tiny), f"trainer.max_epochs={epochs}"]
    measured: dict[RunKey, RunFigures] = {}
    for repeat in range(settings.repeats):
        for algorithm in settings.algorithms:
            for case in cases:
                key = (algorithm, case.run_key, repeat)
                if case.skip is None and key not in measured:
                    measured[key] = _measure(settings, result, base, algorithm, case, repeat)
                    print(f"{name} / {algorithm} / {case.name} / repeat {repeat}: {_progress(measured[key])}")
    result.runs = list(measured.values())
    result.rows = [_row(algorithm, case, cases, measured) for algorithm in settings.algorithms for case in cases]
    return result


LIGHTNING_BASELINES = ("ddp", "post_local_sgd", "single_device")
"""Algorithm configs that are Lightning's own strategies: their step batch is the loader's batch per replica."""


def step_batch_overrides(algorithm: str) -> list[str]:
    """This project's strategy steps on the loader's batch in every placement, as the GPU alone does.

    Its step batch is otherwise the loader's batch times the replicas, so a CPU replica, even one left out, would
    double the GPU's batch and halve the updates of an epoch: the throughput would then measure the batch size.
    Lightning's baselines have no step batch of their own (each replica takes the loader's batch).

    Example:
        >>> step_batch_overrides("hogbatch"), step_batch_overrides("ddp")
        (['++algorithm.step_batch_size=${data.batch_size}'], [])
    """
    return [] if algorithm in LIGHTNING_BASELINES else ["++algorithm.step_batch_size=${data.batch_size}"]


def _measure(
    settings: PlacementSettings, result: WorkloadResult, base: list[str], algorithm: str, case: Case, repeat: int
) -> RunFigures:
    run_dir = settings.out / "runs" / result.workload / algorithm / case.name / f"repeat_{repeat}"
    figures = RunFigures(algorithm, case.name, repeat, record=str(run_dir.relative_to(settings.out) / "record.json"))
    test_batches = TEST_BATCHES_TINY if settings.tiny else None
    try:
        # The user's overrides last, so that they can change anything the benchmark set.
        algorithm_overrides = [f"algorithm={algorithm}", *step_batch_overrides(algorithm)]
        cfg = compose_config([*base, *algorithm_overrides, *case.overrides, *settings.overrides])
        record, tested = fit_and_test(cfg, run_dir, case.threads, test_batches)
    except Exception as error:  # one failed run must not lose the others
        traceback.print_exc()
        figures.error = f"{type(error).__name__}: {error}"
        return figures
    return run_figures(record, figures, result.target, tested.get(on_test_split(result.target.metric)))


def _row(algorithm: str, case: Case, cases: list[Case], measured: dict[RunKey, RunFigures]) -> Row:
    """``case``'s row beside the GPU alone of the same emulation (``None`` where that was skipped)."""
    baseline = baseline_of(case, cases)
    return summarise(algorithm, case, _runs(algorithm, case, measured) or [], _runs(algorithm, baseline, measured))


def _runs(algorithm: str, case: Case | None, measured: dict[RunKey, RunFigures]) -> list[RunFigures] | None:
    if case is None or case.skip is not None:
        return None
    return [run for (name, key, _), run in measured.items() if name == algorithm and key == case.run_key]


def _progress(figures: RunFigures) -> str:
    if figures.error is not None:
        return f"FAILED ({figures.error})"
    reached = "not reached" if figures.time_to_target is None else f"{figures.time_to_target:.1f} s"
    return f"{figures.throughput:.1f} samples/s, target {reached}"
