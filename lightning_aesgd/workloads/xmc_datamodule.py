"""LightningDataModule serving a generated XMC data set."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import cached_property
from typing import Any

import pytorch_lightning as pl
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_aesgd.workloads.xmc_batch import SparseSample, SparseXMCDataset, collate_sparse
from lightning_aesgd.workloads.xmc_data import XMCData, generate_xmc
from lightning_aesgd.workloads.xmc_spec import XMCSpec, get_preset


class XMCDataModule(pl.LightningDataModule):
    """Generates a preset in :meth:`setup` and serves train, validation and test loaders of sparse batches.

    Generation is deterministic by seed, so every process of a distributed run builds the same data in its own
    ``setup`` and nothing is written to disk or shared through ``prepare_data``.

    The validation set is the last ``val_fraction`` of the training split, held out from training, so that the
    test split is never used for model selection or early stopping. (The idf weights are computed on the whole
    training split, validation rows included; they use no labels.)

    Args:
        preset: Name of an XMC preset (see :data:`~lightning_aesgd.workloads.xmc_spec.PRESETS`).
        seed: Generator seed.
        batch_size: Rows per batch of every loader.
        num_workers: DataLoader worker processes.
        val_fraction: Fraction of the training split held out for validation, in ``(0, 1)``.
        overrides: Spec fields to change, e.g. ``{"n_train": 50_000, "signal": 0.3}``.

    Raises:
        ValueError: If ``val_fraction`` leaves no training or no validation row.
    """

    def __init__(
        self,
        preset: str = "mini",
        seed: int = 0,
        batch_size: int = 64,
        num_workers: int = 0,
        val_fraction: float = 0.1,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.spec: XMCSpec = replace(get_preset(preset), seed=seed, **dict(overrides or {}))
        self.num_val = round(val_fraction * self.spec.n_train)
        if not 0 < self.num_val < self.spec.n_train:
            raise ValueError(
                f"val_fraction={val_fraction} holds out {self.num_val} of {self.spec.n_train} training rows; "
                "HINT: choose a fraction that leaves at least one row on each side."
            )
        self.batch_size = batch_size
        self.num_workers = num_workers

    @property
    def num_features(self) -> int:
        """Input dimension (known without generating)."""
        return self.spec.num_features

    @property
    def num_labels(self) -> int:
        """Number of labels (known without generating)."""
        return self.spec.num_labels

    def model_dimensions(self) -> dict[str, Any]:
        """The arguments that size a model for this data: ``num_features`` and ``num_labels``."""
        return {"num_features": self.num_features, "num_labels": self.num_labels}

    @cached_property
    def data(self) -> XMCData:
        """The generated data set (generated on first access)."""
        return generate_xmc(self.spec)

    @cached_property
    def train_set(self) -> SparseXMCDataset:
        """Training rows: the training split without its validation part."""
        num_fit = self.spec.n_train - self.num_val
        return SparseXMCDataset(self.data.X_train[:num_fit], self.data.Y_train[:num_fit])

    @cached_property
    def val_set(self) -> SparseXMCDataset:
        """Validation rows: the last ``val_fraction`` of the training split."""
        num_fit = self.spec.n_train - self.num_val
        return SparseXMCDataset(self.data.X_train[num_fit:], self.data.Y_train[num_fit:])

    @cached_property
    def test_set(self) -> SparseXMCDataset:
        """Test rows: the generator's test split."""
        return SparseXMCDataset(self.data.X_test, self.data.Y_test)

    @property
    def train_costs(self) -> Tensor:
        """Non-zeros of every training row, in dataset order (for cost-aware routing)."""
        return self.train_set.sample_costs

    def setup(self, stage: str) -> None:
        """Generate the data (once per process; later calls reuse it)."""
        _ = self.data

    def train_dataloader(self) -> DataLoader[SparseSample]:
        """Shuffled training batches; an epoch's incomplete last batch is dropped.

        With large batches the remainder is a handful of rows, and one step on a handful of rows at the full
        learning rate is mostly noise.
        """
        return self._loader(self.train_set, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader[SparseSample]:
        """Validation batches in order."""
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader[SparseSample]:
        """Test batches in order."""
        return self._loader(self.test_set, shuffle=False)

    def _loader(self, dataset: SparseXMCDataset, shuffle: bool, drop_last: bool = False) -> DataLoader[SparseSample]:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.num_workers,
            collate_fn=collate_sparse,
            persistent_workers=self.num_workers > 0,
        )
