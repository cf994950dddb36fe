"""scikit-learn's bundled digits (1,797 8×8 images, 10 classes): a dense workload that trains in seconds.

The data ships inside scikit-learn (``load_digits`` reads a file of the wheel, never the network). scikit-learn
is an optional dependency of this package, imported only when the data is loaded.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from lightning_aesgd.workloads.datamodule import Splits
from lightning_aesgd.workloads.images.data import ClassificationDataModule, Sample, split_holdout

_MAX_PIXEL = 16.0  # the digits pixels are counts of set cells in 4×4 blocks of a 32×32 bitmap: 0..16


def load_digits_tensors() -> tuple[Tensor, Tensor]:
    """All 1,797 digits as ``float32`` features in ``[0, 1]``, shape ``(1797, 64)``, and int64 labels.

    Raises:
        ImportError: If scikit-learn is not installed; the message names the fix.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "The digits workload reads scikit-learn's bundled data. HINT: `pip install scikit-learn`."
        ) from error
    features, labels = load_digits(return_X_y=True)
    return torch.from_numpy(features).float() / _MAX_PIXEL, torch.from_numpy(labels).long()


class DigitsDataModule(ClassificationDataModule):
    """The digits as flat 64-feature vectors, split into train, validation and test sets by ``seed``.

    Args:
        batch_size: Samples per batch of every loader.
        num_workers: DataLoader worker processes (0 is best: the data is tiny and already in memory).
        val_size: Samples in the validation set.
        test_size: Samples in the test set.
        seed: Seed of the split.

    Raises:
        ValueError: If ``val_size`` or ``test_size`` is < 1 (and, when loaded, if they leave no training data).
    """

    def __init__(
        self, batch_size: int = 32, num_workers: int = 0, val_size: int = 180, test_size: int = 360, seed: int = 0
    ) -> None:
        super().__init__(batch_size, num_workers)
        if val_size < 1 or test_size < 1:
            raise ValueError(f"val_size and test_size must be >= 1, got {val_size} and {test_size}.")
        self.save_hyperparameters()
        self.val_size = val_size
        self.test_size = test_size
        self.seed = seed

    def build_splits(self) -> Splits[Dataset[Sample]]:
        """Loads the digits and splits them: test first, then validation from the rest."""
        features, labels = load_digits_tensors()
        rest, test = split_holdout(len(labels), self.test_size, self.seed)
        fit, val = (rest[part] for part in split_holdout(len(rest), self.val_size, self.seed))
        return Splits(
            train=_pairs(features[fit], labels[fit]),
            val=_pairs(features[val], labels[val]),
            test=_pairs(features[test], labels[test]),
        )


def _pairs(features: Tensor, labels: Tensor) -> Dataset[Sample]:
    # TensorDataset types its items as tuples of any length; these hold exactly (features, label).
    return cast(Dataset[Sample], TensorDataset(features, labels))
