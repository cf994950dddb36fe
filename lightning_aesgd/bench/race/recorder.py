"""What one benchmark run measures, recorded by a Lightning callback on global rank zero.

Runs launch their replicas as child processes (``launch.start_method: fork``), so the figures exist only in
the rank-zero child: :class:`BenchRecorder` writes them to a JSON file when training ends, and the parent reads
it back with :meth:`RunRecord.load`.

The **training clock** is wall time from the start of training to its end, paused between
``on_validation_epoch_start`` and ``on_validation_end``: it counts steps, merges, data loading and emulated slowdown,
never evaluation. Every replica is waited for before the clock pauses, so that time spent waiting for a
straggler is counted even when validation follows. Sanity checks run before training starts and are therefore
never counted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_aesgd.engine.sampler import PlannedBatchSampler

RunKey = tuple[str, str, int]
"""(profile, algorithm, repeat)."""


@dataclass
class Validation:
    """One validation: when it happened on the training clock, after which step, and its metrics."""

    clock: float
    step: int
    epoch: int
    metrics: dict[str, float]


@dataclass
class RunRecord:
    """Everything one run measured, as written by rank zero.

    Attributes:
        world_size: number of replicas.
        clock: training-clock seconds at each step's end.
        samples: samples processed by all replicas together in each step.
        validations: every validation of the run, in order.
        plans: ``adaptive_elastic``'s plan book (``starts``: first step of each plan, ``sizes``: per-replica batch
            sizes), or ``None`` for other strategies.
        exchanges: ``adaptive_elastic``'s merges: step, plan in force and each replica's measured speed.
    """

    world_size: int = 1
    clock: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    validations: list[Validation] = field(default_factory=list)
    plans: dict[str, Any] | None = None
    exchanges: list[dict[str, Any]] | None = None

    @property
    def seconds(self) -> float:
        """Training-clock seconds of the whole run."""
        return self.clock[-1] if self.clock else 0.0

    @property
    def total_samples(self) -> int:
        """Samples processed by all replicas together."""
        return sum(self.samples)

    def save(self, path: Path) -> None:
        """Write the record as JSON."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        """Read a record written by :meth:`save`."""
        raw = json.loads(path.read_text())
        raw["validations"] = [Validation(**v) for v in raw["validations"]]
        return cls(**raw)


class BenchRecorder(pl.Callback):
    """Measures the training clock, samples per step, validations and plans; rank zero writes them to ``path``.

    Args:
        path: the JSON file to write when training ends.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.record = RunRecord()
        self._elapsed = 0.0
        self._running_since: float | None = None

    def _now(self) -> float:
        running = time.perf_counter() - self._running_since if self._running_since is not None else 0.0
        return self._elapsed + running

    def _pause(self) -> None:
        self._elapsed = self._now()
        self._running_since = None

    def _resume(self) -> None:
        if self._running_since is None:
            self._running_since = time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        self.record = RunRecord(world_size=trainer.world_size)
        self._elapsed, self._running_since = 0.0, None
        self._resume()

    def on_train_batch_end(  # noqa: D102
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.record.samples.append(samples_in_step(trainer, batch, batch_idx))
        self.record.clock.append(self._now())

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        # Wait for every replica before pausing: a straggler still finishing its step would otherwise be waited
        # for inside validation, off the clock, and frequent validation would hide most of DDP's waiting. Not in
        # `on_validation_start`: that runs before the strategy's own, where adaptive_elastic stops its arrival
        # clock, and the waiting would count as the replicas' own time.
        trainer.strategy.barrier("bench-clock")
        self._pause()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items() if name.startswith("val")}
        self.record.validations.append(Validation(self._now(), trainer.global_step, trainer.current_epoch, metrics))
        self._resume()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        self._pause()
        plans = getattr(trainer.strategy, "plans", None)
        if plans is not None and plans.plan_book is not None:
            self.record.plans = plans.plan_book.state_dict()
            self.record.exchanges = [
                {"step": record.step, "sizes": list(record.sizes), "speeds": list(record.speeds)}
                for record in plans.history
            ]
        if trainer.is_global_zero:
            self.record.save(self.path)


def samples_in_step(trainer: pl.Trainer, batch: Any, batch_idx: int) -> int:
    """Samples all replicas processed in this step.

    ``adaptive_elastic`` splits step s's indices ``[s·M, (s+1)·M)`` of the epoch's permutation, so the step
    holds ``min(M, N − s·M)`` samples, padded to one per replica; other strategies give every replica an
    equal batch (``DistributedSampler`` pads the epoch's tail), so the step holds the local batch × replicas.
    """
    sampler = getattr(trainer.train_dataloader, "batch_sampler", None)
    if isinstance(sampler, PlannedBatchSampler):
        step_size = sampler.step_batch_size
        left = sampler.dataset_size - batch_idx * step_size
        return max(min(step_size, left), sampler.num_replicas)
    return batch_length(batch) * trainer.world_size


def batch_length(batch: Any) -> int:
    """Number of samples in a batch: its ``len`` (e.g. ``SparseBatch``), or that of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return batch_length(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return batch_length(batch[0])
    return len(batch)
