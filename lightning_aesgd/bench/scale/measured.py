"""The measured part: DDP and ``adaptive_elastic`` at 2, 4 and 8 replicas with the same spread of speeds.

Each count is one case of the slowness benchmark (:mod:`lightning_aesgd.bench.slowness`): the ``user`` mode,
64 ms per 64-sample step at cost 1 in the user's ``training_step``, with cost factors log-spaced from 1 to the
largest cost, so that every count spans the same speeds. :func:`~lightning_aesgd.bench.slowness.comparison.run_case`
races the two strategies and trains each factor's replica alone for the ideal.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lightning_aesgd.bench.slowness.cases import Case
from lightning_aesgd.bench.slowness.comparison import CaseResult, run_case

MEASURED_REPLICAS = (2, 4, 8)
LARGEST_COST = 4.0
"""The slowest replica's cost factor: speeds from 1 to 1/4 of the fastest, as in the slowness benchmark."""


def log_spaced_costs(replicas: int, largest: float = LARGEST_COST) -> tuple[float, ...]:
    """Cost factors from 1 to ``largest`` in equal ratios, rounded to two decimals.

    Example:
        >>> log_spaced_costs(2)
        (1.0, 4.0)
        >>> log_spaced_costs(4)
        (1.0, 1.59, 2.52, 4.0)
    """
    if replicas == 1:
        return (1.0,)
    return tuple(round(largest ** (rank / (replicas - 1)), 2) for rank in range(replicas))


def scale_case(replicas: int, largest: float = LARGEST_COST) -> Case:
    """The slowness benchmark's ``user`` case with ``replicas`` log-spaced cost factors."""
    return Case(f"user-{replicas}", "user", log_spaced_costs(replicas, largest))


def run_measured(replicas: Sequence[int], largest: float, steps: int, out: Path) -> list[CaseResult]:
    """Race DDP and adaptive_elastic at every count of ``replicas``, one case at a time; prints each ratio."""
    # Imported here: the simulated part needs no data.
    from lightning_aesgd.bench.slowness.model import load_data

    dataset = load_data()
    results = []
    for count in replicas:
        results.append(run_case(scale_case(count, largest), dataset, steps, out))
        print(f"{count} replicas: adaptive_elastic ÷ DDP = {results[-1].ratio():.2f}", flush=True)
    return results
