"""Batch sampling by plan: every step takes the next M indices of one shared permutation and splits them.

All replicas draw the same permutation of the dataset (seed + epoch, as Lightning's ``DistributedSampler``
does). Step ``s`` of an epoch consumes positions ``[s·M, (s+1)·M)`` of it; the plan in force for that step says
how many of those indices (or, cost-aware, how much of their cost) each replica takes, in rank order. Each
replica keeps only its own slice, so across replicas every index of an epoch is used exactly once (an epoch's
last step too short for every replica's smallest batch takes the few it lacks from the epoch's start again, as
DistributedSampler pads: :meth:`PlannedBatchSampler.floors`).

Samplers run ahead of training (Lightning's fetcher and DataLoader workers prefetch), so plans are scheduled
for a future step (:class:`PlanBook`); as long as that step lies beyond the prefetch depth, every replica slices
every step with the same plan.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Sampler

from lightning_aesgd.core.apportion import apportion, per_replica, split_by_cost


class StepIndices(list[int]):
    """One replica's indices for one step, tagged with the step's key (so the loader can time that step).

    Args:
        indices: the dataset indices.
        step: the step's key (:meth:`PlannedBatchSampler.step_key`).
    """

    def __init__(self, indices: Sequence[int], step: int) -> None:
        super().__init__(indices)
        self.step = step


class PlanLagError(RuntimeError):
    """A plan arrived for a step that a sampler has already produced."""


class PlanBook:
    """Per-replica batch sizes, keyed by the first step they apply to.

    Args:
        initial_sizes: the plan in force from step 0.
    """

    def __init__(self, initial_sizes: Sequence[int]) -> None:
        self._starts: list[int] = [0]
        self._sizes: list[tuple[int, ...]] = [tuple(initial_sizes)]
        self.last_served_step = -1

    @property
    def latest(self) -> tuple[int, ...]:
        """The most recently scheduled plan."""
        return self._sizes[-1]

    @property
    def revised(self) -> bool:
        """Whether any plan has been scheduled after the initial one."""
        return len(self._starts) > 1

    def schedule(self, from_step: int, sizes: Sequence[int]) -> None:
        """Put ``sizes`` in force from ``from_step`` on, replacing any plan scheduled at or after it.

        Raises:
            PlanLagError: if a sampler already produced ``from_step``; replicas could then disagree on the split.
        """
        if from_step <= self.last_served_step:
            raise PlanLagError(
                f"A plan for step {from_step} arrived after the sampler produced step {self.last_served_step}. "
                "HINT: increase the strategy's `plan_lag` above the DataLoader prefetch depth "
                "(num_workers × prefetch_factor + 1)."
            )
        keep = bisect.bisect_left(self._starts, from_step)
        del self._starts[keep:], self._sizes[keep:]
        self._starts.append(from_step)
        self._sizes.append(tuple(sizes))

    def sizes_at(self, step: int) -> tuple[int, ...]:
        """The plan in force at ``step``; marks the step as served."""
        self.last_served_step = max(self.last_served_step, step)
        return self._sizes[bisect.bisect_right(self._starts, step) - 1]

    def forget_served(self) -> None:
        """A new loader begins: it has produced no step yet, whatever an earlier one did.

        Lightning's tuner (``lr_find``, or its ``LearningRateFinder`` callback) trains for some steps and then
        rewinds the loop to step 0: the training that follows must not find its first plans refused as late.
        """
        self.last_served_step = -1

    def left_out_throughout(self, rank: int, start: int, end: int) -> bool:
        """Whether every plan in force from step ``start`` up to ``end`` (exclusive) gives ``rank`` no samples.

        Unlike :meth:`sizes_at`, it marks nothing as served.
        """
        first = bisect.bisect_right(self._starts, start) - 1
        last = bisect.bisect_left(self._starts, end)
        return all(sizes[rank] == 0 for sizes in self._sizes[first:last])

    def state_dict(self) -> dict[str, Any]:  # noqa: D102
        return {"starts": list(self._starts), "sizes": [list(s) for s in self._sizes]}

    def load_state_dict(self, state: dict[str, Any], keep_served: bool = False) -> None:
        """Put back what :meth:`state_dict` returned.

        Args:
            state: the plans.
            keep_served: keep the steps this book's sampler has produced (a replica taking its peers' plans in
                the middle of a fit); otherwise none (a fit resumed from a checkpoint draws afresh).
        """
        self._starts = list(state["starts"])
        self._sizes = [tuple(s) for s in state["sizes"]]
        if not keep_served:
            self.last_served_step = -1


class SharedPermutation(Sampler[int]):
    """The order of one epoch's indices, identical on every replica.

    Drawn like torch's ``DistributedSampler`` (``randperm`` seeded with seed + epoch), so both visit the data in
    the same order. Lightning sets the epoch through :meth:`set_epoch` before every epoch.

    Lightning passes the epochs its fit loop has processed: one more than the loop's own ``current_epoch`` for the
    rest of a fit resumed from a checkpoint written at the end of an epoch that ``max_steps`` cut short
    (``ModelCheckpoint``'s default), whose loop finishes that epoch first. Steps are keyed by the loop's epoch, which
    :attr:`loop_epoch` gives where a Trainer drives the sampler.

    Args:
        size: number of samples.
        shuffle: draw a fresh permutation every epoch; otherwise keep dataset order.
        seed: the seed; must be equal on every replica.
    """

    def __init__(self, size: int, shuffle: bool = True, seed: int = 0) -> None:
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.loop_epoch: Callable[[], int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Draw ``epoch`` (the training loop's epoch instead, where :attr:`loop_epoch` is set)."""
        self.epoch = self.loop_epoch() if self.loop_epoch is not None else epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())

    def order(self) -> Tensor:
        """This epoch's permutation."""
        if not self.shuffle:
            return torch.arange(self.size)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator)


@dataclass(frozen=True)
class StepRecord:
    """What this replica received for one step.

    Attributes:
        num_samples: number of samples.
        cost: their total cost (the number of samples without costs).
        planned: the batch size the plan gave this replica: what the planner controls, and what its step-time
            model is fitted against (with cost-aware splitting the count varies around it).
        step_samples: samples of the whole step, every replica's together (0 where unknown); a replica's share of
            the step's gradient is ``num_samples / step_samples``.
    """

    num_samples: int
    cost: float
    planned: int
    step_samples: int = 0


class PlannedBatchSampler(Sampler[list[int]]):
    """Yields this replica's slice of every step's M indices, sized by the plan in force for that step.

    Args:
        dataset_size: number of samples N.
        step_batch_size: indices consumed per step by all replicas together (M).
        num_replicas: number of replicas n.
        rank: this replica's index.
        plan_book: the plans, shared with the strategy that schedules them.
        shuffle: draw a fresh permutation every epoch (seed + epoch); otherwise keep dataset order.
        seed: the permutation seed; must be equal on every replica.
        drop_last: drop the last, incomplete step instead of splitting what is left.
        costs: optional cost per sample (e.g. non-zeros of a sparse row); the plan then splits every step by
            cumulative cost instead of by count.
        learners: models each replica trains side by side: the epoch's last, shorter step still gives each of
            them a sample (plans of full steps are multiples of it already).
        min_batch: the strategy's smallest batch, for all replicas or one per replica: a step split otherwise
            than planned (the epoch's last, shorter step; a cost-aware split) keeps it too
            (:meth:`floors`).
    """

    def __init__(
        self,
        dataset_size: int,
        step_batch_size: int,
        num_replicas: int,
        rank: int,
        plan_book: PlanBook,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        costs: Tensor | None = None,
        learners: int = 1,
        min_batch: int | Sequence[int] = 1,
    ) -> None:
        if step_batch_size < num_replicas:
            raise ValueError(
                f"The step batch size ({step_batch_size}) must give every one of the {num_replicas} replicas at "
                "least one sample. HINT: raise the DataLoader's batch_size."
            )
        if costs is not None and len(costs) != dataset_size:
            raise ValueError(f"Got {len(costs)} sample costs for a dataset of {dataset_size} samples.")
        if drop_last and dataset_size < step_batch_size:
            raise ValueError(f"With drop_last, {dataset_size} samples do not fill one step of {step_batch_size}.")
        # Named `sampler` as in torch's BatchSampler: Lightning finds it there to set the epoch.
        self.sampler = SharedPermutation(dataset_size, shuffle, seed)
        self.dataset_size = dataset_size
        self.step_batch_size = step_batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.plan_book = plan_book
        self.drop_last = drop_last
        self.costs = None if costs is None else torch.as_tensor(costs, dtype=torch.float64)
        self.learners = learners
        self.min_batch = [int(low) for low in per_replica(min_batch, num_replicas, "min_batch")]
        self.steps_done = 0
        self._resume: tuple[int, int] | None = None
        self._records: dict[int, StepRecord] = {}

    def __len__(self) -> int:
        if self.drop_last:
            return self.dataset_size // self.step_batch_size
        return math.ceil(self.dataset_size / self.step_batch_size)

    @property
    def epoch(self) -> int:
        """The epoch being drawn."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose permutation to draw."""
        self.sampler.set_epoch(epoch)

    def step_key(self, epoch: int, index: int) -> int:
        """The global step number of batch ``index`` of ``epoch``; plans are keyed by it."""
        return epoch * len(self) + index

    def __iter__(self) -> Iterator[list[int]]:
        order = self.sampler.order().tolist()  # slicing a list per step costs a fraction of slicing a tensor
        first = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            first = self._resume[1]
        self._resume = None
        self.steps_done = first
        for index in range(first, len(self)):
            yield self._slice(order, index)

    def pop_record(self, key: int) -> StepRecord:
        """Take the record of step ``key``, which training is now running, and forget older ones.

        Older records are batches that prefetching produced but training never consumed (``max_steps``,
        ``limit_train_batches``). Training consumes steps in order, so the step counts as done for
        :meth:`state_dict` from here on: checkpoints are written after a step ends.
        """
        if key not in self._records:
            raise RuntimeError(
                f"Training reached step {key}, which the planned sampler did not produce (it produced "
                f"{sorted(self._records)}): the loader's position and the training loop's disagree. HINT: resume "
                "with fit(ckpt_path=...) from a checkpoint of this run, and do not iterate the training loader "
                "outside the Trainer."
            )
        record = self._records.pop(key)
        for stale in [k for k in self._records if k < key]:
            del self._records[stale]
        self.steps_done = key - self.step_key(self.epoch, 0) + 1
        return record

    def state_dict(self) -> dict[str, int]:
        """Position in the data: the epoch, how many of its steps training has completed, and their size."""
        return {"epoch": self.epoch, "steps_done": self.steps_done, "step_batch_size": self.step_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume the given epoch after its completed steps.

        Raises:
            ValueError: if the epoch is under way and its steps had another size: the samples they used would no
                longer be the first ``steps_done`` steps of this sampler, so some would be used twice or never.
        """
        saved_size = state.get("step_batch_size", self.step_batch_size)
        if state["steps_done"] > 0 and saved_size != self.step_batch_size:
            raise ValueError(
                f"The checkpoint stopped {state['steps_done']} steps into epoch {state['epoch']} with steps of "
                f"{saved_size} samples; this run's steps have {self.step_batch_size}. HINT: set the strategy's "
                f"step_batch_size={saved_size} (or leave it unset) to finish that epoch exactly, or resume from a "
                "checkpoint written at the end of an epoch."
            )
        self.set_epoch(state["epoch"])
        self._resume = (state["epoch"], state["steps_done"])

    def _slice(self, order: list[int], index: int) -> list[int]:
        step = order[index * self.step_batch_size : (index + 1) * self.step_batch_size]
        key = self.step_key(self.epoch, index)
        sizes = self.plan_book.sizes_at(key)
        least = sum(self.floors(sizes))
        if len(step) < least:
            # A tail too short for the floors of the replicas taking part: wrap around to the epoch's start, as
            # DistributedSampler pads, so that none takes fewer samples than it may in the step all of them take.
            # A dataset smaller than the floors is repeated as often as it takes, as DistributedSampler repeats it.
            missing = least - len(step)
            step = step + (order * math.ceil(missing / len(order)))[:missing]
        counts = self._split(step, sizes)
        begin = sum(counts[: self.rank])
        mine = step[begin : begin + counts[self.rank]]
        cost = float(self.costs[mine].sum()) if self.costs is not None else float(len(mine))
        # A short last step keeps the plan's proportions: count it at its apportioned size.
        planned = sizes[self.rank] if len(step) == sum(sizes) else self._split_tail(len(step), sizes)[self.rank]
        self._records[key] = StepRecord(num_samples=len(mine), cost=cost, planned=planned, step_samples=len(step))
        return StepIndices(mine, key)

    def floors(self, sizes: Sequence[int]) -> list[int]:
        """The fewest samples each replica takes where a step is split otherwise than planned.

        Its planned size, up to ``max(min_batch, learners, 2)``: the epoch's last, shorter step and cost-aware
        splits keep ``min_batch`` and a sample for each learner, and hand no replica planned two samples or more a
        batch of one, which BatchNorm cannot train on. A tail shorter than the floors is padded up to them from
        the epoch's start, as DistributedSampler pads (it repeats up to ``n − 1`` samples so that every rank's
        share is equal; here up to ``Σ floors − 1``, in that step only).
        """
        lows = zip(sizes, self.min_batch, strict=True)
        return [min(size, max(low, self.learners, TAIL_FLOOR)) for size, low in lows]

    def _split(self, step: list[int], sizes: Sequence[int]) -> list[int]:
        if self.costs is not None:
            costs = self.costs[step]

            def by_cost(_: int, shares: list[int], floors: list[int]) -> list[int]:
                return split_by_cost(costs, shares, floors)

            return _among_takers(len(step), sizes, self.floors(sizes), by_cost)
        if len(step) == sum(sizes):
            return list(sizes)
        return self._split_tail(len(step), sizes)

    def _split_tail(self, total: int, sizes: Sequence[int]) -> list[int]:
        """The epoch's last, shorter step keeps the plan's proportions, and each replica's floor."""
        return _among_takers(total, sizes, self.floors(sizes), _apportioned)


TAIL_FLOOR = 2
"""The batch below which a step split otherwise than planned takes no replica planned more (BatchNorm needs two)."""


def _apportioned(total: int, shares: list[int], floors: list[int]) -> list[int]:
    return apportion(total, shares, min_size=floors)


Split = Callable[[int, list[int], list[int]], list[int]]
"""``split(total, shares, floors)``: counts summing to ``total``, each at least its floor."""


def _among_takers(total: int, sizes: Sequence[int], floors: Sequence[int], split: Split) -> list[int]:
    """``split(total, sizes, floors)`` among the replicas whose planned size is not 0; a left-out one keeps 0.

    >>> _among_takers(10, [4, 0, 4], [1, 0, 1], _apportioned)
    [5, 0, 5]
    """
    takers = [rank for rank, size in enumerate(sizes) if size > 0]
    counts = [0] * len(sizes)
    chosen = split(total, [sizes[rank] for rank in takers], [floors[rank] for rank in takers])
    for rank, count in zip(takers, chosen, strict=True):
        counts[rank] = count
    return counts
