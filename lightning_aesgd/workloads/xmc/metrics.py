"""Ranking metrics of extreme multi-label classification: precision@k and nDCG@k.

Both are the standard XMC metrics of the Extreme Classification Repository (Bhatia et al.); the Adaptive SGD
paper reports P@1 as "accuracy". The metric classes keep only sums (per-sample scores and the sample count,
reduced with ``sum`` across processes), so they never store predictions and sync exactly under DDP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


def precision_at_k(preds: Tensor, target: Tensor, k: int) -> Tensor:
    """Per-sample precision@k: ``P@k = |top-k(preds) ∩ true labels| / k``.

    The denominator is always ``k``, also for samples with fewer than ``k`` true labels (the repository's
    definition), so such samples cannot reach 1.

    Args:
        preds: Scores, shape ``(B, L)``.
        target: Binary relevance, shape ``(B, L)``.
        k: Cut-off.

    Returns:
        A float tensor of shape ``(B,)``.
    """
    return _top_k_hits(preds, target, k).sum(dim=1) / k


def ndcg_at_k(preds: Tensor, target: Tensor, k: int) -> Tensor:
    """Per-sample nDCG@k with binary relevance; arguments and result as in :func:`precision_at_k`.

    ``DCG@k = Σ_{r=1..k} rel_r / log₂(r + 1)`` over the top-k ranks, and
    ``IDCG@k = Σ_{r=1..min(k, |true|)} 1 / log₂(r + 1)``, the DCG of a perfect ranking; nDCG = DCG / IDCG, and 0
    for a sample without true labels.
    """
    hits = _top_k_hits(preds, target, k)
    discounts = 1.0 / torch.log2(torch.arange(2, hits.shape[1] + 2, device=hits.device, dtype=hits.dtype))
    dcg = (hits * discounts).sum(dim=1)
    num_true = (target > 0).sum(dim=1).clamp(max=hits.shape[1])
    ideal = torch.cat([discounts.new_zeros(1), torch.cumsum(discounts, dim=0)])[num_true]
    return torch.where(num_true > 0, dcg / ideal.clamp(min=torch.finfo(ideal.dtype).tiny), torch.zeros_like(dcg))


def _top_k_hits(preds: Tensor, target: Tensor, k: int) -> Tensor:
    """``hits[b, r] = 1`` if the rank-``r`` prediction of sample ``b`` is a true label; shape ``(B, min(k, L))``."""
    if preds.shape != target.shape or preds.dim() != 2:
        shapes = f"{tuple(preds.shape)} and {tuple(target.shape)}"
        raise ValueError(f"preds and target must both have shape (batch, labels); got {shapes}")
    top = preds.topk(min(k, preds.shape[1]), dim=1).indices
    return (target.gather(1, top) > 0).to(torch.float32)


class _MeanOverSamples(Metric):
    """Mean of a per-sample score over all samples seen, kept as a sum and a count."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    score_sum: Tensor
    num_samples: Tensor

    def __init__(self, k: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if k < 1:
            raise ValueError(f"`k` must be >= 1, got {k}")
        self.k = k
        # float64: a float32 sum stops registering increments of 1 past 2**24 samples.
        self.add_state("score_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_samples", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch of scores ``(B, L)`` and binary targets ``(B, L)``."""
        scores = self._per_sample(preds, target)
        self.score_sum += scores.sum(dtype=torch.float64)
        self.num_samples += scores.numel()

    def compute(self) -> Tensor:
        """The mean per-sample score (NaN before any sample)."""
        return (self.score_sum / self.num_samples).to(torch.float32)

    def _per_sample(self, preds: Tensor, target: Tensor) -> Tensor:
        raise NotImplementedError


class PrecisionAtK(_MeanOverSamples):
    """Precision@k averaged over samples (see :func:`precision_at_k`).

    Args:
        k: Cut-off.
        **kwargs: Passed to :class:`torchmetrics.Metric` (e.g. ``sync_on_compute``).

    Example:
        >>> metric = PrecisionAtK(k=2)
        >>> metric.update(torch.tensor([[0.9, 0.5, 0.1]]), torch.tensor([[1, 0, 1]]))
        >>> metric.compute()
        tensor(0.5000)
    """

    def _per_sample(self, preds: Tensor, target: Tensor) -> Tensor:
        return precision_at_k(preds, target, self.k)


class NDCGAtK(_MeanOverSamples):
    """nDCG@k averaged over samples (see :func:`ndcg_at_k`).

    Args:
        k: Cut-off.
        **kwargs: Passed to :class:`torchmetrics.Metric`.
    """

    def _per_sample(self, preds: Tensor, target: Tensor) -> Tensor:
        return ndcg_at_k(preds, target, self.k)
