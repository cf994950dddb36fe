"""Flat views of a module's tensors, so that a merge moves one contiguous buffer instead of many small ones."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import Tensor, nn


class FlatView:
    """Reads a fixed list of tensors into one flat tensor and writes a flat tensor back into them.

    Reduced precisions (float16, bfloat16) are widened to float32 in the flat copy, so that averages do not lose
    precision; float64 models keep float64.

    With ``bind=True`` and tensors of one device and of the flat dtype, the tensors become views of one
    persistent flat buffer (their ``.data`` is rebound, as torch's ``average_parameters`` does): :attr:`live`
    then *is* the model, and merges update it in place without copying it out and back.

    Flat copies live on :attr:`device`, an empty view's too: a merge puts every flat into one bucket, where an
    empty flat on another device than the model's fails as surely as a full one.

    Args:
        tensors: the tensors to view, e.g. a module's trainable parameters; their order is the flat layout.
        bind: make the tensors views of one flat buffer where possible.
        device: where the flats of a view without tensors live: give the model's device wherever a view may be
            empty (a model without buffers); the CPU by default. A view of tensors uses its first tensor's device.
    """

    def __init__(self, tensors: Iterable[Tensor], bind: bool = False, device: torch.device | str | None = None) -> None:
        self.tensors = list(tensors)
        self.device = self.tensors[0].device if self.tensors else torch.device(device or "cpu")
        self.dtype = torch.float64 if any(t.dtype == torch.float64 for t in self.tensors) else torch.float32
        self.numel = sum(t.numel() for t in self.tensors)
        self.live: Tensor | None = self._bind() if bind and self._bindable() else None

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def _bindable(self) -> bool:
        devices = {t.device for t in self.tensors}
        return bool(self.tensors) and len(devices) == 1 and all(t.dtype == self.dtype for t in self.tensors)

    @torch.no_grad()
    def _bind(self) -> Tensor:
        flat = torch.cat([t.detach().reshape(-1) for t in self.tensors])
        for tensor, chunk in zip(self.tensors, torch.split(flat, [t.numel() for t in self.tensors]), strict=True):
            tensor.data = chunk.view_as(tensor)
        return flat

    def current(self) -> Tensor:
        """The current values: the live buffer itself when bound (do not keep it), otherwise a new copy."""
        return self.live if self.live is not None else self.read()

    def read(self) -> Tensor:
        """A new flat tensor holding the current values."""
        if self.live is not None:
            return self.live.clone()
        if not self.tensors:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return torch.cat([t.detach().reshape(-1).to(self.device, self.dtype) for t in self.tensors])

    @torch.no_grad()
    def read_into(self, out: Tensor) -> Tensor:
        """Copy the current values into ``out`` (a flat tensor of :attr:`numel` elements) and return it."""
        if self.live is not None:
            return out.copy_(self.live)
        offset = 0
        for tensor in self.tensors:
            out[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
            offset += tensor.numel()
        return out

    @torch.no_grad()
    def write_(self, flat: Tensor) -> None:
        """Copy ``flat`` back into the viewed tensors (casting to each tensor's dtype)."""
        if flat.numel() != self.numel:
            raise ValueError(f"A flat tensor of {flat.numel()} elements cannot fill {self.numel} elements.")
        if self.live is not None:
            if flat.data_ptr() != self.live.data_ptr():
                self.live.copy_(flat)
            return
        for tensor, chunk in zip(self.tensors, torch.split(flat, [t.numel() for t in self.tensors]), strict=True):
            tensor.copy_(chunk.view_as(tensor))


def module_device(module: nn.Module) -> torch.device:
    """Where a module's tensors live: its first parameter's or buffer's device (the CPU for a module of neither)."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    return torch.device("cpu")


def to_host(tensor: Tensor) -> list[float]:
    """The elements of a small tensor, flattened, as Python numbers: where the engine waits for its device.

    The merge path reads device numbers through here only, so that its host synchronisations are few and
    visible, and tests on the ``meta`` device (which holds no numbers) can stand in for it.
    """
    return tensor.reshape(-1).tolist()


def trainable_parameters(module: nn.Module) -> list[Tensor]:
    """Parameters that training changes; frozen ones are identical on every replica and need no merge."""
    return [p for p in module.parameters() if p.requires_grad]


def floating_buffers(module: nn.Module) -> list[Tensor]:
    """Floating-point buffers (BatchNorm statistics); integer counters stay local, they advance in lockstep."""
    return [b for b in module.buffers() if b.is_floating_point()]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Floating-point state tensors of an optimizer (momentum buffers, Adam moments) in a stable order."""
    tensors: list[Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            tensors.extend(value for _, value in sorted(state.items()) if _is_mergeable_state(value, param))
    return tensors


def _is_mergeable_state(value: object, param: Tensor) -> bool:
    # Per-parameter moments have the parameter's shape; scalars such as Adam's step count are left alone.
    return isinstance(value, Tensor) and value.is_floating_point() and value.shape == param.shape
