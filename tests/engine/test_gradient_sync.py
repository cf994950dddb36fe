"""``sync="gradients"``: DDP's update at uneven batches for any optimizer, and ABS-SGD's one-step delay.

Two real gloo processes (forked) against Lightning's own DDPStrategy on the same data, or against closed forms.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from helpers import (
    FakeCommunicator,
    RegressionData,
    RegressionModel,
    cpu_trainer,
    flat_parameters,
    no_report_on_its_own,
)
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from test_gradients import FakeBucket
from test_sitting_out import _Filling, _World
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_aesgd import AdaptiveElasticStrategy, ElasticAverage, SlowdownCallback
from lightning_aesgd.checks import UnsupportedSettingError, check_gradient_settings
from lightning_aesgd.engine import report_exchange, stalls
from lightning_aesgd.engine.comm import LocalCommunicator, ReplicaStalledError
from lightning_aesgd.engine.gradient_sync import GradientSync, _judge_exclusions
from lightning_aesgd.engine.gradients import gradient_sum_hook
from lightning_aesgd.engine.pipeline import TrainerHooks
from lightning_aesgd.engine.plan_settings import PlanSettings

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


# --- one process, driven directly: a lone replica, or one of a fake world -------------------------------------


def _lone(
    delay: int = 0, momentum: float = 0.0, comm: Any = None, **options: Any
) -> tuple[GradientSync, nn.Parameter, torch.optim.SGD, DataLoader]:
    """A lone replica's engine (or, with ``comm``, one of its world) over a two-element weight trained by SGD at
    rate 1, and its planned loader."""
    weight = nn.Parameter(torch.zeros(2))
    module = nn.Module()
    module.weight = weight
    engine = GradientSync(PlanSettings(), delay=delay, **{"compensate_momentum": False} | options)
    engine.start(module, comm or LocalCommunicator(), torch.device("cpu"))
    loader = engine.training_loader(DataLoader(RegressionData(64), batch_size=4))
    return engine, weight, torch.optim.SGD([weight], lr=1.0, momentum=momentum), loader


def _powers_of_two(index: int) -> list[float]:
    return [2.0**index, 0.0]


def _run(
    engine: GradientSync,
    weight: nn.Parameter,
    optimizer: Any,
    loader: DataLoader,
    steps: range,
    flush_after: tuple[int, ...] = (),
    record: list[tuple[Any, int]] | None = None,
    slopes: Any = _powers_of_two,
) -> list[float]:
    """Step k's loss is linear in the weight, its gradient ``slopes(k)`` (times ``loss_weight``), by default 2**k on
    the first element: each update's rate and the sum it applies show in the first element, given after every step.
    ``record`` gets each step's output and the number of reports its plans have received."""
    moved = []
    for index, _ in itertools.islice(enumerate(loader), steps.start, steps.stop):
        engine.begin_step(0, index, index)

        def closure(index: int = index) -> Tensor:
            optimizer.zero_grad()
            loss = (weight * torch.tensor(slopes(index))).sum().mul(engine.loss_weight)
            loss.backward()
            if engine.wraps_model(engine._comm().world_size):  # DDP's reducer: the bucket's sum is the gradient
                weight.grad.copy_(gradient_sum_hook(engine.reduce, FakeBucket([weight], [weight.grad])).wait())
            return loss.detach()

        output = engine.optimizer_step(optimizer, lambda c=closure: optimizer.step(engine.after_backward_of(c)))
        if index in flush_after:
            engine.flush()
        moved.append(weight[0].item())
        if record is not None:
            record.append((output, len(engine.plans.history)))
    return moved


def test_a_new_engine_has_counted_nothing_and_weighs_its_gradient_whole():
    engine = GradientSync(PlanSettings(), delay=0)
    assert (engine.sync_count, engine.exclusion_count, engine.sat_out_steps) == (0, 0, 0)
    assert engine.loss_weight == 1.0


def test_only_a_job_of_several_replicas_or_a_delayed_sum_needs_ddps_reducer():
    assert not GradientSync(PlanSettings(), delay=0).wraps_model(1)
    assert GradientSync(PlanSettings(), delay=0).wraps_model(2)
    assert GradientSync(PlanSettings(), delay=1).wraps_model(1)


def test_a_lone_replica_applies_each_steps_whole_gradient_at_once_and_counts_its_sums():
    engine, weight, optimizer, loader = _lone()
    assert _run(engine, weight, optimizer, loader, range(4)) == [-1.0, -3.0, -7.0, -15.0]
    assert engine.loss_weight == 1.0
    assert (engine.sync_count, engine.exclusion_count) == (4, 0)
    engine.finish()
    assert weight[0].item() == -15.0


def test_a_delayed_sum_is_applied_by_the_next_step_and_the_last_by_the_end_of_fit_stale_ones_at_the_scaled_rate():
    """Step 0 applies nothing, step 1 its fresh sum (1), steps 2 and 3 stale ones at half the rate (2, 4) and the end
    of fit the last, stale too (8)."""
    engine, weight, optimizer, loader = _lone(delay=1, delay_lr_scale=0.5)
    assert _run(engine, weight, optimizer, loader, range(4)) == [0.0, -1.0, -2.0, -4.0]
    engine.finish()
    assert weight[0].item() == -8.0
    assert engine.sync_count == 4


def test_after_a_flush_the_next_step_applies_nothing_and_the_one_after_a_fresh_sum_at_the_full_rate():
    """The flush after step 2 applies its stale sum (4 at half the rate); step 3 applies nothing, step 4 step 3's sum
    (8, fresh); the end of fit step 4's (16 at half the rate)."""
    engine, weight, optimizer, loader = _lone(delay=1, delay_lr_scale=0.5)
    moved = _run(engine, weight, optimizer, loader, range(5), flush_after=(2,))
    assert moved == [0.0, -1.0, -4.0, -4.0, -12.0]
    engine.finish()
    assert weight[0].item() == -20.0


def test_the_warm_up_steps_apply_their_own_sums_and_the_first_delayed_sum_is_fresh():
    engine, weight, optimizer, loader = _lone(delay=1, delay_warmup=2, delay_lr_scale=0.5)
    assert _run(engine, weight, optimizer, loader, range(5)) == [-1.0, -3.0, -3.0, -7.0, -11.0]
    engine.finish()
    assert weight[0].item() == -19.0


@pytest.mark.parametrize(
    ("warmup", "forget", "expected"),
    [(0, None, -32.0), (2, None, -35.0), (2, "delayed_gradients_stale", -33.0), (0, "applied_gradients", -32.0)],
)
def test_a_checkpoint_resumes_the_held_sum_at_its_own_rate_and_one_of_unknown_staleness_counts_as_stale(
    warmup, forget, expected
):
    """Saved after step 2, the held sum (4) is stale without a warm-up and fresh after a warm-up of 2 steps: resumed
    into a new engine, the run ends as the uninterrupted one, or (saved before staleness was) with it at half rate.
    A checkpoint without the latest applied sum (no momentum to compensate here) resumes as well."""
    engine, weight, optimizer, loader = _lone(delay=1, delay_warmup=warmup, delay_lr_scale=0.5)
    _run(engine, weight, optimizer, loader, range(3))
    state, saved_weight = engine.training_state(optimizer), weight.detach().clone()
    assert state["shared"]["delayed_gradients_stale"] is (warmup == 0)
    _run(engine, weight, optimizer, loader, range(3, 6))
    engine.finish()
    assert weight[0].item() == (-32.0 if warmup == 0 else -35.0)
    if forget is not None:
        del state["shared"][forget]
    resumed, resumed_weight, resumed_optimizer, resumed_loader = _lone(delay=1, delay_warmup=warmup, delay_lr_scale=0.5)
    resumed.load_training_state(state, resumed_optimizer, torch.device("cpu"))
    with torch.no_grad():
        resumed_weight.copy_(saved_weight)
    _run(resumed, resumed_weight, resumed_optimizer, resumed_loader, range(3, 6))
    resumed.finish()
    assert resumed_weight[0].item() == expected


def test_a_momentum_compensated_run_resumes_with_the_latest_applied_sum_as_if_uninterrupted():
    """Spike compensation subtracts μ times the latest applied sum from the next: the checkpoint's, after resuming."""
    engine, weight, optimizer, loader = _lone(delay=1, momentum=0.5, compensate_momentum=True)
    _run(engine, weight, optimizer, loader, range(3))
    state = engine.training_state(optimizer)
    saved = weight.detach().clone(), copy.deepcopy(optimizer.state_dict())
    _run(engine, weight, optimizer, loader, range(3, 5))
    engine.finish()
    resumed, resumed_weight, resumed_optimizer, resumed_loader = _lone(delay=1, momentum=0.5, compensate_momentum=True)
    resumed_optimizer.load_state_dict(saved[1])
    resumed.load_training_state(state, resumed_optimizer, torch.device("cpu"))
    with torch.no_grad():
        resumed_weight.copy_(saved[0])
    _run(resumed, resumed_weight, resumed_optimizer, resumed_loader, range(3, 5))
    resumed.finish()
    assert resumed_weight.tolist() == weight.tolist()


def test_a_checkpoints_delayed_sum_is_ignored_with_a_warning_by_a_synchronous_run(caplog):
    delayed, weight, optimizer, loader = _lone(delay=1)
    _run(delayed, weight, optimizer, loader, range(2))
    state = delayed.training_state(optimizer)
    engine, weight, optimizer, loader = _lone()
    with caplog.at_level(logging.WARNING, logger="lightning_aesgd.engine.gradient_sync"):
        engine.load_training_state(state, optimizer, torch.device("cpu"))
    assert "sync without delay does not apply" in caplog.text
    assert engine.reduce.peek_pending() is None
    assert _run(engine, weight, optimizer, loader, range(1)) == [-1.0]


def test_a_flush_before_any_step_keeps_the_resumed_sum_for_the_first_step():
    """Validation before the first step of a resumed fit: no optimizer yet, so the held sum waits for step one."""
    delayed, weight, optimizer, loader = _lone(delay=1)
    _run(delayed, weight, optimizer, loader, range(2))
    state = delayed.training_state(optimizer)  # holds step 1's sum, 2
    engine, weight, optimizer, loader = _lone(delay=1)
    engine.load_training_state(state, optimizer, torch.device("cpu"))
    engine.flush()
    assert weight.tolist() == [0.0, 0.0]
    assert _run(engine, weight, optimizer, loader, range(2, 3)) == [-2.0]


class _EnabledScaler:
    def is_enabled(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("delay", "hooks", "allowed"),
    [
        (0, TrainerHooks(), True),
        (1, TrainerHooks(), False),
        (0, TrainerHooks(reducer_meets_every_step=True), False),
        (0, TrainerHooks(grad_scaler=_EnabledScaler()), False),
    ],
)
def test_replicas_sit_out_only_where_no_state_outlives_a_step_and_the_reducer_does_not_meet_every_rank(
    delay, hooks, allowed
):
    """Not with a delayed sum in flight or a grad scaler's scale, nor where DDP's reducer talks to every replica in
    each step (find_unused_parameters), where the plans keep every replica in the steps."""
    engine = GradientSync(PlanSettings(), delay=delay)
    engine.start(nn.Linear(2, 1), _World(3, 0), torch.device("cpu"), hooks)
    assert engine.sitting.enabled is allowed
    assert engine.plans.segment_steps == (engine.sitting.segment_steps if allowed else 0)
    assert engine.plans.segment_steps != 0 or not allowed
    assert (engine.plans.leaving_out_forbidden is not None) is hooks.reducer_meets_every_step


@pytest.mark.parametrize(("delay", "received"), [(0, [0, 0, 0, 1, 1, 1, 2, 2, 2]), (1, [0] * 6 + [1] * 3)])
def test_a_lone_replicas_reports_reach_its_plans_at_once_or_with_the_next_exchange_and_the_step_gives_the_loss(
    delay, received
):
    """Steps 3 and 6 report (every lag + 1 = 3 steps): synchronous sums take each report in its own step, delayed
    ones the previous exchange's at the next, and the end of fit the last. Each step returns its closure's loss."""
    engine, weight, optimizer, loader = _lone(delay=delay)
    record: list[tuple[Any, int]] = []
    _run(engine, weight, optimizer, loader, range(9), record=record)
    assert [count for _, count in record] == received
    assert all(isinstance(output, Tensor) for output, _ in record)
    engine.finish()
    assert len(engine.plans.history) == 2


@pytest.mark.parametrize("share_parameters", [False, True])
def test_evaluation_and_checkpoints_give_a_replica_rank_zeros_buffers_and_across_device_types_its_parameters(
    share_parameters,
):
    """Rank one's BatchNorm takes rank zero's running statistics (one broadcast per dtype), and its weight and bias
    too where replicas run on different device types."""
    module = nn.BatchNorm1d(2)
    floats = torch.arange(8.0 if share_parameters else 4.0)  # running mean and variance, then weight and bias
    world = _Filling(2, 1, tensors=[floats, torch.tensor(9), floats, torch.tensor(9)])
    engine = GradientSync(PlanSettings(), delay=0)
    engine.start(module, world, torch.device("cpu"), TrainerHooks(mixed_device_types=share_parameters))
    engine.begin_evaluation()
    shared = [module.running_mean, module.running_var, *([module.weight, module.bias] if share_parameters else [])]
    assert torch.cat([tensor.detach() for tensor in shared]).tolist() == floats.tolist()
    assert module.num_batches_tracked.item() == 9
    assert module.weight.tolist() == ([4.0, 5.0] if share_parameters else [1.0, 1.0])
    engine.end_evaluation()
    state = engine.global_model_state(module)
    assert state["running_var"].tolist() == [2.0, 3.0]
    assert state["running_var"] is not module.running_var


def test_replicas_left_out_of_sums_are_logged_by_rank_zero_once_there_are_any(caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_aesgd.engine.gradient_sync"):
        _judge_exclusions(2, 0, 7, logs=False)
        _judge_exclusions(0, 0, 7, logs=True)
        assert caplog.text == ""
        _judge_exclusions(2, 0, 7, logs=True)
    assert "2 replica step(s) had non-finite gradients before global step 7" in caplog.text


def test_a_lone_replicas_non_finite_delayed_sum_reaches_its_update_unguarded_as_under_ddp():
    """Alone, the sum is the replica's own gradient: no finiteness pass leaves it out, nothing counts as excluded."""
    engine, weight, optimizer, loader = _lone(delay=1)
    moved = _run(engine, weight, optimizer, loader, range(2), slopes=lambda index: [1.0 if index else math.nan, 0.0])
    assert moved[0] == 0.0
    assert math.isnan(moved[1])
    assert engine.exclusion_count == 0


def _raising(error: RuntimeError, doing: list[Any]) -> Any:
    def run_step() -> None:
        doing.append(stalls.now_doing())
        raise error

    return run_step


def test_a_peer_failing_a_steps_sums_names_the_step_and_any_other_error_passes_as_it_is():
    engine, _weight, optimizer, loader = _lone()
    batches = iter(loader)
    lost = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv")
    stalled = ReplicaStalledError(collective="all-reduce #3", rank=0, world_size=1, waited=1.0, roll=None, cause="x")
    doing: list[Any] = []
    for step, error in enumerate([RuntimeError("Tensors must be contiguous"), stalled, lost]):
        next(batches)
        engine.begin_step(0, step, step)
        with pytest.raises(RuntimeError) as raised:
            engine.optimizer_step(optimizer, _raising(error, doing))
        if error is lost:
            assert isinstance(raised.value, ReplicaStalledError)
            assert raised.value.__cause__ is lost
            assert "the gradient sum of global step 2" in str(raised.value)
        else:
            assert raised.value is error
    assert engine.sync_count == 0
    # A stall while the sums run names the step, under the roll call's key for it (the same on every replica).
    assert [(task.where, task.step_key) for task in doing] == [
        (f"the gradient sum of global step {step}", stalls.roll_call_key(f"step_{step}")) for step in range(3)
    ]


def test_a_step_without_the_planned_loader_fails_with_a_hint():
    module, engine = nn.Linear(2, 1), GradientSync(PlanSettings(), delay=0)
    engine.start(module, LocalCommunicator(), torch.device("cpu"))
    with pytest.raises(TypeError, match=r"needs the training loader to be a torch DataLoader.*HINT: return a"):
        engine.optimizer_step(torch.optim.SGD(module.parameters(), lr=1.0), lambda: None)


def _not_finite_at_step_one(index: int) -> list[float]:
    return [math.nan if index == 1 else 1.0, 0.0]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_replica_weighs_its_gradient_by_its_share_and_a_step_without_a_finite_replica_is_skipped_and_counted(
    caplog, rank
):
    """Two replicas alike (the fake's peer), half the step's samples each: the sum of their weighted gradients is the
    step's mean gradient. At step 1 both are NaN: no update, and the next reports (step 3) count two exclusions,
    which rank zero logs."""
    engine, weight, optimizer, loader = _lone(comm=FakeCommunicator(2, rank))
    with caplog.at_level(logging.WARNING, logger="lightning_aesgd.engine.gradient_sync"):
        moved = _run(engine, weight, optimizer, loader, range(5), slopes=_not_finite_at_step_one)
    assert engine.loss_weight == 0.5
    assert moved == [-1.0, -1.0, -2.0, -3.0, -4.0]
    assert engine.exclusion_count == 2
    logged = "2 replica step(s) had non-finite gradients before global step 3"
    assert (logged in caplog.text) is (rank == 0)


def test_the_reports_ride_in_the_last_buckets_sum_where_ddps_reducer_runs_the_sums(monkeypatch):
    """Two replicas, synchronous sums: the reports of steps 3 and 6 need no all-reduce of their own."""
    monkeypatch.setattr(report_exchange, "_summed", no_report_on_its_own)
    engine, weight, optimizer, loader = _lone(comm=FakeCommunicator(2, 0))
    record: list[tuple[Any, int]] = []
    _run(engine, weight, optimizer, loader, range(7), record=record)
    assert [count for _, count in record] == [0, 0, 0, 1, 1, 1, 2]
