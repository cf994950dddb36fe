"""Heterogeneity emulation: make replica i's device take fᵢ times as long as its real computation.

Machines without mixed GPUs can still show what the strategy does for mixed hardware. After each step's real
computation a replica sleeps ``(fᵢ − 1) × c``, where ``c`` is the compute time of that step. On CPU, ``c`` is the
CPU time the process consumed, which excludes time spent blocked in collectives: waiting for a slower peer must
not make a replica emulate a slower device. It includes the work a strategy does on the replica's data in
other threads (DDP gathers and sums every replica's sparse gradients in gloo's threads): on a real, slower GPU
that work runs on the slower device too. On CUDA ``c`` is the synchronised wall time of the step.

The same profile applies to this project's strategy (its ``slowdown`` argument) and to Lightning's own
``DDPStrategy`` (:class:`~lightning_aesgd.callbacks.SlowdownCallback`), so comparisons are fair.
Results on emulated devices are ratios measured in one run, never absolute times.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class SlowdownChange:
    """From ``step`` on (0-based global step), replica ``replica`` runs ``factor`` times slower than real."""

    step: int
    replica: int
    factor: float


@dataclass(frozen=True)
class SlowdownProfile:
    """Slowdown factors per replica, optionally changing at given steps.

    Args:
        factors: fᵢ ≥ 1 for every replica, in rank order: the devices' relative slowness.
        changes: later changes of single replicas' factors, e.g. one replica becoming 4× slower halfway.
        base: a common factor b ≥ 1 applied to every replica, so that replica i runs b·fᵢ times slower than
            real. With more replicas than cores (4 replicas on 2 cores), b = 4 keeps real computation a small
            part of every emulated step, so that replicas do not slow each other down by competing for cores
            and the devices' speeds keep the ratios fᵢ.

    Example:
        >>> profile = SlowdownProfile((1, 1, 2, 4), (SlowdownChange(step=100, replica=0, factor=4),))
        >>> profile.factor(replica=0, step=99), profile.factor(replica=0, step=100), profile.factor(3, 0)
        (1.0, 4.0, 4.0)
        >>> SlowdownProfile((1, 2), base=3).factor(1, 0)
        6.0
    """

    factors: tuple[float, ...]
    changes: tuple[SlowdownChange, ...] = field(default_factory=tuple)
    base: float = 1.0

    def __post_init__(self) -> None:
        factors = tuple(self.factors)
        changes = tuple(c if isinstance(c, SlowdownChange) else SlowdownChange(**c) for c in self.changes)
        object.__setattr__(self, "factors", factors)
        object.__setattr__(self, "base", float(self.base))
        object.__setattr__(self, "changes", tuple(sorted(changes, key=lambda c: c.step)))
        if not factors:
            raise ValueError("A slowdown profile needs one factor per replica.")
        for value in (*factors, *(c.factor for c in changes), self.base):
            if not value >= 1:
                raise ValueError(f"Slowdown factors must be >= 1 (1 = real speed), got {value}.")
        for change in changes:
            if not 0 <= change.replica < len(factors):
                raise ValueError(f"A change names replica {change.replica}, but there are {len(factors)}.")

    @property
    def num_replicas(self) -> int:
        """Number of replicas the profile describes."""
        return len(self.factors)

    def factor(self, replica: int, step: int) -> float:
        """The total factor (base × fᵢ) of ``replica`` at ``step``."""
        value = self.factors[replica]
        for change in self.changes:
            if change.step <= step and change.replica == replica:
                value = change.factor
        return self.base * value

    def check_replicas(self, world_size: int) -> None:
        """Raise if the profile does not describe exactly ``world_size`` replicas."""
        if world_size != self.num_replicas:
            raise ValueError(
                f"The slowdown profile has {self.num_replicas} factors but {world_size} replicas train. "
                "HINT: give one factor per device (Trainer devices × num_nodes)."
            )


def as_profile(spec: SlowdownProfile | Sequence[float] | Mapping[str, Any] | None) -> SlowdownProfile | None:
    """Accept a profile, a list of factors, or a mapping with ``factors`` and ``changes`` (Hydra configs)."""
    if spec is None or isinstance(spec, SlowdownProfile):
        return spec
    if isinstance(spec, Mapping):
        return SlowdownProfile(tuple(spec["factors"]), tuple(spec.get("changes") or ()), float(spec.get("base", 1)))
    return SlowdownProfile(tuple(spec))


class ComputeClock:
    """Measures a step's compute time as the slowdown emulation defines it (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        """A reading; differences of two readings are compute seconds."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.process_time()


@contextmanager
def emulated_slowdown(clock: ComputeClock, factor: float) -> Iterator[None]:
    """Run the body, then sleep ``(factor − 1) ×`` its compute time."""
    if factor <= 1:
        yield
        return
    start = clock.now()
    yield
    time.sleep((factor - 1) * (clock.now() - start))
