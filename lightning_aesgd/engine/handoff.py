"""Handing one replica's model and optimizer state to the others, as a segment's handoff does (:mod:`.sitting_out`).

The model's tensors and the optimizer's state tensors on the model's device travel by broadcast on the world's
backend, one per dtype, into tensors of the receiver's own where it has them. An optimizer's state is often twice
the model (Adam's two moments): pickled to every rank, as it was before, one handoff of Adam's state took 2.5 to
3.9 times as long (3 gloo processes on CPU, 10⁶ and 10⁷ parameters, two runs). Only the state's structure and its
scalars (Adam's step count) travel pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from lightning_aesgd.engine.comm import Communicator

CHUNK_BYTES = 64 * 2**20
"""The most bytes :func:`broadcast_tensors` gathers into one flat buffer: its extra memory on the device."""


def broadcast_tensors(comm: Communicator, tensors: list[torch.Tensor], src: int) -> None:
    """Overwrite ``tensors`` in place with replica ``src``'s: one broadcast per dtype and device, per chunk.

    Small tensors travel together in flat buffers of at most :data:`CHUNK_BYTES`; a larger contiguous tensor travels
    by itself, in place, so that a handoff needs little memory beyond the state it carries.
    """
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.dtype, tensor.device), []).append(tensor.data)
    for same in kinds.values():
        for chunk in _chunks(same):
            if len(chunk) == 1 and chunk[0].is_contiguous():
                comm.broadcast_(chunk[0], src=src)
                continue
            flat = torch.cat([tensor.reshape(-1) for tensor in chunk])
            comm.broadcast_(flat, src=src)
            for tensor, piece in zip(chunk, torch.split(flat, [tensor.numel() for tensor in chunk]), strict=True):
                tensor.copy_(piece.view_as(tensor))


def _chunks(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in order, in runs of at most :data:`CHUNK_BYTES` (a larger tensor alone); the same on every rank."""
    chunks: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not chunks or size + nbytes > CHUNK_BYTES:  # an empty first tensor opens a chunk too
            chunks.append([])
            size = 0
        chunks[-1].append(tensor)
        size += nbytes
    return chunks


@dataclass(frozen=True)
class TensorSlot:
    """Where a state tensor sent by broadcast belongs: its position among the broadcast tensors, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def split_tensors(state: Any, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    """``state`` (nested dicts, lists, tuples) with each tensor on ``device`` replaced by a :class:`TensorSlot`.

    Returns the skeleton, with every other tensor copied to the host for pickling, and the tensors the slots number.
    Scalars (0-d tensors: Adam's step count) stay in the skeleton on every device: the skeleton then has the same
    slots whatever the replica's device, and a step count received by a GPU replica stays on the host, where the
    optimizer keeps it (one on the GPU would cost a host synchronisation per parameter and step).

    Example:
        >>> skeleton, tensors = split_tensors({"m": torch.zeros(2), "lr": 0.1}, torch.device("cpu"))
        >>> skeleton["m"], skeleton["lr"], len(tensors)
        (TensorSlot(index=0, shape=(2,), dtype=torch.float32), 0.1, 1)
    """
    tensors: list[torch.Tensor] = []

    def slot_of(tensor: torch.Tensor) -> Any:
        if tensor.device != device or tensor.dim() == 0:
            return tensor.detach().cpu()
        tensors.append(tensor.detach())
        return TensorSlot(len(tensors) - 1, tuple(tensor.shape), tensor.dtype)

    return tree_map_only(torch.Tensor, slot_of, state), tensors


def slots_of(skeleton: Any) -> list[TensorSlot]:
    """The slots of ``skeleton``, in the order of its tensors."""
    return sorted((leaf for leaf in tree_leaves(skeleton) if isinstance(leaf, TensorSlot)), key=lambda s: s.index)


def filled(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """``skeleton`` with each :class:`TensorSlot` replaced by its tensor: the inverse of :func:`split_tensors`."""
    return tree_map_only(TensorSlot, lambda slot: tensors[slot.index], skeleton)


def broadcast_optimizer_state(
    comm: Communicator, optimizer: torch.optim.Optimizer | None, src: int, device: torch.device
) -> dict[str, Any] | None:
    """Replica ``src``'s optimizer state on every replica (a collective of ``comm``): the state to load, if any.

    Its state tensors on ``device`` (this rank's model device) travel by :func:`broadcast_tensors`: a receiver whose
    own state has the same tensors receives into them (replicas that took part hold the same values already), any
    other into new ones. Returns, on every rank but ``src``, the state dict to load (``None`` where ``src`` has no
    optimizer): the caller loads it once every collective of its handoff is over, so that a state this replica
    cannot load fails here alone, not the others waiting for it in a collective.
    """
    own = split_tensors(optimizer.state_dict(), device) if optimizer is not None else (None, [])
    skeleton = comm.broadcast_object(own[0] if comm.rank == src else None, src=src)
    if skeleton is None:
        return None
    slots = slots_of(skeleton)
    tensors = own[1]
    if comm.rank != src and [(tuple(t.shape), t.dtype) for t in tensors] != [(s.shape, s.dtype) for s in slots]:
        tensors = [torch.empty(slot.shape, dtype=slot.dtype, device=device) for slot in slots]
    broadcast_tensors(comm, tensors, src)
    received: dict[str, Any] = filled(skeleton, tensors)
    return None if comm.rank == src else received
