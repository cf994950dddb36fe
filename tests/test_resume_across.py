"""Resuming across shapes: another number of replicas, and checkpoints crossing between DDP and the strategy.

Each case interrupts a fit mid-epoch and resumes it; every sample of the interrupted epoch must then be used
exactly once, by the steps before the checkpoint and the steps after it together.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from helpers import RegressionData, RegressionModel, flat_parameters
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_aesgd import AdaptiveElasticStrategy

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(240)]

TIMEOUT = timedelta(seconds=90)
SIZE = 64  # samples; the loader's batch size is 4


class _SeenWriter(pl.Callback):
    """Writes the indices every step of this rank saw, per fit, to ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        self.directory.mkdir(exist_ok=True)
        (self.directory / f"seen_{trainer.global_rank}.json").write_text(json.dumps(pl_module.seen))


class _WorkerModel(RegressionModel):
    """Loads in a worker process, which draws its first batches while Lightning sets the data up, before its loop's
    reset: the sampler must start where the loop will."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RegressionData(self.hparams.size), batch_size=self.hparams.batch_size, num_workers=1)


def _strategy(devices: int, kind: str = "adaptive", **options):
    if devices == 1 and kind == "adaptive":
        return AdaptiveElasticStrategy(**options)
    if kind == "ddp":
        return DDPStrategy(start_method="fork", timeout=TIMEOUT)
    return AdaptiveElasticStrategy(start_method="fork", timeout=TIMEOUT, **options)


def _fit(
    directory: Path,
    devices: int,
    max_steps: int,
    *,
    kind="adaptive",
    ckpt_path=None,
    save_at=None,
    limit_train_batches=1.0,
    workers=0,
    max_epochs=None,
    **options,
):
    """One fit of the regression model; returns the checkpoint written at ``save_at`` steps, if asked.

    ``save_at="epoch_end"``: ModelCheckpoint's default, at the end of an epoch (one ``max_steps`` cut short too).
    """
    callbacks: list[pl.Callback] = [_SeenWriter(directory)]
    if save_at == "epoch_end":
        callbacks.append(ModelCheckpoint(dirpath=directory, filename="last"))
    elif save_at is not None:
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=save_at, filename="{step}"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=_strategy(devices, kind, **options),
        max_steps=max_steps,
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=save_at is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        limit_train_batches=limit_train_batches,
    )
    pl.seed_everything(7)
    model = (_WorkerModel if workers else RegressionModel)(size=SIZE, batch_size=4)
    trainer.fit(model, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    if devices == 1 and torch.distributed.is_initialized():
        # A fit in this process leaves its process group: forked replicas of a later fit would inherit it.
        torch.distributed.destroy_process_group()
    if save_at == "epoch_end":
        return directory / "last.ckpt"
    return directory / f"step={save_at}.ckpt" if save_at is not None else model


def _seen(directory: Path) -> list[int]:
    return [i for path in sorted(directory.glob("seen_*.json")) for step in json.loads(path.read_text()) for i in step]


@pytest.mark.parametrize(
    ("before", "after", "save_at"),
    [(2, 1, 3), (1, 2, 5), (4, 2, 1)],
    ids=["2-on-1", "1-on-2", "4-on-2"],
)
def test_a_mid_epoch_checkpoint_resumes_on_another_number_of_replicas(tmp_path, before, after, save_at):
    steps_per_epoch = SIZE // (4 * before)  # the checkpoint's step size is kept: the epoch keeps its steps
    path = _fit(tmp_path / "first", before, save_at, save_at=save_at)
    _fit(tmp_path / "resumed", after, steps_per_epoch, ckpt_path=path)
    used = _seen(tmp_path / "first") + _seen(tmp_path / "resumed")
    assert sorted(used) == list(range(SIZE)), "every sample of the interrupted epoch once"


def test_the_merged_model_of_two_replicas_loads_and_trains_on_one_process(tmp_path):
    path = _fit(tmp_path / "first", 2, 3, save_at=3)
    merged = RegressionModel.load_from_checkpoint(path)
    assert torch.isfinite(flat_parameters(merged)).all()
    model = _fit(tmp_path / "resumed", 1, 5, ckpt_path=path)
    assert not torch.equal(flat_parameters(model), flat_parameters(merged)), "the resumed fit must train"


def test_another_step_size_mid_epoch_fails_before_training_with_the_fix(tmp_path):
    path = _fit(tmp_path / "first", 2, 3, save_at=3)
    with pytest.raises(ValueError, match="step_batch_size=8"):
        _fit(tmp_path / "resumed", 1, 8, ckpt_path=path, step_batch_size=4)
    assert not (tmp_path / "resumed").exists(), "no training step may run"


def test_a_mid_epoch_ddp_checkpoint_resumes_exactly_with_the_strategy(tmp_path):
    path = _fit(tmp_path / "ddp", 2, 3, kind="ddp", save_at=3)
    _fit(tmp_path / "resumed", 2, 8, ckpt_path=path)
    used = _seen(tmp_path / "ddp") + _seen(tmp_path / "resumed")
    assert sorted(used) == list(range(SIZE)), "DDP's first steps and ours after them: every sample once"


def test_a_mid_epoch_checkpoint_of_the_strategy_resumes_with_ddp(tmp_path):
    path = _fit(tmp_path / "first", 2, 3, save_at=3)
    assert "combined_loader" not in torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]
    model = _fit(tmp_path / "ddp", 2, 8, kind="ddp", ckpt_path=path)
    assert torch.isfinite(flat_parameters(model)).all()
    # DDP's plain loader cannot skip: it replays the epoch from its start, as it does with its own checkpoints.
    assert len(_seen(tmp_path / "ddp")) == 5 * 8


@pytest.mark.parametrize("workers", [0, 1])
def test_a_fit_cut_short_by_max_steps_continues_its_epoch_from_the_checkpoint_of_its_end(tmp_path, workers):
    # The most common resume: train N steps with the default checkpoint, then more. Lightning's loop finishes the
    # epoch it stopped in, but tells samplers the next epoch's number.
    path = _fit(tmp_path / "first", 1, 6, save_at="epoch_end", workers=workers)
    model = _fit(tmp_path / "resumed", 1, SIZE // 4, ckpt_path=path, workers=workers)
    assert model.trainer.global_step == SIZE // 4
    used = _seen(tmp_path / "first") + _seen(tmp_path / "resumed")
    assert sorted(used) == list(range(SIZE)), "every sample of the interrupted epoch once"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_checkpoint_past_the_end_of_a_shorter_epoch_starts_that_epoch_over_as_lightnings_loop_does(tmp_path, workers):
    path = _fit(tmp_path / "first", 1, 8, save_at=8, limit_train_batches=12, workers=workers)
    model = _fit(tmp_path / "resumed", 1, 8 + 6, ckpt_path=path, limit_train_batches=6, workers=workers)
    assert model.trainer.global_step == 8 + 6  # epochs of 6 steps now
    assert len(_seen(tmp_path / "resumed")) == 6 * 4


@pytest.mark.parametrize("workers", [0, 1])
def test_a_checkpoint_at_an_epochs_last_batch_resumes_at_the_next_epoch(tmp_path, workers):
    steps = SIZE // 4
    path = _fit(tmp_path / "first", 1, steps, save_at=steps, workers=workers)
    model = _fit(tmp_path / "resumed", 1, 2 * steps, ckpt_path=path, workers=workers)
    assert model.trainer.global_step == 2 * steps
    assert sorted(_seen(tmp_path / "resumed")) == list(range(SIZE)), "the next epoch, whole"


def test_a_checkpoint_of_a_finished_epoch_resumes_the_next_with_a_loader_in_workers(tmp_path):
    # ModelCheckpoint's default without max_steps: the loop starts the next epoch, which the workers must draw.
    path = _fit(tmp_path / "first", 1, -1, save_at="epoch_end", workers=1, max_epochs=1)
    model = _fit(tmp_path / "resumed", 1, -1, ckpt_path=path, workers=1, max_epochs=2)
    assert model.trainer.global_step == 2 * SIZE // 4
    assert sorted(_seen(tmp_path / "resumed")) == list(range(SIZE)), "the second epoch, whole"
