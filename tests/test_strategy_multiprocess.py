"""End-to-end runs of the strategy on 2 real gloo processes (spawned), against closed-form or DDP references."""

from __future__ import annotations

from datetime import timedelta

import pytest
import pytorch_lightning as pl
import torch
from helpers import RegressionModel, flat_parameters
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy

from lightning_aesgd import AdaptiveElasticStrategy

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(240)]

TIMEOUT = timedelta(seconds=90)


def _trainer(strategy, **kwargs) -> pl.Trainer:
    options = {
        "accelerator": "cpu",
        "devices": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


def _fit(strategy, model_kwargs=None, **trainer_kwargs) -> torch.Tensor:
    pl.seed_everything(7)
    model = RegressionModel(**(model_kwargs or {}))
    _trainer(strategy, **trainer_kwargs).fit(model)
    return flat_parameters(model)


def test_matches_ddp_with_plain_sgd_equal_batches_and_hard_averaging():
    """Averaging models after every plain SGD step is DDP's gradient averaging: θ − η·mean(gᵢ)."""
    steps = 24
    ddp = _fit(DDPStrategy(start_method="fork", timeout=TIMEOUT), max_steps=steps)
    ours = _fit(
        AdaptiveElasticStrategy(period=1, alpha=1.0, merge_weights="uniform", start_method="fork", timeout=TIMEOUT),
        max_steps=steps,
    )
    initial = (pl.seed_everything(7), flat_parameters(RegressionModel()))[1]
    assert not torch.allclose(ddp, initial, atol=1e-3), "training must have moved the parameters"
    torch.testing.assert_close(ours, ddp, atol=1e-5, rtol=0)


def _stateful_strategy() -> AdaptiveElasticStrategy:
    # Outer momentum, an elastic pull, uneven merge spacing and SGD momentum: every piece of state matters.
    return AdaptiveElasticStrategy(
        period=3, warmup_steps=2, alpha=0.5, momentum=0.5, shares=[3, 1], start_method="fork", timeout=TIMEOUT
    )


def test_resume_from_a_mid_epoch_checkpoint_reaches_the_uninterrupted_parameters(tmp_path):
    model_kwargs = {"momentum": 0.9}
    steps = 20  # 8 steps per epoch: the checkpoint at step 11 is mid-epoch
    uninterrupted = _fit(_stateful_strategy(), model_kwargs, max_steps=steps)

    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=11, save_top_k=-1, filename="{step}")
    _fit(_stateful_strategy(), model_kwargs, max_steps=11, callbacks=[checkpoint], enable_checkpointing=True)
    path = tmp_path / "step=11.ckpt"
    assert path.exists()

    pl.seed_everything(7)
    model = RegressionModel(**model_kwargs)
    _trainer(_stateful_strategy(), max_steps=steps).fit(model, ckpt_path=str(path))
    torch.testing.assert_close(flat_parameters(model), uninterrupted, atol=1e-6, rtol=0)
