"""Crossbow's tuner rule: keep adding learners while each one raises the throughput by the set fraction."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_aesgd.core.tuning import learners_to_keep, measures_more, rates_text


@pytest.mark.parametrize(
    ("rates", "kept"),
    [
        ([100.0], 1),
        ([100.0, 109.0], 1),  # a 9% rise is not worth a learner at 10%
        ([100.0, 111.0], 2),
        ([100.0, 190.0, 260.0, 270.0], 3),
        ([100.0, 190.0, 0.0, 400.0], 2),  # a failed measurement (out of memory) ends the search
        ([100.0, math.nan], 1),
    ],
)
def test_the_tuner_keeps_every_learner_that_paid_for_itself(rates, kept):
    assert learners_to_keep(rates, min_gain=0.1) == kept


def test_the_tuner_measures_one_more_only_while_the_last_one_paid_and_below_the_cap():
    assert measures_more([100.0], 0.1, max_learners=2)
    assert measures_more([100.0, 150.0], 0.1, max_learners=3)
    assert not measures_more([100.0, 150.0], 0.1, max_learners=2)
    assert not measures_more([100.0, 105.0], 0.1, max_learners=8)


@given(rates=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=8), gain=st.floats(0.0, 2.0))
def test_the_kept_learners_all_rose_by_the_gain(rates, gain):
    kept = learners_to_keep(rates, gain)
    assert 1 <= kept <= len(rates)
    assert all(0 < rates[k] >= (1 + gain) * rates[k - 1] for k in range(1, kept))
    if kept < len(rates):
        assert not 0 < rates[kept] >= (1 + gain) * rates[kept - 1]


def test_the_tuner_needs_a_measurement_and_a_sane_gain():
    with pytest.raises(ValueError, match="at least one"):
        learners_to_keep([], 0.1)
    with pytest.raises(ValueError, match="min_gain"):
        learners_to_keep([1.0], -0.5)


def test_a_failed_first_learner_ends_the_search_and_any_positive_rate_counts():
    assert not measures_more([0.0], 0.1, max_learners=8)  # out of memory with one learner: nothing to add
    assert not measures_more([math.nan], 0.1, max_learners=8)
    assert measures_more([0.5], 0.1, max_learners=2)  # slow, but it ran


def test_the_rates_text_names_only_the_counts_that_could_not_run():
    assert rates_text([0.4, 0.0]) == "1: 0, 2: did not run"
