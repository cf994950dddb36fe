"""The spawn launcher on CPU: the strategy pickles in every configuration and fits from spawned processes.

Spawn is how replicas start wherever CUDA may be in use (``experiment=gpu``), so what a GPU run needs from
pickling is checked here, on every machine.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from cuda_bodies import fit_each_sync_mode, fit_learners, fit_placed_replicas, fit_sparse_gradients
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from lightning_aesgd import AdaptiveElasticStrategy
from lightning_aesgd.train import config_dir

ALGORITHMS = sorted(path.stem for path in (Path(config_dir()) / "algorithm").glob("*.yaml"))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("placement", [None, "experiment=gpu", "experiment=gpu_shared", "devices=gpu_cpu"])
def test_every_algorithm_config_pickles(algorithm, placement):
    overrides = [f"algorithm={algorithm}"] + ([placement] if placement else [])
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    strategy = instantiate(cfg.algorithm)
    restored = pickle.loads(pickle.dumps(strategy))
    assert type(restored) is type(strategy)
    assert getattr(restored, "replicas_per_device", 1) == getattr(strategy, "replicas_per_device", 1)
    assert getattr(restored, "parallel_devices", None) == getattr(strategy, "parallel_devices", None)


def test_strategy_pickles_after_a_fit_in_this_process(tmp_path):
    from helpers import RegressionModel, cpu_trainer

    strategy = AdaptiveElasticStrategy(gradient_delay=1)
    cpu_trainer(strategy, devices=1, max_steps=3).fit(RegressionModel())
    pickle.loads(pickle.dumps(strategy))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_spawned_replicas_fit_under_each_sync_mode():
    fit_each_sync_mode(accelerator="cpu", devices=2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("sync", "delay"), [("gradients", 0), ("gradients", 1), ("models", 0)])
def test_spawned_replicas_fit_a_sparse_model(sync, delay):
    fit_sparse_gradients(sync, delay, accelerator="cpu", devices=2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_spawned_replicas_fit_learners_chosen_by_the_tuner():
    fit_learners("auto", accelerator="cpu", devices=2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_spawned_replicas_placed_by_replica_devices_fit_a_sparse_model():
    fit_placed_replicas("gradients", sparse=True, devices=("cpu", "cpu"))
