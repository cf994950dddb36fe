"""SlowdownCallback emulates the same devices under any strategy (Lightning's DDP in particular)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_aesgd import SlowdownCallback, SlowdownChange, SlowdownProfile
from lightning_aesgd.callbacks import time as callback_time


class _Clock:
    def __init__(self, readings):
        self.readings = iter(readings)

    def now(self):
        return next(self.readings)


def _trainer(rank: int, step: int):
    return SimpleNamespace(
        global_rank=rank, global_step=step, world_size=2, strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )


@pytest.mark.parametrize(("rank", "step", "expected_sleep"), [(0, 1, 0.0), (1, 1, 1.0), (1, 11, 3.0)])
def test_each_replica_sleeps_its_factor_minus_one_times_its_step_compute(monkeypatch, rank, step, expected_sleep):
    sleeps = []
    monkeypatch.setattr(callback_time, "sleep", sleeps.append)
    profile = SlowdownProfile((1, 3), (SlowdownChange(step=10, replica=1, factor=7),), base=1)
    callback = SlowdownCallback(profile)
    callback.setup(_trainer(rank, 0), None, "fit")
    callback._clock = _Clock([10.0, 10.5])  # the step used half a second of compute
    callback.on_train_batch_start(_trainer(rank, step - 1))
    callback.on_train_batch_end(_trainer(rank, step))  # Lightning counts the step before this hook
    assert sleeps == ([pytest.approx(expected_sleep)] if expected_sleep else [])


def test_the_profile_must_describe_every_replica():
    callback = SlowdownCallback([1, 2, 4])
    with pytest.raises(ValueError, match="one factor per device"):
        callback.setup(_trainer(0, 0), None, "fit")


def test_mappings_from_configs_are_accepted():
    callback = SlowdownCallback({"factors": [1, 2], "changes": [{"step": 5, "replica": 0, "factor": 3}], "base": 2})
    assert callback.profile.factor(0, 5) == 6.0
