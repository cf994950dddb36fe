"""A replica that cannot help gets no work: 3 real gloo processes, one of them 50× slower per sample."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from helpers import RegressionModel, cpu_trainer, flat_parameters, no_report_on_its_own
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint

from lightning_aesgd import AdaptiveElasticStrategy, ElasticAverage, SlowdownCallback
from lightning_aesgd.engine import report_exchange
from lightning_aesgd.engine.loading import IdleBatch
from lightning_aesgd.engine.model_merge import MAX_STEPS_ALONE
from lightning_aesgd.engine.sitting_out import SEGMENT_STEPS
from lightning_aesgd.idle_steps import bare_zero, idle_training_step, zero_loss

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(240)]

BATCH = 8  # the loader's batch: steps of 24 samples among 3 replicas
# The slow replica's step at its floor of one sample (50 ms) dwarfs a loaded machine's per-step overhead, so the
# plan leaves it out early even where Lightning's loop costs tens of milliseconds a step.
SECONDS_PER_SAMPLE = 0.001


class _EpochModel(RegressionModel):
    """Records each training step's epoch and indices (a left-out replica's idle steps record nothing)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append([self.current_epoch, batch[2].tolist()])
        return torch.nn.functional.mse_loss(self(batch[0]), batch[1])


class _Record(pl.Callback):
    """Each rank's samples, plans, summary and parameters; the last two once the strategy ended training."""

    def __init__(self, directory):
        self.directory = directory
        self.record = {}

    def on_train_epoch_end(self, trainer, pl_module):  # the last one: before the strategy's end of training
        self.record["plans_in_training"] = trainer.strategy.plans.plan_book.state_dict()

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        self.record |= {"seen": pl_module.seen, "summary": strategy.engine.summary_record()}
        self.record["sat_out"] = getattr(strategy.engine, "sat_out_steps", 0)

    def on_fit_end(self, trainer, pl_module):  # after the strategy's end of training: replicas caught up
        self.record["plans"] = trainer.strategy.plans.plan_book.state_dict()
        self.record["parameters"] = flat_parameters(pl_module).tolist()
        self.record["global_step"] = trainer.global_step
        checkpoint = trainer.checkpoint_callback
        self.record["best_checkpoint"] = Path(checkpoint.best_model_path).name if checkpoint is not None else None
        states = trainer.optimizers[0].state_dict()["state"].values()
        self.record["optimizer"] = [x for state in states for t in state.values() for x in t.reshape(-1).tolist()]
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))


class _SyncLoggingModel(_EpochModel):
    """Logs its loss with sync_dist=True: an all-reduce inside every training step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss, sync_dist=True)
        return loss


class _GatheringModel(_EpochModel):
    """Gathers its loss from every replica inside each training step, as a user's own collective."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.all_gather(loss.detach())
        return loss


class _BarrierModel(_EpochModel):
    """Waits at the strategy's barrier inside each training step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trainer.strategy.barrier("step")
        return super().training_step(batch, batch_idx)


class _MetricModel(_EpochModel):
    """Logs a torchmetrics metric for the epoch: its compute gathers every replica's states at the epoch's end."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.train_error = torchmetrics.MeanSquaredError()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_error(self(batch[0]).detach(), batch[1])
        self.log("train/error", self.train_error, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


class _BatchHookModel(_EpochModel):
    """Reads each batch in a hook before the step, which a left-out replica's idle batch would reach."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        _, _, index = batch
        assert len(index) > 0


class _DictLoaderModel(_EpochModel):
    """Trains on a dict of one loader: each batch comes as ``{"main": batch}``, an idle one too."""

    def train_dataloader(self):
        return {"main": super().train_dataloader()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch["main"], batch_idx)


class _ProgressModel(_EpochModel):
    """Logs a training metric that improves at every step, as a loss mostly does."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("progress", -float(self.global_step))
        return super().training_step(batch, batch_idx)


def _fit_three(tmp_path, model, callbacks=(), trainer_options=None, **options):
    slow = SlowdownCallback({"factors": [1, 1, 50], "mode": "user", "seconds_per_sample": SECONDS_PER_SAMPLE})
    epochs = options.pop("max_epochs", 1)
    strategy = AdaptiveElasticStrategy(start_method="fork", timeout=timedelta(seconds=60), **options)
    checkpoints = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)
    callbacks = [slow, _Record(tmp_path), *callbacks]
    trainer = cpu_trainer(
        strategy,
        devices=3,
        max_epochs=epochs,
        callbacks=callbacks,
        enable_checkpointing=checkpoints,
        **(trainer_options or {}),
    )
    trainer.fit(model)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]


@pytest.mark.parametrize("model", [_SyncLoggingModel, _GatheringModel, _BarrierModel, _MetricModel, _BatchHookModel])
def test_a_training_step_that_communicates_keeps_every_replica_in_the_steps(tmp_path, model):
    pl.seed_everything(7)
    # Two epochs: a metric's gather at an epoch's end would wait for a replica left out all epoch.
    records = _fit_three(tmp_path, model(size=240, batch_size=BATCH), max_epochs=2)
    assert all(min(sizes) > 0 for sizes in records[0]["plans"]["sizes"])  # no one left out, and no hang
    assert records[0]["plans"]["sizes"][-1][2] < BATCH  # the slow replica still gets a smaller batch


def test_a_dict_of_one_training_loader_leaves_a_slow_replica_out_and_never_hands_it_data(tmp_path):
    # The idle batch came inside the dict ({"main": IdleBatch()}): the user's step unpacked it and failed.
    pl.seed_everything(7)
    records = _fit_three(tmp_path, _DictLoaderModel(size=240, batch_size=BATCH))
    assert records[0]["plans"]["sizes"][-1][2] == 0
    seen = sorted(i for record in records for _, indices in record["seen"] for i in indices)
    assert seen == list(range(240))


@pytest.mark.parametrize("judged_at", ["training steps", "validation ends"])
def test_a_left_out_replicas_stale_training_metric_neither_stops_the_fit_nor_holds_back_its_best_checkpoint(
    tmp_path, judged_at
):
    # Its "progress" stays at its last step with data. Lightning stops the fit where any replica's EarlyStopping says
    # so, and saves a checkpoint where every replica's ModelCheckpoint finds it better: the replicas in the steps
    # must decide, as under DDP, where every replica's metric is current. The callbacks judge inside the training
    # steps, or at the end of each validation (every 2 steps), where the training metric is just as stale.
    pl.seed_everything(7)
    in_steps = judged_at == "training steps"
    stop = EarlyStopping(monitor="progress", mode="min", patience=1, check_on_train_epoch_end=in_steps)
    best = ModelCheckpoint(
        tmp_path / "checkpoints", monitor="progress", mode="min", every_n_train_steps=2 if in_steps else None
    )
    validation = {} if in_steps else {"limit_val_batches": 1, "val_check_interval": 2}
    records = _fit_three(tmp_path, _ProgressModel(size=240, batch_size=BATCH), [stop, best], validation, max_epochs=3)
    assert records[0]["plans"]["sizes"][-1][2] == 0, "the slow replica is left out"
    assert [record["global_step"] for record in records] == [30] * 3  # 3 epochs of 10 steps
    assert records[0]["best_checkpoint"] == "epoch=2-step=30.ckpt"


def test_find_unused_parameters_keeps_every_replica_in_the_steps(tmp_path):
    # An idle replica's zero gradients would make a parameter that no one used this step take an AdamW step.
    pl.seed_everything(7)
    records = _fit_three(tmp_path, _EpochModel(size=240, batch_size=BATCH), find_unused_parameters=True)
    assert all(min(sizes) > 0 for sizes in records[0]["plans"]["sizes"])


def test_lr_scaling_under_merges_lets_an_idle_replica_step(tmp_path):
    pl.seed_everything(7)
    records = _fit_three(tmp_path, _EpochModel(size=240, batch_size=BATCH), sync="models", lr_scaling=True)
    assert records[0]["plans"]["sizes"][-1][2] == 0


@pytest.mark.parametrize("sync", ["gradients", "models"])
def test_a_replica_50x_slower_is_left_out_and_every_sample_is_still_used_once(tmp_path, monkeypatch, sync):
    """Under gradient sync the reports ride in the sums of the replicas taking part, none in a collective of its own."""
    monkeypatch.setattr(report_exchange, "_summed", no_report_on_its_own)  # the forked replicas inherit it
    size, epochs = 480, 2
    steps_per_epoch = size // (3 * BATCH)  # 20
    slow = SlowdownCallback({"factors": [1, 1, 50], "mode": "user", "seconds_per_sample": SECONDS_PER_SAMPLE})
    strategy = AdaptiveElasticStrategy(sync=sync, start_method="fork", timeout=timedelta(seconds=90))
    pl.seed_everything(7)
    model = _EpochModel(size=size, batch_size=BATCH)
    cpu_trainer(strategy, devices=3, max_epochs=epochs, callbacks=[slow, _Record(tmp_path)]).fit(model)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]

    plans = records[0]["plans"]
    assert all(record["plans"] == plans for record in records)
    assert records[1]["plans_in_training"] == records[0]["plans_in_training"] == plans  # those taking part agree
    first_out = next(start for start, sizes in zip(plans["starts"], plans["sizes"], strict=True) if sizes[2] == 0)
    assert first_out <= 20, f"the slow replica must be left out within 20 steps: {plans}"
    later = [sizes for start, sizes in zip(plans["starts"], plans["sizes"], strict=True) if start >= first_out]
    assert all(sizes[2] == 0 for sizes in later), f"out for the rest of this short run (no probe yet): {plans}"

    for epoch in range(epochs):
        used = [
            i for record in records for seen_epoch, indices in record["seen"] if seen_epoch == epoch for i in indices
        ]
        assert sorted(used) == list(range(size)), f"epoch {epoch}: every sample exactly once"
    assert len(records[2]["seen"]) < len(records[0]["seen"]) == epochs * steps_per_epoch  # it idled

    summary = records[0]["summary"]
    assert any("replica 2 is left out" in line for line in summary["starved"]), summary["starved"]
    if sync == "gradients":  # one summed gradient: every replica, the idle one too, holds the same model
        assert records[2]["parameters"] == pytest.approx(records[0]["parameters"], abs=1e-6)
        # It sat out whole segments after the first plan that left it out (the second one at the latest), outside
        # the others' sums; they never did.
        assert records[2]["sat_out"] >= epochs * steps_per_epoch - 2 * SEGMENT_STEPS, records[2]["sat_out"]
        assert records[0]["sat_out"] == records[1]["sat_out"] == 0


class _ValidationRecord(pl.Callback):
    """Each rank's global step, logged validation loss and parameters at every validation, written at the end."""

    def __init__(self, directory):
        self.directory = directory
        self.checks = []

    def on_validation_end(self, trainer, pl_module):
        loss = float(trainer.callback_metrics["val/loss"])
        self.checks.append([trainer.global_step, loss, flat_parameters(pl_module).tolist()])

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.checks.append([trainer.global_step, None, flat_parameters(pl_module).tolist()])

    def on_fit_end(self, trainer, pl_module):
        (self.directory / f"validations{trainer.global_rank}.json").write_text(json.dumps(self.checks))


def test_a_replica_sitting_out_catches_up_before_validation_and_checkpoints(tmp_path):
    """Validation (a collective in the user's step), checkpoints and the end of fit all see one model."""
    slow = SlowdownCallback({"factors": [1, 1, 50], "mode": "user", "seconds_per_sample": SECONDS_PER_SAMPLE})
    saves = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=7, save_top_k=-1)
    strategy = AdaptiveElasticStrategy(start_method="fork", timeout=timedelta(seconds=90))
    pl.seed_everything(7)
    model = _EpochModel(size=480, batch_size=BATCH, momentum=0.9)  # 20 steps an epoch; momentum: optimizer state
    callbacks = [slow, _ValidationRecord(tmp_path), _Record(tmp_path), saves]
    trainer = cpu_trainer(
        strategy,
        devices=3,
        max_epochs=2,
        limit_val_batches=2,
        val_check_interval=10,
        enable_checkpointing=True,
        callbacks=callbacks,
    )
    trainer.fit(model)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert records[2]["sat_out"] > 0
    assert records[2]["parameters"] == pytest.approx(records[0]["parameters"], abs=1e-6)
    assert records[2]["optimizer"] == pytest.approx(records[0]["optimizer"], abs=1e-6)  # the handoff's momentum
    assert len(records[0]["optimizer"]) == len(records[0]["parameters"])
    checks = [json.loads((tmp_path / f"validations{rank}.json").read_text()) for rank in range(3)]
    validated = [check[0] for check in checks[0] if check[1] is not None]
    saved = [check[0] for check in checks[0] if check[1] is None]
    assert validated == [10, 20, 30, 40]
    assert saved == [7, 14, 21, 28, 35]
    for rank in (1, 2):  # the replica that sat out validated and saved the model the others trained
        assert [check[0] for check in checks[rank]] == [check[0] for check in checks[0]]
        for theirs, mine in zip(checks[rank], checks[0], strict=True):
            assert theirs[2] == pytest.approx(mine[2], abs=1e-6), f"rank {rank} at step {theirs[0]}"


def test_an_idle_step_gives_every_parameter_a_zero_gradient_in_its_own_layout():
    module = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    module[1].bias.requires_grad_(False)
    zero_loss(module).backward()
    embedding, weight = module[0].weight.grad, module[1].weight.grad
    assert embedding.is_sparse
    assert float(embedding.to_dense().abs().sum()) == 0.0
    assert not weight.is_sparse
    assert float(weight.abs().sum()) == 0.0
    assert module[1].bias.grad is None


def test_an_idle_step_brings_back_the_training_step_it_replaced():
    model = RegressionModel()
    wrapped = object()
    model.training_step = wrapped
    with idle_training_step(model):
        assert float(model.training_step(IdleBatch(), 0).detach()) == 0.0
    assert model.training_step is wrapped
    del model.training_step
    with idle_training_step(model):
        pass
    assert "training_step" not in vars(model)


class _RecordFitted(pl.Callback):
    """Each replica's parameters once fit is over (the strategy's end of fit has made the global model its own)."""

    def __init__(self, directory):
        self.directory = directory

    def teardown(self, trainer, pl_module, stage):
        fitted = flat_parameters(pl_module).tolist()
        (self.directory / f"fitted{trainer.global_rank}.json").write_text(json.dumps(fitted))


def _fit_two(tmp_path, model, **options):
    slow = SlowdownCallback({"factors": [1, 50], "mode": "user", "seconds_per_sample": SECONDS_PER_SAMPLE})
    strategy = AdaptiveElasticStrategy(start_method="fork", timeout=timedelta(seconds=90), **options)
    callbacks = [slow, _Record(tmp_path), _RecordFitted(tmp_path)]
    cpu_trainer(strategy, devices=2, max_epochs=2, callbacks=callbacks).fit(model)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, record in enumerate(records):
        record["fitted"] = json.loads((tmp_path / f"fitted{rank}.json").read_text())
    return records


def test_a_replica_training_alone_merges_only_when_another_is_planned_in(tmp_path):
    size = 480  # 30 steps of 16 samples an epoch, 60 in all
    pl.seed_everything(7)
    averaging = {"merge_rule": ElasticAverage(alpha=1.0, momentum=0.0), "merge_weights": "samples", "period": 1}
    records = _fit_two(tmp_path, _EpochModel(size=size, batch_size=BATCH), sync="models", **averaging)

    plans = records[0]["plans"]
    first_out = next(start for start, sizes in zip(plans["starts"], plans["sizes"], strict=True) if sizes[1] == 0)
    assert first_out <= 20, plans
    merges, steps = records[0]["summary"]["syncs"], 60
    ends = [*plans["starts"][1:], steps]
    shared = sum(
        end - start for start, end, sizes in zip(plans["starts"], ends, plans["sizes"], strict=True) if min(sizes) > 0
    )
    probes = sum(1 for sizes in plans["sizes"][1:] if min(sizes) > 0)
    # A merge after each step that both replicas share; alone, one before each probe, a few while the probe's
    # measurement is on its way, and one every MAX_STEPS_ALONE steps: a few, where lockstep merges would be 60.
    assert merges <= shared + 4 * probes + steps // MAX_STEPS_ALONE + 1, (merges, plans)
    assert merges < steps // 4, (merges, plans)
    for epoch in range(2):
        used = [
            i for record in records for seen_epoch, indices in record["seen"] if seen_epoch == epoch for i in indices
        ]
        assert sorted(used) == list(range(size)), f"epoch {epoch}: every sample exactly once"
    # The end of fit makes the global model every replica's: the lone replica's own model (which the merge gives
    # back unchanged), the idle one's stale copy carrying no weight.
    assert records[0]["fitted"] == pytest.approx(records[0]["parameters"], abs=1e-6)
    assert records[1]["fitted"] == pytest.approx(records[0]["parameters"], abs=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {"merge_rule": ElasticAverage(alpha=1.0, momentum=0.3)},  # outer momentum moves even a lone model
        {"merge_rule": ElasticAverage(alpha=1.0, momentum=0.0), "optimizer_state": "reset"},  # merges reset
    ],
)
def test_a_merge_that_changes_a_lone_model_stays_on_schedule(tmp_path, options):
    pl.seed_everything(7)
    model = _EpochModel(size=480, batch_size=BATCH)
    records = _fit_two(tmp_path, model, sync="models", period=1, warmup_steps=0, **options)
    # Left out ... (its latest plan may be a probe, at the floor batch, when the run ends during one)
    assert any(sizes[1] == 0 for sizes in records[0]["plans"]["sizes"]), records[0]["plans"]
    assert records[0]["summary"]["syncs"] == 60  # ... and still in every merge: outer momentum moves the model


def test_an_idle_step_under_merges_reaches_no_parameter():
    module = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    model = RegressionModel()
    with idle_training_step(model, every_parameter=False):
        loss = model.training_step(IdleBatch(), 0)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(p.grad is None for p in model.parameters())
    assert bare_zero(module).device == module[1].weight.device
