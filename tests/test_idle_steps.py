"""Which user code would receive a left-out replica's idle batch: then no replica is left out."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytorch_lightning as pl
from helpers import RegressionModel
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint, TQDMProgressBar

from lightning_aesgd import SlowdownCallback
from lightning_aesgd.idle_steps import batch_hooks_in_training


class _TransferHook(RegressionModel):
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


class _ReadingCallback(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        return None


class _RenamedBatch(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, data, index) -> None:
        return None


class _TransferringData(pl.LightningDataModule):
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


class _CountingCallback(pl.Callback):
    def on_train_batch_start(self, trainer, *args: Any) -> None:
        return None


def _trainer(*callbacks: pl.Callback, datamodule: Any = None) -> Any:
    return SimpleNamespace(callbacks=list(callbacks), datamodule=datamodule)


def test_lightnings_own_hooks_and_callbacks_and_this_packages_let_replicas_be_left_out():
    callbacks = (ModelCheckpoint(), LearningRateMonitor(), TQDMProgressBar(), SlowdownCallback([1, 2]))
    assert batch_hooks_in_training(_trainer(*callbacks), RegressionModel()) is None


def test_a_callback_that_takes_its_hooks_arguments_as_args_lets_replicas_be_left_out():
    assert batch_hooks_in_training(_trainer(_CountingCallback()), RegressionModel()) is None


def test_a_module_batch_hook_or_a_callback_that_takes_the_batch_keeps_every_replica_in():
    reason = batch_hooks_in_training(_trainer(), _TransferHook())
    assert reason is not None
    assert reason.startswith("the module overrides on_before_batch_transfer(), which would receive a left-out")
    reason = batch_hooks_in_training(_trainer(ModelCheckpoint(), _ReadingCallback()), RegressionModel())
    assert reason is not None
    assert "the callback _ReadingCallback overrides on_train_batch_end()" in reason


def test_a_batch_hook_under_another_name_a_datamodules_or_a_batch_size_fn_keeps_every_replica_in():
    # Lightning passes the batch by position; a DataModule's transfer hook and ThroughputMonitor's function see it.
    from pytorch_lightning.callbacks import ThroughputMonitor

    reason = batch_hooks_in_training(_trainer(_RenamedBatch()), RegressionModel())
    assert reason is not None
    assert "_RenamedBatch overrides on_train_batch_start()" in reason
    reason = batch_hooks_in_training(_trainer(datamodule=_TransferringData()), RegressionModel())
    assert reason is not None
    assert reason.startswith("the DataModule overrides on_before_batch_transfer()")
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))
    reason = batch_hooks_in_training(_trainer(monitor), RegressionModel())
    assert reason is not None
    assert "ThroughputMonitor calls its batch_size_fn" in reason
    assert batch_hooks_in_training(_trainer(datamodule=pl.LightningDataModule()), RegressionModel()) is None
