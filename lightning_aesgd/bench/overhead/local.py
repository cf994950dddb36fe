"""What the planning machinery costs a replica per step, without any communication, in microseconds.

* Planner: the work at a sync point, :meth:`~lightning_aesgd.engine.arrivals.ArrivalClock.arrive` and
  :meth:`~lightning_aesgd.engine.plan_loop.PlanLoop.receive` with scripted reports (updating the arrival models,
  the planner's plan, damping, scheduling it in the plan book), and the planner's ``plan`` alone. It runs once per
  merge, i.e. every ``period`` steps.
* Sampler: iterating one epoch of :class:`~lightning_aesgd.engine.sampler.PlannedBatchSampler` (by count, and by
  cost as the XMC workloads use it) against torch's ``BatchSampler`` over a ``DistributedSampler``, which is
  what DDP iterates, for the same dataset size, step batch and number of replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch.utils.data import BatchSampler, Dataset, DistributedSampler

from lightning_aesgd.core.apportion import apportion
from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.engine.arrivals import ArrivalClock
from lightning_aesgd.engine.plan_loop import PlanLoop
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.sampler import PlanBook, PlannedBatchSampler

REPLICAS = 4
STEP_BATCH = 256
LAG = 2
PERIOD = 2


def scripted_rows(call: int) -> list[list[float]]:
    """Every replica's report for merge number ``call``.

    The fastest replica's speed alternates, so that every merge changes the plan and schedules it.
    """
    fast = 2 if call % 2 else 1
    return [
        PeriodReport(1.0, work=64.0, planned=64.0, steps=PERIOD, active=PERIOD * 0.064 * factor / fast).as_row()
        if rank == 0
        else PeriodReport(1.0, work=64.0, planned=64.0, steps=PERIOD, active=PERIOD * 0.064 * factor).as_row()
        for rank, factor in enumerate((1.0, 1.0, 2.0, 4.0))
    ]


def planner_costs(iterations: int) -> dict[str, float]:
    """Microseconds per merge of the planning work, and per plan.

    The planning work: a step's beginning, the arrival, the release and the receipt (models, plan, schedule).
    """
    arrivals, plans = ArrivalClock(), PlanLoop(PlanSettings(planner="balanced", plan_dead_band=0.0))
    arrivals.attach(torch.device("cpu"))
    plans.attach(REPLICAS)
    plans.plan_book_for(STEP_BATCH, REPLICAS, LAG)
    rows = [scripted_rows(call) for call in range(2)]

    def exchange(iteration: int) -> None:
        arrivals.begin_step()
        arrivals.arrive(1.0)
        arrivals.release()
        plans.receive(rows[iteration % 2], iteration * PERIOD)

    exchange_us = _microseconds(exchange, iterations)
    current = apportion(STEP_BATCH, [1.0] * REPLICAS)
    models = [
        [StepTime(0.002, 1.0 / speed) for speed in speeds]
        for speeds in ([2000.0, 1000.0, 500.0, 250.0], [1000.0, 1000.0, 500.0, 250.0])
    ]
    planner = plans.planner
    plan_us = _microseconds(lambda i: planner.plan(current, models[i % 2], STEP_BATCH), iterations)
    return {"exchange_us_per_merge": exchange_us, "plan_us_per_merge": plan_us, "merge_period": PERIOD}


def sampler_costs(dataset_size: int) -> dict[str, float]:
    """Microseconds per batch of one epoch, for the planned sampler (count, cost-aware) and torch's."""
    costs = torch.randint(1, 200, (dataset_size,), generator=torch.Generator().manual_seed(0)).double()
    equal = apportion(STEP_BATCH, [1.0] * REPLICAS)

    def elastic(sample_costs: torch.Tensor | None) -> PlannedBatchSampler:
        book = PlanBook(equal)
        return PlannedBatchSampler(dataset_size, STEP_BATCH, REPLICAS, 0, book, costs=sample_costs)

    # DistributedSampler reads only the dataset's length.
    dataset = cast(Dataset[int], range(dataset_size))
    distributed: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=REPLICAS, rank=0, shuffle=True, seed=0
    )
    torch_batches = BatchSampler(distributed, batch_size=STEP_BATCH // REPLICAS, drop_last=False)
    return {
        "dataset_size": dataset_size,
        "torch_us_per_batch": _per_item_microseconds(torch_batches),
        "elastic_us_per_batch": _per_item_microseconds(elastic(None)),
        "elastic_cost_aware_us_per_batch": _per_item_microseconds(elastic(costs)),
    }


def _microseconds(operation: Callable[[int], Any], iterations: int) -> float:
    start = time.perf_counter()
    for iteration in range(iterations):
        operation(iteration)
    return 1e6 * (time.perf_counter() - start) / iterations


def _per_item_microseconds(batches: Iterable[list[int]]) -> float:
    start = time.perf_counter()
    count = sum(1 for _ in batches)
    return 1e6 * (time.perf_counter() - start) / max(1, count)
