"""LightningDataModule serving a generated XMC data set."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import cached_property
from typing import Any

from torch import Tensor

from lightning_aesgd.workloads.datamodule import SplitDataModule, Splits
from lightning_aesgd.workloads.xmc.batch import SparseXMCDataset, collate_sparse
from lightning_aesgd.workloads.xmc.data import XMCData, generate_xmc
from lightning_aesgd.workloads.xmc.spec import XMCSpec, get_preset


class XMCDataModule(SplitDataModule[SparseXMCDataset]):
    """Generates a preset in :meth:`setup` and serves train, validation and test loaders of sparse batches.

    Generation is deterministic by seed, so every process of a distributed run builds the same data in its own
    ``setup`` and nothing is written to disk or shared through ``prepare_data``.

    The validation set is the last ``val_fraction`` of the training split, held out from training, so that the
    test split is never used for model selection or early stopping. (The idf weights are computed on the whole
    training split, validation rows included; they use no labels.)

    Args:
        preset: Name of an XMC preset (see :data:`~lightning_aesgd.workloads.xmc.spec.PRESETS`).
        seed: Generator seed.
        batch_size: Rows per batch of every loader.
        num_workers: DataLoader worker processes.
        val_fraction: Fraction of the training split held out for validation, in ``(0, 1)``.
        overrides: Spec fields to change, e.g. ``{"n_train": 50_000, "signal": 0.3}``.

    Raises:
        ValueError: If ``val_fraction`` leaves no training or no validation row, if ``batch_size`` < 1, or if
            ``num_workers`` < 0.
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
        # An epoch's incomplete last training batch is dropped: with large batches it is a handful of rows, and one
        # step on a handful of rows at the full learning rate is mostly noise.
        super().__init__(batch_size, num_workers, collate_fn=collate_sparse, drop_last=True)
        self.save_hyperparameters()
        self.spec: XMCSpec = replace(get_preset(preset), seed=seed, **dict(overrides or {}))
        self.num_val = round(val_fraction * self.spec.n_train)
        if not 0 < self.num_val < self.spec.n_train:
            raise ValueError(
                f"val_fraction={val_fraction} holds out {self.num_val} of {self.spec.n_train} training rows; "
                "HINT: choose a fraction that leaves at least one row on each side."
            )

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

    def build_splits(self) -> Splits[SparseXMCDataset]:
        """Generates the data; the last ``val_fraction`` of the training split is held out for validation."""
        data, num_fit = self.data, self.spec.n_train - self.num_val
        return Splits(
            train=SparseXMCDataset(data.X_train[:num_fit], data.Y_train[:num_fit]),
            val=SparseXMCDataset(data.X_train[num_fit:], data.Y_train[num_fit:]),
            test=SparseXMCDataset(data.X_test, data.Y_test),
        )

    @property
    def train_set(self) -> SparseXMCDataset:
        """Training rows: the training split without its validation part."""
        return self.splits.train

    @property
    def val_set(self) -> SparseXMCDataset:
        """Validation rows: the last ``val_fraction`` of the training split."""
        return self.splits.val

    @property
    def test_set(self) -> SparseXMCDataset:
        """Test rows: the generator's test split."""
        return self.splits.test

    @property
    def train_costs(self) -> Tensor:
        """Non-zeros of every training row, in dataset order (for cost-aware routing)."""
        return self.train_set.sample_costs
