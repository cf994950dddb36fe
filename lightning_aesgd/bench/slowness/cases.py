"""The slowness benchmark's cases: where the slowness lands, how much per step, on which devices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_aesgd.emulation.profiles import SlowdownMode, SlowdownProfile

BATCH = 64  # per replica and step; the step batch is 256
SMALL_BATCH = 16  # the solo runs' second batch size: tells a fixed cost per step from a per-sample cost
HETEROGENEOUS = (1.0, 1.0, 2.0, 4.0)
HOMOGENEOUS = (1.0, 1.0, 1.0, 1.0)
STRAGGLER = (1.0, 1.0, 50.0)


@dataclass(frozen=True)
class Case:
    """One kind of slowness: where it lands, how much per step, on which devices.

    Attributes:
        name: the case's name in tables.
        mode: the slowdown mode (see :mod:`lightning_aesgd.emulation.profiles`), or ``"none"`` for no slowdown.
        factors: each replica's cost factor.
        step_ms: milliseconds of a cost-1 replica's step that the emulation adds (64-sample batches).
        workers: DataLoader worker processes per replica.
        network: ``"mlp"`` (little compute: the emulation is the device), ``"cnn"`` (a small convolutional
            network: real compute per step, few parameters, for the modes that slow real work down) or
            ``"tiny"`` (almost no work per step).
        base: the ``step`` mode's common factor.
    """

    name: str
    mode: SlowdownMode | Literal["none"]
    factors: tuple[float, ...]
    step_ms: float = 64.0
    workers: int = 0
    network: str = "mlp"
    base: float = 1.0

    def profile(self, factors: tuple[float, ...] | None = None) -> SlowdownProfile | None:
        """The slowdown profile of this case (for other ``factors`` when given, e.g. one solo replica).

        ``None`` for the ``"none"`` mode.
        """
        if self.mode == "none":
            return None
        per_sample = self.step_ms / 1000 / BATCH if self.mode in ("user", "data", "hook") else None
        return SlowdownProfile(factors or self.factors, base=self.base, mode=self.mode, seconds_per_sample=per_sample)


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("user", "user", HETEROGENEOUS),
        Case("user+workers", "user", HETEROGENEOUS, workers=1),
        Case("data", "data", HETEROGENEOUS, workers=1),
        Case("data-inline", "data", HETEROGENEOUS),  # no loader workers: fetched in the training process
        Case("hook", "hook", HETEROGENEOUS),
        Case("quota", "quota", HETEROGENEOUS, step_ms=0.0, network="cnn"),
        # CPU quotas on the small MLP: real work of a few milliseconds a step, where fixed costs weigh most.
        Case("quota-short", "quota", HETEROGENEOUS, step_ms=0.0),
        Case("step", "step", HETEROGENEOUS, step_ms=0.0, network="cnn", base=2.0),
        # Launch-bound steps on slower devices (replicas sharing one GPU): a near-empty model's step, almost all fixed
        # cost, stretched to base × fᵢ its compute, so that no batch split can balance the slowest replicas.
        Case("step-fixed", "step", HETEROGENEOUS, step_ms=0.0, network="tiny", base=6.0),
        # Replicas sharing the compute they run on, as several processes share one GPU: four CNN replicas on the
        # machine's 2 cores, at base 1, so that they compete for the cores; the slower ones sleep their extra time
        # (the cores are free meanwhile). With equal costs no emulation at all (not even its clock): the contention
        # alone.
        Case("shared-cores", "step", HETEROGENEOUS, step_ms=0.0, network="cnn", base=1.0),
        Case("shared-cores-equal", "none", HOMOGENEOUS, step_ms=0.0, network="cnn"),
        Case("short", "user", HETEROGENEOUS, step_ms=5.0),
        Case("equal-60ms", "user", HOMOGENEOUS, step_ms=60.0),
        Case("equal-5ms", "user", HOMOGENEOUS, step_ms=5.0),
        # A replica 50x slower than two others (it cannot help: left out), and the two others alone, for the ratio.
        Case("straggler", "user", STRAGGLER, step_ms=8.0),
        Case("straggler-pair", "user", STRAGGLER[:2], step_ms=8.0),
    )
}
"""The cases by ``--cases`` name; :data:`MACHINERY` is measured separately."""

MACHINERY = Case("machinery", "none", HOMOGENEOUS, step_ms=0.0, network="tiny")
"""A near-empty model without slowdown: what remains per step is each strategy's own cost."""
