"""The DataModule the built-in workloads share: three splits, built once per process and served in batches."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic, TypeVar

import pytorch_lightning as pl
from torch.utils.data import DataLoader, Dataset

DatasetT = TypeVar("DatasetT", bound=Dataset[Any])


@dataclass(frozen=True)
class Splits(Generic[DatasetT]):
    """The three datasets of a workload."""

    train: DatasetT
    val: DatasetT
    test: DatasetT


class SplitDataModule(pl.LightningDataModule, ABC, Generic[DatasetT]):
    """Serves the train, validation and test splits that a subclass builds in :meth:`build_splits`.

    The splits are built on first use, once per process, deterministically, so every process of a distributed
    run holds the same data without anything being shared through ``prepare_data``. Training batches are
    shuffled; validation and test batches come in order.

    Args:
        batch_size: Samples per batch of every loader.
        num_workers: DataLoader worker processes.
        collate_fn: Turns a list of samples into a batch; ``None`` is PyTorch's default.
        drop_last: Drop each epoch's incomplete last training batch.

    Raises:
        ValueError: If ``batch_size`` < 1 or ``num_workers`` < 0.
    """

    def __init__(
        self,
        batch_size: int,
        num_workers: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1 or num_workers < 0:
            raise ValueError(f"Need batch_size >= 1 and num_workers >= 0, got {batch_size} and {num_workers}.")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.drop_last = drop_last

    @abstractmethod
    def model_dimensions(self) -> dict[str, Any]:
        """The arguments that size a model for this data (the training entry point passes them to the model)."""

    @abstractmethod
    def build_splits(self) -> Splits[DatasetT]:
        """Loads or generates the data and returns the three splits."""

    @cached_property
    def splits(self) -> Splits[DatasetT]:
        """The splits (built on first access)."""
        return self.build_splits()

    def setup(self, stage: str) -> None:
        """Build the splits (once per process; later calls reuse them)."""
        _ = self.splits

    def train_dataloader(self) -> DataLoader[Any]:
        """Shuffled training batches."""
        return self._loader(self.splits.train, shuffle=True, drop_last=self.drop_last)

    def val_dataloader(self) -> DataLoader[Any]:
        """Validation batches in order."""
        return self._loader(self.splits.val, shuffle=False)

    def test_dataloader(self) -> DataLoader[Any]:
        """Test batches in order."""
        return self._loader(self.splits.test, shuffle=False)

    def _loader(self, dataset: DatasetT, shuffle: bool, drop_last: bool = False) -> DataLoader[Any]:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            persistent_workers=self.num_workers > 0,
        )
