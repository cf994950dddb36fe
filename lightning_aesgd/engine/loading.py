"""Rebuild the user's training DataLoader around an :class:`~lightning_aesgd.engine.sampler.PlannedBatchSampler`.

Users keep writing ``DataLoader(dataset, batch_size=..., shuffle=True, num_workers=...)``; the strategy turns it
into an :class:`PlannedDataLoader` that keeps every option of the original loader and only replaces how indices
are batched.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightning_aesgd.core.values import is_whole
from lightning_aesgd.engine.sampler import PlanBook, PlannedBatchSampler, StepIndices

SampleCosts = Union[None, Literal["dataset", "auto"], Callable[[Any], "Sequence[float] | Tensor"]]  # noqa: UP007


def resolve_sample_costs(spec: SampleCosts, dataset: Any) -> Tensor | None:
    """Per-sample costs for cost-aware splitting, from the dataset's ``sample_costs`` or a function of it.

    ``"auto"`` uses the dataset's ``sample_costs`` where it has them and counts samples otherwise.
    """
    if spec is None or (spec == "auto" and not hasattr(dataset, "sample_costs")):
        return None
    if spec == "auto":
        spec = "dataset"
    if spec == "dataset":
        if not hasattr(dataset, "sample_costs"):
            raise TypeError(
                f"sample_costs='dataset' needs a `sample_costs` attribute on {type(dataset).__name__} (one cost "
                "per sample, e.g. its number of non-zeros). HINT: add it, or pass a function of the dataset."
            )
        costs = dataset.sample_costs
    else:
        check_sample_costs(spec)
        costs = spec(dataset)
    costs = torch.as_tensor(costs, dtype=torch.float64)
    size = len(dataset) if isinstance(dataset, Sized) else None
    if costs.ndim != 1 or (size is not None and len(costs) != size):
        raise ValueError(
            f"Got sample costs of shape {tuple(costs.shape)} for a dataset of {size} samples. HINT: sample_costs "
            "must give one number per sample of the training dataset."
        )
    if not bool(torch.isfinite(costs).all()) or bool((costs < 0).any()):
        raise ValueError(
            "Sample costs must be finite and non-negative. HINT: fix the dataset's `sample_costs` (or the function "
            "passed as sample_costs), e.g. the number of non-zeros of each sample."
        )
    return costs


def check_sample_costs(spec: SampleCosts) -> None:
    """Raise, with the choices, unless ``spec`` is a valid ``sample_costs`` option (checked at construction)."""
    if spec is None or callable(spec) or (isinstance(spec, str) and spec in ("dataset", "auto")):
        return
    raise ValueError(
        f"Unknown sample_costs {spec!r}. HINT: pass None (count samples), 'auto', 'dataset' or a function of the "
        "dataset that returns one cost per sample."
    )


LOADER_CLOCK_SLOTS = 1024  # steps remembered; far more than any loader prefetches

# DataLoader options carried over unchanged; `prefetch_factor` only exists when workers do.
_KEPT_OPTIONS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


IN_ORDER_WARNING = (
    "DataLoader(in_order=False) is set to in_order=True on the strategy's loader: each step's batch must reach the "
    "step it was planned for, which gives its loss weight (out of order, a replica trained the next step's batch "
    "with this step's weight). HINT: drop in_order=False; for slow samples, raise num_workers or prefetch_factor."
)
"""The warning for a training loader made with ``in_order=False``, which the strategy's loader cannot honour."""


class LoaderClock:
    """Seconds the loader spent producing each step's batch, in whichever process produced it.

    DataLoader workers prepare batches while the replica trains, so a slow data pipeline shows in the replica's
    arrival times only by what the workers failed to hide. The workers write each batch's production time
    (fetching and collating) into a small shared-memory ring, keyed by step; the replica reads it when it trains
    that step, and plans from the larger of its arrival time and its loader's time.

    Args:
        slots: how many steps the ring remembers.
    """

    def __init__(self, slots: int = LOADER_CLOCK_SLOTS) -> None:
        self.seconds = torch.zeros(slots, dtype=torch.float64).share_memory_()  # type: ignore[no-untyped-call]
        self._slots = self.seconds.numpy()  # the same memory: a numpy element costs a tenth of a tensor element

    def __getstate__(self) -> dict[str, Any]:
        return {"seconds": self.seconds}  # the tensor travels to workers as shared memory; the view is rebuilt

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.seconds = state["seconds"]
        self._slots = self.seconds.numpy()

    def record(self, step: int, seconds: float) -> None:
        """Note that producing step ``step``'s batch took ``seconds``."""
        self._slots[step % len(self._slots)] = seconds

    def read(self, step: int) -> float:
        """Seconds producing step ``step``'s batch took (0 if not recorded); the slot is cleared."""
        slot = step % len(self._slots)
        seconds = float(self._slots[slot])
        self._slots[slot] = 0.0
        return seconds


class IdleBatch:
    """The batch of a replica that the plan leaves out of a step (batch size 0).

    Lightning's loop still runs the step, so that every replica takes part in its sync point; the strategy runs no
    forward over data for it, only a zero loss's backward (:mod:`lightning_aesgd.idle_steps`). It is not moved to a
    device. Where the user's module or callbacks override a hook that receives the batch, no replica is left out
    (:func:`~lightning_aesgd.idle_steps.batch_hooks_in_training`).
    """

    def __repr__(self) -> str:
        return "IdleBatch()"

    def __len__(self) -> int:
        return 0


def is_idle(batch: Any) -> bool:
    """Whether ``batch`` is an :class:`IdleBatch`, or holds one (a dict of one training loader gives ``{"a": ...}``).

    Only one level deep, where Lightning's CombinedLoader puts a loader's batch: a step's batch may hold thousands
    of items, and this runs twice a step.

    >>> is_idle(IdleBatch()), is_idle({"main": IdleBatch()}), is_idle([torch.zeros(2)])
    (True, True, False)
    """
    if isinstance(batch, IdleBatch):
        return True
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return len(items) == 1 and isinstance(next(iter(items)), IdleBatch)


class TimedLoading(Dataset[Any]):
    """The user's dataset and collate function as one timed step: fetch every sample of a batch, then collate.

    The planned loader asks for whole batches (``__getitems__``) and its own collate function only unwraps what
    this returns, so the time of the user's fetching and collating is measured in the process that does it.
    Attributes of the user's dataset are reachable through this wrapper.

    Args:
        dataset: the user's map-style dataset.
        collate: the user's collate function.
        clock: where the times go.
        workers: loader worker processes producing batches in parallel; each batch's time is divided by their
            number, the rate at which the loader can keep up.
    """

    _OWN = ("dataset", "collate", "clock", "workers")
    dataset: Dataset[Any]
    collate: Callable[[list[Any]], Any]
    clock: LoaderClock
    workers: int

    def __init__(
        self, dataset: Dataset[Any], collate: Callable[[list[Any]], Any], clock: LoaderClock, workers: int = 0
    ) -> None:
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "collate", collate)
        object.__setattr__(self, "clock", clock)
        object.__setattr__(self, "workers", workers)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        if not indices:  # a replica left out of the step: nothing to fetch or collate
            return [IdleBatch()]
        started = time.perf_counter()
        fetch = getattr(self.dataset, "__getitems__", None)
        samples = fetch(indices) if fetch is not None else [self.dataset[i] for i in indices]
        batch = self.collate(samples)
        if isinstance(indices, StepIndices):
            self.clock.record(indices.step, (time.perf_counter() - started) / max(1, self.workers))
        return [batch]

    def __getattr__(self, name: str) -> Any:
        if name in self._OWN:  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # A worker_init_fn that sets state on `get_worker_info().dataset` means the user's dataset.
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)


def unwrap_batch(data: list[Any]) -> Any:
    """The planned loader's collate function: :class:`TimedLoading` already collated the batch."""
    return data[0]


class PlannedDataLoader(DataLoader[Any]):
    """A DataLoader whose position in the data is saved in checkpoints, so a resumed run continues mid-epoch.

    Lightning saves and restores any training loader that has ``state_dict``/``load_state_dict``.
    """

    batch_sampler: PlannedBatchSampler
    loader_clock: LoaderClock

    def state_dict(self) -> dict[str, int]:  # noqa: D102
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:  # noqa: D102
        self.batch_sampler.load_state_dict(state)


@dataclass(frozen=True)
class TrainLoaderFacts:
    """What the planned loader keeps of the user's training DataLoader, read (and checked) once."""

    dataset_size: int
    batch_size: int
    shuffle: bool
    seed: int


def inspect_train_loader(loader: DataLoader[Any]) -> TrainLoaderFacts:
    """Read what the planned loader needs from ``loader``.

    A plain torch ``BatchSampler`` over a ``SequentialSampler`` or ``RandomSampler`` of the whole dataset (what
    ``batch_size``, ``shuffle`` and ``drop_last=False`` build) is read as those options: its batch size and its
    sampler's order. Lightning's distributed sampler injection (``use_distributed_sampler=True``, the default)
    rebuilds such a loader before the strategy sees it, as ``batch_size=1`` (torch's default) and a
    ``DistributedSampler``; DDP trains that loader too.

    Raises:
        TypeError: for loaders the strategy cannot partition (iterable datasets, datasets without length,
            custom samplers or batch samplers, a ``BatchSampler`` with ``drop_last=True``, ``batch_size=None``),
            with the fix in the message.
    """
    size = _dataset_size(loader)
    shuffle, seed = _ordering(loader, size)
    return TrainLoaderFacts(size, _batch_size(loader), shuffle, seed)


def check_step_options(step_batch_size: Any, plan_lag: Any) -> None:
    """Check the strategy's loader options when it is built, before any DataLoader is known.

    Raises:
        ValueError: unless each is a whole number >= 1 or None, naming the option and the fix.
    """
    for name, value in (("step_batch_size", step_batch_size), ("plan_lag", plan_lag)):
        if value is not None and (not is_whole(value) or value < 1):
            raise ValueError(
                f"`{name}` must be a whole number >= 1 or None (the default), got {value!r}. HINT: leave {name} "
                "unset for the default, or pass e.g. 4."
            )


def check_step_fits(dataset_size: int, step_batch_size: int, drop_last: bool) -> None:
    """Check that an epoch of ``dataset_size`` samples yields at least one step of ``step_batch_size``.

    Raises:
        ValueError: with ``drop_last``, when the only step would be dropped (every epoch would train nothing).
    """
    if drop_last and dataset_size < step_batch_size:
        raise ValueError(
            f"With drop_last=True, the {dataset_size} samples of the training dataset do not fill one step of "
            f"{step_batch_size}: every epoch would train nothing. HINT: set drop_last=False on the training "
            "DataLoader, or lower its batch_size (or the strategy's step_batch_size)."
        )


def build_planned_loader(
    loader: DataLoader[Any],
    facts: TrainLoaderFacts,
    *,
    num_replicas: int,
    rank: int,
    plan_book: PlanBook,
    step_batch_size: int,
    costs: Tensor | None = None,
    learners: int = 1,
    min_batch: int | Sequence[int] = 1,
) -> PlannedDataLoader:
    """Return a copy of ``loader`` whose batches follow the plans in ``plan_book``.

    Args:
        loader: the training DataLoader as the user (and Lightning's sampler injection) built it.
        facts: what :func:`inspect_train_loader` read from it.
        num_replicas: number of replicas.
        rank: this replica's index.
        plan_book: the plans, shared with the strategy.
        step_batch_size: indices per step over all replicas.
        costs: optional per-sample costs for cost-aware splitting.
        learners: models each replica trains side by side (each needs a sample of the epoch's last step).
        min_batch: the strategy's smallest batch per replica, which the epoch's last step keeps too.
    """
    check_step_fits(facts.dataset_size, step_batch_size, loader.drop_last)
    batch_sampler = PlannedBatchSampler(
        facts.dataset_size,
        step_batch_size,
        num_replicas,
        rank,
        plan_book,
        shuffle=facts.shuffle,
        seed=facts.seed,
        drop_last=loader.drop_last,
        costs=costs,
        learners=learners,
        min_batch=min_batch,
    )
    options: dict[str, Any] = {name: getattr(loader, name) for name in _KEPT_OPTIONS if hasattr(loader, name)}
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    if options.get("in_order") is False:
        options["in_order"] = True
        if rank == 0:
            warnings.warn(IN_ORDER_WARNING, stacklevel=2)
    clock = LoaderClock()
    options["collate_fn"] = unwrap_batch
    timed = TimedLoading(loader.dataset, loader.collate_fn, clock, loader.num_workers)
    elastic = PlannedDataLoader(timed, batch_sampler=batch_sampler, **options)
    elastic.loader_clock = clock
    return elastic


def prefetch_depth(loader: DataLoader[Any]) -> int:
    """How many batches a DataLoader (plus Lightning's one-batch fetcher) can draw ahead of training."""
    workers_ahead = loader.num_workers * (loader.prefetch_factor or 0) if loader.num_workers > 0 else 0
    return workers_ahead + 1


def _dataset_size(loader: DataLoader[Any]) -> int:
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            "adaptive_elastic splits every step's indices among replicas, which needs a map-style dataset; "
            f"got an IterableDataset ({type(loader.dataset).__name__}). HINT: use a map-style Dataset with "
            "__getitem__ and __len__, or train this loader with strategy='ddp'."
        )
    if not isinstance(loader.dataset, Sized):
        raise TypeError(
            f"The training dataset {type(loader.dataset).__name__} has no length. HINT: implement __len__ so that "
            "adaptive_elastic can plan the steps of an epoch."
        )
    return len(loader.dataset)


def _users_batch_sampler(loader: DataLoader[Any]) -> BatchSampler | None:
    """The plain torch ``BatchSampler`` the user passed as ``batch_sampler`` (None where torch built it)."""
    batch_sampler = loader.batch_sampler
    if loader.batch_size is None and type(batch_sampler) is BatchSampler:
        return batch_sampler
    return None


def _ordering(loader: DataLoader[Any], size: int) -> tuple[bool, int]:
    """Whether to shuffle, and the seed, as the loader's sampler (or its batch sampler's) implied."""
    users = _users_batch_sampler(loader)
    # With a user's BatchSampler, `loader.sampler` is torch's unused default: the indices come from its sampler.
    sampler = users.sampler if users is not None else loader.sampler
    if type(sampler) is DistributedSampler:  # injected by Lightning in place of a plain shuffle or sequence
        return sampler.shuffle, sampler.seed
    if isinstance(sampler, DistributedSampler):
        # Lightning wraps a user's own sampler (weighted, class-balanced, ...) in a DistributedSampler subclass;
        # keeping only its shuffle flag would silently train on other samples than the sampler draws.
        inner = getattr(getattr(sampler, "dataset", None), "_sampler", sampler)
        raise TypeError(
            f"adaptive_elastic draws and partitions indices itself and cannot follow the sampler "
            f"{type(inner).__name__} of the training DataLoader. HINT: build the loader with shuffle=True or "
            "shuffle=False and no sampler (weight the loss, or resample the dataset, for weighted sampling), or "
            "train with strategy='ddp'."
        )
    if isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None:
        _check_sampler_covers_dataset(type(sampler).__name__, len(sampler.data_source), size)
        return True, int(os.environ.get("PL_GLOBAL_SEED", 0))
    if isinstance(sampler, SequentialSampler):
        _check_sampler_covers_dataset(type(sampler).__name__, len(sampler.data_source), size)
        return False, 0
    raise TypeError(
        f"adaptive_elastic draws and partitions indices itself and cannot keep the sampler "
        f"{type(sampler).__name__}. HINT: build the training DataLoader with shuffle=True or shuffle=False and "
        "no sampler."
    )


def _check_sampler_covers_dataset(name: str, drawn: int, size: int) -> None:
    """Raise unless a plain sampler of ``drawn`` indices draws every sample once, as the strategy's epoch does."""
    if drawn != size:
        raise TypeError(
            f"The training DataLoader's {name} draws {drawn} indices of a dataset of {size} "
            "samples; adaptive_elastic draws every sample once per epoch and cannot follow it. HINT: build the "
            "loader with shuffle=True or shuffle=False and no sampler (for a subset, pass a Subset of the dataset)."
        )


def _batch_size(loader: DataLoader[Any]) -> int:
    users = _users_batch_sampler(loader)
    if users is not None:
        if users.drop_last:
            # The planned loader takes drop_last from the DataLoader, which torch keeps False beside a batch_sampler.
            raise TypeError(
                "adaptive_elastic cannot keep drop_last=True of the training DataLoader's BatchSampler. HINT: pass "
                f"batch_size={users.batch_size}, shuffle=... and drop_last=True to the DataLoader instead of a "
                "batch_sampler."
            )
        return users.batch_size
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        raise TypeError(
            "adaptive_elastic sizes every replica's batches itself and cannot keep a custom batch_sampler or "
            "batch_size=None. HINT: pass batch_size=<per-replica batch size> to the training DataLoader."
        )
    return loader.batch_size
