"""SlowdownCallback emulates the same devices under any strategy (Lightning's DDP in particular)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_aesgd import SlowdownCallback, SlowdownChange, SlowdownProfile
from lightning_aesgd.callbacks import SlowCollate
from lightning_aesgd.callbacks import time as callback_time


class _Clock:
    def __init__(self, readings):
        self.readings = iter(readings)

    def mark(self):
        return next(self.readings)

    def seconds_since(self, mark):
        return next(self.readings) - mark


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
    callback.on_train_batch_end(_trainer(rank, step), None, None, None, 0)  # Lightning counted the step already
    assert sleeps == ([pytest.approx(expected_sleep)] if expected_sleep else [])


def test_the_profile_must_describe_every_replica():
    callback = SlowdownCallback([1, 2, 4])
    with pytest.raises(ValueError, match="one factor per device"):
        callback.setup(_trainer(0, 0), None, "fit")


def test_mappings_from_configs_are_accepted():
    callback = SlowdownCallback({"factors": [1, 2], "changes": [{"step": 5, "replica": 0, "factor": 3}], "base": 2})
    assert callback.profile.factor(0, 5) == 6.0


def _per_sample(mode: str) -> SlowdownProfile:
    return SlowdownProfile((1, 3), mode=mode, seconds_per_sample=0.01)


def test_hook_mode_sleeps_in_proportion_to_the_batch(monkeypatch):
    sleeps = []
    monkeypatch.setattr(callback_time, "sleep", sleeps.append)
    callback = SlowdownCallback(_per_sample("hook"))
    callback.setup(_trainer(1, 0), None, "fit")
    callback.on_train_batch_end(_trainer(1, 1), None, None, (torch.zeros(8, 2), torch.zeros(8)), 0)
    assert sleeps == [pytest.approx(3 * 0.01 * 8)]


def test_user_mode_slows_the_modules_training_step_and_restores_it(monkeypatch):
    sleeps = []
    monkeypatch.setattr(callback_time, "sleep", sleeps.append)

    class Module:
        def training_step(self, batch, batch_idx):
            return batch_idx

    module = Module()
    callback = SlowdownCallback(_per_sample("user"))
    callback.setup(_trainer(1, 0), module, "fit")
    assert module.training_step(torch.zeros(5, 2), 7) == 7
    assert sleeps == [pytest.approx(3 * 0.01 * 5)]
    callback.teardown(_trainer(1, 0), module, "fit")
    assert "training_step" not in vars(module)


def test_data_mode_slows_the_loaders_collate_function(monkeypatch):
    sleeps = []
    monkeypatch.setattr(callback_time, "sleep", sleeps.append)
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4)
    module = SimpleNamespace(train_dataloader=lambda: loader)
    trainer = SimpleNamespace(**vars(_trainer(1, 0)), datamodule=None)
    callback = SlowdownCallback(_per_sample("data"))
    callback.setup(trainer, module, "fit")
    batch = next(iter(module.train_dataloader()))
    assert isinstance(loader.collate_fn, SlowCollate)
    assert batch.tolist() == [0, 1, 2, 3]
    assert sleeps == [pytest.approx(3 * 0.01 * 4)]


def test_a_batch_object_is_counted_by_its_own_length(monkeypatch):
    class SparseRows:
        def __init__(self):
            self.indices = torch.zeros(500)  # non-zeros: Lightning's estimate would count these

        def __len__(self):
            return 4

    sleeps = []
    monkeypatch.setattr(callback_time, "sleep", sleeps.append)
    callback = SlowdownCallback(_per_sample("hook"))
    callback.setup(_trainer(0, 0), None, "fit")
    callback.on_train_batch_end(_trainer(0, 1), None, None, SparseRows(), 0)
    assert sleeps == [pytest.approx(0.01 * 4)]


class _RecordingSlowdown(SlowdownCallback):
    """Counts the stretches taken at DDP's last gradient bucket, per rank, into a file."""

    def __init__(self, profile, path) -> None:
        super().__init__(profile)
        self.path = path
        self.before_sync = 0

    def stretch_before_sync(self) -> None:
        self.before_sync += 1
        super().stretch_before_sync()

    def on_train_end(self, trainer, pl_module) -> None:
        (self.path / f"rank{trainer.global_rank}").write_text(str(self.before_sync))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_under_ddp_the_step_mode_stretches_before_the_gradient_all_reduce_and_keeps_ddps_result(tmp_path):
    """The stretch belongs to the device's compute, not to the all-reduce's work; the hook is otherwise DDP's."""
    from datetime import timedelta

    import pytorch_lightning as pl
    from helpers import RegressionModel, flat_parameters
    from pytorch_lightning.strategies import DDPStrategy

    def fit(callbacks):
        pl.seed_everything(7)
        model = RegressionModel()
        trainer = pl.Trainer(
            strategy=DDPStrategy(start_method="fork", timeout=timedelta(seconds=60)),
            accelerator="cpu",
            devices=2,
            max_steps=6,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )
        trainer.fit(model)
        return flat_parameters(model)

    plain = fit([])
    slowed = fit([_RecordingSlowdown([1.0, 3.0], tmp_path)])
    assert [int((tmp_path / f"rank{rank}").read_text()) for rank in (0, 1)] == [6, 6]
    torch.testing.assert_close(slowed, plain, atol=1e-6, rtol=0)
