"""The ``machinery`` figures: wall and CPU time per step of a near-empty model, alone and under each strategy.

With almost no work per step and no slowdown, what a step of DDP or ``adaptive_elastic`` (4 replicas) costs
beyond one process without any strategy is that strategy's own per-step cost.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from torch.utils.data import TensorDataset

from lightning_aesgd.bench.slowness.cases import HOMOGENEOUS, MACHINERY
from lightning_aesgd.bench.slowness.runner import run_once

RUNS = {"solo": (1.0,), "ddp": HOMOGENEOUS, "adaptive_elastic": HOMOGENEOUS}
"""The machinery runs: their algorithm and their replicas' factors."""


def measure_machinery(dataset: TensorDataset, steps: int, out: Path, repeats: int = 3) -> dict[str, float]:
    """Microseconds per step of a near-empty model: one process alone, DDP and adaptive_elastic (4 replicas).

    The three runs are repeated ``repeats`` times, interleaved, and the medians reported: on a shared machine
    single runs of a few seconds differ by several percent.
    """
    wall: dict[str, list[float]] = {name: [] for name in RUNS}
    cpu: dict[str, list[float]] = {name: [] for name in RUNS}
    for _ in range(repeats):
        for algorithm, factors in RUNS.items():
            result = run_once(MACHINERY, algorithm, dataset, steps, out, factors=factors)
            wall[algorithm].append(1e6 * result.seconds_per_step)
            cpu[algorithm].append(1e6 * result.cpu_seconds_per_step)
    return machinery_figures(wall, cpu, repeats)


def machinery_figures(wall: dict[str, list[float]], cpu: dict[str, list[float]], repeats: int) -> dict[str, float]:
    """Medians per run, then each strategy's excess over the solo run (``<name>_machinery_us`` and ``_cpu_us``)."""
    figures: dict[str, float] = {"repeats": repeats}
    for name in RUNS:
        figures[f"{name}_us_per_step"] = statistics.median(wall[name])
        figures[f"{name}_cpu_us_per_step"] = statistics.median(cpu[name])
    for name in list(RUNS)[1:]:
        figures[f"{name}_machinery_us"] = figures[f"{name}_us_per_step"] - figures["solo_us_per_step"]
        figures[f"{name}_machinery_cpu_us"] = figures[f"{name}_cpu_us_per_step"] - figures["solo_cpu_us_per_step"]
    return figures
