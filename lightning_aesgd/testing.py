"""A pytest plugin: check your own LightningModule under ``adaptive_elastic`` on emulated heterogeneous CPU replicas.

Installing the package registers this module with pytest (entry point ``pytest11``), so any test suite gets the
``aesgd_trainer`` fixture, a factory of Trainers whose replicas are CPU processes made ``slowdown`` times slower
than real, through the real strategy (and :class:`~lightning_aesgd.callbacks.SlowdownCallback` for the slowdown
modes outside the optimizer step). A test of a small module takes seconds::

    def test_my_module_trains_on_mixed_devices(aesgd_trainer):
        trainer = aesgd_trainer(devices=2, slowdown=[1, 3], max_steps=8)
        trainer.fit(MyModule())
        assert trainer.state.finished
        assert trainer.callback_metrics["train/loss"] < 1.0

Without installing (a source checkout), load it with ``pytest -p lightning_aesgd.testing``; to keep it out of a
session, ``pytest -p no:lightning_aesgd.testing``. Loading it imports the package, and so Lightning.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import pytest
import pytorch_lightning as pl

from lightning_aesgd.callbacks import SlowdownCallback
from lightning_aesgd.emulation.profiles import SlowdownProfile, as_profile
from lightning_aesgd.strategy import AdaptiveElasticStrategy

Slowdown = Sequence[float] | Mapping[str, Any] | None


class TrainerFactory(Protocol):
    """The ``aesgd_trainer`` fixture's signature (see :func:`make_trainer`)."""

    def __call__(
        self,
        devices: int = 2,
        slowdown: SlowdownProfile | Slowdown = (1, 3),
        *,
        strategy_options: Mapping[str, Any] | None = None,
        timeout_s: float = 60.0,
        **trainer_kwargs: Any,
    ) -> pl.Trainer:
        """Build the Trainer."""


def make_trainer(
    devices: int = 2,
    slowdown: SlowdownProfile | Slowdown = (1, 3),
    *,
    strategy_options: Mapping[str, Any] | None = None,
    timeout_s: float = 60.0,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    """A quiet CPU Trainer with ``devices`` replica processes under ``adaptive_elastic``, emulating mixed devices.

    Replica ``r`` runs ``slowdown[r]`` times slower than real: in the default ``step`` mode the strategy stretches
    its own optimizer steps (as ``AdaptiveElasticStrategy(slowdown=...)`` does); other modes (a mapping with
    ``mode: user | data | hook | quota``) are applied by :class:`~lightning_aesgd.callbacks.SlowdownCallback`.
    Replicas start by fork where the platform has it (spawn elsewhere), and a collective that waits longer than
    ``timeout_s`` fails the test instead of hanging it.

    Args:
        devices: Replica processes.
        slowdown: One factor per replica, a mapping with ``factors`` (and ``mode``, ``changes``, ...), a
            :class:`~lightning_aesgd.emulation.profiles.SlowdownProfile`, or ``None`` for equal replicas.
        strategy_options: Further arguments of :class:`~lightning_aesgd.AdaptiveElasticStrategy`, e.g.
            ``{"sync": "models", "period": 2, "merge_rule": "sma"}``.
        timeout_s: Timeout of the replicas' collectives, in seconds.
        **trainer_kwargs: Further arguments of ``Trainer`` (``max_steps``, ``callbacks``, ...); they override the
            defaults (CPU, no logger, no checkpoints, no progress bar, no model summary).

    Returns:
        The Trainer.

    Raises:
        ValueError: If the slowdown profile does not give one factor per replica.
    """
    profile = as_profile(slowdown)
    if profile is not None:
        profile.check_replicas(devices)
    in_strategy = profile is not None and profile.mode == "step"
    start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    options: dict[str, Any] = {"start_method": start_method, "timeout": timedelta(seconds=timeout_s)}
    options.update(strategy_options or {})
    strategy = AdaptiveElasticStrategy(slowdown=profile if in_strategy else None, **options)
    callbacks = list(trainer_kwargs.pop("callbacks", None) or [])
    if profile is not None and not in_strategy:
        callbacks.append(SlowdownCallback(profile))
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **trainer_kwargs,
    }
    return pl.Trainer(strategy=strategy, devices=devices, callbacks=callbacks, **settings)


@pytest.fixture
def aesgd_trainer() -> Iterator[TrainerFactory]:
    """A factory of Trainers on emulated heterogeneous CPU replicas under ``adaptive_elastic``.

    Call it as ``aesgd_trainer(devices=2, slowdown=[1, 3], **trainer_kwargs)`` (see :func:`make_trainer`). The
    environment variables that Lightning's launchers export (ranks, ports) are restored after the test.
    """
    environment = os.environ.copy()
    yield make_trainer
    os.environ.clear()
    os.environ.update(environment)
