"""Whole and real numbers in options: NumPy's count, bools do not, and every option check agrees."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_aesgd.core.lr import InverseTimeDecay, stale_update_scale
from lightning_aesgd.core.schedule import validate_schedule
from lightning_aesgd.core.values import is_real, is_whole, plain
from lightning_aesgd.placement import check_replicas_per_device


@pytest.mark.parametrize("value", [0, 7, np.int64(7), np.int32(-2)])
def test_integers_of_any_kind_are_whole(value):
    assert is_whole(value)
    assert is_real(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 2.0, "2", None])
def test_bools_floats_and_others_are_not_whole(value):
    assert not is_whole(value)


@pytest.mark.parametrize("value", [True, "0.5", None, 1j])
def test_bools_strings_and_complex_numbers_are_not_real(value):
    assert not is_real(value)


def test_option_checks_take_numpy_counts_as_a_sweep_might_give_them():
    validate_schedule(np.int64(4), np.int64(10))
    assert InverseTimeDecay(decay=0.1, warmup_steps=np.int64(5))(np.int64(5)) == 1.0
    assert stale_update_scale(np.int64(1)) == pytest.approx(0.5)
    assert check_replicas_per_device(np.int64(2)) == 2
    assert type(check_replicas_per_device(np.int64(2))) is int
    with pytest.raises(ValueError, match="period"):
        validate_schedule(True, 0)


@pytest.mark.parametrize("value", ["4", None, {"period": 4}, 1j])
def test_plain_returns_what_is_no_number_nor_list_as_it_is(value):
    assert plain(value) is value
