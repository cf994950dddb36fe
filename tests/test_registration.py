"""`import lightning_aesgd` registers the strategy names in both Lightning namespaces, idempotently."""

from __future__ import annotations

import importlib

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
from lightning.pytorch.strategies import StrategyRegistry as UnifiedRegistry
from pytorch_lightning.strategies import StrategyRegistry
from pytorch_lightning.utilities.exceptions import MisconfigurationException

import lightning_aesgd
import lightning_aesgd.unified

NAMES = (
    ("adaptive_elastic", "popen"),
    ("adaptive_elastic_spawn", "spawn"),
    ("adaptive_elastic_fork", "fork"),
    ("adaptive_elastic_notebook", "fork"),
)


@pytest.mark.parametrize(
    ("trainer_cls", "registry", "strategy_cls"),
    [
        (pl.Trainer, StrategyRegistry, lightning_aesgd.AdaptiveElasticStrategy),
        (L.Trainer, UnifiedRegistry, lightning_aesgd.unified.AdaptiveElasticStrategy),
    ],
)
def test_both_namespaces_accept_the_name_and_the_class(trainer_cls, registry, strategy_cls):
    for name, start_method in NAMES:
        assert registry[name]["strategy"] is strategy_cls
        trainer = trainer_cls(strategy=name, accelerator="cpu", devices=1, logger=False)
        assert type(trainer.strategy) is strategy_cls
        assert trainer.strategy._start_method == start_method
    trainer = trainer_cls(strategy=strategy_cls(sync="models", period=4), accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy.period == 4


def test_registration_is_idempotent():
    importlib.reload(lightning_aesgd)
    lightning_aesgd.register_all()
    assert "adaptive_elastic" in StrategyRegistry.available_strategies()
    assert "adaptive_elastic" in UnifiedRegistry.available_strategies()


def test_device_parsing_gives_one_replica_per_device(monkeypatch):
    import lightning_fabric.accelerators.cuda as fabric_cuda
    import pytorch_lightning.accelerators.cuda as pl_cuda

    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 4)
    monkeypatch.setattr(pl_cuda, "num_cuda_devices", lambda: 4)
    monkeypatch.setattr(fabric_cuda, "_check_cuda_matmul_precision", lambda device: None, raising=False)
    trainer = pl.Trainer(strategy="adaptive_elastic", accelerator="gpu", devices=[1, 3], num_nodes=2, logger=False)
    assert [d.index for d in trainer.strategy.parallel_devices] == [1, 3]
    assert trainer.strategy.world_size == 4
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 0}


@pytest.mark.parametrize("registry", [StrategyRegistry, UnifiedRegistry])
def test_the_fork_names_launch_as_lightnings_ddp_fork_and_ddp_notebook(registry):
    for name, lightning_name in (("adaptive_elastic_fork", "ddp_fork"), ("adaptive_elastic_notebook", "ddp_notebook")):
        assert registry[name]["init_params"] == {"start_method": "fork"}
        assert registry[name]["init_params"] == registry[lightning_name]["init_params"]
    assert "notebook" in registry["adaptive_elastic_notebook"]["description"]


def test_the_notebook_name_is_the_one_an_interactive_session_accepts(monkeypatch):
    # In a notebook, Lightning refuses launchers that would re-run the script or spawn; it accepts fork.
    from pytorch_lightning.trainer.connectors import accelerator_connector

    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", True)
    for name in ("adaptive_elastic_notebook", "adaptive_elastic_fork"):
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert trainer.strategy.launcher.is_interactive_compatible
    with pytest.raises(MisconfigurationException, match="interactive"):
        pl.Trainer(strategy="adaptive_elastic", accelerator="cpu", devices=2, logger=False)
