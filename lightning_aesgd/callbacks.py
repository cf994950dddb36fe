"""Lightning callbacks: heterogeneity emulation for any strategy, so baselines run under the same profile."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytorch_lightning as pl

from lightning_aesgd.slowdown import ComputeClock, SlowdownProfile, as_profile


class SlowdownCallback(pl.Callback):
    """Emulate slower devices under any strategy (Lightning's DDP in particular).

    Each step, replica ``r`` sleeps ``(f_r − 1) × c`` after its step, where ``c`` is the step's compute time as
    :class:`~lightning_aesgd.slowdown.ComputeClock` measures it: CPU time on CPU, which excludes the time DDP's
    gradient all-reduce spends waiting for slower peers. The sleep comes before the next step's collectives,
    so under DDP every step waits for the slowest emulated device, as it would on real mixed hardware.
    ``adaptive_elastic`` applies the same profile itself through its ``slowdown`` argument.

    Args:
        profile: a :class:`~lightning_aesgd.slowdown.SlowdownProfile`, a list of factors, or a mapping with
            ``factors`` (and optional ``changes``).
    """

    def __init__(self, profile: SlowdownProfile | Sequence[float] | Mapping[str, Any]) -> None:
        resolved = as_profile(profile)
        assert resolved is not None
        self.profile = resolved
        self._clock: ComputeClock | None = None
        self._started = 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        if stage == "fit":
            self.profile.check_replicas(trainer.world_size)
            self._clock = ComputeClock(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:  # noqa: D102
        if self._clock is not None:
            self._started = self._clock.now()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:  # noqa: D102
        if self._clock is None:
            return
        factor = self.profile.factor(trainer.global_rank, trainer.global_step - 1)
        if factor > 1:
            time.sleep((factor - 1) * (self._clock.now() - self._started))
