"""Dense classification networks and the LightningModule that trains them on the image workloads.

* :class:`FashionCNN` for :class:`~lightning_aesgd.workloads.images.fashion_mnist.FashionMNISTDataModule`: two
  convolution blocks with BatchNorm. The BatchNorm is deliberate: the strategy averages running statistics
  (buffers) as well as weights, and a workload without buffers would not exercise that path.
* :class:`DigitsMLP` for :class:`~lightning_aesgd.workloads.images.digits.DigitsDataModule`: trains in seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn.functional import cross_entropy
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from lightning_aesgd.workloads.images.data import Sample
from lightning_aesgd.workloads.training import EvaluatedModule, build_optimizer, check_optimizer

NetworkName = Literal["fashion_cnn", "digits_mlp"]
OptimizerName = Literal["sgd", "adam"]


class FashionCNN(nn.Sequential):
    """``[conv 3×3 → BatchNorm → ReLU → max-pool 2]`` twice, then a linear classifier; input ``(n, 1, 28, 28)``.

    With the defaults and :class:`ImageClassifier`'s default SGD, two epochs reach about 89 % test accuracy at
    about 20 s per epoch on two CPU cores; ``width=32`` costs about three times as much compute per step.

    Args:
        width: Channels of the first block; the second has twice as many.
        num_classes: Number of outputs.
    """

    def __init__(self, width: int = 16, num_classes: int = 10) -> None:
        super().__init__(
            *_conv_block(1, width),
            *_conv_block(width, 2 * width),
            nn.Flatten(),
            nn.Linear(2 * width * 7 * 7, num_classes),
        )


def _conv_block(in_channels: int, out_channels: int) -> list[nn.Module]:
    # No conv bias: the BatchNorm that follows subtracts the mean and has its own shift.
    return [
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
        nn.MaxPool2d(2),
    ]


class DigitsMLP(nn.Sequential):
    """``Linear → ReLU → Linear`` on the 64 pixels of a digit.

    It has no BatchNorm on purpose: ``BatchNorm1d`` fails on a training batch of one sample, which the
    strategy's speed-proportional batch split can produce for a slow worker.

    Args:
        hidden: Hidden width.
        num_classes: Number of outputs.
    """

    def __init__(self, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


NETWORKS: dict[str, Callable[[], nn.Module]] = {"fashion_cnn": FashionCNN, "digits_mlp": DigitsMLP}
"""Networks :class:`ImageClassifier` can build by name, with their default sizes."""


def build_network(name: str) -> nn.Module:
    """A freshly initialised network from :data:`NETWORKS`.

    Raises:
        ValueError: For an unknown name.
    """
    if name not in NETWORKS:
        raise ValueError(f"Unknown network {name!r}; choose one of {sorted(NETWORKS)} or pass an nn.Module.")
    return NETWORKS[name]()


class ImageClassifier(EvaluatedModule):
    """Trains a classifier with cross-entropy and measures its accuracy.

    Logs ``train/loss`` (per step and per epoch), ``val/loss``, ``val/acc``, ``test/loss`` and ``test/acc``.
    Accuracy is the fraction of correctly classified samples (micro average), accumulated over the epoch by
    torchmetrics, so it is exact however the samples were batched.

    Args:
        network: A name from :data:`NETWORKS` or a module mapping a batch of inputs to ``num_classes`` scores.
            A module is not saved in the hyperparameters: pass it again to ``load_from_checkpoint``.
        lr: Learning rate (the default suits SGD with momentum; Adam wants about ``1e-3``).
        momentum: SGD momentum (Adam ignores it).
        optimizer: ``"sgd"`` (the paper's local update) or ``"adam"``.
        weight_decay: L2 penalty of the optimizer.
        num_classes: Number of classes.

    Raises:
        ValueError: For an unknown network or optimizer, or an out-of-range number.
    """

    def __init__(
        self,
        network: NetworkName | nn.Module = "fashion_cnn",
        lr: float = 0.02,
        momentum: float = 0.9,
        optimizer: OptimizerName = "sgd",
        weight_decay: float = 0.0,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        check_optimizer(optimizer, get_args(OptimizerName))
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0 or num_classes < 2:
            raise ValueError(
                f"Need lr > 0, 0 <= momentum < 1, weight_decay >= 0 and num_classes >= 2; got {lr}, {momentum}, "
                f"{weight_decay} and {num_classes}."
            )
        self.save_hyperparameters(ignore=[] if isinstance(network, str) else ["network"])
        self.net = build_network(network) if isinstance(network, str) else network
        metrics = MetricCollection({"acc": MulticlassAccuracy(num_classes, average="micro")})
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def forward(self, inputs: Tensor) -> Tensor:
        """Class scores, shape ``(n, num_classes)``."""
        scores: Tensor = self.net(inputs)
        return scores

    def training_step(self, batch: Sample, batch_idx: int) -> Tensor:
        """One local update's loss."""
        inputs, labels = batch
        loss = cross_entropy(self(inputs), labels)
        self.log("train/loss", loss, on_step=True, on_epoch=True, batch_size=len(labels))
        return loss

    def evaluate(self, batch: Sample) -> tuple[Tensor, Tensor, Tensor, int]:
        """Class scores, labels, loss and size of an evaluation batch."""
        inputs, labels = batch
        scores = self(inputs)
        return scores, labels, cross_entropy(scores, labels), len(labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The optimizer named by ``optimizer`` over all parameters."""
        hparams = self.hparams
        return build_optimizer(
            hparams["optimizer"], self.parameters(), hparams["lr"], hparams["momentum"], hparams["weight_decay"]
        )
