"""Statistics of an XMC data set, comparison with its targets, and the popularity baseline.

The report holds what the project's data reference (§4.2) asks to measure on a generated set, so that a
synthetic set can be checked against the Extreme Classification Repository's Table 1 and the literature.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from lightning_aesgd.workloads.xmc.data import XMCData, per_sample_cost
from lightning_aesgd.workloads.xmc.spec import XMCSpec

# Labels with at most this many points count as "tail" labels (Babbar & Schölkopf: up to 80 % of labels).
TAIL_LABEL_POINTS = 5
# The rank-frequency slope is fitted from this rank on, away from the flattened head of the prior.
_FIRST_FITTED_RANK = 10


@dataclass(frozen=True)
class XMCStatistics:
    """Summary statistics of a feature and label matrix pair.

    Attributes:
        num_rows: Rows measured.
        nnz_mean: Mean non-zeros per row.
        nnz_sd: Standard deviation of non-zeros per row.
        nnz_cv: Coefficient of variation ``sd / mean`` (real text: about 0.8).
        nnz_logsd: Standard deviation of ``log(nnz)`` over rows with at least one non-zero.
        labels_per_point_mean: Mean labels per row.
        labels_per_point_sd: Standard deviation of labels per row.
        points_per_label: Label assignments divided by the number of labels (the repository's convention:
            every label counts, used or not).
        unused_label_fraction: Fraction of labels that no row carries.
        tail_label_fraction: Fraction of labels with at most 5 points (unused ones included).
        top1pct_label_share: Share of all assignments held by the most frequent 1 % of labels.
        largest_label_points: Points carrying the most frequent label.
        rank_frequency_slope: Least-squares slope of ``log(points)`` on ``log(rank)`` over ranks 10 to
            (used labels)/2; about ``−α`` for a power-law prior. NaN when fewer than 3 ranks fall in that range.
    """

    num_rows: int
    nnz_mean: float
    nnz_sd: float
    nnz_cv: float
    nnz_logsd: float
    labels_per_point_mean: float
    labels_per_point_sd: float
    points_per_label: float
    unused_label_fraction: float
    tail_label_fraction: float
    top1pct_label_share: float
    largest_label_points: int
    rank_frequency_slope: float


def statistics(features: sp.csr_matrix, labels: sp.csr_matrix) -> XMCStatistics:
    """Measure a feature matrix and its label matrix.

    Args:
        features: CSR features, one row per point.
        labels: Binary CSR labels with the same rows.

    Returns:
        The statistics.
    """
    nnz = per_sample_cost(features).astype(np.float64)
    labels_per_point = per_sample_cost(labels).astype(np.float64)
    label_points = np.bincount(labels.indices, minlength=labels.shape[1])
    by_rank = np.sort(label_points)[::-1]
    top_labels = max(1, int(np.ceil(0.01 * labels.shape[1])))
    return XMCStatistics(
        num_rows=features.shape[0],
        nnz_mean=float(nnz.mean()),
        nnz_sd=float(nnz.std()),
        nnz_cv=float(nnz.std() / nnz.mean()),
        nnz_logsd=float(np.log(nnz[nnz > 0]).std()),
        labels_per_point_mean=float(labels_per_point.mean()),
        labels_per_point_sd=float(labels_per_point.std()),
        points_per_label=float(label_points.sum() / labels.shape[1]),
        unused_label_fraction=float(np.mean(label_points == 0)),
        tail_label_fraction=float(np.mean(label_points <= TAIL_LABEL_POINTS)),
        top1pct_label_share=float(by_rank[:top_labels].sum() / max(by_rank.sum(), 1)),
        largest_label_points=int(by_rank[0]),
        rank_frequency_slope=rank_frequency_slope(label_points),
    )


def rank_frequency_slope(label_points: np.ndarray) -> float:
    """Slope of ``log(points)`` against ``log(rank)`` by least squares over ranks 10 to (used labels)/2.

    The head (ranks below 10) is flattened by the prior's shift and the far tail by sampling noise
    (labels seen once or twice), so both are left out.

    Args:
        label_points: Points per label.

    Returns:
        The fitted slope, or NaN when fewer than 3 ranks are in range.
    """
    used = np.sort(label_points[label_points > 0])[::-1]
    ranks = np.arange(_FIRST_FITTED_RANK, used.size // 2 + 1)
    if ranks.size < 3:
        return float("nan")
    slope, _ = np.polyfit(np.log(ranks), np.log(used[ranks - 1]), deg=1)
    return float(slope)


def dataset_statistics(data: XMCData) -> XMCStatistics:
    """Measure a generated set over the rows its spec's ``count_basis`` names (train + test, or train only)."""
    if data.spec.count_basis == "train":
        return statistics(data.X_train, data.Y_train)
    return statistics(sp.vstack([data.X_train, data.X_test], format="csr"), sp.vstack([data.Y_train, data.Y_test]))


def compare_to_targets(stats: XMCStatistics, spec: XMCSpec) -> dict[str, float]:
    """Relative error ``(measured − target) / target`` of every quantity the spec targets.

    Args:
        stats: Measured statistics (use :func:`dataset_statistics` so points per label use the right rows).
        spec: The spec with the targets.

    Returns:
        Errors keyed ``nnz_mean``, ``nnz_logsd``, ``labels_per_point`` and, when the spec has a target,
        ``points_per_label``.
    """
    measured_and_target = {
        "nnz_mean": (stats.nnz_mean, spec.nnz_mean),
        "nnz_logsd": (stats.nnz_logsd, spec.nnz_logsd),
        "labels_per_point": (stats.labels_per_point_mean, spec.k_mean),
    }
    if spec.points_per_label is not None:
        measured_and_target["points_per_label"] = (stats.points_per_label, spec.points_per_label)
    return {key: (measured - target) / target for key, (measured, target) in measured_and_target.items()}


def popularity_precision(train_labels: sp.csr_matrix, test_labels: sp.csr_matrix, k: int = 1) -> float:
    """P@k of the popularity baseline: predict the ``k`` most frequent training labels for every test point.

    Any model worth training must beat it; on power-law labels it is far above chance (``k̄ / L``).

    Args:
        train_labels: Binary CSR training labels.
        test_labels: Binary CSR test labels.
        k: Number of predicted labels.

    Returns:
        The mean over test points of ``|top-k ∩ true| / k``.
    """
    top = np.argsort(-np.bincount(train_labels.indices, minlength=train_labels.shape[1]), kind="stable")[:k]
    hits = np.asarray(test_labels[:, top].sum(axis=1)).ravel()
    return float(hits.mean() / k)
