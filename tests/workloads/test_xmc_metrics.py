"""P@k and nDCG@k against brute force, and their sum-state accumulation."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_aesgd.workloads.xmc.metrics import NDCGAtK, PrecisionAtK, ndcg_at_k, precision_at_k


def _brute_force(scores: np.ndarray, truth: np.ndarray, k: int) -> tuple[float, float]:
    ranking = sorted(range(scores.size), key=lambda label: -scores[label])[:k]
    hits = [bool(truth[label]) for label in ranking]
    precision = sum(hits) / k
    dcg = sum(hit / math.log2(rank + 2) for rank, hit in enumerate(hits))
    ideal = sum(1 / math.log2(rank + 2) for rank in range(min(k, int(truth.sum()))))
    return precision, (dcg / ideal if ideal > 0 else 0.0)


@st.composite
def _scores_and_truth(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    batch, labels = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    seed, k = draw(st.integers(0, 2**31)), draw(st.integers(1, 7))
    rng = np.random.default_rng(seed)
    scores = rng.permutation(batch * labels).reshape(batch, labels).astype(np.float32)  # distinct: no ties
    # Sparse truths so that many rows have fewer than k true labels, some none at all.
    truth = rng.random((batch, labels)) < draw(st.sampled_from([0.0, 0.1, 0.3, 0.8]))
    return scores, truth, k


@settings(max_examples=60, deadline=None)
@given(_scores_and_truth())
def test_per_sample_metrics_match_brute_force(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    scores, truth, k = case
    expected = np.array([_brute_force(row, row_truth, k) for row, row_truth in zip(scores, truth, strict=True)])
    preds, target = torch.from_numpy(scores), torch.from_numpy(truth.astype(np.float32))
    np.testing.assert_allclose(precision_at_k(preds, target, k).numpy(), expected[:, 0], atol=1e-6)
    np.testing.assert_allclose(ndcg_at_k(preds, target, k).numpy(), expected[:, 1], atol=1e-6)


def test_rows_with_fewer_true_labels_than_k() -> None:
    preds = torch.tensor([[0.9, 0.8, 0.7, 0.1, 0.0], [0.9, 0.8, 0.7, 0.1, 0.0]])
    target = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(precision_at_k(preds, target, 3), torch.tensor([1 / 3, 0.0]))
    # One true label ranked first is a perfect ranking: the ideal DCG stops at min(k, |true|) = 1.
    torch.testing.assert_close(ndcg_at_k(preds, target, 3), torch.tensor([1.0, 0.0]))


def test_metric_objects_average_over_all_updates() -> None:
    generator = torch.Generator().manual_seed(0)
    preds = torch.rand(50, 20, generator=generator)
    target = (torch.rand(50, 20, generator=generator) < 0.2).float()
    for metric, function in ((PrecisionAtK(5), precision_at_k), (NDCGAtK(5), ndcg_at_k)):
        for chunk in range(0, 50, 16):  # uneven batches: the mean must weigh samples, not batches
            metric.update(preds[chunk : chunk + 16], target[chunk : chunk + 16])
        torch.testing.assert_close(metric.compute(), function(preds, target, 5).mean())


def test_metric_states_are_sums_reduced_by_sum() -> None:
    # Merging two processes' states must equal seeing all samples in one process.
    first, second, together = PrecisionAtK(1), PrecisionAtK(1), PrecisionAtK(1)
    first.update(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]))
    second.update(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]]))
    together.update(
        torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    )
    first.merge_state(second)
    torch.testing.assert_close(first.compute(), together.compute())


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="k"):
        PrecisionAtK(0)
    with pytest.raises(ValueError, match="shape"):
        precision_at_k(torch.zeros(2, 3), torch.zeros(2, 4), 1)
