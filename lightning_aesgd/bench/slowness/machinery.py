"""The ``machinery`` figures: wall and CPU time per step of a near-empty model, alone and under each strategy.

With almost no work per step and no slowdown, what a step of DDP or ``adaptive_elastic`` costs beyond one process
without any strategy is that strategy's own per-step cost: with 4 replicas, and with one replica, where a step is
all host work, as a small model's step is on a GPU that runs ahead of the host.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from torch.utils.data import TensorDataset

from lightning_aesgd.bench.slowness.cases import HOMOGENEOUS, MACHINERY
from lightning_aesgd.bench.slowness.runner import run_once

RUNS = {
    "solo": ("solo", (1.0,)),
    "ddp": ("ddp", HOMOGENEOUS),
    "adaptive_elastic": ("adaptive_elastic", HOMOGENEOUS),
    "ddp_one": ("ddp", (1.0,)),
    "adaptive_elastic_one": ("adaptive_elastic", (1.0,)),
}
"""The machinery runs by name: their algorithm and their replicas' factors."""
RIVALS = {"adaptive_elastic": "ddp", "adaptive_elastic_one": "ddp_one"}
"""Each strategy run and the DDP run it is compared with, repeat by repeat."""
ONE_PROCESS_STEPS = 10
"""One process runs this many times the steps: its steps are about a tenth as long as those of 4 replicas sharing
2 cores, and a difference of a few percent needs seconds of them."""


def measure_machinery(dataset: TensorDataset, steps: int, out: Path, repeats: int = 3) -> dict[str, float]:
    """Microseconds per step of a near-empty model under each of :data:`RUNS`.

    The runs are repeated ``repeats`` times, interleaved, and the medians reported: on a shared machine single runs
    of a few seconds differ by several percent.
    """
    wall: dict[str, list[float]] = {name: [] for name in RUNS}
    cpu: dict[str, list[float]] = {name: [] for name in RUNS}
    for _ in range(repeats):
        for name, (algorithm, factors) in RUNS.items():
            run_steps = steps * ONE_PROCESS_STEPS if len(factors) == 1 else steps
            result = run_once(MACHINERY, algorithm, dataset, run_steps, out, factors=factors, name=name)
            wall[name].append(1e6 * result.seconds_per_step)
            cpu[name].append(1e6 * result.cpu_seconds_per_step)
    return machinery_figures(wall, cpu, repeats)


def machinery_figures(wall: dict[str, list[float]], cpu: dict[str, list[float]], repeats: int) -> dict[str, float]:
    """Medians per run, each strategy's excess over the solo run, and its wall time over DDP's repeat by repeat.

    Keys: ``<name>_us_per_step``, ``_cpu_us_per_step``, ``_machinery_us`` and ``_machinery_cpu_us``; for each of
    :data:`RIVALS`, ``<name>_vs_ddp_low`` and ``_high``, the least and the largest ratio of a repeat (a run and
    its rival run one after the other).
    """
    figures: dict[str, float] = {"repeats": repeats}
    names = list(RUNS)
    for name in names:
        figures[f"{name}_us_per_step"] = statistics.median(wall[name])
        figures[f"{name}_cpu_us_per_step"] = statistics.median(cpu[name])
    for name in names[1:]:
        figures[f"{name}_machinery_us"] = figures[f"{name}_us_per_step"] - figures["solo_us_per_step"]
        figures[f"{name}_machinery_cpu_us"] = figures[f"{name}_cpu_us_per_step"] - figures["solo_cpu_us_per_step"]
    for name, rival in RIVALS.items():
        ratios = [mine / theirs for mine, theirs in zip(wall[name], wall[rival], strict=True)]
        figures[f"{name}_vs_ddp_low"], figures[f"{name}_vs_ddp_high"] = min(ratios), max(ratios)
    return figures
