"""One case of the slowness benchmark: DDP and ``adaptive_elastic`` on the same slowness, and the ideal."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch.utils.data import TensorDataset

from lightning_aesgd.bench.slowness.cases import BATCH, SMALL_BATCH, Case
from lightning_aesgd.bench.slowness.runner import RunResult, run_once
from lightning_aesgd.core.apportion import share_error
from lightning_aesgd.core.planners import admitted_replicas, balance_step_times
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.engine.plan_settings import PlanSettings

ALGORITHMS = ("ddp", "adaptive_elastic")
SOLO_BATCHES = (SMALL_BATCH, BATCH)
"""The batch sizes each factor's replica trains at alone: two points of its step time ``t(b) = a + c·b``."""


@dataclass
class CaseResult:
    """One case: DDP, adaptive_elastic, and the ideal.

    ``solo_step_times`` holds, per replica, its step time as a function of its batch size, measured alone (see
    :func:`solo_step_times`): the yardstick of the ideal and of the plan.
    """

    case: str
    mode: str
    factors: list[float]
    step_ms: float
    workers: int
    solo_step_times: list[StepTime]
    runs: dict[str, RunResult] = field(default_factory=dict)
    repeat_ratios: list[float] = field(default_factory=list)
    first_plans: list[list[int] | None] = field(default_factory=list)  # adaptive_elastic's, one per repeat

    @property
    def balanced_plan(self) -> list[int]:
        """The split of the step batch ``M = BATCH·n`` under which the solo step times are equal.

        Speed-proportional where steps have no fixed cost; with one, a slow replica's small batch pays it on fewer
        samples, so it gets less than its speed at ``BATCH`` would say (:func:`balance_step_times`). A replica whose
        step at the strategy's floor batch outlasts the others' balanced step gets none (:func:`admitted_replicas`,
        as ``leave_out_stragglers`` decides).
        """
        total = BATCH * len(self.factors)
        floors = PlanSettings().floors(total, len(self.factors))
        helping = admitted_replicas(total, self.solo_step_times, floors)
        kept = [rank for rank, helps in enumerate(helping) if helps]
        sizes = iter(balance_step_times(total, [self.solo_step_times[r] for r in kept], [floors[r] for r in kept]))
        return [next(sizes) if helps else 0 for helps in helping]

    @property
    def ideal(self) -> float:
        """The ideal throughput: ``M`` samples per step of the balanced plan (``Σᵢ 1/cᵢ`` without fixed costs)."""
        plan = self.balanced_plan
        step = max(time.seconds(size) for time, size in zip(self.solo_step_times, plan, strict=True) if size > 0)
        return sum(plan) / step

    def ratio(self) -> float:
        """adaptive_elastic's throughput over DDP's."""
        return self.runs["adaptive_elastic"].samples_per_second / self.runs["ddp"].samples_per_second

    def ratio_range(self) -> tuple[float, float]:
        """The lowest and highest of the repeats' ratios (each repeat's two runs ran back to back)."""
        ratios = self.repeat_ratios or [self.ratio()]
        return min(ratios), max(ratios)

    def efficiency(self, algorithm: str) -> float:
        """Throughput over the ideal."""
        return self.runs[algorithm].samples_per_second / self.ideal

    def plan_error(self) -> float | None:
        """Largest relative share error of the plan at the check step (step 30) against :attr:`balanced_plan`."""
        return self._error(self.runs["adaptive_elastic"].plan_at_check)

    def worst_first_plan_error(self) -> float | None:
        """The largest :meth:`plan_error` of the first plan made from measurements, over the repeats.

        The first plan comes from one short report per replica: noise or a step measured in part (a fit's first
        step without the hooks after its sync point) shows here, before the plan loop's averages smooth it.
        """
        errors = [self._error(plan) for plan in self.first_plans if plan is not None]
        return max((error for error in errors if error is not None), default=None)

    def _error(self, plan: list[int] | None) -> float | None:
        target = self.balanced_plan
        if plan is None:
            return None
        if [size > 0 for size in plan] != [size > 0 for size in target]:
            return 1.0  # a replica in where the ideal leaves it out, or out where it helps: its whole share wrong
        kept = [(size, goal) for size, goal in zip(plan, target, strict=True) if goal > 0]
        return share_error([size for size, _ in kept], [goal for _, goal in kept])

    def nominal_plan_error(self) -> float | None:
        """The same against the nominal split ``∝ 1/fᵢ``, which counts only the slowness as work."""
        plan = self.runs["adaptive_elastic"].plan_at_check
        return None if plan is None else share_error(plan, [1 / f for f in self.factors])


def run_case(case: Case, dataset: TensorDataset, steps: int, out: Path, repeats: int = 1) -> CaseResult:
    """DDP and adaptive_elastic on ``case``, and replicas alone for the ideal.

    With ``repeats`` > 1 the two strategies alternate and each keeps its run of median throughput.
    """
    solo = solo_step_times(case, dataset, steps, out)
    result = CaseResult(case.name, case.mode, list(case.factors), case.step_ms, case.workers, solo)
    runs: dict[str, list[RunResult]] = {algorithm: [] for algorithm in ALGORITHMS}
    for _ in range(repeats):
        for algorithm, done in runs.items():
            done.append(run_once(case, algorithm, dataset, steps, out))
    for algorithm, done in runs.items():
        result.runs[algorithm] = sorted(done, key=lambda run: run.samples_per_second)[len(done) // 2]
    pairs = zip(runs["ddp"], runs["adaptive_elastic"], strict=True)
    result.repeat_ratios = [adaptive.samples_per_second / ddp.samples_per_second for ddp, adaptive in pairs]
    result.first_plans = [run.first_plan for run in runs["adaptive_elastic"]]
    return result


def solo_step_times(case: Case, dataset: TensorDataset, steps: int, out: Path) -> list[StepTime]:
    """Each replica's step time alone, in the case's order: every distinct factor trains alone at both batch sizes.

    Measured rather than derived from the factor: only the emulated slowness scales with ``f``, the model's own
    compute and the framework's per-step work do not (in short steps they are a good part of the step), and a CPU
    quota of the shared machine slows neither by exactly its factor. Under a quota the process alone still gets
    the share of the cores one of the case's replicas gets.
    """
    fitted = {}
    for factor in sorted(set(case.factors)):
        runs = [run_once(case, "solo", dataset, steps, out, (factor,), size) for size in SOLO_BATCHES]
        fitted[factor] = step_time_through(SOLO_BATCHES, [run.seconds_per_step for run in runs])
    return [fitted[factor] for factor in case.factors]


def step_time_through(sizes: tuple[int, int], seconds: list[float]) -> StepTime:
    """The line ``t(b) = a + c·b`` through two measured steps, with ``a ≥ 0``.

    Where noise makes the line fall at zero (a step that did not grow with the batch, or grew more than in
    proportion), the larger batch's speed is taken for the whole step: ``t(b) = b · t₂/b₂``.

    Example:
        >>> step_time_through((16, 64), [0.04, 0.10])
        StepTime(overhead=0.02, per_sample=0.00125)
        >>> step_time_through((16, 64), [0.10, 0.08])
        StepTime(overhead=0.0, per_sample=0.00125)
    """
    (small, large), (short, long) = sizes, seconds
    per_sample = (long - short) / (large - small)
    overhead = short - per_sample * small
    if per_sample <= 0 or overhead < 0:
        return StepTime(0.0, long / large)
    return StepTime(overhead, per_sample)
