"""Torch view of sparse XMC data: a map-style dataset over CSR rows and a bag-form batch for ``EmbeddingBag``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor
from torch.utils.data import Dataset


class SparseSample(NamedTuple):
    """One row of a sparse XMC data set."""

    feature_ids: Tensor
    """Column ids of the row's non-zeros (int64)."""
    feature_values: Tensor
    """Values of the row's non-zeros (float32)."""
    label_ids: Tensor
    """Ids of the row's labels (int64)."""


class SparseXMCDataset(Dataset[SparseSample]):
    """Rows of CSR features and labels as small tensors, without densifying anything.

    The CSR arrays are shared with numpy (no copy); ``__getitem__`` slices one row.

    Args:
        features: CSR features, shape ``(n, num_features)``.
        labels: Binary CSR labels, shape ``(n, num_labels)``.

    Raises:
        ValueError: If the matrices have different numbers of rows.
    """

    def __init__(self, features: sp.csr_matrix, labels: sp.csr_matrix) -> None:
        if features.shape[0] != labels.shape[0]:
            raise ValueError(f"features have {features.shape[0]} rows but labels have {labels.shape[0]}")
        features, labels = sp.csr_matrix(features), sp.csr_matrix(labels)
        self._feature_ptr = np.asarray(features.indptr, dtype=np.int64)
        self._feature_ids = torch.from_numpy(features.indices)
        self._feature_values = torch.from_numpy(np.asarray(features.data, dtype=np.float32))
        self._label_ptr = np.asarray(labels.indptr, dtype=np.int64)
        self._label_ids = torch.from_numpy(labels.indices)

    def __len__(self) -> int:
        return self._feature_ptr.size - 1

    def __getitem__(self, index: int) -> SparseSample:
        start, end = self._feature_ptr[index], self._feature_ptr[index + 1]
        label_start, label_end = self._label_ptr[index], self._label_ptr[index + 1]
        return SparseSample(
            feature_ids=self._feature_ids[start:end].long(),
            feature_values=self._feature_values[start:end],
            label_ids=self._label_ids[label_start:label_end].long(),
        )

    def __getitems__(self, indices: Sequence[int]) -> SparseBatch:
        """A whole batch at once: the DataLoader calls this instead of one ``__getitem__`` per row.

        Gathering the rows' CSR slices with array operations costs a fraction of building one small tensor per
        row and concatenating them (about 15 ms for 512 rows), which would otherwise rival a step's compute.
        """
        rows = np.asarray(indices, dtype=np.int64)
        feature_positions, offsets = _row_positions(self._feature_ptr, rows)
        label_positions, label_offsets = _row_positions(self._label_ptr, rows)
        return SparseBatch(
            indices=self._feature_ids[feature_positions].long(),
            offsets=offsets,
            weights=self._feature_values[feature_positions],
            label_ids=self._label_ids[label_positions].long(),
            label_offsets=label_offsets,
        )

    @property
    def sample_costs(self) -> Tensor:
        """Cost of every row for cost-aware routing: its number of non-zeros (float32)."""
        return torch.from_numpy(np.diff(self._feature_ptr)).float()


@dataclass(frozen=True)
class SparseBatch:
    """A batch in the bag form of ``torch.nn.EmbeddingBag(mode="sum")``, labels kept sparse.

    Row ``i``'s features are ``indices[offsets[i]:offsets[i + 1]]`` with values
    ``weights[offsets[i]:offsets[i + 1]]`` (the last row runs to the end); labels are laid out the same way.
    Labels stay as ids because a dense ``B × L`` target on the host would be 2.7 GB for ``B = 1024`` on
    Amazon-670K; :meth:`dense_labels` builds it on the device, next to the equally large logits.

    Lightning moves any object with a ``to`` method to the device, and the DataLoader pins any object with a
    ``pin_memory`` method, so the batch works with both unchanged.

    Attributes:
        indices: Concatenated feature ids (int64).
        offsets: Start of each row in ``indices`` (int64, one per row).
        weights: Concatenated feature values (float32), the ``per_sample_weights`` of ``EmbeddingBag``.
        label_ids: Concatenated label ids (int64).
        label_offsets: Start of each row in ``label_ids`` (int64, one per row).
    """

    indices: Tensor
    offsets: Tensor
    weights: Tensor
    label_ids: Tensor
    label_offsets: Tensor

    def __len__(self) -> int:
        return self.offsets.numel()

    @property
    def device(self) -> torch.device:
        """Device holding the batch."""
        return self.indices.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseBatch:
        """Return the batch on ``device``."""
        return SparseBatch(*(tensor.to(device, non_blocking=non_blocking) for tensor in self._tensors()))

    def pin_memory(self) -> SparseBatch:
        """Return the batch in page-locked memory, for asynchronous host-to-GPU copies."""
        return SparseBatch(*(tensor.pin_memory() for tensor in self._tensors()))

    def dense_labels(self, num_labels: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """The multi-hot target, shape ``(len(self), num_labels)``, built on the batch's device.

        Built with no host synchronisation (a GPU step runs ahead of the host): the output sizes are known here.
        """
        rows = torch.repeat_interleave(
            torch.arange(len(self), device=self.device),
            _lengths(self.label_offsets, self.label_ids),
            output_size=self.label_ids.numel(),
        )
        target = torch.zeros(len(self), num_labels, dtype=dtype, device=self.device)
        target[rows, self.label_ids] = 1
        return target

    def _tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self.indices, self.offsets, self.weights, self.label_ids, self.label_offsets


def _lengths(offsets: Tensor, values: Tensor) -> Tensor:
    """Row lengths from row starts and the concatenated values."""
    return torch.diff(offsets, append=offsets.new_full((1,), values.numel()))  # new_tensor would copy from the host


def _row_positions(pointers: np.ndarray, rows: np.ndarray) -> tuple[Tensor, Tensor]:
    """Positions of the given CSR rows' entries, back to back, and each row's start among them."""
    starts = pointers[rows]
    lengths = pointers[rows + 1] - starts
    offsets = np.cumsum(lengths) - lengths
    positions = np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
    return torch.from_numpy(positions), torch.from_numpy(offsets)


def collate_sparse(samples: Sequence[SparseSample] | SparseBatch) -> SparseBatch:
    """Concatenate rows into one :class:`SparseBatch` (the ``collate_fn`` of the XMC data loaders).

    Args:
        samples: Rows from :class:`SparseXMCDataset`, or a batch its ``__getitems__`` already gathered.

    Returns:
        The batch, on the host.
    """
    if isinstance(samples, SparseBatch):
        return samples
    feature_ids, feature_values, label_ids = zip(*samples, strict=True)
    return SparseBatch(
        indices=torch.cat(feature_ids),
        offsets=_starts(feature_ids),
        weights=torch.cat(feature_values),
        label_ids=torch.cat(label_ids),
        label_offsets=_starts(label_ids),
    )


def _starts(pieces: Sequence[Tensor]) -> Tensor:
    lengths = torch.tensor([piece.numel() for piece in pieces], dtype=torch.int64)
    return torch.cumsum(lengths, dim=0) - lengths
