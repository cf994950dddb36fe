"""One case of the slowness benchmark: DDP and ``adaptive_elastic`` on the same slowness, and the ideal."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch.utils.data import TensorDataset

from lightning_aesgd.bench.slowness.cases import Case
from lightning_aesgd.bench.slowness.runner import RunResult, run_once
from lightning_aesgd.core.apportion import share_error

ALGORITHMS = ("ddp", "adaptive_elastic")


@dataclass
class CaseResult:
    """One case: DDP, adaptive_elastic, and the ideal.

    ``solo_speeds`` holds, per replica, its speed trained alone (samples/s): the yardstick of the ideal and of the
    plan. Under sleeping slowness it is ``s₁/fᵢ``; under CPU quotas it is measured per factor, since a quota of the
    shared machine does not slow a process by exactly its nominal factor.
    """

    case: str
    mode: str
    factors: list[float]
    step_ms: float
    workers: int
    solo_speeds: list[float]
    runs: dict[str, RunResult] = field(default_factory=dict)

    @property
    def ideal(self) -> float:
        """The ideal throughput: the sum of the replicas' solo speeds."""
        return sum(self.solo_speeds)

    def ratio(self) -> float:
        """adaptive_elastic's throughput over DDP's."""
        return self.runs["adaptive_elastic"].samples_per_second / self.runs["ddp"].samples_per_second

    def efficiency(self, algorithm: str) -> float:
        """Throughput over the ideal (the sum of solo speeds)."""
        return self.runs[algorithm].samples_per_second / self.ideal

    def plan_error(self) -> float | None:
        """Largest relative share error of the plan at step 30 against the split in proportion to solo speeds."""
        plan = self.runs["adaptive_elastic"].plan_at_check
        return None if plan is None else share_error(plan, self.solo_speeds)

    def nominal_plan_error(self) -> float | None:
        """The same against the nominal split ``∝ 1/fᵢ`` (equal to :meth:`plan_error` but under quotas)."""
        plan = self.runs["adaptive_elastic"].plan_at_check
        return None if plan is None else share_error(plan, [1 / f for f in self.factors])


def run_case(case: Case, dataset: TensorDataset, steps: int, out: Path, repeats: int = 1) -> CaseResult:
    """DDP and adaptive_elastic on ``case``, and replicas alone for the ideal ``Σᵢ solo speedᵢ``.

    With ``repeats`` > 1 the two strategies alternate and each keeps its run of median throughput.
    """
    solo = solo_speeds(case, dataset, steps, out)
    result = CaseResult(case.name, case.mode, list(case.factors), case.step_ms, case.workers, solo)
    runs: dict[str, list[RunResult]] = {algorithm: [] for algorithm in ALGORITHMS}
    for _ in range(repeats):
        for algorithm, done in runs.items():
            done.append(run_once(case, algorithm, dataset, steps, out))
    for algorithm, done in runs.items():
        result.runs[algorithm] = sorted(done, key=lambda run: run.samples_per_second)[len(done) // 2]
    return result


def solo_speeds(case: Case, dataset: TensorDataset, steps: int, out: Path) -> list[float]:
    """Each replica's speed trained alone (samples/s), in the case's order.

    Sleeping devices are measured once at factor 1 (``solo speed at f = s₁/f``); under quotas every distinct
    factor runs alone, with its quota of the shared machine.
    """
    quota = case.mode == "quota"
    factors = sorted(set(case.factors)) if quota else [1.0]
    solo = {f: run_once(case, "solo", dataset, steps, out, factors=(f,)).samples_per_second for f in factors}
    return [solo[f] for f in case.factors] if quota else [solo[1.0] / f for f in case.factors]
