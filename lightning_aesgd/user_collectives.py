"""The user's own collectives inside a training step, at batches that differ from replica to replica.

Two things DDP's equal batches hide:

* A replica that the plan leaves out (a batch of 0) skips the user's ``training_step``; any collective in it
  (``self.all_gather``, ``self.trainer.strategy.barrier()``, ``reduce``, ``broadcast``) would then wait for a
  replica that never comes. :class:`StepCollectives` notes which of the strategy's collectives the first step
  called, so that the strategy keeps every replica in the steps.
* A per-sample tensor has each replica's own batch size, and an all-gather of tensors of different shapes is a
  collective mismatch (gloo aborts the process). :func:`check_same_shapes` turns it into an error with the fix,
  and :func:`rows_in_rank_order` serves :meth:`AdaptiveElasticMixin.all_gather_rows`, the gather that takes
  uneven rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "StepCollectives",
    "UnevenGatherError",
    "check_rows",
    "check_same_shapes",
    "padded_rows",
    "rows_in_rank_order",
    "shape_descriptor",
    "shapes_from",
]

MAX_DIMS = 8
"""Dimensions a gathered shape descriptor holds (a tensor of more is compared by its first ``MAX_DIMS``)."""


class UnevenGatherError(RuntimeError):
    """``all_gather`` met tensors of different shapes on the replicas (per-sample tensors at uneven batches)."""


class StepCollectives:
    """Which of the strategy's collectives the user's training step called (read after the fit's first step)."""

    def __init__(self) -> None:
        self.watching = False
        self.called: list[str] = []

    def note(self, name: str) -> None:
        """Record a collective ``name`` if it was called inside a training step."""
        if self.watching and name not in self.called:
            self.called.append(name)

    def reason(self) -> str | None:
        """Why an idle replica may not skip the training step, or ``None``."""
        if not self.called:
            return None
        return f"the training step calls the strategy's {', '.join(self.called)}, which every replica must join"


def shape_descriptor(tensor: Tensor) -> list[int]:
    """``tensor``'s shape as a row of fixed length, ``[ndim, *shape, -1, ...]``: every replica gathers the same size.

    Example:
        >>> shape_descriptor(torch.zeros(3, 2))
        [2, 3, 2, -1, -1, -1, -1, -1, -1]
    """
    shape = list(tensor.shape)[:MAX_DIMS]
    return [tensor.dim(), *shape, *[-1] * (MAX_DIMS - len(shape))]


def shapes_from(descriptors: Sequence[Sequence[int]]) -> list[list[int]]:
    """Every replica's shape from the gathered :func:`shape_descriptor` rows."""
    return [list(row[1 : 1 + min(int(row[0]), MAX_DIMS)]) for row in descriptors]


def check_same_shapes(shapes: Sequence[Sequence[int]]) -> None:
    """Raise :class:`UnevenGatherError`, naming the fix, unless every replica's tensor has the same shape.

    Args:
        shapes: every replica's shape, in rank order (each replica checks the same list, so all raise alike).
    """
    if all(list(shape) == list(shapes[0]) for shape in shapes):
        return
    listed = ", ".join(f"{rank}: {list(shape)}" for rank, shape in enumerate(shapes))
    raise UnevenGatherError(
        f"all_gather in a training step got tensors of different shapes on the replicas ({listed}): at "
        "speed-proportional batches a per-sample tensor has each replica's own batch size, where DDP's batches are "
        "equal. HINT: gather per-sample rows with `self.trainer.strategy.all_gather_rows(tensor)` (every replica's "
        "rows in rank order: what `self.all_gather(tensor).flatten(0, 1)` gives under DDP; `sync_grads=True` "
        "works too), or reduce each replica's tensor to a fixed shape before gathering."
    )


def check_rows(shapes: Sequence[Sequence[int]]) -> list[int]:
    """Every replica's number of rows; raise :class:`UnevenGatherError` unless all have rows of one shape.

    Args:
        shapes: every replica's shape, in rank order (each replica checks the same list, so all raise alike).
    """
    if all(len(shape) >= 1 and list(shape[1:]) == list(shapes[0][1:]) for shape in shapes):
        return [int(shape[0]) for shape in shapes]
    listed = ", ".join(f"{rank}: {list(shape)}" for rank, shape in enumerate(shapes))
    raise UnevenGatherError(
        f"all_gather_rows needs rows of one shape on every replica, got {listed}. HINT: gather tensors of shape "
        "(rows, ...) with the same trailing shape everywhere (a batch of one still has its row: avoid squeeze())."
    )


def padded_rows(tensor: Tensor, rows: int) -> Tensor:
    """``tensor`` with zero rows appended up to ``rows`` rows (autograd flows to the original rows)."""
    missing = rows - tensor.shape[0]
    if missing == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((missing, *tensor.shape[1:]))])


def rows_in_rank_order(gathered: Tensor, sizes: Sequence[int]) -> Tensor:
    """Every replica's own rows of a gather of padded tensors (``gathered[r]`` holds replica ``r``'s), concatenated.

    Example:
        >>> gathered = torch.tensor([[1, 2, 3], [4, 0, 0]])
        >>> rows_in_rank_order(gathered, [3, 1]).tolist()
        [1, 2, 3, 4]
    """
    return torch.cat([gathered[rank, :size] for rank, size in enumerate(sizes)])
