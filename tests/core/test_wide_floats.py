"""Float64 report rows through a float32 sum: disjoint rows arrive to 48 bits, non-finite values as they were."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_aesgd.core.wide_floats import joined_wide, parts_per_value, split_wide

FINITE = st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, allow_infinity=False)


@given(st.lists(st.lists(FINITE, min_size=3, max_size=3), min_size=1, max_size=5))
def test_disjoint_rows_summed_in_float32_parts_arrive_to_48_bits(rows):
    """Each replica splits a table holding only its row; the float32 sum of the parts joins into the whole table."""
    table = torch.tensor(rows, dtype=torch.float64)
    summed = torch.zeros(2 * table.numel(), dtype=torch.float32)
    for rank in range(len(rows)):
        own = torch.zeros_like(table)
        own[rank] = table[rank]
        summed += split_wide(own, torch.float32)
    arrived = joined_wide(summed, table.shape)
    assert arrived.dtype == torch.float64
    for got, sent in zip(arrived.reshape(-1).tolist(), table.reshape(-1).tolist(), strict=True):
        assert got == pytest.approx(sent, rel=2.0**-46, abs=1e-37)


def test_float32_alone_would_lose_what_the_low_part_keeps():
    """A replica's active seconds after hours of training: float32 keeps 7 digits, the two parts about 14."""
    seconds = torch.tensor([12345.678901234], dtype=torch.float64)
    assert seconds.to(torch.float32).item() != pytest.approx(seconds.item(), rel=1e-9)
    assert joined_wide(split_wide(seconds, torch.float32), (1,)).item() == pytest.approx(seconds.item(), rel=1e-13)


def test_float64_carries_the_values_as_they_are_and_non_finite_values_survive_float32():
    values = torch.tensor([1.0 / 3.0, math.inf, -math.inf, math.nan], dtype=torch.float64)
    assert torch.equal(joined_wide(split_wide(values, torch.float64), (4,))[:1], values[:1])
    arrived = joined_wide(split_wide(values, torch.float32), (4,))
    assert arrived[1].item() == math.inf
    assert arrived[2].item() == -math.inf
    assert math.isnan(arrived[3].item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64])
def test_other_dtypes_cannot_carry_float64_values(dtype):
    with pytest.raises(ValueError, match="float32 or float64"):
        parts_per_value(dtype)


def test_a_float64_value_takes_one_float64_element_or_two_float32_ones():
    assert parts_per_value(torch.float64) == 1
    assert parts_per_value(torch.float32) == 2
    assert split_wide(torch.ones(3, dtype=torch.float64), torch.float32).numel() == 6
