"""One placement run: the race's configuration and recorder, fit, then the final model on the test split.

The configuration is composed, logged and recorded exactly as a race run (:mod:`lightning_aesgd.bench.race.runner`);
what this adds is the test pass the GPU targets are stated in ("test P@1 within 0.01"). Replicas are spawned, and
Lightning hands rank zero's final weights back to this process's model, which one CPU process then tests: the
test's figure does not depend on the placement's devices.
"""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
from omegaconf import DictConfig

from lightning_aesgd.bench.race.recorder import RunRecord
from lightning_aesgd.bench.race.runner import fit_recorded


def fit_and_test(
    cfg: DictConfig, run_dir: Path, threads: int | None, test_batches: int | None
) -> tuple[RunRecord, dict[str, float]]:
    """Fit ``cfg`` with its outputs in ``run_dir`` (as the race's ``run_once``), then test the final model.

    Args:
        cfg: a composed configuration (modified in place: logger and recorder).
        run_dir: the run's directory.
        threads: torch threads per replica; the placement's own when ``None``.
        test_batches: test batches to evaluate; every one when ``None``.

    Returns:
        What rank zero recorded, and the test metrics.
    """
    record, model, datamodule = fit_recorded(cfg, run_dir, threads)
    return record, _test(model, datamodule, test_batches)


def _test(model: pl.LightningModule, datamodule: pl.LightningDataModule, batches: int | None) -> dict[str, float]:
    """The test metrics of ``model`` in one CPU process, each test sample once (as the main job tests)."""
    tester = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_test_batches=batches if batches is not None else 1.0,
    )
    tested = tester.test(model.cpu(), datamodule=datamodule, verbose=False)
    return {name: float(value) for name, value in tested[0].items()}
