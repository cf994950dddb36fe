"""One benchmark run: compose a configuration with Hydra, build it with the main job's ``build``, fit, read back.

Configurations are composed exactly as ``python -m lightning_aesgd.train`` composes them, plus the
benchmark's own settings: a CSV logger and the :class:`~lightning_aesgd.bench.race.recorder.BenchRecorder` inside the
run's directory, no checkpoints (saving a model is not training, and for ``adaptive_elastic`` it is a
collective), no progress bar and no test.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import traceback
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytorch_lightning as pl
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_aesgd.bench.race.recorder import RunRecord
from lightning_aesgd.train import build, config_dir

RECORD_FILE = "record.json"

# Applied before the user's overrides, so that those can still change them.
BENCH_OVERRIDES = (
    "test=false",
    # No checkpoints: the job's own callbacks and the recorder only.
    "callbacks=none",
    "++trainer.enable_checkpointing=false",
    "++trainer.enable_progress_bar=false",
    "++trainer.enable_model_summary=false",
)

# Variables Lightning's launcher exports in the parent process; a later run must choose its own port.
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK")


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """``configs/train.yaml`` composed with ``overrides``, as the main job composes it."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("train", overrides=[*BENCH_OVERRIDES, *overrides])


def run_once(cfg: DictConfig, run_dir: Path, threads: int | None = None) -> RunRecord:
    """Fit ``cfg`` with its outputs in ``run_dir``, in a fresh process; returns what rank zero recorded.

    Each run gets a process of its own (see :func:`fit_recorded`). A run that trains in the benchmark's process
    (``single_device``) leaves GNU OpenMP's thread team there, and replicas forked from that process afterwards
    deadlock in their first parallel region (OpenMP is not fork-safe). A fresh process also keeps one run's
    threads, memory and CUDA state from the next one's figures.
    """
    # The process starts with this one's logger levels and warning filters (the program's --verbose or not).
    loggers = logging.root.manager.loggerDict.items()
    levels = {name: logger.level for name, logger in loggers if isinstance(logger, logging.Logger) and logger.level}
    with ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_take_outputs,
        initargs=(levels, list(warnings.filters)),
    ) as pool:
        return pool.submit(_record_of_fit, cfg, run_dir, threads).result()


def _take_outputs(levels: dict[str, int], filters: list[Any]) -> None:
    """Set a run's process's logger levels and warning filters to those of the process that started it."""
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    cast(list[Any], warnings.filters)[:] = filters  # as they are: typeshed calls the list a Sequence


def _record_of_fit(cfg: DictConfig, run_dir: Path, threads: int | None) -> RunRecord:
    """:func:`fit_recorded`'s record, in the run's own process.

    A failure is printed here and comes back as a ``RuntimeError`` naming it: some of the strategy's errors take
    keyword-only arguments, which the trip back between processes cannot rebuild.
    """
    try:
        return fit_recorded(cfg, run_dir, threads)[0]
    except Exception as error:
        traceback.print_exc()
        raise RuntimeError(f"{type(error).__name__}: {error}") from None


def fit_recorded(
    cfg: DictConfig, run_dir: Path, threads: int | None = None
) -> tuple[RunRecord, pl.LightningModule, pl.LightningDataModule]:
    """Fit ``cfg`` with its outputs in ``run_dir``; returns what rank zero recorded, the model and its data.

    Args:
        cfg: a composed configuration (modified in place: logger and recorder).
        run_dir: the run's directory.
        threads: torch threads per replica; Lightning's default (cores / local replicas) when ``None``.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    record_path = run_dir / RECORD_FILE
    record_path.unlink(missing_ok=True)
    _add_bench_outputs(cfg, run_dir, record_path, threads)
    trainer, model, datamodule = build(cfg)
    with _fresh_launch_environment():
        trainer.fit(model, datamodule=datamodule)
    if not record_path.is_file():
        raise RuntimeError(f"The run wrote no record ({RECORD_FILE}); did rank zero reach the end of training?")
    return RunRecord.load(record_path), model, datamodule


def _add_bench_outputs(cfg: DictConfig, run_dir: Path, record_path: Path, threads: int | None) -> None:
    """Log into ``run_dir``, record into ``record_path`` and, when given, set ``threads`` torch threads per replica."""
    with open_dict(cfg):
        # The main job logs into Hydra's output directory, which the compose API does not create.
        csv = {
            "_target_": "pytorch_lightning.loggers.CSVLogger",
            "save_dir": str(run_dir),
            "name": "logs",
            "version": "",
        }
        cfg.logger = {"csv": csv}
        recorder = {"_target_": "lightning_aesgd.bench.race.recorder.BenchRecorder", "path": str(record_path)}
        callbacks: dict[str, Any] = {"bench_recorder": recorder}
        if threads is not None:
            callbacks["bench_threads"] = {
                "_target_": "lightning_aesgd.bench.race.runner.TorchThreads",
                "threads": threads,
            }
        cfg.callbacks = OmegaConf.merge(cfg.get("callbacks") or {}, callbacks)


class TorchThreads(pl.Callback):
    """Set torch's intra-op threads in every replica process (Lightning sets them only when launching).

    Args:
        threads: threads per process.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        torch.set_num_threads(self.threads)


def threads_per_replica(num_replicas: int) -> int:
    """Torch threads Lightning gives each of ``num_replicas`` processes on this machine: ⌊cores / n⌋, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // num_replicas)


def shrink_replicas(cfg: DictConfig, num_replicas: int) -> None:
    """Keep ``num_replicas`` replicas of the profile, spread over its range of factors (for ``--tiny``).

    From the sorted factors f₍₀₎ ≤ … ≤ f₍ₙ₋₁₎, replica j keeps f₍round(j·(n−1)/(k−1))₎, so two replicas of
    ``[1, 1, 2, 4]`` are ``[1, 4]``; changes of dropped replicas are dropped.
    """
    with open_dict(cfg):
        cfg.devices.num_replicas = num_replicas
        slowdown = cfg.devices.get("slowdown")
        if slowdown is None:
            return
        factors = sorted(slowdown.factors)
        last = len(factors) - 1
        picks = [round(j * last / max(1, num_replicas - 1)) for j in range(num_replicas)]
        slowdown.factors = [factors[p] for p in picks]
        if slowdown.get("changes"):
            slowdown.changes = [c for c in slowdown.changes if c.replica < num_replicas]


@contextmanager
def _fresh_launch_environment() -> Iterator[None]:
    saved = {name: os.environ.pop(name) for name in _LAUNCH_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        for name in _LAUNCH_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(saved)
