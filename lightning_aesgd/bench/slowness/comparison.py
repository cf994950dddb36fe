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
    """One case: DDP, adaptive_elastic, and the ideal."""

    case: str
    mode: str
    factors: list[float]
    step_ms: float
    workers: int
    ideal: float
    runs: dict[str, RunResult] = field(default_factory=dict)

    def ratio(self) -> float:
        """adaptive_elastic's throughput over DDP's."""
        return self.runs["adaptive_elastic"].samples_per_second / self.runs["ddp"].samples_per_second

    def efficiency(self, algorithm: str) -> float:
        """Throughput over the ideal (the sum of solo speeds)."""
        return self.runs[algorithm].samples_per_second / self.ideal

    def plan_error(self) -> float | None:
        """Largest relative share error of the plan at step 30 against the speed-proportional ideal."""
        plan = self.runs["adaptive_elastic"].plan_at_check
        return None if plan is None else share_error(plan, [1 / f for f in self.factors])


def run_case(case: Case, dataset: TensorDataset, steps: int, out: Path, repeats: int = 1) -> CaseResult:
    """DDP and adaptive_elastic on ``case``, and replicas alone for the ideal ``Σᵢ solo speedᵢ``.

    With ``repeats`` > 1 the two strategies alternate and each keeps its run of median throughput.
    """
    ideal = ideal_throughput(case, dataset, steps, out)
    result = CaseResult(case.name, case.mode, list(case.factors), case.step_ms, case.workers, ideal)
    runs: dict[str, list[RunResult]] = {algorithm: [] for algorithm in ALGORITHMS}
    for _ in range(repeats):
        for algorithm, done in runs.items():
            done.append(run_once(case, algorithm, dataset, steps, out))
    for algorithm, done in runs.items():
        result.runs[algorithm] = sorted(done, key=lambda run: run.samples_per_second)[len(done) // 2]
    return result


def ideal_throughput(case: Case, dataset: TensorDataset, steps: int, out: Path) -> float:
    """The sum of the replicas' solo speeds, from replicas trained alone.

    Sleeping devices are measured once at factor 1 (``solo speed at f = s₁/f``); under quotas every distinct
    factor runs alone, with its quota of the shared machine.
    """
    quota = case.mode == "quota"
    factors = sorted(set(case.factors)) if quota else [1.0]
    solo = {f: run_once(case, "solo", dataset, steps, out, factors=(f,)).samples_per_second for f in factors}
    return sum(solo[f] for f in case.factors) if quota else solo[1.0] * sum(1 / f for f in case.factors)
