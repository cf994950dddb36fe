"""Float64 values carried through a float32 sum: each split in two float32 parts, a high and a low one.

A gradient bucket is float32, a report row float64 (a replica's active seconds, its sample counts). To let the
rows travel in the bucket's all-reduce, each value ``x`` is sent as ``hi = fl32(x)`` and ``lo = fl32(x − hi)``
and read back as ``hi + lo``: about 48 bits of its 53. Where each element of the sum has one contributor, as
report rows do (every replica fills its own row, the others send zeros), adding zeros is exact and so is the
transport, to those 48 bits. Non-finite values keep their value (their low part is 0); a finite value beyond
float32's range (about 3.4e38) arrives as an infinity.
"""

from __future__ import annotations

import torch
from torch import Tensor

CARRIERS = (torch.float32, torch.float64)
"""The dtypes that carry float64 values: float64 as they are, float32 in two parts. Half precision has too few
exponent or mantissa bits."""


def parts_per_value(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that carry one float64 value: 1 for float64, 2 for float32."""
    if dtype not in CARRIERS:
        raise ValueError(f"float64 values travel in float32 or float64 tensors, not {dtype}.")
    return 1 if dtype == torch.float64 else 2


def split_wide(values: Tensor, dtype: torch.dtype) -> Tensor:
    """``values`` (float64) as a flat tensor of ``dtype``: ``[hi…, lo…]`` for float32, themselves for float64."""
    flat = values.reshape(-1).to(torch.float64)
    if parts_per_value(dtype) == 1:
        return flat
    high = flat.to(torch.float32)
    low = torch.where(torch.isfinite(high), flat - high.to(torch.float64), torch.zeros_like(flat))
    return torch.cat([high, low.to(torch.float32)])


def joined_wide(parts: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """The float64 values of shape ``shape`` that :func:`split_wide` split into ``parts`` (after a sum, theirs)."""
    if parts_per_value(parts.dtype) == 1:
        return parts.reshape(shape)
    high, low = parts.to(torch.float64).chunk(2)
    return (high + low).reshape(shape)
