"""The synthetic XMC generator: statistics against the presets' targets, structure, determinism."""

from dataclasses import replace

import numpy as np
import pytest
import scipy.sparse as sp

from lightning_aesgd.workloads.xmc.data import XMCData, generate_xmc, per_sample_cost, tfidf
from lightning_aesgd.workloads.xmc.sampling import GroupedSampler
from lightning_aesgd.workloads.xmc.spec import PRESETS, XMCSpec, get_preset
from lightning_aesgd.workloads.xmc.stats import (
    compare_to_targets,
    dataset_statistics,
    popularity_precision,
    statistics,
)


@pytest.fixture(scope="module")
def mini() -> XMCData:
    return generate_xmc(get_preset("mini"))


def _assert_within_targets(data: XMCData, tolerance: float = 0.05) -> None:
    errors = compare_to_targets(dataset_statistics(data), data.spec)
    assert set(errors) == {"nnz_mean", "nnz_logsd", "labels_per_point", "points_per_label"}
    assert all(abs(error) < tolerance for error in errors.values()), errors


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mini_statistics_match_targets(seed: int) -> None:
    _assert_within_targets(generate_xmc(replace(get_preset("mini"), seed=seed)))


@pytest.mark.slow
def test_eurlex4k_statistics_match_targets() -> None:
    data = generate_xmc(get_preset("eurlex4k"))
    _assert_within_targets(data)
    stats = dataset_statistics(data)
    assert stats.num_rows == 15_539 + 3_809  # the repository counts EURLex-4K's points over train + test
    # The prototype measured 12 % tail labels, a 22 % top-1 % share and slope −0.82 on this shape.
    assert 0.08 < stats.tail_label_fraction < 0.16
    assert 0.18 < stats.top1pct_label_share < 0.27
    assert -0.95 < stats.rank_frequency_slope < -0.7


def test_shapes_dtypes_and_normalised_rows(mini: XMCData) -> None:
    spec = mini.spec
    assert mini.X_train.shape == (spec.n_train, spec.num_features)
    assert mini.X_test.shape == (spec.n_test, spec.num_features)
    assert mini.Y_train.shape == (spec.n_train, spec.num_labels)
    assert mini.Y_test.shape == (spec.n_test, spec.num_labels)
    for matrix in (mini.X_train, mini.Y_train, mini.X_test, mini.Y_test):
        assert isinstance(matrix, sp.csr_matrix)
        assert matrix.dtype == np.float32
    np.testing.assert_array_equal(mini.Y_train.data, 1.0)
    assert per_sample_cost(mini.Y_train).min() >= 1  # every point has a label
    assert per_sample_cost(mini.X_train).min() >= 1  # and at least one word
    for features in (mini.X_train, mini.X_test):
        norms = np.sqrt(np.asarray(features.multiply(features).sum(axis=1)).ravel())
        np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
        assert features.data.min() > 0


def test_same_seed_same_data_and_other_seed_other_data(mini: XMCData) -> None:
    again = generate_xmc(get_preset("mini"))
    other = generate_xmc(replace(get_preset("mini"), seed=1))
    for name in ("X_train", "Y_train", "X_test", "Y_test"):
        first, second = getattr(mini, name), getattr(again, name)
        np.testing.assert_array_equal(first.indptr, second.indptr)
        np.testing.assert_array_equal(first.indices, second.indices)
        np.testing.assert_array_equal(first.data, second.data)
    assert (mini.X_train != other.X_train).nnz > 0


def test_label_frequencies_follow_a_power_law(mini: XMCData) -> None:
    stats = dataset_statistics(mini)
    assert -1.3 < stats.rank_frequency_slope < -0.5  # prior exponent 0.9, flattened a little by deduplication
    assert stats.largest_label_points > 10 * np.median(np.bincount(mini.Y_train.indices, minlength=500))
    assert stats.top1pct_label_share > 0.05  # 5 labels of 500 hold far more than 1 % of the assignments


def test_nnz_spread_is_like_real_text(mini: XMCData) -> None:
    stats = statistics(mini.X_train, mini.Y_train)
    # Real newswire TF-IDF: CV 0.83; scikit-learn's generator gives 0.06.
    assert 0.65 < stats.nnz_cv < 1.0
    assert 0.7 < stats.nnz_logsd < 0.9


def test_labels_are_learnable_from_words(mini: XMCData) -> None:
    # Label topics make a label's words over-represented in its points: the centroid of a label's training
    # points must be closer to its test points than to the other test points.
    label = int(np.argmax(np.bincount(mini.Y_train.indices)))
    centroid = np.asarray(mini.X_train[mini.Y_train[:, label].nonzero()[0]].mean(axis=0)).ravel()
    scores = mini.X_test @ centroid
    has_label = mini.Y_test[:, label].toarray().ravel() > 0
    assert scores[has_label].mean() > 2 * scores[~has_label].mean()


def test_popularity_baseline_is_above_chance(mini: XMCData) -> None:
    baseline = popularity_precision(mini.Y_train, mini.Y_test)
    chance = mini.spec.k_mean / mini.spec.num_labels
    assert 10 * chance < baseline < 0.3


def test_length_tail_adds_stragglers(mini: XMCData) -> None:
    plain = statistics(mini.X_train, mini.Y_train)
    tailed_data = generate_xmc(replace(mini.spec, tail_fraction=0.05))
    tailed = statistics(tailed_data.X_train, tailed_data.Y_train)
    assert tailed.nnz_mean > 1.1 * plain.nnz_mean
    assert tailed.nnz_cv > plain.nnz_cv


def test_tfidf_uses_train_document_frequencies_only() -> None:
    train = sp.csr_matrix(np.array([[2.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    test = sp.csr_matrix(np.array([[0.0, 0.0, 3.0], [1.0, 1.0, 0.0]]))
    train_x, test_x = tfidf(train, test)
    idf = np.log(3.0 / (1.0 + np.array([1.0, 2.0, 0.0]))) + 1.0
    expected_row = np.array([1.0 + np.log(2.0), 1.0, 0.0]) * idf
    np.testing.assert_allclose(train_x[0].toarray().ravel(), expected_row / np.linalg.norm(expected_row), rtol=1e-6)
    np.testing.assert_allclose(test_x[0].toarray().ravel(), [0.0, 0.0, 1.0], rtol=1e-6)
    assert train_x.dtype == np.float32


def test_grouped_sampler_draws_within_group_with_the_right_probabilities() -> None:
    groups = np.array([2, 0, 2, 0, 2])
    items = np.array([10, 11, 12, 13, 14])
    weights = np.array([1.0, 3.0, 2.0, 1.0, 1.0])
    sampler = GroupedSampler.from_groups(groups, items, weights)
    rng = np.random.default_rng(0)
    draws = sampler.sample(np.full(40_000, 2), rng)
    assert set(np.unique(draws)) == {10, 12, 14}
    np.testing.assert_allclose([np.mean(draws == item) for item in (10, 12, 14)], [0.25, 0.5, 0.25], atol=0.01)
    np.testing.assert_allclose(np.mean(sampler.sample(np.zeros(40_000, dtype=int), rng) == 11), 0.75, atol=0.01)


def test_get_preset_lists_names_on_error() -> None:
    assert get_preset("eurlex4k").num_labels == 3_993
    with pytest.raises(KeyError, match=r"amazon670k.*delicious200k.*eurlex4k.*mini.*wiki10_31k"):
        get_preset("eurlex")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_consistent_with_the_repository_counts(name: str) -> None:
    spec = PRESETS[name]
    rows = spec.num_rows if spec.count_basis == "train+test" else spec.n_train
    assert spec.points_per_label is not None
    # Table 1 satisfies N · (labels per point) = L · (points per label) on the right rows (within rounding).
    assert rows * spec.k_mean == pytest.approx(spec.num_labels * spec.points_per_label, rel=0.01)


@pytest.mark.parametrize(
    "change",
    [{"k_mean": 0.5}, {"signal": 1.5}, {"n_train": 0}, {"tail_min_factor": 30.0}, {"count_basis": "test"}],
)
def test_spec_rejects_invalid_values(change: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"must|need"):
        replace(get_preset("mini"), **change)


def test_spec_default_cluster_count_is_root_of_labels() -> None:
    assert XMCSpec("x", 10, 0, 10, 500, 1.0, 5.0).clusters == 22
