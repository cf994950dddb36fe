"""Parameters of the synthetic extreme multi-label (XMC) generator and the named presets.

Every field of :class:`XMCSpec` is one input of the generator recipe (the project's data reference, §4.2).
Presets copy the shapes of the Extreme Classification Repository's Table 1 (Bhatia et al.,
``manikvarma.org/downloads/XC/XMLRepository.html``) and the approximate non-zeros per point from the XMC
literature; the knobs that the repository does not describe (label exponent, dispersion, log-sd) follow the
measured prototype settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

CountBasis = Literal["train+test", "train"]


@dataclass(frozen=True)
class XMCSpec:
    """Everything the generator needs; the same spec and seed always give the same data.

    Attributes:
        name: Preset name, or ``"custom"``.
        n_train: Training rows.
        n_test: Test rows; generated together with the training rows and split off at the end.
        num_features: Vocabulary size ``d`` (bag-of-words features).
        num_labels: Number of labels ``L``.
        k_mean: Target mean labels per point ``k̄`` (at least 1).
        nnz_mean: Target mean distinct words (non-zeros) per point.
        nnz_logsd: Target standard deviation of ``log(nnz)`` (real text: about 0.8).
        label_alpha: Exponent α of the label prior ``p_l ∝ (rank_l + shift)^(-α)``.
        label_shift: Rank offset of the label prior.
        word_alpha: Zipf exponent of the background vocabulary ``q_j ∝ rank_j^(-word_alpha)``.
        n_clusters: Label clusters ``C``; ``None`` means ``⌊√L⌋``.
        p_same_cluster: Probability ρ that an extra label comes from the first label's cluster.
        words_per_label: Topic words ``m`` owned by each label (half shared with its cluster).
        signal: Fraction of tokens drawn from the point's label topics; sets how learnable the labels are.
        k_dispersion: Dispersion ``r`` of the negative-binomial number of extra labels (1 for tag-like sets).
        seed: Seed of every random draw.
        calibrate: Calibrate the token-length distribution on a pilot so that nnz hits its targets.
        tail_fraction: Fraction of rows whose token count is multiplied by a Pareto factor (0 disables);
            creates straggler batches for heterogeneity experiments. The nnz targets describe the rows without it.
        tail_shape: Pareto shape of the tail factor.
        tail_min_factor: Smallest tail factor.
        tail_max_factor: Largest tail factor.
        points_per_label: Target average points per label from the repository table, or ``None``.
        count_basis: Rows over which the repository counts points per label: train + test for the small
            legacy sets, train only for the large ones (data reference §2).
    """

    name: str
    n_train: int
    n_test: int
    num_features: int
    num_labels: int
    k_mean: float
    nnz_mean: float
    nnz_logsd: float = 0.8
    label_alpha: float = 0.9
    label_shift: float = 1.0
    word_alpha: float = 1.0
    n_clusters: int | None = None
    p_same_cluster: float = 0.7
    words_per_label: int = 20
    signal: float = 0.5
    k_dispersion: float = 2.0
    seed: int = 0
    calibrate: bool = True
    tail_fraction: float = 0.0
    tail_shape: float = 1.5
    tail_min_factor: float = 5.0
    tail_max_factor: float = 20.0
    points_per_label: float | None = None
    count_basis: CountBasis = "train+test"

    def __post_init__(self) -> None:
        _check(self.n_train >= 1 and self.n_test >= 0, "`n_train` must be >= 1 and `n_test` >= 0")
        _check(self.num_features >= 1 and self.num_labels >= 1, "`num_features` and `num_labels` must be >= 1")
        _check(1.0 <= self.k_mean <= self.num_labels, "`k_mean` must lie in [1, num_labels]")
        _check(self.nnz_mean >= 1.0 and self.nnz_logsd > 0.0, "`nnz_mean` must be >= 1 and `nnz_logsd` > 0")
        _check(0.0 <= self.signal <= 1.0, "`signal` is a fraction of tokens: it must lie in [0, 1]")
        _check(0.0 <= self.p_same_cluster <= 1.0, "`p_same_cluster` is a probability: it must lie in [0, 1]")
        _check(0.0 <= self.tail_fraction <= 1.0, "`tail_fraction` must lie in [0, 1]")
        _check(1.0 <= self.tail_min_factor <= self.tail_max_factor, "need 1 <= tail_min_factor <= tail_max_factor")
        _check(self.words_per_label >= 1 and self.k_dispersion > 0, "need `words_per_label` >= 1, `k_dispersion` > 0")
        _check(self.n_clusters is None or self.n_clusters >= 1, "`n_clusters` must be >= 1 (or None for ⌊√L⌋)")
        _check(self.count_basis in ("train+test", "train"), "`count_basis` must be 'train+test' or 'train'")

    @property
    def num_rows(self) -> int:
        """Rows generated in total (train + test)."""
        return self.n_train + self.n_test

    @property
    def clusters(self) -> int:
        """Number of label clusters actually used: ``n_clusters`` or ``⌊√L⌋``."""
        return self.n_clusters if self.n_clusters is not None else max(1, math.isqrt(self.num_labels))


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# fmt: off
PRESETS: dict[str, XMCSpec] = {
    # CI-sized: generates in about half a second, yet holds enough rows for the main job's steps of 1,024 rows.
    # Strong signal and predictable co-labels keep it learnable within a few epochs; 20,000 × 3 / 500 = 120
    # points per label.
    "mini": XMCSpec(
        name="mini", n_train=16_000, n_test=4_000, num_features=2_000, num_labels=500, k_mean=3.0, nnz_mean=40.0,
        signal=0.6, p_same_cluster=0.9, points_per_label=120.0,
    ),
    # Legacy set: the repository's 25.73 points per label counts train + test rows.
    "eurlex4k": XMCSpec(
        name="eurlex4k", n_train=15_539, n_test=3_809, num_features=5_000, num_labels=3_993, k_mean=5.31,
        nnz_mean=236.0, points_per_label=25.73,
    ),
    "wiki10_31k": XMCSpec(
        name="wiki10_31k", n_train=14_146, n_test=6_616, num_features=101_938, num_labels=30_938, k_mean=18.64,
        nnz_mean=670.0, points_per_label=8.52, count_basis="train",
    ),
    # Tag-like: heavier-tailed label counts (r = 1) and document lengths (σ = 0.9). The Adaptive SGD paper's
    # own figure gives 301.17 non-zeros per point.
    "delicious200k": XMCSpec(
        name="delicious200k", n_train=196_606, n_test=100_095, num_features=782_585, num_labels=205_443,
        k_mean=75.54, nnz_mean=301.17, nnz_logsd=0.9, k_dispersion=1.0, points_per_label=72.29,
        count_basis="train",
    ),
    # Flat, very long label tail (α = 0.6); 75.68 non-zeros per point as in the Adaptive SGD paper's figure.
    "amazon670k": XMCSpec(
        name="amazon670k", n_train=490_449, n_test=153_025, num_features=135_909, num_labels=670_091,
        k_mean=5.45, nnz_mean=75.68, nnz_logsd=0.7, label_alpha=0.6, points_per_label=3.99, count_basis="train",
    ),
}
# fmt: on


def get_preset(name: str) -> XMCSpec:
    """Return the preset called ``name``.

    Args:
        name: One of :data:`PRESETS`.

    Returns:
        The preset's spec; derive variants with :func:`dataclasses.replace`.

    Raises:
        KeyError: If no preset has that name; the message lists the available ones.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"Unknown XMC preset {name!r}. Available presets: {', '.join(sorted(PRESETS))}.") from None
