"""A faithful synthetic extreme multi-label classification (XMC) data set over sparse bags of words.

No real XMC data set ships in a package (they all download at run time), and scikit-learn's
``make_multilabel_classification`` is unfaithful for XMC: near-constant document lengths (CV 0.06 against
about 0.8 in real text), near-uniform label frequencies and no label co-occurrence. This module implements
the recipe of the project's data reference (§4.2) with numpy and scipy only, fully vectorised and seeded:

1. Background vocabulary ``q_j ∝ rank_j^(-word_alpha)`` (Zipf), ids randomly permuted.
2. Label prior ``p_l ∝ (rank_l + shift)^(-α)``, permuted (power-law label frequencies, as in DiSMEC's
   observation that XMC data "exhibit fit to power-law distribution").
3. Labels in ``C`` random clusters; extra labels come from the first label's cluster with probability ρ.
4. Label topics of ``m`` words with weights ``1 + Lomax(1.5)``.
5. ``k_i = 1 + NegBin`` labels per point, the mean rescaled for deduplication.
6. ``T_i ~ LogNormal(μ, σ)`` tokens, ``Binomial(T_i, signal)`` of them from the label topics, ``(μ, σ)``
   calibrated on a pilot so that the distinct words per point match the targets.
7. Sublinear tf ``1 + ln c`` times smooth idf ``ln((1 + N)/(1 + df)) + 1`` (train rows only), rows
   L2-normalised, float32 CSR, as in the Extreme Classification Repository's BoW features.

Example:
    >>> from lightning_aesgd.workloads.xmc.data import generate_xmc
    >>> from lightning_aesgd.workloads.xmc.spec import get_preset
    >>> data = generate_xmc(get_preset("mini"))
    >>> data.X_train.shape, data.Y_test.shape
    ((16000, 2000), (4000, 500))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from lightning_aesgd.workloads.xmc.labels import build_label_model, sample_label_matrix
from lightning_aesgd.workloads.xmc.sampling import GroupedSampler, permuted_power_law
from lightning_aesgd.workloads.xmc.spec import XMCSpec
from lightning_aesgd.workloads.xmc.tokens import (
    PILOT_ROWS,
    LengthTail,
    TokenModel,
    calibrate_token_lengths,
    sample_token_counts,
)

# One independent random stream per step, so that changing one step (say, the calibration) leaves the draws of
# the others untouched.
_STREAMS = ("vocabulary", "labels", "label_sets", "tokens")


@dataclass(frozen=True)
class XMCData:
    """A generated data set: TF-IDF features and binary labels, both float32 CSR.

    Attributes:
        X_train: Features of the training rows, shape ``(n_train, num_features)``.
        Y_train: Labels of the training rows, shape ``(n_train, num_labels)``.
        X_test: Features of the test rows, shape ``(n_test, num_features)``.
        Y_test: Labels of the test rows, shape ``(n_test, num_labels)``.
        spec: The spec it was generated from.
    """

    X_train: sp.csr_matrix
    Y_train: sp.csr_matrix
    X_test: sp.csr_matrix
    Y_test: sp.csr_matrix
    spec: XMCSpec


def generate_xmc(spec: XMCSpec) -> XMCData:
    """Generate the data set described by ``spec``; the same spec (seed included) gives identical arrays.

    Train and test rows are drawn together and independently, so the first ``n_train`` rows are the
    training split and the rest the test split: deterministic and as random as any shuffled split.

    Args:
        spec: Generator parameters, e.g. ``get_preset("eurlex4k")``.

    Returns:
        The data set.
    """
    seeds = dict(zip(_STREAMS, np.random.SeedSequence(spec.seed).spawn(len(_STREAMS)), strict=True))
    vocabulary = permuted_power_law(spec.num_features, spec.word_alpha, 0.0, np.random.default_rng(seeds["vocabulary"]))
    label_model = build_label_model(spec, vocabulary, np.random.default_rng(seeds["labels"]))
    labels = sample_label_matrix(spec.num_rows, spec, label_model, seeds["label_sets"])
    token_model = TokenModel(
        num_features=spec.num_features,
        signal=spec.signal,
        background=GroupedSampler.single(vocabulary),
        topics=label_model.topic_sampler,
    )
    # The pilot draws from the token stream itself: when all rows fit in the pilot, the calibrated draw *is* the
    # output, so small sets hit their targets exactly instead of up to a sampling error away.
    lengths = calibrate_token_lengths(labels[:PILOT_ROWS], spec, token_model, seeds["tokens"])
    tail = LengthTail.from_spec(spec)
    counts = sample_token_counts(labels, lengths, token_model, np.random.default_rng(seeds["tokens"]), tail)
    X_train, X_test = tfidf(counts[: spec.n_train], counts[spec.n_train :])
    return XMCData(X_train, labels[: spec.n_train], X_test, labels[spec.n_train :], spec)


def tfidf(train_counts: sp.csr_matrix, test_counts: sp.csr_matrix) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Weigh word counts as sublinear tf × smooth idf and L2-normalise the rows.

    ``x_ij = (1 + ln c_ij) · (ln((1 + N)/(1 + df_j)) + 1)`` with ``N`` and ``df`` counted on the training rows
    only, so that nothing about the test rows leaks into the features; then ``x_i ← x_i / ‖x_i‖₂`` (rows
    without words stay zero). This is scikit-learn's ``TfidfTransformer(sublinear_tf=True)``.

    Args:
        train_counts: Word counts of the training rows.
        test_counts: Word counts of the test rows.

    Returns:
        The weighted training and test matrices, float32 CSR.
    """
    document_frequency = np.bincount(train_counts.indices, minlength=train_counts.shape[1])
    idf = np.log((1.0 + train_counts.shape[0]) / (1.0 + document_frequency)) + 1.0
    return _weigh(train_counts, idf), _weigh(test_counts, idf)


def _weigh(counts: sp.csr_matrix, idf: np.ndarray) -> sp.csr_matrix:
    weighted = sp.csr_matrix(counts, dtype=np.float64, copy=True)
    weighted.sum_duplicates()  # document frequencies and norms assume one entry per (row, word)
    weighted.data = (1.0 + np.log(weighted.data)) * idf[weighted.indices]
    norms = np.sqrt(np.asarray(weighted.multiply(weighted).sum(axis=1)).ravel())
    scale = np.divide(1.0, norms, out=np.ones_like(norms), where=norms > 0)
    weighted.data *= np.repeat(scale, np.diff(weighted.indptr))
    return weighted.astype(np.float32)


def per_sample_cost(features: sp.csr_matrix) -> np.ndarray:
    """Cost of each row for cost-aware routing: its number of non-zeros.

    A sparse input layer touches one embedding row per non-zero, so a batch's forward and backward time
    follows its total non-zeros rather than its number of rows.

    Args:
        features: CSR feature matrix.

    Returns:
        An int64 array with the non-zeros of every row.
    """
    return np.diff(np.asarray(features.indptr, dtype=np.int64))
