"""The main job: ``python -m lightning_aesgd.train`` (or ``aesgd-train``) trains and tests one configuration.

Hydra composes ``configs/train.yaml``: a workload (``data`` and ``model``), an ``algorithm`` (this project's
strategy configured as Adaptive SGD, SMA, EASGD or local SGD, or Lightning's own DDP), a ``trainer`` and a
``devices`` profile; and the groups of the lightning-hydra-template layout: ``logger``, ``callbacks``, ``paths``,
``debug`` and ``hparams_search``. Any group can be swapped on the command line, and ``-m`` sweeps over several
(with Optuna under ``hparams_search``, or on SLURM through ``hydra/launcher=submitit_slurm``).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

import hydra
import pytorch_lightning as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.utilities import rank_zero_only

from lightning_aesgd.callbacks import SlowdownCallback
from lightning_aesgd.console import quiet_known_noise
from lightning_aesgd.emulation.profiles import as_profile
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
    strategy = instantiate(cfg.algorithm)
    model = _build_model(cfg, datamodule, strategy)
    callbacks: list[pl.Callback] = _instantiate_group(cfg.get("callbacks"))
    # The Trainer's switches win over the callbacks group: no checkpoints, or no bar, means none of the group's.
    if cfg.trainer.get("enable_checkpointing") is False:
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.ModelCheckpoint)]
    if cfg.trainer.get("enable_progress_bar") is False:
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.ProgressBar)]
    callbacks += [FirstValidation(), LogHyperparameters(hyperparameters(cfg))]
    profile = as_profile(cfg.devices.slowdown)
    if profile is not None and (profile.mode != "step" or not isinstance(strategy, AdaptiveElasticMixin)):
        # Every strategy gets the same emulated devices through a callback, except in the `step` mode, which
        # this project's strategy applies inside its own optimizer step.
        callbacks.append(SlowdownCallback(profile))
    options: dict[str, Any] = {"strategy": strategy, "callbacks": callbacks}
    if "logger" not in cfg.trainer:  # a trainer config with a logger of its own keeps it
        options["logger"] = _instantiate_group(cfg.get("logger")) or False
    trainer = instantiate(cfg.trainer, **options)
    return trainer, model, datamodule


def _model_options(cfg: DictConfig, strategy: Any) -> dict[str, Any]:
    """Dense embedding gradients for a baseline (Lightning's DDP reducer) over NCCL, which has no sparse sum.

    This project's strategy sums sparse gradients itself on any backend; Lightning's reducer hands them to the
    backend's all-reduce, which NCCL cannot do for sparse tensors (gloo can: replicas sharing a GPU, or CPU replicas
    beside GPU replicas).
    """
    if isinstance(strategy, AdaptiveElasticMixin) or not cfg.model.get("sparse_gradients", False):
        return {}
    if not _trains_on_cuda(cfg) or getattr(strategy, "connects_over_gloo", False):  # gloo sums sparse ones
        return {}
    log.info("Lightning's DDP on CUDA: the model uses dense embedding gradients (NCCL cannot sum sparse ones).")
    return {"sparse_gradients": False}


def _trains_on_cuda(cfg: DictConfig) -> bool:
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    # The device count comes from NVML, which leaves CUDA uninitialised here (replicas may still be forked).
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.device_count() > 0)


def _instantiate_group(group: DictConfig | None) -> list[Any]:
    """The objects of a ``logger`` or ``callbacks`` group: one per entry with a ``_target_``, in order.

    Entries without one (a user's switch such as ``callbacks.early_stopping=null``) are left out.
    """
    if not group:
        return []
    return [instantiate(node) for node in group.values() if isinstance(node, DictConfig) and "_target_" in node]


def _checkpoint(path: str | None, trainer: pl.Trainer) -> str | None:
    """``ckpt_path``, checked before any replica starts: a file that is not there fails at once, naming it.

    Lightning's own names (``"last"``, ``"best"``, ...) and remote paths are Lightning's to resolve; where
    ``"last"`` finds nothing (Lightning then trains from scratch), a warning says why: each job writes to a new
    folder.
    """
    if path == "last":
        dirpaths = [getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks]
        folders = [Path(dirpath) for dirpath in dirpaths if dirpath]
        if not any(next(folder.glob("last*.ckpt"), None) for folder in folders if folder.is_dir()):
            # A restart loop (torchrun --max-restarts) asks for "last" on its first attempt too: it trains afresh.
            shown = ", ".join(str(folder) for folder in folders) or "none: no ModelCheckpoint"
            log.warning(
                "ckpt_path=last finds no last checkpoint in this job's checkpoint folder (%s): the fit starts from "
                "scratch. Each job writes to a new folder: to resume an earlier job, give its checkpoint's path "
                "(ckpt_path=outputs/DATE/TIME/checkpoints/last.ckpt) or run in its folder (hydra.run.dir=...).",
                shown,
            )
        return path
    if path is None or path in ("best", "hpc") or path.lower().startswith("registry") or "://" in path:
        return path
    if Path(path).expanduser().exists():
        return path
    raise FileNotFoundError(
        f"ckpt_path={path} does not exist (a relative path starts from {Path.cwd()}). HINT: give the path of a "
        "checkpoint a job wrote, e.g. ckpt_path=outputs/DATE/TIME/checkpoints/last.ckpt, or leave it unset."
    )


MODEL_FOR_DATA = {
    "xmc_mini": "xmc",
    "xmc_eurlex": "xmc",
    "xmc_files": "xmc",
    "digits": "digits_mlp",
    "fashion_mnist": "fashion_cnn",
}
"""The model config that takes each data config's dimensions (the ``experiment`` configs set both)."""


def _build_model(cfg: DictConfig, datamodule: Any, strategy: Any) -> pl.LightningModule:
    """The model of ``cfg``, sized by the data; a model that cannot take the data's dimensions says which can."""
    dimensions = _dimensions(datamodule)
    try:
        model: pl.LightningModule = instantiate(cfg.model, **dimensions, **_model_options(cfg, strategy))
    except InstantiationException as error:
        reason = error.__cause__ or error  # the constructor's own TypeError, without Hydra's wrapping
        if not any(f"unexpected keyword argument '{name}'" in str(reason) for name in dimensions):
            raise  # a misspelt model option, say: Hydra's own message names it
        pairs = ", ".join(f"data={data} model={model}" for data, model in MODEL_FOR_DATA.items())
        raise TypeError(
            f"The model {cfg.model._target_} cannot be built for the data {type(datamodule).__name__} "
            f"(dimensions {dimensions}): {reason}. HINT: choose the model that goes with the data ({pairs}), or an "
            "experiment that sets both (experiment=digits, experiment=fashion_mnist)."
        ) from error
    return model


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
    params: dict[str, Any] = {
        "algorithm": {"name": choices.get("algorithm") or target.rsplit(".", 1)[-1], "class": target, **algorithm},
        "devices": {"name": choices.get("devices") or "custom", **devices},
    }
    tags = cfg.get("tags")
    if tags:
        params["tags"] = [str(tag) for tag in tags]
    return params


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
    results, _metrics = fit_and_test(cfg)
    return results


def fit_and_test(cfg: DictConfig) -> tuple[dict[str, float], dict[str, float]]:
    """Fit (resuming from ``cfg.ckpt_path`` where set), then test the final (merged) model.

    Returns:
        The results :func:`run` returns (the test metrics and the first validation's), and every metric the job
        knows: the results and fit's ``trainer.callback_metrics`` (the last validation's ``val/...`` among them),
        from which :func:`optimized_value` reads the value a sweeper optimises.
    """
    trainer, model, datamodule = build(cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("model: %s, %s trainable parameters", type(model).__name__, f"{trainable:,}")
    check_data = getattr(datamodule, "check_data", None)  # files the replicas would each find missing
    if check_data is not None:
        check_data()
    trainer.fit(model, datamodule=datamodule, ckpt_path=_checkpoint(cfg.get("ckpt_path"), trainer))
    fitted = {name: float(value) for name, value in trainer.callback_metrics.items() if value.numel() == 1}
    results: dict[str, float] = {}
    if cfg.test:
        results.update(test_once(trainer, model, datamodule))
    first = {name: float(value) for name, value in trainer.callback_metrics.items() if name.startswith("first_val/")}
    results.update(first)
    if trainer.is_global_zero:  # under popen or torchrun every rank gets here
        log.info("%s", _report(results))
    return results, {**fitted, **results}


def test_once(trainer: pl.Trainer, model: pl.LightningModule, datamodule: Any) -> dict[str, float]:
    """Test the fitted model in one process, each test sample exactly once; the test metrics (none on other ranks).

    Every replica holds the same merged model after fit. Spawned or forked replicas have returned to the launching
    process by now; launched by popen or torchrun, every rank runs this script, and only rank zero tests, on its own
    device. The fit's process group goes first, on every rank: the test metrics would otherwise gather their states
    over it, from ranks that do not test (or, with several GPUs, from every rank on the first one).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if not trainer.is_global_zero:
        return {}
    device = trainer.strategy.root_device
    tester = pl.Trainer(
        accelerator=trainer.accelerator,
        devices=[device.index] if device.type == "cuda" and device.index is not None else 1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    tested = tester.test(model, datamodule=datamodule, verbose=False)
    return {name: float(value) for name, value in tested[0].items()}


def check_optimized_metric(name: str | None, tests: bool) -> None:
    """Fail before the fit where ``optimized_metric`` names a test metric of a job that does not test.

    Other names are only known once the model has logged them (after the fit, :func:`optimized_value`).
    """
    if name is not None and name.startswith("test/") and not tests:
        raise ValueError(
            f"optimized_metric={name!r} is a test metric, but the job does not test (test=false). "
            "HINT: set test=true, or optimise a validation metric, e.g. optimized_metric=val/p@1."
        )


def optimized_value(name: str | None, metrics: dict[str, float]) -> float:
    """The value of the metric ``name`` (``optimized_metric``) that the job returns to Hydra's sweepers.

    Without a name, the first test metric that is not a loss (``test/p@1``, ``test/acc``), NaN if there is none.
    """
    if name is None:
        return next((v for k, v in metrics.items() if k.startswith("test/") and "loss" not in k), math.nan)
    if name not in metrics:
        known = ", ".join(sorted(metrics)) or "none"
        raise KeyError(
            f"optimized_metric={name!r} is not among the job's metrics ({known}). HINT: name one of them, e.g. "
            "optimized_metric=val/p@1; test/ metrics need test=true."
        )
    return metrics[name]


def _report(results: dict[str, float]) -> str:
    shown = {name: value for name, value in sorted(results.items()) if not math.isnan(value)}
    return "results: " + ", ".join(f"{name}={value:.4f}" for name, value in shown.items())


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def _main(cfg: DictConfig) -> float:
    quiet_known_noise()
    check_optimized_metric(cfg.get("optimized_metric"), bool(cfg.test))
    _results, metrics = fit_and_test(cfg)
    if getattr(rank_zero_only, "rank", 0) != 0:
        return math.nan  # under popen or torchrun every rank runs the job: rank zero tests, and its value counts
    # The value Hydra's sweepers optimise (Optuna under hparams_search): optimized_metric, or the first test metric.
    return optimized_value(cfg.get("optimized_metric"), metrics)


def main() -> None:
    """Console entry point (``aesgd-train``): Hydra parses the command line."""
    quiet_known_noise()  # before Hydra composes the configuration, whose known warnings it hides too
    _main()


if __name__ == "__main__":
    main()
