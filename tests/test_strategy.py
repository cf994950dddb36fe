"""The strategy in one process: fit, evaluate, checkpoints, both namespaces, and early errors."""

from __future__ import annotations

import csv
import io
import json
import logging
import warnings
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
from helpers import RegressionData, RegressionModel, flat_parameters
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_aesgd import SMA, AdaptiveElasticStrategy, ReplicaStalledError
from lightning_aesgd.checks import UnsupportedSettingError
from lightning_aesgd.core.planners import StaticPlanner
from lightning_aesgd.engine.averager import ElasticAverager
from lightning_aesgd.strategy import SUMMARY_FILE
from lightning_aesgd.unified import AdaptiveElasticStrategy as UnifiedStrategy

pytestmark = pytest.mark.slow

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def _trainer(strategy="adaptive_elastic", trainer_cls=pl.Trainer, **kwargs):
    options = {"accelerator": "cpu", "devices": 1, "enable_checkpointing": False, **QUIET, **kwargs}
    return trainer_cls(strategy=strategy, **options)


def test_fit_covers_every_sample_each_epoch_then_evaluates_and_predicts():
    model = RegressionModel(size=40, batch_size=8)
    trainer = _trainer(max_epochs=2)
    trainer.fit(model)
    assert trainer.global_step == 10
    for epoch in range(2):
        seen = sorted(i for batch in model.seen[5 * epoch : 5 * (epoch + 1)] for i in batch)
        assert seen == list(range(40))
    validated = trainer.validate(model, verbose=False)[0]["val/loss"]
    tested = trainer.test(model, dataloaders=model.val_dataloader(), verbose=False)[0]["test/loss"]
    assert validated == pytest.approx(tested)
    predictions = trainer.predict(model, dataloaders=model.val_dataloader())
    assert sum(len(p) for p in predictions) == 32


class _Wrapped(pl.Callback):
    """Whether the strategy trained the model wrapped in DistributedDataParallel (unwrapped again at teardown)."""

    def on_train_start(self, trainer, pl_module):
        self.wrapped = isinstance(trainer.strategy.model, DistributedDataParallel)


def _one_replica_run(strategy):
    pl.seed_everything(3)
    model = RegressionModel(size=48, batch_size=8, momentum=0.9, shuffle=False)
    wrapped = _Wrapped()
    trainer = _trainer(strategy, max_epochs=2, limit_val_batches=0, callbacks=[wrapped])
    trainer.fit(model)
    return trainer, flat_parameters(model), wrapped.wrapped


def test_one_replica_trains_its_model_unwrapped_with_ddps_updates():
    trainer, trained, wrapped = _one_replica_run(AdaptiveElasticStrategy())
    assert not wrapped  # nothing to sum: no reducer, no hooks
    assert trainer.strategy.engine.sync_count == 12
    assert "gradient sums: 12" in trainer.strategy.engine.summary()
    _, ddp, ddp_wrapped = _one_replica_run("ddp")  # the same order of samples (DistributedSampler's)
    assert ddp_wrapped
    assert trained.tolist() == pytest.approx(ddp.tolist(), abs=1e-6)
    # ABS-SGD's delayed sum needs the hook, which holds it for a step.
    assert _one_replica_run(AdaptiveElasticStrategy(gradient_delay=1))[2]


def test_the_fit_ends_before_the_train_end_hooks_and_the_loop_is_left_as_it_was():
    ended = []

    class Hooks(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            ended.append(trainer.strategy._fit_finished)

    trainer = _trainer(max_steps=3, limit_val_batches=0, callbacks=[Hooks()])
    trainer.fit(RegressionModel())
    assert ended == [True]  # the strategy had finished the fit when the callbacks' on_train_end ran
    assert "on_run_end" not in vars(trainer.fit_loop)  # the fit loop's own method again after teardown


def test_model_checkpoint_loads_into_the_plain_module(tmp_path):
    model = RegressionModel()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last", every_n_train_steps=6)
    strategy = AdaptiveElasticStrategy(sync="models")
    trainer = _trainer(strategy, max_steps=6, callbacks=[checkpoint], enable_checkpointing=True)
    trainer.fit(model)
    loaded = RegressionModel.load_from_checkpoint(tmp_path / "last.ckpt")
    torch.testing.assert_close(flat_parameters(loaded), flat_parameters(model))
    payload = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert set(payload["adaptive_elastic"]) == {"world_size", "shared", "replicas"}
    assert all(not key.startswith("module.") for key in payload["state_dict"])


class _UnifiedRegression(L.LightningModule):
    """The same model in the unified `lightning` namespace, whose Trainer takes only its own modules."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return RegressionModel().train_dataloader()


def test_the_unified_lightning_trainer_trains_with_the_strategy_name():
    model = _UnifiedRegression()
    before = flat_parameters(model)
    trainer = _trainer(trainer_cls=L.Trainer, max_steps=3, limit_val_batches=0)
    trainer.fit(model)
    assert trainer.global_step == 3
    assert not torch.allclose(flat_parameters(model), before)


@pytest.mark.parametrize(
    "strategy_class", [AdaptiveElasticStrategy, UnifiedStrategy], ids=["pytorch_lightning", "unified"]
)
def test_the_unused_parameters_error_names_the_strategys_own_option(strategy_class):
    reducer_error = RuntimeError(
        "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates "
        "that your module has parameters that were not used in producing loss. ..."
    )
    strategy_class().on_exception(reducer_error)
    (message,) = reducer_error.args
    assert "HINT: if this is intentional, let the strategy detect them: " in message
    assert "AdaptiveElasticStrategy(find_unused_parameters=True)" in message
    assert "ddp_find_unused_parameters_true" not in message  # Lightning's DDP's fix leaves this strategy
    other = RuntimeError("the user's own error")
    strategy_class().on_exception(other)
    assert other.args == ("the user's own error",)


@pytest.mark.parametrize(("rule", "expected_resets"), [(SMA(alpha=0.1), 2), ("elastic_average", 0)])
def test_replicas_reset_to_the_central_model_when_the_learning_rate_drops(monkeypatch, rule, expected_resets):
    class Decaying(RegressionModel):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    resets = []
    monkeypatch.setattr(ElasticAverager, "reset_to_center", lambda self: resets.append(self.local_steps))
    strategy = AdaptiveElasticStrategy(sync="models", merge_rule=rule, period=100)
    _trainer(strategy, max_epochs=3, limit_val_batches=0).fit(Decaying(size=16, batch_size=8))
    assert resets == [2, 4][:expected_resets]  # the rate halves after each 2-step epoch (Crossbow's LR drops)


class _Manual(RegressionModel):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class _BatchList(RegressionModel):
    """Training batches from a plain iterable, which Lightning accepts and the strategy cannot split."""

    def train_dataloader(self):
        return list(super().train_dataloader())


@pytest.mark.parametrize("sync", ["gradients", "models"])
def test_a_training_iterable_that_is_not_a_dataloader_fails_before_training(sync):
    model = _BatchList()
    before = flat_parameters(model)
    with pytest.raises(UnsupportedSettingError, match=r"not a torch DataLoader\. HINT: return torch\.utils"):
        _trainer(AdaptiveElasticStrategy(sync=sync), max_steps=2).fit(model)
    torch.testing.assert_close(flat_parameters(model), before)


class _TwoLoaders(RegressionModel):
    """Trains on a dict (or list) of two loaders, which Lightning combines into one batch of both."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def train_dataloader(self):
        loaders = [super().train_dataloader(), super().train_dataloader()]
        return dict(zip("ab", loaders, strict=True)) if self.form == "dict" else loaders

    def training_step(self, batch, batch_idx):
        return super().training_step(batch["a"] if self.form == "dict" else batch[0], batch_idx)


@pytest.mark.parametrize("form", ["dict", "list"])
def test_several_training_loaders_fail_before_training(form):
    # Only the last loader followed the plans: the others kept an equal split, weighted with its shares.
    model = _TwoLoaders(form)
    before = flat_parameters(model)
    with pytest.raises(UnsupportedSettingError, match=r"holds 2 \(a (dict|list) of loaders\).* HINT: put the datasets"):
        _trainer(max_steps=2).fit(model)
    torch.testing.assert_close(flat_parameters(model), before)


def test_several_training_loaders_under_auto_learners_fail_with_the_same_hint():
    # "auto" times the step on one loader's batch, before Lightning has handed the strategy the others.
    model = _TwoLoaders("dict")
    before = flat_parameters(model)
    with pytest.raises(RuntimeError, match=r"learners_per_device='auto'.* failed: .*HINT: .*several DataLoaders"):
        _trainer(AdaptiveElasticStrategy(sync="models", learners_per_device="auto"), max_steps=2).fit(model)
    torch.testing.assert_close(flat_parameters(model), before)


def test_a_peer_failing_while_auto_learners_are_timed_is_raised_as_it_is(monkeypatch):
    # The launcher ends the replicas on a ReplicaStalledError: wrapped, it would not know it.
    stalled = ReplicaStalledError(collective="all-reduce", rank=0, world_size=2, waited=1.0, roll=None, cause="gone")

    def fails(self, measure):
        raise stalled

    monkeypatch.setattr("lightning_aesgd.engine.model_merge.ModelMerge.choose_learners", fails)
    with pytest.raises(ReplicaStalledError) as raised:
        _trainer(AdaptiveElasticStrategy(sync="models", learners_per_device="auto"), max_steps=2).fit(RegressionModel())
    assert raised.value is stalled


@pytest.mark.parametrize(
    ("model", "trainer_kwargs", "match"),
    [
        (_Manual(), {}, "automatic optimization"),
        (RegressionModel(), {"accumulate_grad_batches": 2}, "accumulate_grad_batches=1"),
    ],
)
def test_unsupported_settings_fail_before_training(model, trainer_kwargs, match):
    before = flat_parameters(model)
    with pytest.raises(UnsupportedSettingError, match=match):
        _trainer(max_steps=2, **trainer_kwargs).fit(model)
    torch.testing.assert_close(flat_parameters(model), before)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # A training option, checked by the strategy's settings (every kind of bad value: tests/test_settings.py).
        ({"period": 0}, ValueError, "`period` must be >= 1"),
        ({"lr_scaling": "no"}, TypeError, "`lr_scaling` is a switch"),
        # A launch option, checked by the strategy itself.
        ({"timeout": 60}, TypeError, "`timeout` is the time collectives may wait"),
        ({"timeout": timedelta(seconds=-1)}, ValueError, "every collective would fail at once"),
        ({"start_method": "thread"}, ValueError, "`start_method` is how the replicas are started, got 'thread'"),
    ],
)
def test_invalid_arguments_fail_at_construction_with_a_hint(kwargs, error, match):
    with pytest.raises(error, match=rf"{match}.*HINT"):
        AdaptiveElasticStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"slowdown": [1, 2, 4]}, "The slowdown profile has 3 factors but 2 replicas train"),
        ({"min_batch": [1, 2, 3]}, "`min_batch` holds 3 values for 2 replicas"),
        ({"planner": "static", "shares": [1, 2, 3]}, "Got 3 static shares for 2 replicas"),
    ],
)
def test_options_given_per_replica_fail_when_the_trainer_knows_its_devices(kwargs, match):
    """Before any replica starts (they would each fail after the launch, in a multi-process traceback)."""
    with pytest.raises(ValueError, match=rf"{match}.*HINT"):
        _trainer(AdaptiveElasticStrategy(**kwargs), devices=2)


def test_a_misspelt_option_is_an_error_not_a_silent_ddp_argument():
    with pytest.raises(TypeError, match=r"unexpected arguments \['perod'\] \(perod: did you mean period\?\)") as caught:
        AdaptiveElasticStrategy(perod=4)
    assert "its options: accelerator, checkpoint_io," in str(caught.value)
    assert "unexpected" not in str(caught.value).split("its options:")[1]


def test_an_option_of_ddps_is_named_as_such_beside_a_typo():
    with pytest.raises(
        TypeError, match=r"takes no \['bucket_cap_mb', 'static_graph'\]: they are Distributed"
    ) as caught:
        AdaptiveElasticStrategy(static_graph=True, bucket_cap_mb=50, perod=3)
    assert "unexpected arguments ['perod'] (perod: did you mean period?)" in str(caught.value)


def test_telemetry_reaches_csv_and_tensorboard_loggers(tmp_path):
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = [CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")]
    # Merges fall on even steps, logging steps on odd ones: the latest merge's numbers must still be logged.
    strategy = AdaptiveElasticStrategy(sync="models", planner="proportional", period=2)
    trainer = _trainer(strategy, max_steps=8, logger=loggers, log_every_n_steps=2, limit_val_batches=0)
    trainer.fit(RegressionModel())
    header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    for name in ("samples_per_sec", "batch_size", "share", "merge_weight", "wait_fraction"):
        assert f"aesgd/replica_0/{name}" in header
    assert "aesgd/share_error" in header
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    assert "aesgd/replica_0/samples_per_sec" in events.Tags()["scalars"]


def test_telemetry_follows_lightnings_logging_steps_and_none_at_log_every_n_steps_zero(tmp_path):
    def logged_steps(every: int, max_steps: int) -> list[int]:
        logger = pl.loggers.CSVLogger(tmp_path, name=f"every_{every}")
        strategy = AdaptiveElasticStrategy(sync="models", period=1)
        _trainer(strategy, max_steps=max_steps, logger=logger, log_every_n_steps=every).fit(RegressionModel())
        path = Path(logger.log_dir) / "metrics.csv"
        rows = list(csv.DictReader(path.open())) if path.exists() else []  # no file: nothing was logged
        return [int(row["step"]) for row in rows if row.get("aesgd/share_error")]

    assert logged_steps(0, max_steps=4) == []  # Lightning logs nothing at 0; the telemetry logged every step
    assert logged_steps(3, max_steps=7) == [2, 5]  # Lightning's every third step


def test_end_of_fit_summary_reaches_the_root_logger_and_is_saved_as_json(caplog, tmp_path):
    strategy = AdaptiveElasticStrategy(planner="proportional")
    logger = pl.loggers.CSVLogger(tmp_path, name="csv")
    # The package's records propagate to the root logger (Hydra's train.log, pytest's capture) where it has handlers.
    with caplog.at_level("INFO", logger="lightning_aesgd"):
        _trainer(strategy, max_steps=4, limit_val_batches=0, logger=logger).fit(RegressionModel())
    summary = "\n".join(record.getMessage() for record in caplog.records if record.name.startswith("lightning_aesgd"))
    assert "replicas at the end of fit" in summary
    assert "gradient sums: 4" in summary  # the default sync mode's sync points
    record = json.loads((Path(logger.log_dir) / SUMMARY_FILE).read_text())
    assert (record["syncs"], record["sync_name"]) == (4, "gradient sums")
    assert [replica["rank"] for replica in record["replicas"]] == [0]
    assert sum(replica["batch"] for replica in record["replicas"]) > 0


def test_the_package_logger_prints_by_itself_only_without_a_root_handler(monkeypatch):
    # Without any logging configuration the summary still shows (on stderr), and once configured it shows once.
    root, package = logging.getLogger(), logging.getLogger("lightning_aesgd")
    (fallback,) = package.handlers
    own, configured = io.StringIO(), io.StringIO()
    monkeypatch.setattr(fallback, "stream", own)
    monkeypatch.setattr(root, "handlers", [])
    logging.getLogger("lightning_aesgd.strategy").info("alone")
    monkeypatch.setattr(root, "handlers", [logging.StreamHandler(configured)])
    logging.getLogger("lightning_aesgd.strategy").info("configured")
    assert (own.getvalue(), configured.getvalue()) == ("alone\n", "configured\n")


class SIGTERMException(SystemExit):
    """Stands in for Lightning's: the stop check raises the exception of the loop's own module."""


def test_the_strategy_replaces_the_sigterm_broadcast_only_during_fit():
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append(type(vars(trainer.fit_loop.epoch_loop).get("_broadcast_sigterm_tensor")).__name__)

    trainer = _trainer(AdaptiveElasticStrategy(), max_steps=2, callbacks=[Probe()], limit_val_batches=0)
    trainer.fit(RegressionModel())
    assert seen == ["StopCheck", "StopCheck"]
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)


class _WeightedSampling(RegressionModel):
    def train_dataloader(self):
        weights = [0.0] * 32 + [1.0] * 32  # the first half must never be drawn
        sampler = torch.utils.data.WeightedRandomSampler(weights, num_samples=64)
        return DataLoader(RegressionData(64), batch_size=4, sampler=sampler)


def test_a_weighted_sampler_is_refused_before_training_not_replaced():
    model = _WeightedSampling()
    with pytest.raises(TypeError, match="WeightedRandomSampler"):
        _trainer(max_steps=4).fit(model)
    assert model.seen == []  # not one step trained


def test_a_plan_lag_within_the_prefetch_depth_fails_before_training():
    model = RegressionModel()
    with pytest.raises(ValueError, match=r"plan_lag=1 is not above .* prefetch depth 1.*HINT: set plan_lag >= 2"):
        _trainer(AdaptiveElasticStrategy(plan_lag=1), max_steps=2).fit(model)
    assert model.seen == []


def test_a_planner_object_that_cannot_plan_for_the_replicas_fails_before_training():
    # Found by tests/test_fuzz.py: the first plan, after a training step, raised an error without a hint.
    model = RegressionModel()
    strategy = AdaptiveElasticStrategy(planner=StaticPlanner((1.0, 2.0)))
    with pytest.raises(ValueError, match=r"failed a trial plan.*HINT"):
        _trainer(strategy, max_steps=2).fit(model)
    assert model.seen == []


@pytest.fixture
def deterministic_algorithms():
    yield
    torch.use_deterministic_algorithms(False)  # Lightning's Trainer(deterministic=True) sets it for the process


def test_deterministic_trainer_is_told_that_measured_plans_do_not_repeat(deterministic_algorithms):
    with pytest.warns(UserWarning, match=r"deterministic=True.*HINT: planner='static'"):
        _trainer(max_steps=2, deterministic=True).fit(RegressionModel())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*deterministic=True")
        _trainer(AdaptiveElasticStrategy(planner="static"), max_steps=2, deterministic=True).fit(RegressionModel())


def test_a_gradient_accumulation_schedule_is_refused_before_training_as_accumulate_grad_batches_is():
    from pytorch_lightning.callbacks import GradientAccumulationScheduler

    trainer = _trainer(max_steps=2, callbacks=[GradientAccumulationScheduler({0: 2})])
    with pytest.raises(UnsupportedSettingError, match=r"GradientAccumulationScheduler.*HINT: remove the callback"):
        trainer.fit(RegressionModel())
    _trainer(max_steps=2, callbacks=[GradientAccumulationScheduler({0: 1})]).fit(RegressionModel())  # no accumulation


@pytest.mark.parametrize("averaging", ["StochasticWeightAveraging", "EMAWeightAveraging"])
def test_weight_averaging_callbacks_are_refused_under_model_merges_only(averaging):
    from pytorch_lightning import callbacks

    callback = getattr(callbacks, averaging)
    options = {"swa_lrs": 0.01, "swa_epoch_start": 1} if averaging == "StochasticWeightAveraging" else {}
    merging = _trainer(AdaptiveElasticStrategy(sync="models"), max_steps=2, callbacks=[callback(**options)])
    with pytest.raises(UnsupportedSettingError, match=rf"{averaging} with sync='models'.*HINT: use sync='gradients'"):
        merging.fit(RegressionModel())
    _trainer(max_steps=2, callbacks=[callback(**options)]).fit(RegressionModel())


def test_use_distributed_sampler_false_is_said_to_have_no_effect():
    with pytest.warns(UserWarning, match=r"use_distributed_sampler=False\) has no effect"):
        _trainer(max_steps=2, use_distributed_sampler=False).fit(RegressionModel())


@pytest.mark.parametrize(
    ("device", "backend", "extended"), [(torch.device("cuda", 0), "nccl", True), (torch.device("cpu"), "gloo", False)]
)
def test_a_group_the_host_does_not_wait_in_outlasts_the_timeout_so_the_collective_watch_reports_first(
    monkeypatch, device, backend, extended
):
    # NCCL's watchdog ends the process at the group's timeout; the watch names the stall at the strategy's, and its
    # roll call needs up to GRACE_SECONDS more. No group is formed here: Lightning's connection is recorded.
    from lightning_fabric.plugins.environments import LightningEnvironment

    from lightning_aesgd.engine.collective_watch import GRACE_SECONDS

    formed = []
    monkeypatch.setattr(
        "pytorch_lightning.strategies.ddp._init_dist_connection",
        lambda environment, chosen, **options: formed.append((chosen, options["timeout"])),
    )
    monkeypatch.setattr("lightning_aesgd.placement._init_dist_connection", lambda environment, chosen, **options: None)
    monkeypatch.setattr("lightning_aesgd.strategy.destroy_group_at_exit", lambda: None)
    attempt = []  # a single-node torchrun forms its group here, before Lightning's set-up
    monkeypatch.setattr("lightning_aesgd.strategy.init_attempt_group", lambda s: attempt.append(s._timeout))
    strategy = AdaptiveElasticStrategy(
        timeout=timedelta(seconds=10), parallel_devices=[device], cluster_environment=LightningEnvironment()
    )
    strategy.setup_distributed()
    group_timeout = timedelta(seconds=10 + (GRACE_SECONDS if extended else 0))
    assert formed == [(backend, group_timeout)]
    assert attempt == [group_timeout]
    assert strategy._timeout == timedelta(seconds=10), "the steps' own waits keep the strategy's timeout"
    # The watch fires at the strategy's timeout, however short, not at a rule of the group's.
    assert strategy._watch_after() == (10.0 if extended else None)


class _OneCycle(RegressionModel):
    """Lightning's recipe for a per-step schedule: its length read from the trainer in ``configure_optimizers``."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        total = self.trainer.estimated_stepping_batches  # sets the training data up, before the strategy's engine
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("sync", ["gradients", "models"])
def test_a_schedule_sized_by_estimated_stepping_batches_trains_on_the_planned_loader(sync):
    # The loader set up for the estimate was the user's own: the planned loader never replaced it, and the fit
    # failed at its end ("call plan_book_for() first"), or under sync="models" never merged.
    model = _OneCycle(size=40, batch_size=8)
    trainer = _trainer(AdaptiveElasticStrategy(sync=sync), max_epochs=2)
    trainer.fit(model)
    assert trainer.global_step == 10
    assert type(trainer.train_dataloader).__name__ == "PlannedDataLoader"


class _LinearDecay(_OneCycle):
    """A schedule that only decays, sized as the OneCycle one, so that running past its end does not raise."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_an_estimate_read_before_the_planned_loader_is_warned_of_where_the_step_batch_differs(caplog):
    # The user's loader counts 5 batches of 8 an epoch; with a step batch of 4 the planned loader takes 10.
    model = _LinearDecay(size=40, batch_size=8)
    with caplog.at_level("WARNING", logger="lightning_aesgd.trainer_io"):
        _trainer(AdaptiveElasticStrategy(step_batch_size=4), max_epochs=1).fit(model)
    assert "estimated_stepping_batches from the training loader as given, 5 batches an epoch" in caplog.text
    assert "the strategy's planned loader takes 10" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_aesgd.trainer_io"):
        _trainer(AdaptiveElasticStrategy(), max_epochs=1).fit(_LinearDecay(size=40, batch_size=8))
    assert "estimated_stepping_batches" not in caplog.text
