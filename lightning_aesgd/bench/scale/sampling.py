"""The real :class:`~lightning_aesgd.engine.sampler.PlannedBatchSampler` at the simulated scale: checked and timed.

Every replica's sampler splits the same steps by one plan; together their slices must be every index of the
epoch exactly once, each of the plan's size. Rank zero's epoch is timed: the sampler's cost per batch, which
grows with the number of replicas (each slice starts after the sizes of the ranks before it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from lightning_aesgd.engine.sampler import PlanBook, PlannedBatchSampler

CHECKED_STEPS = 8
"""Steps in the checked epoch."""


def check_sampler(plan: Sequence[int], steps: int = CHECKED_STEPS, seed: int = 0) -> float:
    """Split ``steps`` steps by ``plan`` among ``len(plan)`` replicas; returns rank zero's microseconds per batch.

    Raises:
        RuntimeError: if a slice differs from its planned size, or the slices miss or repeat an index.
    """
    replicas, total = len(plan), sum(plan)
    book = PlanBook(plan)
    samplers = [PlannedBatchSampler(total * steps, total, replicas, rank, book, seed=seed) for rank in range(replicas)]
    epochs = [list(sampler) for sampler in samplers]
    # Timed on a second pass over the same epoch: the first pays torch's one-time start-up.
    start = time.perf_counter()
    list(samplers[0])
    microseconds = 1e6 * (time.perf_counter() - start) / steps
    sizes = [[len(batch) for batch in epoch] for epoch in epochs]
    if any(size != [planned] * steps for size, planned in zip(sizes, plan, strict=True)):
        raise RuntimeError(f"The sampler's slices {sizes} do not follow the plan {list(plan)}.")
    indices = sorted(index for epoch in epochs for batch in epoch for index in batch)
    if indices != list(range(total * steps)):
        raise RuntimeError("The replicas' slices miss or repeat indices of the epoch.")
    return microseconds
