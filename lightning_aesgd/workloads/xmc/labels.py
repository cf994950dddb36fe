"""Label side of the XMC generator: power-law prior, label clusters, label topics and label sets per point.

Steps 2–5 of the recipe in the project's data reference (§4.2). Clusters give labels co-occurrence structure
(trees and label partitioning have something to find); topics give each label the words that make it
learnable from the bag of words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from lightning_aesgd.workloads.xmc.sampling import GroupedSampler, permuted_power_law
from lightning_aesgd.workloads.xmc.spec import XMCSpec

# Shape of the Lomax (Pareto II) law for topic-word weights 1 + Lomax(1.5): a few dominant words per label.
_TOPIC_WEIGHT_SHAPE = 1.5
# The realised mean of labels per point is rescaled until within 1 %, at most this many times.
_MAX_RESCALES = 5
_RESCALE_TOLERANCE = 0.01


@dataclass(frozen=True)
class LabelModel:
    """The label prior, the cluster structure and the word topics of every label.

    Attributes:
        prior: Label probabilities ``p_l ∝ (rank_l + shift)^(-α)``, ranks randomly permuted.
        cluster_of_label: Cluster id of each label.
        cluster_sampler: Draws a label from a cluster with probabilities ``p`` restricted and renormalised.
        prior_sampler: Draws a label from ``p``.
        topic_sampler: Draws a word from a label's topic (group = label id).
    """

    prior: np.ndarray
    cluster_of_label: np.ndarray
    cluster_sampler: GroupedSampler
    prior_sampler: GroupedSampler
    topic_sampler: GroupedSampler


def build_label_model(spec: XMCSpec, vocabulary: np.ndarray, rng: np.random.Generator) -> LabelModel:
    """Draw the label prior, assign labels to clusters and give every label its topic words.

    Args:
        spec: Generator parameters.
        vocabulary: Background word probabilities ``q`` (sum to one).
        rng: Random generator.

    Returns:
        The label model.
    """
    num_labels, num_clusters = spec.num_labels, spec.clusters
    prior = permuted_power_law(num_labels, spec.label_alpha, spec.label_shift, rng)
    cluster_of_label = rng.integers(0, num_clusters, size=num_labels)
    return LabelModel(
        prior=prior,
        cluster_of_label=cluster_of_label,
        cluster_sampler=GroupedSampler.from_groups(cluster_of_label, np.arange(num_labels), prior),
        prior_sampler=GroupedSampler.single(prior),
        topic_sampler=_sample_topics(spec, vocabulary, cluster_of_label, rng),
    )


def _sample_topics(
    spec: XMCSpec, vocabulary: np.ndarray, cluster_of_label: np.ndarray, rng: np.random.Generator
) -> GroupedSampler:
    """Give each label ``m`` weighted topic words: ``⌊m/2⌋`` shared with its cluster, the rest its own.

    Words are drawn from ``q^0.5`` (renormalised), which favours mid-frequency words over stop-words. Each
    cluster draws ``2m`` candidates; a label's shared half is a uniform choice without replacement among its
    cluster's candidates. Draws from ``q^0.5`` are with replacement: a repeated word simply weighs more.
    """
    words_per_label, num_labels = spec.words_per_label, spec.num_labels
    mid_frequency = GroupedSampler.single(np.sqrt(vocabulary) / np.sqrt(vocabulary).sum())
    candidates = mid_frequency.sample_single(spec.clusters * 2 * words_per_label, rng)
    candidates = candidates.reshape(spec.clusters, 2 * words_per_label)
    num_shared = words_per_label // 2
    # The positions of the smallest random keys of a row are a uniform choice without replacement.
    picks = np.argpartition(rng.random((num_labels, 2 * words_per_label)), num_shared, axis=1)[:, :num_shared]
    shared = candidates[cluster_of_label[:, None], picks]
    own = mid_frequency.sample_single(num_labels * (words_per_label - num_shared), rng).reshape(num_labels, -1)
    words = np.concatenate([shared, own], axis=1)
    weights = 1.0 + rng.pareto(_TOPIC_WEIGHT_SHAPE, size=words.shape)
    return GroupedSampler.from_groups(np.repeat(np.arange(num_labels), words_per_label), words.ravel(), weights.ravel())


def sample_label_matrix(num_rows: int, spec: XMCSpec, model: LabelModel, seed: np.random.SeedSequence) -> sp.csr_matrix:
    """Draw every point's label set, rescaling the extra-label mean until the realised mean hits ``k̄``.

    ``k_i = 1 + NegBin(r, r / (r + μ_extra))`` (mean ``1 + μ_extra``), capped at ``L``. Deduplication lowers the
    realised mean ``k̂``, so ``μ_extra ← μ_extra · (k̄ − 1) / (k̂ − 1)`` until ``|k̂ − k̄| ≤ 1 % · k̄``. Every attempt
    reuses the same random stream, so the loop is a smooth fixed-point iteration rather than a noisy search.

    Args:
        num_rows: Number of points.
        spec: Generator parameters (``k_mean``, ``k_dispersion``, ``p_same_cluster``).
        model: The label model.
        seed: Seed of the random stream reused by every attempt.

    Returns:
        A binary float32 CSR matrix of shape ``(num_rows, L)`` with sorted indices.
    """
    extra_mean = spec.k_mean - 1.0
    labels = _draw_label_matrix(num_rows, extra_mean, spec, model, np.random.default_rng(seed))
    for _ in range(_MAX_RESCALES):
        realised = labels.nnz / num_rows
        if extra_mean == 0.0 or abs(realised - spec.k_mean) <= _RESCALE_TOLERANCE * spec.k_mean:
            break
        extra_mean *= (spec.k_mean - 1.0) / max(realised - 1.0, 1e-9)
        labels = _draw_label_matrix(num_rows, extra_mean, spec, model, np.random.default_rng(seed))
    return labels


def _draw_label_matrix(
    num_rows: int, extra_mean: float, spec: XMCSpec, model: LabelModel, rng: np.random.Generator
) -> sp.csr_matrix:
    """One draw of all label sets: the first label from ``p``, extra ones from its cluster with probability ρ."""
    dispersion = spec.k_dispersion
    extra = np.zeros(num_rows, dtype=np.int64)
    if extra_mean > 0.0:
        extra = rng.negative_binomial(dispersion, dispersion / (dispersion + extra_mean), size=num_rows)
    extra = np.minimum(extra, spec.num_labels - 1)
    first = model.prior_sampler.sample_single(num_rows, rng)
    owner = np.repeat(np.arange(num_rows), extra)
    same_cluster = rng.random(owner.size) < spec.p_same_cluster
    extra_labels = np.empty(owner.size, dtype=np.int64)
    first_cluster = model.cluster_of_label[first[owner[same_cluster]]]
    extra_labels[same_cluster] = model.cluster_sampler.sample(first_cluster, rng)
    extra_labels[~same_cluster] = model.prior_sampler.sample_single(int((~same_cluster).sum()), rng)
    rows = np.concatenate([np.arange(num_rows), owner])
    cols = np.concatenate([first, extra_labels])
    labels = sp.csr_matrix((np.ones(rows.size, dtype=np.float32), (rows, cols)), shape=(num_rows, spec.num_labels))
    labels.sum_duplicates()
    labels.data[:] = 1.0  # a label drawn twice is still one label
    return labels
