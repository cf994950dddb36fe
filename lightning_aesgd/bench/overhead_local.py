"""What the routing machinery costs a replica per step, without any communication, in microseconds.

* Planner: :meth:`~lightning_aesgd.routing.Router.exchange` with the all-gather replaced by scripted peers
  (so what remains is building the statistics, the policy's plan and scheduling it in the plan book), and the
  policy's ``plan`` alone. It runs once per merge, i.e. every ``period`` steps.
* Sampler: iterating one epoch of :class:`~lightning_aesgd.sampler.ElasticBatchSampler` (by count, and by
  cost as the XMC workloads use it) against torch's ``BatchSampler`` over a ``DistributedSampler``, which is
  what DDP iterates, for the same dataset size, step batch and number of replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, replace
from typing import Any, TypeVar, cast

import torch
from torch.utils.data import BatchSampler, Dataset, DistributedSampler

from lightning_aesgd.core.planning import apportion
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.routing import ReplicaStats, Router
from lightning_aesgd.sampler import ElasticBatchSampler, PlanBook

T = TypeVar("T")
REPLICAS = 4
STEP_BATCH = 256
LAG = 2
PERIOD = 2


class ScriptedPeers:
    """A communicator whose all-gather returns scripted rows at once: every collective costs nothing.

    Rows alternate between two sets of speeds, so that every exchange changes the plan and schedules it.
    """

    world_size = REPLICAS
    rank = 0

    def __init__(self) -> None:
        self.calls = 0

    def all_gather_floats(self, values: Sequence[float]) -> list[list[float]]:  # noqa: D102
        self.calls += 1
        fast = 1000.0 * (1 + self.calls % 2)
        own = ReplicaStats(*values)
        peers = (fast, 1000.0, 500.0, 250.0)
        return [list(astuple(replace(own, speed=speed, per_sample=1 / speed))) for speed in peers]

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:  # noqa: D102
        return None

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:  # noqa: D102
        return None

    def all_gather_object(self, obj: T) -> list[T]:  # noqa: D102
        return [obj] * REPLICAS


def planner_costs(iterations: int) -> dict[str, float]:
    """Microseconds per ``Router.exchange`` without its collective, and per ``policy.plan``."""
    router = Router(planner="balanced")
    peers = ScriptedPeers()
    router.attach(peers, torch.device("cpu"))
    router.plan_book_for(STEP_BATCH, REPLICAS, LAG)
    exchange_us = _microseconds(lambda i: router.exchange(1.0, i * PERIOD), iterations)
    current = apportion(STEP_BATCH, [1.0] * REPLICAS)
    models = [
        [StepTime(0.002, 1.0 / speed) for speed in speeds]
        for speeds in ([2000.0, 1000.0, 500.0, 250.0], [1000.0, 1000.0, 500.0, 250.0])
    ]
    plan_us = _microseconds(lambda i: router.policy.plan(current, models[i % 2], STEP_BATCH), iterations)
    return {"exchange_us_per_merge": exchange_us, "plan_us_per_merge": plan_us, "merge_period": PERIOD}


def sampler_costs(dataset_size: int) -> dict[str, float]:
    """Microseconds per batch of one epoch, for the elastic sampler (count, cost-aware) and torch's."""
    costs = torch.randint(1, 200, (dataset_size,), generator=torch.Generator().manual_seed(0)).double()
    equal = apportion(STEP_BATCH, [1.0] * REPLICAS)

    def elastic(sample_costs: torch.Tensor | None) -> ElasticBatchSampler:
        book = PlanBook(equal)
        return ElasticBatchSampler(dataset_size, STEP_BATCH, REPLICAS, 0, book, costs=sample_costs)

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
