"""Lightning callbacks: heterogeneity emulation for any strategy, so that every strategy runs under the same profile."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.data import extract_batch_size
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_aesgd.emulation.clock import ComputeClock, stretch
from lightning_aesgd.emulation.cpu_quota import CpuQuota
from lightning_aesgd.emulation.profiles import SlowdownProfile, as_profile


class SlowdownCallback(pl.Callback):
    """Emulate slower devices under any strategy, with the slowness where the profile's ``mode`` puts it.

    * ``step``: replica ``r`` sleeps ``(f_r − 1) × c`` per step, ``c`` the step's compute time as
      :class:`~lightning_aesgd.emulation.clock.ComputeClock` measures it (CPU time on CPU, which excludes time DDP's
      gradient all-reduce spends waiting for slower peers). Under DistributedDataParallel the compute is the
      forward and backward, stretched when the last gradient bucket is ready and before its all-reduce (a slower
      device finishes its backward later), and the optimizer's update, stretched at the end of the step: the
      all-reduce's own work is not the device's compute. The hook doing this is otherwise DDP's default; where the
      strategy has a hook of its own, the whole step is stretched at its end. ``adaptive_elastic`` applies this
      mode itself, through its ``slowdown`` argument (the engine tells a
      :class:`~lightning_aesgd.emulation.clock.StepStretcher` of the same compute spans).
    * ``user``: the LightningModule's ``training_step`` takes ``f_r × s`` more seconds per sample.
    * ``data``: the training DataLoader's collate function takes ``f_r × s`` seconds per sample.
    * ``hook``: ``on_train_batch_end`` takes ``f_r × s`` seconds per sample.
    * ``quota``: each replica process runs under a CPU quota of ``1/f_r`` of its fair share of the cores.

    Args:
        profile: a :class:`~lightning_aesgd.emulation.profiles.SlowdownProfile`, a list of factors, or a mapping with
            ``factors`` (and optional ``changes``, ``base``, ``mode``, ``seconds_per_sample``).
        replicas_sharing: in the ``quota`` mode, how many replicas share the machine's cores equally at factor 1;
            by default the replicas of this run on one node (a lone replica measuring one device of a larger
            run sets the larger run's count).
    """

    def __init__(
        self, profile: SlowdownProfile | Sequence[float] | Mapping[str, Any], replicas_sharing: int | None = None
    ) -> None:
        resolved = as_profile(profile)
        assert resolved is not None
        self.profile = resolved
        self.replicas_sharing = replicas_sharing
        self._clock: ComputeClock | None = None
        self._started: Any = None
        self._stretched_before_sync = False
        self._update_started: Any = None
        self._quota: CpuQuota | None = None
        self._restore: list[Callable[[], None]] = []

    @property
    def mode(self) -> str:
        """Where the slowness lands."""
        return self.profile.mode

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        if stage != "fit":
            return
        self.profile.check_replicas(trainer.world_size)
        rank = trainer.global_rank
        if self.mode == "step":
            self._clock = ComputeClock(trainer.strategy.root_device)
        elif self.mode == "user":
            self._slow_down_training_step(trainer, pl_module)
        elif self.mode == "data":
            self._slow_down_collate(trainer, pl_module)
        elif self.mode == "quota":
            cores = _fair_share_of_cores(trainer, self.replicas_sharing) / self.profile.factor(rank, 0)
            self._quota = CpuQuota(cores, f"lightning_aesgd_{os.getpid()}_{rank}")
            self._quota.apply()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        self._started = self._update_started = None  # a device's marks (CUDA events) do not outlive the fit
        if self._quota is not None:
            self._quota.release()
            self._quota = None
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Release the CPU quota and the wrapped hooks when fit fails, as when it ends."""
        self.teardown(trainer, pl_module, "fit")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        model = trainer.strategy.model
        if self._clock is None or not isinstance(model, DistributedDataParallel):
            return
        self._trainer = trainer
        try:
            model.register_comm_hook(self, _stretch_then_allreduce)
        except RuntimeError:  # the strategy registered a hook of its own: stretch at the end of the step
            return

    def stretch_before_sync(self) -> None:
        """The last gradient bucket is ready: the emulated device's forward and backward end now."""
        if self._clock is None or self._stretched_before_sync or self._started is None:
            return
        trainer = self._trainer
        stretch(self._clock, self._started, self.profile.factor(trainer.global_rank, trainer.global_step))
        self._stretched_before_sync = True

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:  # noqa: D102
        if self._clock is not None:
            self._started = self._clock.mark()
            self._stretched_before_sync = False
            self._update_started = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """After the gradient all-reduce: the update's compute is timed from here."""
        if self._clock is not None and self._stretched_before_sync:
            self._update_started = self._clock.mark()

    def on_train_batch_end(  # noqa: D102
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step - 1
        if self._clock is not None:
            started = self._update_started if self._stretched_before_sync else self._started
            if started is not None:
                stretch(self._clock, started, self.profile.factor(trainer.global_rank, step))
        elif self.mode == "hook":
            time.sleep(self.profile.extra_seconds(trainer.global_rank, step, _batch_size(batch)))

    def _slow_down_training_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        original = pl_module.training_step
        profile = self.profile

        @functools.wraps(original)
        def slow_training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            output = original(batch, *args, **kwargs)
            time.sleep(profile.extra_seconds(trainer.global_rank, trainer.global_step, _batch_size(batch)))
            return output

        pl_module.training_step = slow_training_step  # type: ignore[method-assign]
        self._restore.append(lambda: delattr(pl_module, "training_step"))

    def _slow_down_collate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The loader is built later (and rebuilt by samplers and strategies, which keep its collate_fn):
        # wrap the hook that builds it, whether it lives on the datamodule or on the module.
        datamodule = getattr(trainer, "datamodule", None)
        owner: Any = datamodule if datamodule is not None else pl_module
        build = owner.train_dataloader
        seconds = self.profile.extra_seconds(trainer.global_rank, 0, 1)

        @functools.wraps(build)
        def slow_train_dataloader() -> Any:
            loader = build()
            slow = SlowCollate(loader.collate_fn, seconds)
            loader.collate_fn = slow
            # Lightning re-creates loaders from the arguments it saw (to inject its sampler): update them too.
            saved = getattr(loader, "__pl_saved_kwargs", None)
            if saved is not None:
                saved["collate_fn"] = slow
            return loader

        owner.train_dataloader = slow_train_dataloader
        self._restore.append(lambda: delattr(owner, "train_dataloader"))


class SlowCollate:
    """A collate function that takes ``seconds_per_sample`` per sample longer (picklable for loader workers).

    Args:
        collate: the loader's own collate function.
        seconds_per_sample: extra seconds per sample.
    """

    def __init__(self, collate: Callable[[list[Any]], Any], seconds_per_sample: float) -> None:
        self.collate = collate
        self.seconds_per_sample = seconds_per_sample

    def __call__(self, samples: list[Any]) -> Any:  # noqa: D102
        batch = self.collate(samples)
        time.sleep(self.seconds_per_sample * len(samples))
        return batch


def _stretch_then_allreduce(state: SlowdownCallback, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce, after the emulated device's compute has been stretched at the last bucket."""
    if bucket.is_last():
        state.stretch_before_sync()
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


# DDP checks a hook's annotations as objects; this module's are strings (postponed evaluation).
_stretch_then_allreduce.__annotations__ = {
    "state": SlowdownCallback,
    "bucket": torch.distributed.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}


def _batch_size(batch: Any) -> int:
    """Samples in a batch: a batch object's own length (e.g. a sparse batch), else Lightning's estimate."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if hasattr(batch, "__len__") and not isinstance(batch, (list, tuple, Mapping, str)):
        # Lightning's estimate would take the first tensor inside it, e.g. a sparse batch's non-zeros.
        return len(batch)
    return int(extract_batch_size(batch))


def _fair_share_of_cores(trainer: pl.Trainer, replicas_sharing: int | None) -> float:
    """The CPUs each local replica would get if all shared the machine equally."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local_replicas = replicas_sharing or max(1, trainer.world_size // max(1, trainer.num_nodes))
    return cores / local_replicas
