"""The main job: ``python -m lightning_aesgd.train`` (or ``aesgd-train``) trains and tests one configuration.

Hydra composes ``configs/train.yaml``: a workload (``data`` and ``model``), an ``algorithm`` (this project's
strategy configured as Adaptive SGD, SMA, EASGD or local SGD, or Lightning's own DDP), a ``trainer`` and a
``devices`` profile. Any group can be swapped on the command line, and ``-m`` sweeps over several.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_aesgd.callbacks import SlowdownCallback
from lightning_aesgd.console import quiet_known_noise
from lightning_aesgd.core.slowdown import as_profile
from lightning_aesgd.strategy import AdaptiveElasticMixin

log = logging.getLogger(__name__)


def config_dir() -> str:
    """The Hydra configs: ``$AESGD_CONFIG_DIR``, else the package's own copy, else ``configs/`` of a source checkout.

    The repository keeps them in its top-level ``configs/``; the wheel ships that directory inside the package as
    ``lightning_aesgd/configs`` (``package-dir`` in ``pyproject.toml``), so an installed ``aesgd-train`` runs from
    any directory. A source checkout (on ``PYTHONPATH`` or installed editable) has no such copy and reads the
    directory beside the package. Either way it is a real directory, which ``hydra.main`` and the compose API (the
    benchmark, the tests) both accept. Users add options of their own with ``--config-dir DIR`` (e.g.
    ``DIR/data/mine.yaml``, then ``data=mine``) or replace the whole tree with ``--config-path``.
    """
    override = os.environ.get("AESGD_CONFIG_DIR")
    if override:
        return override
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    return str(installed if (installed / "train.yaml").is_file() else package.parent / "configs")


class _ShapedDataModule(Protocol):
    def model_dimensions(self) -> dict[str, int]: ...


def build(cfg: DictConfig) -> tuple[pl.Trainer, pl.LightningModule, pl.LightningDataModule]:
    """Instantiate the data, the model (sized by the data), the strategy and the Trainer of a configuration."""
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model, **_dimensions(datamodule))
    strategy = instantiate(cfg.algorithm)
    callbacks: list[pl.Callback] = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    callbacks += [FirstValidation(), LogHyperparameters(hyperparameters(cfg))]
    profile = as_profile(cfg.devices.slowdown)
    if profile is not None and (profile.mode != "step" or not isinstance(strategy, AdaptiveElasticMixin)):
        # Every strategy gets the same emulated devices through a callback, except in the `step` mode, which
        # this project's strategy applies inside its own optimizer step.
        callbacks.append(SlowdownCallback(profile))
    trainer = instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks)
    return trainer, model, datamodule


def _dimensions(datamodule: Any) -> dict[str, int]:
    shaped: _ShapedDataModule | None = datamodule if hasattr(datamodule, "model_dimensions") else None
    return shaped.model_dimensions() if shaped is not None else {}


def hyperparameters(cfg: DictConfig) -> dict[str, Any]:
    """The algorithm, its options and the devices profile, as the loggers' hyperparameters.

    Nested as ``{"algorithm": {"name": ..., <options>}, "devices": {"name": ..., <profile>}}``; loggers that
    want flat names (TensorBoard) flatten them to ``algorithm/period`` and so on. The names are Hydra's choices
    of the two groups where Hydra composed the job, the algorithm's class otherwise.
    """
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    algorithm = OmegaConf.to_container(cfg.algorithm, resolve=True)
    devices = OmegaConf.to_container(cfg.devices, resolve=True)
    assert isinstance(algorithm, dict)
    assert isinstance(devices, dict)
    target = str(algorithm.pop("_target_", ""))
    return {
        "algorithm": {"name": choices.get("algorithm") or target.rsplit(".", 1)[-1], "class": target, **algorithm},
        "devices": {"name": choices.get("devices") or "custom", **devices},
    }


class LogHyperparameters(pl.Callback):
    """Hands fixed hyperparameters to every logger of the fit (rank zero), beside the model's own."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log :attr:`params` once per fit."""
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_hyperparams(self.params)


class FirstValidation(pl.Callback):
    """Keeps the first validation's metrics in ``trainer.callback_metrics`` as ``first_val/...``.

    Whatever the loggers (CSV, TensorBoard or none), they reach the launching process with the other callback
    metrics, which Lightning sends back from rank zero when the replicas ran in processes of their own.
    """

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Copy ``val/...`` to ``first_val/...`` after the first validation that is not a sanity check."""
        metrics = trainer.callback_metrics
        if trainer.sanity_checking or any(name.startswith("first_val/") for name in metrics):
            return
        metrics.update({f"first_{name}": value for name, value in list(metrics.items()) if name.startswith("val/")})


def run(cfg: DictConfig) -> dict[str, float]:
    """Fit, then test the final (merged) model; returns the test metrics and the first validation metrics."""
    trainer, model, datamodule = build(cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("model: %s, %s trainable parameters", type(model).__name__, f"{trainable:,}")
    trainer.fit(model, datamodule=datamodule)
    results: dict[str, float] = {}
    if cfg.test:
        # Every replica holds the same merged model after fit: one process tests it, each sample exactly once.
        tester = pl.Trainer(
            accelerator=trainer.accelerator,
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        tested = tester.test(model, datamodule=datamodule, verbose=False)
        results.update({name: float(value) for name, value in tested[0].items()})
    first = {name: float(value) for name, value in trainer.callback_metrics.items() if name.startswith("first_val/")}
    results.update(first)
    log.info("%s", _report(results))
    return results


def _report(results: dict[str, float]) -> str:
    shown = {name: value for name, value in sorted(results.items()) if not math.isnan(value)}
    return "results: " + ", ".join(f"{name}={value:.4f}" for name, value in shown.items())


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def _main(cfg: DictConfig) -> float:
    quiet_known_noise()
    results = run(cfg)
    # The value Hydra sweepers optimise: the first test metric, e.g. test/p@1 or test/acc.
    return next((v for k, v in results.items() if k.startswith("test/") and "loss" not in k), math.nan)


def main() -> None:
    """Console entry point (``aesgd-train``): Hydra parses the command line."""
    _main()


if __name__ == "__main__":
    main()
