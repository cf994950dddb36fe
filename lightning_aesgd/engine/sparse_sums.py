"""Sparse gradients summed over replicas, where the backend has no sparse all-reduce (NCCL) or where it has (gloo).

A sparse gradient (an ``EmbeddingBag(sparse=True)``'s) travels in a bucket of its own. Gloo all-reduces sparse
tensors (:func:`native_sparse_sum`); NCCL cannot, so there (``sparse_reduction="auto"``) it is summed by the
cheaper of two dense collectives, judged by the bytes each replica receives (:func:`sparse_sum_method`): *gather*
every replica's stored rows (indices and values, padded to the longest) and hand back all of them, an uncoalesced
tensor whose sum is the sum of the contributions (:func:`gathered_sum`); or *densify* it, all-reducing the gradient
as a dense tensor of its full size (:func:`densified_sum`). Both need every replica's number of rows first
(:func:`exchange_rows`), which is why that choice blocks the backward until every replica has reached the bucket.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from lightning_aesgd.engine.comm import Communicator, completed, copy_from_host
from lightning_aesgd.engine.flat import to_host

SparseReduction = Literal["auto", "all_reduce", "gather", "densify"]
"""How a sparse gradient is summed: ``"auto"`` is ``"all_reduce"`` where the backend takes sparse tensors, else the
cheaper of ``"gather"`` and ``"densify"`` (see :func:`sparse_sum_method`)."""


def densifies(local: Tensor, counts: list[int], reduction: SparseReduction) -> bool:
    """Whether a sparse sum without a sparse all-reduce densifies ``local`` (else it gathers the replicas' rows).

    ``counts`` are the replicas' numbers of stored rows (:func:`exchange_rows`): every replica decides alike.
    """
    if reduction != "auto":
        return reduction == "densify"
    method = sparse_sum_method(
        max(counts),
        row_width=math.prod(local.shape[local.sparse_dim() :]),
        sparse_dim=local.sparse_dim(),
        numel=math.prod(local.shape),
        element_size=local.element_size(),
        world_size=len(counts),
    )
    return method == "densify"


def no_rows(sparse: Tensor) -> Tensor:
    """A sparse tensor of ``sparse``'s size, dtype and device with no stored rows: zeros."""
    dims = sparse.sparse_dim()
    return torch.sparse_coo_tensor(
        torch.empty((dims, 0), dtype=torch.long, device=sparse.device),
        torch.empty((0, *sparse.shape[dims:]), dtype=sparse.dtype, device=sparse.device),
        sparse.size(),
        is_coalesced=True,
        check_invariants=False,
    )


def sparse_sum_method(
    rows: int, row_width: int, sparse_dim: int, numel: int, element_size: int, world_size: int
) -> Literal["gather", "densify"]:
    """The cheaper way to sum a sparse gradient over replicas without a sparse all-reduce, in bytes received.

    Gathering the replicas' rows (each padded to the longest, an int64 index per sparse dimension) and densifying
    (an all-reduce of the full tensor) receive about::

        gather  = world_size · rows · (row_width · element_size + 8 · sparse_dim)
        densify = numel · element_size

    per replica; gather where it is not dearer. Gather grows with the replicas and their rows, densify does not:
    a gradient densifies once a replica stores more than about ``1/world_size`` of its rows (fewer where rows are
    narrow, their indices then weighing more).

    Args:
        rows: the most stored rows (coalesced) of a replica's gradient.
        row_width: elements per row, the product of the dense dimensions' sizes.
        sparse_dim: the sparse dimensions, each stored row's number of indices.
        numel: elements of the whole (dense) gradient.
        element_size: bytes per element.
        world_size: the replicas summed over.

    Returns:
        ``"gather"`` or ``"densify"``, whichever receives fewer bytes.
    """
    gather = world_size * rows * (row_width * element_size + 8 * sparse_dim)
    densify = numel * element_size
    return "gather" if gather <= densify else "densify"


def native_sparse_sum(
    contribution: Tensor, share: float, comm: Communicator, finite: bool = True
) -> tuple[torch.futures.Future[Tensor], Tensor]:
    """A sparse all-reduce (gloo's), its finite flags summed beside it: nothing blocks the backward.

    A replica whose gradient is not ``finite`` is left out (sent as no rows); one with a ``share`` of 0 and a
    finite gradient (an idle step) is not. The returned flags are filled when the sums complete, before the
    future's value is handed to DDP.
    """
    mine = _flags_on(contribution.device, [share if finite else 0.0, 0.0 if finite else 1.0])
    flags = torch.zeros(2, dtype=torch.float64, device=contribution.device)
    both = torch.futures.collect_all([comm.all_reduce_sum_async(contribution), comm.all_reduce_sum_async(mine)])

    def renormalised_sum(future: torch.futures.Future[list[torch.futures.Future[Any]]]) -> Tensor:
        summed: Tensor
        summed_flags: Tensor
        summed, summed_flags = (done.value()[0] for done in future.value())
        flags.copy_(summed_flags)
        finite_share, left_out = summed_flags.tolist()
        if left_out > 0:
            summed = summed * (1.0 / finite_share if finite_share > 0 else 0.0)
        return summed

    return both.then(renormalised_sum), flags


class RowExchange(NamedTuple):
    """What the row exchange tells every replica alike (:func:`exchange_rows`)."""

    counts: list[int]
    """Each replica's stored rows to sum, in rank order: 0 for a replica left out."""
    finite_share: float
    """The sum of the finite replicas' shares of the step."""
    left_out: int
    """How many replicas were left out, their gradients not finite."""
    finite: list[bool]
    """Whether each replica's gradient is finite, in rank order."""


def exchange_rows(sparse: Tensor, share: float, comm: Communicator, finite: bool | Tensor = True) -> RowExchange:
    """Every replica's stored rows of ``sparse``, share and finiteness, exchanged in one small all-gather.

    A replica whose gradient is not ``finite`` is left out (its rows count 0, and it must send none); one with a
    ``share`` of 0 and a finite gradient (an idle step) is not. ``finite`` may be a flag on the device that the host
    has not read (a 0-dim bool tensor): it travels in the exchange, so that the host reads the device once, with the
    rows. Read on the host: it blocks.
    """
    flag = finite.to(torch.float64) if isinstance(finite, Tensor) else float(finite)
    mine = _flags_on(sparse.device, [float(sparse._nnz()), share, 1.0])
    mine[1:2].mul_(flag)  # the share where finite, else 0
    mine[2:3].sub_(flag)  # 0 where finite, else 1: left out
    numbers = to_host(torch.stack(comm.all_gather(mine)))
    rows = [numbers[start : start + 3] for start in range(0, len(numbers), 3)]
    finites = [row[2] == 0.0 for row in rows]
    counts = [round(row[0]) if ok else 0 for row, ok in zip(rows, finites, strict=True)]
    return RowExchange(counts, sum(row[1] for row in rows), finites.count(False), finites)


def gathered_sum(local: Tensor, counts: list[int], comm: Communicator) -> torch.futures.Future[Tensor]:
    """All replicas' rows of a sparse gradient, an uncoalesced tensor whose sum is the sum of the gradients.

    ``counts`` are the replicas' numbers of rows (:func:`exchange_rows`): each pads its indices and values to the
    most, as an all-gather takes tensors of one size, and the padding is dropped from what arrives.
    """
    longest = max(counts)
    if not longest:  # every replica knows: none launches the gather
        return completed(no_rows(local))
    indices, values = _padded(local._indices(), longest, dim=1), _padded(local._values(), longest, dim=0)
    # The gathers leave the host going on (the current stream waits for them); the tensor is then built on this
    # stream and handed back in a completed CPU future. A CUDA future's callback result would have its storages
    # collected through ``indices()``, which an uncoalesced sparse tensor refuses.
    all_indices, all_values = comm.all_gather(indices), comm.all_gather(values)
    return completed(
        torch.sparse_coo_tensor(
            torch.cat([rows[:, :n] for rows, n in zip(all_indices, counts, strict=True)], dim=1),
            torch.cat([rows[:n] for rows, n in zip(all_values, counts, strict=True)]),
            local.size(),
            check_invariants=False,
        )
    )


def _padded(tensor: Tensor, length: int, dim: int) -> Tensor:
    """A copy of ``tensor`` lengthened with zeros to ``length`` along ``dim``."""
    shape = list(tensor.shape)
    shape[dim] = length
    padded = tensor.new_zeros(shape)
    padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return padded


def densified_sum(sparse: Tensor, comm: Communicator) -> torch.futures.Future[Tensor]:
    """The sum of a sparse gradient all-reduced as a dense tensor, handed back with every row stored.

    Keeping every row (zero where no replica touched it) needs nothing of the sum's values, so the conversion
    queues behind the all-reduce without waiting for it; dropping the zero rows would wait in the hook, as their
    count decides the result's size. The optimizers that take sparse gradients (SGD, Adagrad) leave a zero row
    as it was.
    """
    dims = sparse.sparse_dim()
    dense = sparse.to_dense()  # a tensor of its own: the gradient tensor is free for DDP at once
    indices = torch.stack(
        torch.unravel_index(torch.arange(math.prod(sparse.shape[:dims]), device=dense.device), sparse.shape[:dims])
    )
    summed: torch.futures.Future[list[Tensor]] = comm.all_reduce_sum_async(dense)

    def every_row(future: torch.futures.Future[list[Tensor]]) -> Tensor:
        total = future.value()[0]
        return torch.sparse_coo_tensor(
            indices,
            total.reshape(-1, *sparse.shape[dims:]),
            sparse.size(),
            is_coalesced=True,
            check_invariants=False,
        )

    return summed.then(every_row)


def _flags_on(device: torch.device, values: list[float]) -> Tensor:
    """Host numbers as a float64 tensor on ``device``, copied without blocking (a pinned staging tensor)."""
    flags = torch.empty(len(values), dtype=torch.float64, device=device)
    copy_from_host(flags, values)
    return flags
