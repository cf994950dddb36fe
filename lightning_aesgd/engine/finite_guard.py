"""Non-finite gradients left out of a step's sum: the rest of the step's samples decide the update.

A replica whose loss or gradients are not finite (a NaN from a bad batch, an overflow) would make every replica's
summed gradient non-finite, and every replica's model with it. Under gradient synchronisation each bucket's
contribution travels with two more numbers in the same all-reduce: ``fᵢ·sᵢ`` and ``1 − fᵢ``, where ``fᵢ`` is 1 if
replica ``i``'s bucket is finite and ``sᵢ = bᵢ/M`` its share of the step. A non-finite contribution is sent as
zeros, and where any replica was left out the sum is renormalised over the finite shares::

    g = Σᵢ fᵢ·sᵢ·gᵢ / Σᵢ fᵢ·sᵢ

the mean gradient of the step's finite samples. Where every replica is finite the sum is left exactly as it is
(DDP's update); where none is, the update is zero. Every replica receives the same numbers, so all apply the same
update and stay identical: no replica needs restoring.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_aesgd.engine.flat import to_host

FLAG_SLOTS = 2
"""Numbers appended to a guarded contribution: the finite share ``fᵢ·sᵢ`` and the non-finite count ``1 − fᵢ``."""


def guarded(buffer: Tensor, share: float, rider: Tensor | None = None) -> Tensor:
    """A copy of the flat dense ``buffer``, zeros if any element is not finite, with the two flags appended.

    The finiteness test reads the buffer's sum (one pass): a NaN or an infinity makes it non-finite, and so,
    harmlessly, does a sum that overflows. On a device it is decided there, without waiting for the device; on
    the host it is read at once, which saves the small tensor operations that dominate short steps.

    A ``rider`` (of the buffer's dtype) travels after the flags, whatever the buffer holds: numbers that share the
    bucket's all-reduce (the replicas' reports). The guarded part is the first ``buffer.numel() + FLAG_SLOTS``.
    """
    extra = 0 if rider is None else rider.numel()
    contribution = torch.empty(buffer.numel() + FLAG_SLOTS + extra, dtype=buffer.dtype, device=buffer.device)
    if rider is not None:
        contribution[buffer.numel() + FLAG_SLOTS :].copy_(rider)
    head = contribution[: buffer.numel() + FLAG_SLOTS]
    if _on_host(buffer):
        if math.isfinite(finite_probe(buffer).item()):
            head[:-2].copy_(buffer)
            head[-2:] = torch.tensor([share, 0.0], dtype=buffer.dtype)
        else:
            head.zero_()
            head[-1] = 1.0
        return contribution
    finite = torch.isfinite(finite_probe(buffer))
    zero = torch.zeros((), dtype=buffer.dtype, device=buffer.device)
    torch.where(finite, buffer, zero, out=head[:-2])
    head[-2:] = torch.stack([finite * share, ~finite]).to(buffer.dtype)
    return contribution


def finite_probe(tensor: Tensor) -> Tensor:
    """The sum of ``tensor``, finite when every element is (one pass), accumulated in at least float32.

    Finite half-precision values whose sum passes 65504 (float16) are then not taken for a NaN.
    """
    return tensor.sum(dtype=torch.promote_types(tensor.dtype, torch.float32))


def guarded_in_place(buffer: Tensor, share: float) -> Tensor:
    """Guard a flat dense host ``buffer`` in place: zeros if any element is not finite; returns its two flags.

    The in-place form of :func:`guarded`, for a bucket large enough that its copy costs more than a second, small
    all-reduce of the flags (:data:`~lightning_aesgd.engine.gradients.IN_PLACE_MIN_ELEMENTS`). A non-finite
    replica's own gradients are lost with it, as they are useless.
    """
    if math.isfinite(finite_probe(buffer).item()):
        return torch.tensor([share, 0.0], dtype=buffer.dtype)
    buffer.zero_()
    return torch.tensor([0.0, 1.0], dtype=buffer.dtype)


def renormalised(summed: Tensor, flags: Tensor | None = None) -> Tensor:
    """The sum of guarded contributions (:func:`guarded`), renormalised over the finite shares where needed.

    Returns a view of ``summed`` without its flags (scaled in place); the flags stay readable as
    ``summed[-2:]`` (:func:`flags_of`). With ``flags`` (summed apart, :func:`guarded_in_place`), all of ``summed``
    is the sum.
    """
    total, flags = (summed[:-2], summed[-2:]) if flags is None else (summed, flags)
    if _on_host(flags):  # the flags are readable at once: scale only where a replica was left out
        finite_share, left_out = flags.tolist()
        if left_out > 0:
            total.mul_(1.0 / finite_share if finite_share > 0 else 0.0)
        return total
    total.mul_(renormalisation(flags[0], flags[1]))
    return total


def _on_host(tensor: Tensor) -> bool:
    return tensor.device.type == "cpu"


def renormalisation(finite_share: Tensor, left_out: Tensor) -> Tensor:
    """``1`` where no replica was left out, ``1 / Σ fᵢ·sᵢ`` where some were, ``0`` where all were."""
    one, zero = torch.ones_like(finite_share), torch.zeros_like(finite_share)
    safe = torch.where(finite_share > 0, finite_share, one)
    return torch.where(left_out > 0, torch.where(finite_share > 0, one / safe, zero), one)


def flags_of(summed: Tensor) -> Tensor:
    """The summed flags ``[Σ fᵢ·sᵢ, Σ (1 − fᵢ)]`` of a sum of guarded contributions."""
    return summed[-2:]


class Exclusions:
    """Replicas left out of gradient sums, counted on the device and read on the host (at the reports).

    Every replica counts the same summed flags, so every replica holds the same counts.
    """

    def __init__(self) -> None:
        # [replica exclusions since the last read, current run of steps without a finite replica, longest run
        # since the last read]: a run is counted on the device, so that no step waits for the host.
        self._counts: Tensor | None = None
        self._host_counts = (0.0, 0.0, 0.0)  # the same, where the flags live on the host

    def add_step(self, flags: list[Tensor], world_size: int) -> None:
        """Count one step's sums from their summed flags (one ``[Σ fᵢ·sᵢ, Σ (1 − fᵢ)]`` per bucket)."""
        if not flags:
            return
        if _on_host(flags[0]):  # readable at once: a few float operations instead of a dozen tensor ones
            self._host_counts = _counted(self._host_counts, max(float(flag[1]) for flag in flags), world_size)
            return
        left_out = torch.stack([flag[1].to(torch.float64) for flag in flags]).max()
        none_finite = (left_out >= world_size).to(torch.float64)
        counts = self._counts
        if counts is None:
            counts = torch.zeros(3, dtype=torch.float64, device=left_out.device)
        run = (counts[1] + 1) * none_finite  # back to 0 at a step with any finite replica
        self._counts = torch.stack([counts[0] + left_out, run, torch.maximum(counts[2], run)])

    def state_dict(self) -> dict[str, Any]:
        """The counts, on the host (for a replica that missed some sums: all then count alike again)."""
        counts = None if self._counts is None else self._counts.cpu()
        return {"counts": counts, "host_counts": self._host_counts}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Take what :meth:`state_dict` returned; device counts go to ``device``."""
        counts = state["counts"]
        self._counts = None if counts is None else counts.to(device)
        self._host_counts = tuple(state["host_counts"])

    def read(self) -> tuple[int, int]:
        """Replica exclusions since the last read, and the longest run of steps without a finite replica in them.

        One host read; the run in progress carries over to the next read.
        """
        counts = self.take()
        return self.counted(None if counts is None else to_host(counts))

    def take(self) -> Tensor | None:
        """The counts to read where they live on the device (else ``None``), restarted there from them.

        For a caller that reads them with other device numbers in one wait, then hands them to :meth:`counted`.
        """
        counts = self._counts
        if counts is not None:
            # The next counts from these on the device: a tensor built from the host numbers would wait again.
            self._counts = torch.stack([torch.zeros_like(counts[1]), counts[1], counts[1]])
        return counts

    def counted(self, numbers: list[float] | None) -> tuple[int, int]:
        """What :meth:`read` returns, from the numbers of the counts :meth:`take` gave (``None`` where it gave none)."""
        if numbers is not None:
            excluded, _, longest = numbers
        else:
            excluded, run, longest = self._host_counts
            self._host_counts = (0.0, run, run)
        return round(excluded), round(longest)


def _counted(counts: tuple[float, float, float], left_out: float, world_size: int) -> tuple[float, float, float]:
    """``counts`` (exclusions, current run, longest run) after a step with ``left_out`` replicas left out."""
    excluded, run, longest = counts
    run = run + 1 if left_out >= world_size else 0.0
    return excluded + left_out, run, max(longest, run)
