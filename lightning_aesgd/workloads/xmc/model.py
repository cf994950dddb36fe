"""The Adaptive SGD paper's XMC network and its LightningModule.

The paper trains "a fully connected network with a sparse input layer" on Amazon-670K and Delicious-200K;
the most likely shape is SLIDE's (Chen et al., MLSys 2020): sparse features → 128 ReLU units → scores over
all labels, evaluated by P@1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn.functional import binary_cross_entropy_with_logits, cross_entropy
from torchmetrics import MetricCollection

from lightning_aesgd.workloads.training import EvaluatedModule, build_optimizer, check_optimizer
from lightning_aesgd.workloads.xmc.batch import SparseBatch
from lightning_aesgd.workloads.xmc.metrics import NDCGAtK, PrecisionAtK

OptimizerName = Literal["sgd", "adam", "adagrad"]
LossName = Literal["softmax", "bce"]


class XMCNet(nn.Module):
    """``logits = W₂ · ReLU(Σ_j x_j E_j + b₁) + b₂``: a sparse input layer, one hidden layer, one score per label.

    The input layer is an ``EmbeddingBag(mode="sum")`` weighted by the feature values, which equals
    ``x @ E`` for the sparse row ``x`` while touching only the rows of ``E`` that ``x`` uses.

    Args:
        num_features: Input dimension (vocabulary size).
        num_labels: Number of labels.
        hidden: Hidden width (128 in SLIDE and, most likely, in the paper).
        sparse_gradients: Give ``E`` sparse gradients (only SGD and Adagrad accept them); saves the dense
            ``num_features × hidden`` gradient on very large vocabularies.
    """

    def __init__(self, num_features: int, num_labels: int, hidden: int = 128, sparse_gradients: bool = False) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(num_features, hidden, mode="sum", sparse=sparse_gradients)
        self.hidden_bias = nn.Parameter(torch.zeros(hidden))
        self.output = nn.Linear(hidden, num_labels)

    def forward(self, indices: Tensor, offsets: Tensor, weights: Tensor) -> Tensor:
        """Scores of every label, shape ``(batch, num_labels)``, from a batch in bag form."""
        hidden: Tensor = self.embedding(indices, offsets, per_sample_weights=weights) + self.hidden_bias
        scores: Tensor = self.output(torch.relu(hidden))
        return scores


class XMCModule(EvaluatedModule):
    """Trains :class:`XMCNet` on :class:`~lightning_aesgd.workloads.xmc.batch.SparseBatch` batches.

    The default loss is softmax cross-entropy against the normalised multi-hot target,
    ``ℓ = −Σ_l (y_l / Σ y) · log softmax(z)_l``: it is what SLIDE and the paper's network optimise, and it
    ranks labels directly, which is what P@k measures. Per-label binary cross-entropy (``"bce"``, summed over
    labels) is available; on the ``mini`` preset it learns more slowly, because the rare positives of
    thousands of independent sigmoids are drowned by the negatives early on.

    Logs ``train/loss``; ``val/loss``, ``val/p@1``, ``val/p@3``, ``val/p@5`` and ``val/ndcg@5``; and the same
    under ``test/``.

    Args:
        num_features: Input dimension.
        num_labels: Number of labels.
        hidden: Hidden width.
        optimizer: ``"adagrad"`` (default: learns fast, and with sparse gradients its per-step cost stays small
            next to the per-sample cost), ``"sgd"`` (plain SGD, the paper's local update) or ``"adam"``.
        lr: Learning rate.
        loss: ``"softmax"`` or ``"bce"``.
        sparse_gradients: Sparse embedding gradients, updating only the rows a batch touches (``"sgd"`` and
            ``"adagrad"`` only).
        check_sparse_invariants: Check the invariants of the sparse tensors built during a step (the sparse
            gradients and the optimizer's sparse updates). Off by default, torch's own default, which the step
            states explicitly (``torch.sparse.check_sparse_tensor_invariants``), so torch does not warn that it
            was left implicit; turn on to debug a crash in sparse code.

    Raises:
        ValueError: For an unknown optimizer or loss, or sparse gradients with Adam.
    """

    def __init__(
        self,
        num_features: int,
        num_labels: int,
        hidden: int = 128,
        optimizer: OptimizerName = "adagrad",
        lr: float = 0.1,
        loss: LossName = "softmax",
        sparse_gradients: bool = True,
        check_sparse_invariants: bool = False,
    ) -> None:
        super().__init__()
        check_optimizer(optimizer, get_args(OptimizerName), sparse_gradients)
        if loss not in get_args(LossName):
            raise ValueError(f"Unknown loss {loss!r}; choose 'softmax' or 'bce'.")
        self.save_hyperparameters()
        self.net = XMCNet(num_features, num_labels, hidden, sparse_gradients)
        metrics = MetricCollection(
            {"p@1": PrecisionAtK(1), "p@3": PrecisionAtK(3), "p@5": PrecisionAtK(5), "ndcg@5": NDCGAtK(5)},
            compute_groups=False,
        )
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def forward(self, batch: SparseBatch) -> Tensor:
        """Label scores for a batch, shape ``(len(batch), num_labels)``."""
        scores: Tensor = self.net(batch.indices, batch.offsets, batch.weights)
        return scores

    def loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """The training loss for scores ``logits`` and a multi-hot ``target``, averaged over the batch."""
        if self.hparams["loss"] == "bce":
            return binary_cross_entropy_with_logits(logits, target, reduction="sum") / logits.shape[0]
        # A point without labels contributes nothing instead of dividing by zero.
        return cross_entropy(logits, target / target.sum(dim=1, keepdim=True).clamp(min=1.0))

    def training_step(self, batch: SparseBatch, batch_idx: int) -> Tensor:
        """One local update's loss."""
        loss = self.loss(self(batch), batch.dense_labels(self.hparams["num_labels"]))
        self.log("train/loss", loss, batch_size=len(batch))
        return loss

    def evaluate(self, batch: SparseBatch) -> tuple[Tensor, Tensor, Tensor, int]:
        """Scores, multi-hot targets, loss and size of an evaluation batch."""
        logits = self(batch)
        target = batch.dense_labels(self.hparams["num_labels"])
        return logits, target, self.loss(logits, target), len(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The optimizer named by ``optimizer`` over all parameters."""
        return build_optimizer(self.hparams["optimizer"], self.parameters(), lr=self.hparams["lr"])

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Callable[[], Any] | None = None
    ) -> None:
        """Lightning's step (forward, backward and update), with an explicit choice of sparse invariant checks."""
        check = bool(self.hparams.get("check_sparse_invariants"))
        with torch.sparse.check_sparse_tensor_invariants(enable=check):  # type: ignore[no-untyped-call]
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
