"""The user's side of every slowness run: an image classifier, its DataLoader and the images it trains on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_aesgd.bench.slowness.cases import BATCH
from lightning_aesgd.workloads.images.models import FashionCNN


class Classifier(pl.LightningModule):
    """The user's model in every case: an image classifier trained with SGD, with its training DataLoader.

    The DataLoader comes from the module's own ``train_dataloader`` hook, which the ``data`` mode wraps.

    Args:
        dataset: the training data.
        network: ``"mlp"`` (one hidden layer of 64 units), ``"cnn"`` (:class:`FashionCNN`) or ``"tiny"`` (one
            linear layer: almost no work per step).
        workers: DataLoader worker processes.
        lr: SGD learning rate.
        batch_size: samples per replica and step.
    """

    def __init__(
        self, dataset: TensorDataset, network: str, workers: int, lr: float = 0.05, batch_size: int = BATCH
    ) -> None:
        super().__init__()
        layers: dict[str, Callable[[], nn.Module]] = {
            "mlp": lambda: nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10)),
            "cnn": FashionCNN,
            "tiny": lambda: nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10)),
        }
        self.net = layers[network]()
        self.dataset = dataset
        self.workers = workers
        self.lr = lr
        self.batch_size = batch_size

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:  # noqa: D102
        inputs, labels = batch
        return nn.functional.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:  # noqa: D102
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader[Any]:  # noqa: D102
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.workers)


def load_data() -> TensorDataset:
    """Fashion-MNIST's 60,000 training images, or the digits scaled to 28×28 where it is not installed."""
    from lightning_aesgd.workloads.images.fashion_mnist import is_available, load_split

    if is_available():
        images, labels = load_split("train")
        return TensorDataset(images.reshape(-1, 1, 28, 28).float(), labels)
    from lightning_aesgd.workloads.images.digits import load_digits_tensors

    features, labels = load_digits_tensors()
    images = nn.functional.interpolate(features.reshape(-1, 1, 8, 8), size=(28, 28), mode="bilinear")
    repeats = 32  # 57,504 rows: one epoch outlasts every run
    return TensorDataset(images.repeat(repeats, 1, 1, 1), labels.repeat(repeats))
