"""What the built-in workloads' LightningModules share: the optimizer registry and the evaluation steps."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from torchmetrics import MetricCollection

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adagrad": torch.optim.Adagrad,
}
"""The optimizers a workload can name; each workload accepts a subset."""
SPARSE_OPTIMIZERS = ("sgd", "adagrad")
"""The optimizers of :data:`OPTIMIZERS` that accept sparse gradients, e.g. those of ``EmbeddingBag(sparse=True)``."""


def check_optimizer(name: str, accepted: Sequence[str], sparse_gradients: bool = False) -> None:
    """Checks that ``name`` is one of the ``accepted`` optimizers and, if needed, that it takes sparse gradients.

    Args:
        name: The optimizer a user chose.
        accepted: The workload's choices, all of them keys of :data:`OPTIMIZERS`.
        sparse_gradients: Whether the model has sparse gradients.

    Raises:
        ValueError: For a name outside ``accepted`` (the message lists them), or an optimizer outside
            :data:`SPARSE_OPTIMIZERS` with sparse gradients.
    """
    if name not in accepted:
        raise ValueError(f"Unknown optimizer {name!r}; choose one of {sorted(accepted)}.")
    if sparse_gradients and name not in SPARSE_OPTIMIZERS:
        choices = " or ".join(repr(choice) for choice in SPARSE_OPTIMIZERS)
        raise ValueError(f"{name!r} cannot take sparse gradients. HINT: use {choices}.")


def build_optimizer(
    name: str, parameters: Iterable[Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """The optimizer registered as ``name`` in :data:`OPTIMIZERS`.

    Args:
        name: A key of :data:`OPTIMIZERS`.
        parameters: The parameters to optimise.
        lr: Learning rate.
        momentum: Momentum of SGD; the other optimizers have none and ignore it.
        weight_decay: L2 penalty.

    Example:
        >>> build_optimizer("adagrad", [torch.zeros(2, requires_grad=True)], lr=0.1).defaults["lr"]
        0.1
    """
    options: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if name == "sgd":
        options["momentum"] = momentum
    return OPTIMIZERS[name](parameters, **options)


class EvaluatedModule(pl.LightningModule):
    """A LightningModule whose validation and test steps accumulate torchmetrics and log them with the loss.

    Subclasses set ``val_metrics`` and ``test_metrics`` (collections prefixed ``val/`` and ``test/``) and
    implement :meth:`evaluate`. Each process evaluates its shard: the loss is averaged over processes at the end
    of the epoch, and the metrics synchronise their own states.
    """

    val_metrics: MetricCollection
    test_metrics: MetricCollection

    def evaluate(self, batch: Any) -> tuple[Tensor, Tensor, Tensor, int]:
        """The batch's predictions, targets, loss and size."""
        raise NotImplementedError

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Accumulate the validation metrics; Lightning computes and resets them at the end of the epoch."""
        self._log_evaluation(batch, "val", self.val_metrics)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        """Accumulate the test metrics."""
        self._log_evaluation(batch, "test", self.test_metrics)

    def _log_evaluation(self, batch: Any, stage: str, metrics: MetricCollection) -> None:
        predictions, targets, loss, size = self.evaluate(batch)
        metrics.update(predictions, targets)
        self.log(f"{stage}/loss", loss, on_epoch=True, batch_size=size, sync_dist=True)
        self.log_dict(metrics, on_epoch=True, batch_size=size)
