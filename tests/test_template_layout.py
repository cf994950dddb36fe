"""The lightning-hydra-template layout: logger, callbacks, paths, debug and hparams_search
groups, the submitit launchers, ``tags``, ``ckpt_path`` and ``optimized_metric``; with an Optuna search, a
submitit sweep and a resumed job run end to end on tiny settings."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from pytorch_lightning.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from lightning_aesgd.train import build, check_optimized_metric, config_dir, hyperparameters, optimized_value

CONFIGS = Path(config_dir())
_LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TINY = [
    "devices.num_replicas=2",
    "devices.slowdown.base=1",
    "devices.slowdown.factors=[1,2]",
    "data.batch_size=64",
    "trainer.max_epochs=1",
    "trainer.log_every_n_steps=1",
    "+trainer.limit_train_batches=3",
    "+trainer.limit_val_batches=2",
    "+trainer.limit_test_batches=2",
    "+trainer.enable_progress_bar=false",
]
"""A job of seconds: 2 replicas (one 2× slower, no common base), 3 small training batches per epoch."""


def _options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONFIGS / group).glob("*.yaml"))


def _compose(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[f"hydra.runtime.output_dir={tmp_path}", *overrides],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    return cfg


# --- composition ----------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/submitit_:UserWarning")
@pytest.mark.parametrize(
    ("group", "options"),
    [
        ("logger", ["comet", "csv", "many_loggers", "mlflow", "neptune", "tensorboard", "wandb"]),
        ("callbacks", ["default", "early_stopping", "lr_monitor", "model_checkpoint", "none", "rich_progress_bar"]),
        ("paths", ["default"]),
        ("debug", ["default", "fdr", "limit", "overfit"]),
        ("hparams_search", ["digits_optuna", "xmc_mini_optuna"]),
        ("hydra/launcher", ["submitit_local", "submitit_slurm"]),
    ],
)
def test_every_option_of_the_template_groups_composes(tmp_path, group, options):
    assert set(options) <= set(_options(group))
    for option in _options(group):
        cfg = _compose(tmp_path, f"{group}={option}")
        assert cfg.trainer is not None
        if group == "logger":
            assert all("_target_" in node for node in cfg.logger.values())
        if group == "hydra/launcher":
            assert cfg.hydra.launcher._target_.startswith("hydra_plugins.hydra_submitit_launcher.")


def test_the_default_job_logs_csv_into_its_output_folder_and_checkpoints_beside(tmp_path):
    cfg = _compose(tmp_path)
    assert list(cfg.logger) == ["csv"]
    assert cfg.paths.output_dir == str(tmp_path)
    assert cfg.paths.root_dir == os.getcwd()  # the directory the job started from
    assert (cfg.seed, cfg.ckpt_path, cfg.optimized_metric, list(cfg.tags)) == (0, None, None, ["dev"])
    trainer, _model, _datamodule = build(cfg)
    [logger] = trainer.loggers
    assert isinstance(logger, CSVLogger)
    assert Path(logger.log_dir) == tmp_path / "logs"  # as before the logger group: no version_N folder
    [checkpoint] = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert Path(checkpoint.dirpath) == tmp_path / "checkpoints"
    assert checkpoint.save_last
    # The tqdm bar by name: Lightning would pick its rich bar wherever rich is installed.
    assert [type(c) for c in trainer.callbacks if isinstance(c, ProgressBar)] == [TQDMProgressBar]
    assert hyperparameters(cfg)["tags"] == ["dev"]


def test_the_trainers_switches_win_over_the_callbacks_group(tmp_path):
    cfg = _compose(tmp_path, "++trainer.enable_checkpointing=false", "+trainer.enable_progress_bar=false")
    trainer, _model, _datamodule = build(cfg)  # Lightning would refuse a checkpoint callback or a bar here
    assert not any(isinstance(c, ModelCheckpoint | ProgressBar) for c in trainer.callbacks)


def test_loggers_come_from_the_logger_group(tmp_path):
    trainer, _model, _datamodule = build(_compose(tmp_path, "logger=many_loggers"))
    assert [type(logger) for logger in trainer.loggers] == [CSVLogger, TensorBoardLogger]
    assert Path(trainer.loggers[1].log_dir) == tmp_path / "tensorboard"
    trainer, _model, _datamodule = build(_compose(tmp_path, "~logger"))
    assert trainer.loggers == []


def test_the_online_loggers_stay_offline_by_default(tmp_path):
    cfg = _compose(tmp_path, "logger=[wandb,mlflow,comet,neptune]")
    assert cfg.logger.wandb.offline is True
    assert cfg.logger.mlflow.tracking_uri == f"file:{tmp_path}/mlflow"
    assert cfg.logger.comet.online is False
    assert cfg.logger.neptune.mode == "offline"


def test_the_callbacks_group_instantiates(tmp_path):
    pytest.importorskip("rich")
    cfg = _compose(tmp_path, "callbacks=[default,lr_monitor,early_stopping,rich_progress_bar]")
    callbacks = [type(instantiate(node)).__name__ for node in cfg.callbacks.values()]
    assert callbacks == ["ModelCheckpoint", "RichProgressBar", "LearningRateMonitor", "EarlyStopping"]


@pytest.mark.parametrize(("debug", "setting"), [("fdr", "fast_dev_run"), ("limit", "limit_train_batches")])
def test_the_debug_configs_build_a_trainer_without_loggers(tmp_path, debug, setting):
    cfg = _compose(tmp_path, f"debug={debug}")
    assert cfg.logger is None
    assert cfg.trainer[setting]
    trainer, _model, _datamodule = build(cfg)
    assert trainer.loggers == []
    assert not any(isinstance(c, ModelCheckpoint) for c in trainer.callbacks)


@pytest.mark.parametrize(("search", "metric"), [("xmc_mini_optuna", "val/p@1"), ("digits_optuna", "val/acc")])
def test_the_search_maximises_a_metric_the_job_returns(tmp_path, search, metric):
    cfg = _compose(tmp_path, f"hparams_search={search}")
    assert cfg.optimized_metric == metric
    assert cfg.hydra.sweeper.direction == "maximize"
    assert cfg.hydra.sweeper.storage is None  # in memory: optuna 2's database storage predates SQLAlchemy 2
    assert set(cfg.hydra.sweeper.params) == {"model.lr", "algorithm.period", "algorithm.merge_rule.alpha"}


def test_the_optimized_value_is_the_named_metric_or_the_first_test_metric():
    metrics = {"val/p@1": 0.4, "test/loss": 2.0, "test/p@1": 0.5, "test/p@3": 0.3}
    assert optimized_value("val/p@1", metrics) == 0.4
    assert optimized_value(None, metrics) == 0.5
    assert math.isnan(optimized_value(None, {"val/p@1": 0.4}))
    with pytest.raises(KeyError, match="val/acc"):
        optimized_value("val/acc", metrics)


def test_a_test_metric_to_optimise_in_a_job_that_does_not_test_fails_before_the_fit():
    with pytest.raises(ValueError, match="test=true"):
        check_optimized_metric("test/p@1", tests=False)
    check_optimized_metric("test/p@1", tests=True)
    check_optimized_metric("val/p@1", tests=False)
    check_optimized_metric(None, tests=False)


# --- end to end -----------------------------------------------------------------------------------------------


def _train(*arguments: str, timeout: int = 240) -> str:
    environment = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    command = [sys.executable, "-m", "lightning_aesgd.train", *arguments]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_optuna_search_runs_its_trials_and_writes_the_best_parameters(tmp_path):
    output = _train(
        "-m",
        "hparams_search=xmc_mini_optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.n_startup_trials=2",
        *TINY,
        f"hydra.sweep.dir={tmp_path}",
    )
    assert output.count("results: ") == 2
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"model.lr", "algorithm.period", "algorithm.merge_rule.alpha"}
    assert 0.0 <= best["best_value"] <= 1.0  # a P@1


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_submitit_local_sweep_runs_each_job_in_a_process_of_its_own(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    output = _train(
        "-m", "hydra/launcher=submitit_local", "algorithm=adaptive_sgd,ddp", *TINY, f"hydra.sweep.dir={tmp_path}"
    )
    assert "Submitit 'local' sweep output dir" in output
    assert "validated against ConfigStore schema" not in output  # the known deprecation is hidden
    for job in ("0", "1"):
        assert "results: " in (tmp_path / job / "train.log").read_text()
        assert (tmp_path / job / "logs" / "metrics.csv").is_file()
    assert len(list((tmp_path / ".submitit").glob("*/*_result.pkl"))) == 2


def _steps(metrics_csv: Path) -> list[int]:
    with metrics_csv.open() as rows:
        return [int(row["step"]) for row in csv.DictReader(rows)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_job_logs_to_tensorboard_and_a_second_resumes_from_its_checkpoint(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    _train(*TINY, "trainer.max_epochs=2", "logger=many_loggers", "tags=[resume]", f"hydra.run.dir={first}")
    assert list((first / "tensorboard").glob("events.out.tfevents.*"))
    assert max(_steps(first / "logs" / "metrics.csv")) == 5
    last = first / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 6
    assert yaml.safe_load((first / "logs" / "hparams.yaml").read_text())["tags"] == ["resume"]

    _train(*TINY, "trainer.max_epochs=3", f"ckpt_path={last}", f"hydra.run.dir={second}")
    # The second job ran the third epoch only: its steps continue from the first job's.
    assert min(_steps(second / "logs" / "metrics.csv")) >= 6
    assert torch.load(second / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 9


def test_the_template_groups_keep_the_main_jobs_trainer_a_plain_trainer(tmp_path):
    trainer, _model, _datamodule = build(_compose(tmp_path, "logger=tensorboard", "callbacks=none"))
    assert isinstance(trainer, pl.Trainer)
    assert isinstance(trainer.logger, TensorBoardLogger)
