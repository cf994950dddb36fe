"""``sync="gradients"``: DDP's update at uneven batches for any optimizer, and ABS-SGD's one-step delay.

Two real gloo processes (forked) against Lightning's own DDPStrategy on the same data, or against closed forms.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from helpers import RegressionModel, cpu_trainer, flat_parameters, no_report_on_its_own
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch import Tensor, nn

from lightning_aesgd import AdaptiveElasticStrategy, ElasticAverage, SlowdownCallback
from lightning_aesgd.checks import UnsupportedSettingError, check_gradient_settings
from lightning_aesgd.engine import report_exchange

TIMEOUT = timedelta(seconds=90)


def multiprocess(test: Any) -> Any:
    """Marks of a test that forks two gloo processes: a hang fails it instead of blocking the suite."""
    return pytest.mark.distributed(pytest.mark.slow(pytest.mark.timeout(240)(test)))


class AdamRegression(RegressionModel):
    """The regression net under Adam: averaging models is not averaging gradients for it."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class LinearInParameters(RegressionModel):
    """A loss linear in the parameters: its gradient does not depend on them, so θ_T = θ_0 − η·Σ_t g_t in closed
    form whatever the order or staleness in which the step gradients g_t are applied, as long as each once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        del self.net  # DDP (and sync="gradients", through it) refuses parameters without gradients
        self.weight = nn.Parameter(torch.zeros(8))
        # Over DDP's 1 MB first bucket: the gradients travel in more than one bucket, as a real model's do.
        self.wide = nn.Parameter(torch.zeros(300_000))
        self.register_buffer("slope", torch.linspace(-1, 1, 300_000))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, _y, _index = batch
        return (x @ self.weight).mean() + (self.wide * self.slope).sum() * x[:, 0].mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", (batch[0] @ self.weight).mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # With momentum the final weights depend on the order of the gradients too: the delayed sums must keep it.
        return torch.optim.SGD([self.weight, self.wide], lr=0.1, momentum=0.9)


def _fit(strategy: Any, model_class: type = AdamRegression, model_kwargs: Any = None, **trainer_kwargs: Any) -> Tensor:
    pl.seed_everything(7)
    model = model_class(**(model_kwargs or {"size": 256, "batch_size": 8}))
    cpu_trainer(strategy, **trainer_kwargs).fit(model)
    return flat_parameters(model)


def _gradients(**options: Any) -> AdaptiveElasticStrategy:
    return AdaptiveElasticStrategy(sync="gradients", start_method="fork", timeout=TIMEOUT, **options)


class _PlanWriter(pl.Callback):
    def __init__(self, path: Any) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(trainer.strategy.plans.plan_book.state_dict()))


# --- equivalence with DDP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
@multiprocess
def test_gradient_sync_follows_ddp_at_uneven_changing_plans(tmp_path, monkeypatch, optimizer):
    """Replica 1's hooks take 3× as long per sample: the plan moves from 8:8 towards 12:4, and every step's update
    is still DDP's, Σ (bᵢ/M)·gᵢ over the same M samples, so Adam's trajectory is DDP's (models mode misses it).

    The reports that move the plan ride in the last bucket's sum: none has an all-reduce of its own."""
    monkeypatch.setattr(report_exchange, "_summed", no_report_on_its_own)  # the forked replicas inherit it
    model_class = AdamRegression if optimizer == "adam" else RegressionModel
    model_kwargs: dict[str, Any] = {"size": 256, "batch_size": 8}
    if optimizer == "sgd_momentum":
        model_kwargs["momentum"] = 0.9
    slow = {"factors": [1, 3], "mode": "hook", "seconds_per_sample": 0.004}
    steps = 30
    ddp = _fit(DDPStrategy(start_method="fork", timeout=TIMEOUT), model_class, model_kwargs, max_steps=steps,
               callbacks=[SlowdownCallback(slow)])  # fmt: skip
    ours = _fit(_gradients(), model_class, model_kwargs, max_steps=steps,
                callbacks=[SlowdownCallback(slow), _PlanWriter(tmp_path / "plans.json")])  # fmt: skip
    plans = json.loads((tmp_path / "plans.json").read_text())
    assert plans["sizes"][-1][0] >= 10, f"the plan must favour the faster replica (ideal 12:4), got {plans}"
    initial = (pl.seed_everything(7), flat_parameters(model_class(**model_kwargs)))[1]
    assert (ddp - initial).abs().max() > 1e-2, "training must have moved the parameters"
    torch.testing.assert_close(ours, ddp, atol=1e-5, rtol=0)


@multiprocess
def test_models_mode_is_not_ddp_under_adam():
    """The contrast that motivates sync='gradients': merging Adam replicas after every step is not DDP."""
    shares = {"planner": "static", "shares": [3, 1]}
    ddp = _fit(DDPStrategy(start_method="fork", timeout=TIMEOUT), max_steps=20)
    models = _fit(AdaptiveElasticStrategy(sync="models", start_method="fork", timeout=TIMEOUT, **shares), max_steps=20)
    gradients = _fit(_gradients(**shares), max_steps=20)
    assert (models - ddp).abs().max() > 1e-3
    torch.testing.assert_close(gradients, ddp, atol=1e-5, rtol=0)


@multiprocess
def test_sparse_gradients_follow_ddp():
    """The XMC model's EmbeddingBag sends sparse gradients through DDP's reducer, weighted like dense ones."""
    from lightning_aesgd.workloads import XMCDataModule, XMCModule

    def fit(strategy: Any) -> Tensor:
        pl.seed_everything(3)
        data = XMCDataModule(preset="mini", batch_size=64)
        data.setup("fit")
        model = XMCModule(**data.model_dimensions(), optimizer="sgd", lr=0.5, sparse_gradients=True)
        cpu_trainer(strategy, max_steps=6).fit(model, datamodule=data)
        return flat_parameters(model)

    ddp = fit(DDPStrategy(start_method="fork", timeout=TIMEOUT))
    ours = fit(_gradients(planner="static", shares=[5, 3]))
    torch.testing.assert_close(ours, ddp, atol=1e-5, rtol=0)


class BatchNormRegression(AdamRegression):
    """With running statistics, which DDP broadcasts from rank zero at every forward."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


class _BufferWriter(pl.Callback):
    def __init__(self, path: Any) -> None:
        self.path = path

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        buffers = [b.tolist() for b in pl_module.buffers()]
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(buffers))


@multiprocess
@pytest.mark.parametrize("delay", [0, 1])
def test_every_replica_evaluates_with_rank_zeros_buffers(tmp_path, delay):
    """Buffers travel at evaluation, checkpoints and the end of fit instead of every forward: replicas whose
    batches differ (so do their running statistics) all evaluate with rank zero's, as under DDP."""
    pl.seed_everything(7)
    model = BatchNormRegression(size=256, batch_size=8)
    strategy = _gradients(planner="static", shares=[3, 1], gradient_delay=delay)
    cpu_trainer(
        strategy, max_steps=6, limit_val_batches=1, val_check_interval=5, callbacks=[_BufferWriter(tmp_path)]
    ).fit(model)
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert rank0 == rank1
    assert rank0[0] != [0.0] * 16  # the running mean moved


# --- ABS-SGD: every reduced gradient applied exactly once -----------------------------------------------------


@multiprocess
@pytest.mark.parametrize(("validate", "warmup"), [(False, 0), (True, 0), (True, 3)])
def test_delayed_sums_are_each_applied_exactly_once(monkeypatch, validate, warmup):
    """With a gradient independent of the parameters, one-step-stale updates end where DDP ends, exactly: the
    first step applies nothing, validation (a flush) and the end of fit apply what is in flight, none twice; so
    does a synchronous warm-up, across the switch to the delay. The reports ride in the delayed sums too."""
    monkeypatch.setattr(report_exchange, "_summed", no_report_on_its_own)
    kwargs: dict[str, Any] = {"max_steps": 12}
    if validate:
        kwargs.update(limit_val_batches=2, val_check_interval=5)
    ddp = _fit(DDPStrategy(start_method="fork", timeout=TIMEOUT), LinearInParameters, **kwargs)
    delayed = {"gradient_delay": 1, "compensate_momentum": False, "planner": "static", "shares": [3, 1]}
    delayed["gradient_delay_warmup"] = warmup
    ours = _fit(_gradients(**delayed), LinearInParameters, **kwargs)
    torch.testing.assert_close(ours, ddp, atol=1e-6, rtol=0)
    undelayed = _fit(_gradients(planner="static", shares=[3, 1]), LinearInParameters, **kwargs)
    torch.testing.assert_close(undelayed, ddp, atol=1e-6, rtol=0)


class LinearInParametersHalvedAt(LinearInParameters):
    """LinearInParameters whose k-th update runs at half the rate for k in ``halved``: DDP's closed form of ABS-SGD's
    scaled stale updates (the momentum buffers are DDP's, in the same order; each is applied at its update's rate)."""

    def __init__(self, halved: tuple[int, ...] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.halved = halved

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        halved = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 0.5 if update in self.halved else 1.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halved, "interval": "step"}}


def _scaled_stale(**options: Any) -> AdaptiveElasticStrategy:
    return _gradients(
        gradient_delay=1, gradient_delay_lr_scale=0.5, compensate_momentum=False, planner="static", shares=[3, 1],
        **options,
    )  # fmt: skip


@multiprocess
def test_stale_updates_run_at_the_scaled_learning_rate():
    """``gradient_delay_lr_scale`` scales exactly the updates whose sum was computed before the latest update.

    3 synchronous steps; step 3 applies nothing, so step 4 applies a fresh sum (full rate); the validations after
    steps 4 and 9 and the end of fit flush stale sums (half); steps 5 and 10 apply nothing after a flush, so steps 6
    and 11 apply fresh sums; steps 7-9 apply stale ones. Of the 12 updates, numbers 4, 6, 7, 8, 9 and 11 run at
    half the rate.
    """
    kwargs: dict[str, Any] = {"max_steps": 12, "limit_val_batches": 2, "val_check_interval": 5}
    model_kwargs = {"size": 256, "batch_size": 8, "halved": (4, 6, 7, 8, 9, 11)}
    ddp = _fit(DDPStrategy(start_method="fork", timeout=TIMEOUT), LinearInParametersHalvedAt, model_kwargs, **kwargs)
    ours = _fit(_scaled_stale(gradient_delay_warmup=3), LinearInParameters, **kwargs)
    torch.testing.assert_close(ours, ddp, atol=1e-6, rtol=0)


@multiprocess
def test_a_sum_flushed_by_every_steps_validation_is_fresh_and_runs_at_the_full_rate():
    """Validated after every step, each step applies nothing and its own sum is flushed before the weights move:
    no update is stale, and the run ends where DDP ends, unscaled."""
    kwargs: dict[str, Any] = {"max_steps": 6, "limit_val_batches": 1, "val_check_interval": 1}
    ddp = _fit(DDPStrategy(start_method="fork", timeout=TIMEOUT), LinearInParameters, **kwargs)
    ours = _fit(_scaled_stale(), LinearInParameters, **kwargs)
    torch.testing.assert_close(ours, ddp, atol=1e-6, rtol=0)


class SparseLinearInParameters(RegressionModel):
    """An EmbeddingBag with sparse gradients, under a loss linear in its weights (the XMC model's sparse path)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        del self.net
        self.embedding = nn.EmbeddingBag(64, 4, mode="sum", sparse=True)
        self.register_buffer("direction", torch.linspace(-1, 1, 4))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, _y, index = batch
        rows = torch.stack([index % 64, (index * 7) % 64], dim=1)
        return (self.embedding(rows) * self.direction).sum(dim=1).mul(x[:, 0]).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@multiprocess
def test_delayed_sparse_sums_are_each_applied_exactly_once():
    """The sparse gradient of an embedding travels in a bucket of its own: delayed, it too is applied once, by the
    next step's hook (no validation here to flush it), and the run ends where DDP ends."""
    ddp = _fit(DDPStrategy(start_method="fork", timeout=TIMEOUT), SparseLinearInParameters, max_steps=12)
    ours = _fit(_gradients(gradient_delay=1, planner="static", shares=[3, 1]), SparseLinearInParameters, max_steps=12)
    torch.testing.assert_close(ours, ddp, atol=1e-6, rtol=0)


class LinearInParametersNesterov(LinearInParameters):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.weight, self.wide], lr=0.1, momentum=0.9, nesterov=True)


@multiprocess
def test_momentum_compensation_turns_delayed_heavy_ball_into_ddps_nesterov():
    """Spike compensation (the default) feeds heavy-ball SGD (1 + μ)·Ĝ_{t−1} − μ·Ĝ_{t−2}: on a loss linear in its
    parameters, where staleness does not change the sums, the run ends where DDP with Nesterov momentum ends,
    through validation flushes and over several buckets."""
    kwargs: dict[str, Any] = {"max_steps": 12, "limit_val_batches": 2, "val_check_interval": 5}
    nesterov = _fit(DDPStrategy(start_method="fork", timeout=TIMEOUT), LinearInParametersNesterov, **kwargs)
    ours = _fit(_gradients(gradient_delay=1, planner="static", shares=[3, 1]), LinearInParameters, **kwargs)
    torch.testing.assert_close(ours, nesterov, atol=1e-6, rtol=0)


@multiprocess
def test_the_warm_up_steps_are_synchronous():
    """Adam on a nonlinear model: with the whole run inside the warm-up, the delayed mode is sync_adaptive exactly;
    with a shorter warm-up the trajectories part after it."""
    # Static shares: measured plans could split the steps differently, and the sums differ by rounding.
    shares = {"planner": "static", "shares": [3, 1]}
    synchronous = _fit(_gradients(**shares), max_steps=10)
    warm_throughout = _fit(_gradients(gradient_delay=1, gradient_delay_warmup=10, **shares), max_steps=10)
    torch.testing.assert_close(warm_throughout, synchronous, atol=1e-7, rtol=0)
    warm_then_delayed = _fit(_gradients(gradient_delay=1, gradient_delay_warmup=5, **shares), max_steps=10)
    assert (warm_then_delayed - synchronous).abs().max() > 1e-5


@multiprocess
def test_delay_changes_the_trajectory_of_a_nonlinear_model_by_one_step_of_staleness():
    ddp = _fit(DDPStrategy(start_method="fork", timeout=TIMEOUT), max_steps=20)
    delayed = _fit(_gradients(gradient_delay=1), max_steps=20)
    initial = (pl.seed_everything(7), flat_parameters(AdamRegression(size=256, batch_size=8)))[1]
    assert (delayed - ddp).abs().max() > 1e-6, "a stale gradient is not the fresh one"
    # Both trained: the delayed run moved as far as DDP's, within a factor.
    moved, moved_ddp = (delayed - initial).norm(), (ddp - initial).norm()
    assert 0.5 * moved_ddp < moved < 2 * moved_ddp


@multiprocess
@pytest.mark.parametrize(("delay", "momentum", "warmup"), [(0, None, 0), (1, None, 0), (1, 0.9, 0), (1, None, 9)])
def test_resume_mid_epoch_reaches_the_uninterrupted_parameters(tmp_path, delay, momentum, warmup):
    """A checkpoint written mid-epoch holds the plans and (ABS-SGD) the sum the next step applies, whether it is
    stale (scaled), and the one the latest step applied (momentum compensation subtracts it): resuming from it
    continues exactly as the run that wrote it (writing it does not change that run either). Adam, or SGD with
    momentum. With a warm-up of 9 steps the checkpoint follows the first delayed step, whose sum is fresh."""
    strategy_options: dict[str, Any] = {"gradient_delay": delay, "planner": "static", "shares": [3, 1]}
    if delay:
        strategy_options.update(gradient_delay_lr_scale=0.5, gradient_delay_warmup=warmup)
    model_class = AdamRegression if momentum is None else RegressionModel
    model_kwargs: dict[str, Any] = {"size": 256, "batch_size": 8}
    if momentum is not None:
        model_kwargs["momentum"] = momentum
    steps, every = 24, 10  # 256 / 16 = 16 steps per epoch: the checkpoint falls mid-epoch 0
    uninterrupted = _fit(_gradients(**strategy_options), model_class, model_kwargs, max_steps=steps)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1)
    with_checkpoint = _fit(_gradients(**strategy_options), model_class, model_kwargs, max_steps=steps,
                           enable_checkpointing=True, callbacks=[checkpoint])  # fmt: skip
    torch.testing.assert_close(with_checkpoint, uninterrupted, atol=0, rtol=0)
    path = next(tmp_path.glob(f"*step={every}.ckpt"))
    pl.seed_everything(7)
    model = model_class(**model_kwargs)
    cpu_trainer(_gradients(**strategy_options), max_steps=steps).fit(model, ckpt_path=str(path))
    torch.testing.assert_close(flat_parameters(model), uninterrupted, atol=1e-7, rtol=0)


# --- options --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sync": "gradients", "period": 4}, "period"),
        ({"sync": "gradients", "merge_rule": ElasticAverage(alpha=0.5)}, "merge_rule"),
        ({"sync": "gradients", "lr_scaling": True}, "lr_scaling"),
        ({"sync": "models", "gradient_delay": 1}, "sync='gradients'"),
        ({"sync": "gradients", "gradient_delay": 2}, "0 .synchronous. or 1"),
        ({"sync": "weights"}, "not one of"),
        ({"sync": "models", "find_unused_parameters": True}, "sync='gradients'"),
        ({"sync": "gradients", "gradient_delay": 1, "find_unused_parameters": True}, "unused in a step"),
        ({"sync": "gradients", "gradient_delay_warmup": 5}, "gradient_delay=1"),
        ({"sync": "gradients", "gradient_delay": 1, "gradient_delay_warmup": -1}, "counts steps"),
        ({"sync": "gradients", "gradient_delay": 1, "gradient_delay_warmup": 2.5}, "counts steps"),
        ({"sync": "gradients", "gradient_delay_lr_scale": 0.5}, "gradient_delay=1"),
        ({"sync": "gradients", "gradient_delay": 1, "gradient_delay_lr_scale": 0}, "stop or reverse"),
        ({"sync": "gradients", "gradient_delay": 1, "gradient_delay_lr_scale": -0.5}, "stop or reverse"),
        ({"sync": "gradients", "gradient_delay": 1, "gradient_delay_lr_scale": float("nan")}, "not a finite number"),
        ({"sync": "gradients", "gradient_delay": 1, "gradient_delay_lr_scale": float("inf")}, "not a finite number"),
        ({"sync": "gradients", "gradient_delay": 1, "gradient_delay_lr_scale": "half"}, "is a factor"),
    ],
)
def test_options_that_do_not_apply_to_the_sync_mode_fail_early(options, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveElasticStrategy(**options)


def test_a_numpy_number_is_a_valid_stale_rate_factor():
    """Values from numpy (a sweep's grid, say) pass, as a plain float."""
    strategy = AdaptiveElasticStrategy(sync="gradients", gradient_delay=1, gradient_delay_lr_scale=np.float32(0.5))
    assert strategy.engine.delay_lr_scale == 0.5
    assert type(strategy.engine.delay_lr_scale) is float


def test_delayed_sums_refuse_a_grad_scaler():
    class Delayed:
        delay = 1

    class WithScaler:
        scaler = object()

    with pytest.raises(UnsupportedSettingError, match="bf16-mixed"):
        check_gradient_settings(Delayed(), WithScaler())
    check_gradient_settings(Delayed(), object())  # no scaler: fine


class _DriftAndRecord(pl.Callback):
    """Nudges rank one's parameters after every step (as CPU and CUDA rounding might) and records them at evaluation."""

    def __init__(self, path: Any, share_parameters: bool) -> None:
        self.path = path
        self.share_parameters = share_parameters

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.engine.share_parameters = self.share_parameters  # what CPU + GPU replicas set

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_rank == 1:
            with torch.no_grad():
                for parameter in pl_module.parameters():
                    parameter.add_(1e-4)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(flat_parameters(pl_module).tolist()))


@multiprocess
@pytest.mark.parametrize("share_parameters", [True, False])
def test_replicas_on_different_device_types_evaluate_rank_zeros_parameters(tmp_path, share_parameters):
    pl.seed_everything(7)
    callback = _DriftAndRecord(tmp_path, share_parameters)
    strategy = _gradients(planner="static", shares=[3, 1])
    cpu_trainer(strategy, max_steps=6, limit_val_batches=1, val_check_interval=5, callbacks=[callback]).fit(
        AdamRegression(size=256, batch_size=8)
    )
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert (rank0 == rank1) == share_parameters  # without sharing, the nudges stay on rank one
