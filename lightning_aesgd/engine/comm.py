"""Communication between replicas: a thin layer over ``torch.distributed`` that tests can fake.

The strategy talks to other replicas only through a :class:`Communicator`. :class:`TorchCommunicator` is the
real one (any backend: gloo, nccl); :class:`LocalCommunicator` serves a single replica without a process group.
Tests substitute their own implementation of the protocol to count calls or simulate peers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")


class Communicator(Protocol):
    """The collectives the strategy needs. Every replica must call them in the same order."""

    @property
    def world_size(self) -> int:
        """Number of replicas taking part."""
        ...

    @property
    def rank(self) -> int:
        """Index of this replica, in ``[0, world_size)``."""
        ...

    def all_reduce_sum_(self, tensor: Tensor) -> None:
        """Replace ``tensor`` in place by its elementwise sum over all replicas."""
        ...

    def broadcast_(self, tensor: Tensor, src: int = 0) -> None:
        """Replace ``tensor`` in place by replica ``src``'s tensor."""
        ...

    def all_gather_object(self, obj: T) -> list[T]:
        """Gather one picklable object from every replica (used for checkpoints, not on the hot path)."""
        ...


class LocalCommunicator:
    """The communicator of a lone replica: every collective is the identity."""

    @property
    def world_size(self) -> int:  # noqa: D102
        return 1

    @property
    def rank(self) -> int:  # noqa: D102
        return 0

    def all_reduce_sum_(self, tensor: Tensor) -> None:  # noqa: D102
        return None

    def broadcast_(self, tensor: Tensor, src: int = 0) -> None:  # noqa: D102
        return None

    def all_gather_object(self, obj: T) -> list[T]:  # noqa: D102
        return [obj]


class TorchCommunicator:
    """Collectives over an initialised ``torch.distributed`` process group.

    Args:
        device: where small tensors for collectives live; must be a CUDA device for NCCL.
        group: the process group; the default (world) group when ``None``.
    """

    def __init__(self, device: torch.device, group: Any = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs an initialised torch.distributed process group.")
        self.device = device
        self.group = group

    @property
    def world_size(self) -> int:  # noqa: D102
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:  # noqa: D102
        return dist.get_rank(self.group)

    def all_reduce_sum_(self, tensor: Tensor) -> None:  # noqa: D102
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def broadcast_(self, tensor: Tensor, src: int = 0) -> None:  # noqa: D102
        dist.broadcast(tensor, src=src, group=self.group)

    def all_gather_object(self, obj: T) -> list[T]:  # noqa: D102
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered


class NoMergeWeightError(ValueError):
    """Every replica's merge weight was zero; ``rows`` holds every replica's report row, in rank order."""

    def __init__(self, message: str, rows: list[list[float]]) -> None:
        super().__init__(message)
        self.rows = rows


def default_communicator(device: torch.device) -> Communicator:
    """The process group's collectives where torch.distributed runs, a single replica's otherwise."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return TorchCommunicator(device)
    return LocalCommunicator()


class WeightedAllReduce:
    """Weighted means of flat tensors over all replicas, with one SUM all-reduce per dtype.

    Each replica contributes one bucket ``[w·θ₁, w·θ₂, …, w]`` (all flats of one dtype back to back, then its
    weight); after the SUM every replica divides by ``Σw``:

        meanₖ = Σᵢ wᵢ θₖ,ᵢ / Σᵢ wᵢ

    A replica may also send a short row of statistics (its arrival report) in the same collective: the widest
    floating bucket gets ``n`` row slots after the weight, replica ``r`` writes its row into slot ``r`` and zeros
    elsewhere, so the SUM gathers every replica's row without a collective of its own.

    Buckets are kept between calls: a merge runs on the training path, and a fresh model-sized buffer costs as
    much as a copy of the model.

    Args:
        comm: the communicator.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._buckets: dict[tuple[torch.dtype, torch.device, int], Tensor] = {}

    def __call__(
        self, flats: Sequence[Tensor], weight: float, row: Sequence[float] = ()
    ) -> tuple[list[Tensor], list[list[float]]]:
        """Return the means, one per input in the same order, and every replica's ``row`` (rank order).

        The means are views of an internal bucket: valid until the next call, and free to be overwritten.

        A replica with weight 0 contributes zeros, whatever its tensors hold (a non-finite replica left out).

        Raises:
            NoMergeWeightError: if the total weight is not positive (with every replica's row).
        """
        means = list(flats)  # placeholders, each replaced by its mean below
        dtypes = list(dict.fromkeys(flat.dtype for flat in flats))
        carrier = _row_carrier(dtypes)
        rows: list[list[float]] = []
        row_slots = len(row) * self.comm.world_size
        total_weight = 0.0
        for dtype in dtypes:
            positions = [k for k, flat in enumerate(flats) if flat.dtype == dtype]
            sizes = [flats[k].numel() for k in positions]
            body = sum(sizes)
            extra = row_slots if dtype == carrier else 0
            bucket = self._bucket(dtype, flats[positions[0]].device, body + 1 + extra)
            for k, chunk in zip(positions, torch.split(bucket[:body], sizes), strict=True):
                if weight == 0:
                    chunk.zero_()  # 0·NaN would be NaN
                else:
                    torch.mul(flats[k].reshape(-1), weight, out=chunk)
            bucket[body] = weight
            if extra:
                _write_row(bucket[body + 1 :], row, self.comm.rank)
            self.comm.all_reduce_sum_(bucket)
            total_weight = float(bucket[body])
            if total_weight > 0:
                bucket[:body].div_(total_weight)
            if extra:
                rows = bucket[body + 1 :].view(-1, len(row)).tolist()
            for k, mean in zip(positions, torch.split(bucket[:body], sizes), strict=True):
                means[k] = mean
        if row and not rows:  # no float32/float64 bucket to carry the row: send it on its own
            device = flats[0].device if flats else torch.device("cpu")
            slots = torch.zeros(row_slots, dtype=torch.float64, device=device)
            _write_row(slots, row, self.comm.rank)
            self.comm.all_reduce_sum_(slots)
            rows = slots.view(-1, len(row)).tolist()
        if flats and not total_weight > 0:
            raise NoMergeWeightError(
                f"The merge weights of all replicas sum to {total_weight}; at least one must be positive.", rows
            )
        return means, rows

    def _bucket(self, dtype: torch.dtype, device: torch.device, size: int) -> Tensor:
        key = (dtype, device, size)
        if key not in self._buckets:
            self._buckets[key] = torch.empty(size, dtype=dtype, device=device)
        return self._buckets[key]


def _row_carrier(dtypes: Sequence[torch.dtype]) -> torch.dtype | None:
    """The bucket dtype that carries the report rows: float64 or float32, never a half-precision type.

    Half precision would turn counts above 65504 into ``inf`` (fp16) or round them (bf16); a model without a
    float32 or float64 bucket sends its rows in a small all-reduce of their own.
    """
    for dtype in (torch.float64, torch.float32):
        if dtype in dtypes:
            return dtype
    return None


def _write_row(slots: Tensor, row: Sequence[float], rank: int) -> None:
    slots.zero_()
    width = len(row)
    slots[rank * width : (rank + 1) * width] = torch.tensor(list(row), dtype=slots.dtype)
