"""Every Hydra config option composes and instantiates; a multirun sweep over algorithms runs end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from lightning_aesgd import AdaptiveElasticStrategy, InverseTimeDecay
from lightning_aesgd.core.planners import AdditivePlanner
from lightning_aesgd.train import MODEL_FOR_DATA, _checkpoint, build, config_dir, fit_and_test

CONFIGS = Path(config_dir())


def _options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONFIGS / group).glob("*.yaml"))


def _compose(tmp_path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[f"hydra.runtime.output_dir={tmp_path}", *overrides], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


@pytest.mark.parametrize("algorithm", [name for name in _options("algorithm") if name != "single_device"])
@pytest.mark.parametrize("devices", ["strong", "straggler"])
def test_every_algorithm_builds_a_trainer(tmp_path, algorithm, devices):
    trainer, _model, _datamodule = build(_compose(tmp_path, f"algorithm={algorithm}", f"devices={devices}"))
    assert isinstance(trainer, pl.Trainer)
    assert trainer.num_devices == 4
    if isinstance(trainer.strategy, AdaptiveElasticStrategy):
        assert trainer.strategy.slowdown.factor(3, 10_000) == 24.0  # base 6 × factor 4
    else:
        assert any(type(c).__name__ == "SlowdownCallback" for c in trainer.callbacks)


def test_the_single_device_floor_builds_one_process_on_the_cpu(tmp_path):
    cfg = _compose(tmp_path, "algorithm=single_device", "devices.num_replicas=1", "devices.slowdown=null")
    trainer, _model, _datamodule = build(cfg)
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"
    assert trainer.strategy.root_device.type == "cpu"
    assert trainer.num_devices == 1


@pytest.mark.parametrize("group", ["data", "model", "devices", "trainer", "experiment"])
def test_every_option_of_every_group_composes_to_its_own_choice(tmp_path, group):
    for option in _options(group):
        cfg = _compose(tmp_path, f"{group}={option}")
        assert cfg.hydra.runtime.choices[group] == option
        if group == "experiment":  # an experiment sets the trainer at least
            assert cfg.trainer._target_.endswith("Trainer")
        else:
            assert cfg[group], f"{group}={option} composed to an empty group"


@pytest.mark.parametrize(("experiment", "outer_momentum"), [(None, 0.3), ("fashion_mnist", 0.0), ("digits", 0.0)])
def test_adaptive_sgd_outer_momentum_is_off_where_the_optimizer_has_momentum(tmp_path, experiment, outer_momentum):
    overrides = [f"experiment={experiment}"] if experiment else []
    trainer, _model, _datamodule = build(_compose(tmp_path, "algorithm=adaptive_sgd", *overrides))
    assert trainer.strategy.merge_rule.momentum == outer_momentum


def test_the_paper_preset_is_the_papers_algorithm(tmp_path):
    trainer, model, _datamodule = build(_compose(tmp_path, "algorithm=adaptive_sgd_paper"))
    strategy = trainer.strategy
    planner = strategy.plans.planner
    assert isinstance(planner, AdditivePlanner)
    assert (planner.step, planner.min_batch, planner.max_batch) == (32, 32, 1024)
    assert (strategy.plans.settings.plan_gain, strategy.plans.settings.min_share) == (1.0, 0.0)
    assert strategy.plans.settings.hold_steps == strategy.warmup_steps == 10
    assert strategy.merging.weights == "updates"
    assert strategy.engine.lr_scaling
    assert strategy.engine.normalization.enabled
    assert strategy.merge_rule.alpha == 1.0
    assert strategy.engine.lr_schedule == InverseTimeDecay(decay=0.005, warmup_steps=10, warmup_start=0.01)
    assert strategy.engine.lr_schedule.warmup_steps == strategy.warmup_steps
    assert (model.hparams["optimizer"], model.hparams["lr"]) == ("sgd", 4.0)  # plain SGD locally


@pytest.mark.parametrize("experiment", ["fashion_mnist", "digits"])
def test_the_paper_preset_takes_the_local_momentum_off_image_models(tmp_path, experiment):
    _trainer, model, _datamodule = build(_compose(tmp_path, "algorithm=adaptive_sgd_paper", f"experiment={experiment}"))
    assert model.hparams["momentum"] == 0.0
    _trainer, model, _datamodule = build(_compose(tmp_path, "algorithm=adaptive_sgd", f"experiment={experiment}"))
    assert model.hparams["momentum"] == 0.9


def test_other_algorithms_keep_the_models_own_optimizer(tmp_path):
    _trainer, model, _datamodule = build(_compose(tmp_path, "algorithm=adaptive_sgd"))
    assert (model.hparams["optimizer"], model.hparams["lr"]) == ("adagrad", 0.1)


WORKLOADS = sorted(MODEL_FOR_DATA.items())


def test_the_workload_table_covers_every_data_and_model_option():
    assert sorted({data for data, _ in WORKLOADS}) == _options("data")
    assert sorted({model for _, model in WORKLOADS}) == _options("model")


def test_a_checkpoint_path_that_does_not_exist_fails_before_the_fit(tmp_path):
    cfg = _compose(tmp_path, f"ckpt_path={tmp_path / 'no_such.ckpt'}", "trainer.max_epochs=1")
    with pytest.raises(FileNotFoundError, match=r"no_such\.ckpt does not exist .*HINT"):
        fit_and_test(cfg)
    assert not list(tmp_path.rglob("*.ckpt")), "nothing trained"


def test_checkpoint_paths_that_lightning_resolves_pass_unchecked(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "last.ckpt").touch()
    trainer = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(tmp_path))])
    for path in (
        "last",
        "best",
        "registry:model:1",
        "s3://bucket/last.ckpt",
        "~/last.ckpt",
        str(tmp_path / "last.ckpt"),
    ):
        assert _checkpoint(path, trainer) == path
    assert _checkpoint(None, trainer) is None


def test_last_without_a_last_checkpoint_in_the_jobs_folder_says_the_fit_starts_from_scratch(tmp_path, caplog):
    # Lightning warns of no last checkpoint in words that do not say each job writes to a new folder. A restart
    # loop asks for "last" on its first attempt too: it trains.
    trainer = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(tmp_path / "checkpoints"))])
    with caplog.at_level("WARNING", logger="lightning_aesgd.train"):
        assert _checkpoint("last", trainer) == "last"
    assert "finds no last checkpoint in this job's checkpoint folder" in caplog.text
    assert "hydra.run.dir" in caplog.text


def test_a_misspelt_model_option_keeps_hydras_own_error(tmp_path):
    with pytest.raises(InstantiationException, match="unexpected keyword argument 'dropuot'"):
        build(_compose(tmp_path, "+model.dropuot=0.1"))


def test_a_model_that_does_not_fit_the_data_names_the_one_that_does(tmp_path):
    with pytest.raises(
        TypeError, match=r"XMCModule cannot be built for the data .*num_classes.*HINT: .*data=digits model=digits_mlp"
    ):
        build(_compose(tmp_path, "data=digits"))


@pytest.mark.parametrize(("data", "model"), WORKLOADS)
def test_every_data_option_instantiates_with_its_model(tmp_path, data, model):
    overrides = []
    if data == "xmc_files":  # real data the user has: two tiny files in the repository's format
        for name, points in (("train.txt", 20), ("test.txt", 5)):
            (tmp_path / name).write_text(f"{points} 7 6\n" + "0,5 1:0.5 6:1.0\n" * points)
        overrides.append(f"data.path={tmp_path}")
    cfg = _compose(tmp_path, f"data={data}", f"model={model}", *overrides)
    datamodule = instantiate(cfg.data)
    dimensions = datamodule.model_dimensions()
    if data == "xmc_files":
        assert dimensions == {"num_features": 7, "num_labels": 6}
    assert isinstance(instantiate(cfg.model, **dimensions), pl.LightningModule)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_multirun_sweep_over_three_algorithms(tmp_path):
    command = [
        sys.executable,
        "-m",
        "lightning_aesgd.train",
        "-m",
        "algorithm=adaptive_sgd,sma,ddp",
        "devices.num_replicas=2",
        "devices.slowdown.factors=[1,2]",
        "+trainer.max_steps=6",
        "+trainer.enable_progress_bar=false",
        f"hydra.sweep.dir={tmp_path}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=540, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("results: ") + result.stdout.count("results: ") == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0", "1", "2"]
    for job in ("0", "1", "2"):
        assert (tmp_path / job / "logs" / "metrics.csv").exists()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_paper_preset_trains_past_its_warm_up_end_to_end(tmp_path):
    command = [
        sys.executable,
        "-m",
        "lightning_aesgd.train",
        "algorithm=adaptive_sgd_paper",
        "devices.num_replicas=2",
        "devices.slowdown.factors=[1,2]",
        "+trainer.max_steps=16",
        "+trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp_path}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stderr + result.stdout
    assert "results: " in output
    assert "replicas at the end of fit" in output


def test_gpu_cpu_places_hogbatch_on_the_gpu_and_the_spare_cores(tmp_path, monkeypatch):
    from pytorch_lightning.accelerators import CUDAAccelerator

    from lightning_aesgd import placement

    monkeypatch.setattr(placement, "num_cuda_devices", lambda: 1)
    monkeypatch.setattr(placement, "available_cores", lambda: 16)
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(CUDAAccelerator, "parse_devices", staticmethod(lambda devices: [0]))
    trainer, _model, _datamodule = build(_compose(tmp_path, "devices=gpu_cpu", "algorithm=hogbatch"))
    strategy = trainer.strategy
    assert strategy.parallel_devices == [torch.device("cuda", 0), torch.device("cpu")]
    assert strategy.connects_over_gloo
    assert strategy._start_method == "spawn"
    assert (strategy.sync, strategy.settings.planner, strategy.settings.merge_weights) == (
        "models",
        "proportional",
        "samples",
    )
    assert not any(type(c).__name__ == "SlowdownCallback" for c in trainer.callbacks)  # real devices


def test_gpu_cpu_without_a_gpu_is_cpu_replicas_alone(tmp_path):
    trainer, _model, _datamodule = build(_compose(tmp_path, "devices=gpu_cpu", "algorithm=hogbatch"))
    assert {device.type for device in trainer.strategy.parallel_devices} == {"cpu"}
