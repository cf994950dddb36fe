"""The placement benchmark's cases: where every replica runs, which ranks are slowed, and what cannot run here.

Three placements, all through the ``gpu_cpu`` devices profile (spawned replicas, each rank on its own device), so
that only where the replicas run differs:

* ``gpu``: one replica on ``cuda:0`` (``launch.replica_devices=[cuda:0]``);
* ``gpu_cpu``: ``devices=gpu_cpu`` as it is (``replica_devices: auto``: every GPU, then CPU replicas on the
  cores the GPUs leave spare);
* ``cpu``: the CPU replicas that ``gpu_cpu`` adds, alone, with the threads they get there (and Lightning's own
  accelerator on the CPU: nothing of this run needs CUDA).

A weak GPU is emulated by the ``step`` slowdown mode with ``base`` 1 and factor ``F`` on GPU ranks only (1 on CPU
ranks): the GPU's forward, backward and update take ``F`` times their measured time, and the CPU replicas run at
their real speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_fabric.accelerators.cuda import num_cuda_devices

from lightning_aesgd.placement import (
    GPU_FEEDER_CORES,
    MIN_CPU_REPLICA_CORES,
    auto_replica_devices,
    available_cores,
    replica_threads,
)

PLACEMENTS = ("gpu", "gpu_cpu", "cpu")
"""Every placement, in table order; ``gpu`` is the baseline of every ratio."""
BASELINE = "gpu"
DESCRIPTIONS = {"gpu": "GPU alone", "gpu_cpu": "GPU + CPU replicas", "cpu": "CPU replicas alone"}
DEVICES_PROFILE = "devices=gpu_cpu"
NO_GPU = "no CUDA GPU on this machine (torch counts 0): a GPU placement cannot run, and GPU numbers are never faked"


@dataclass(frozen=True)
class Machine:
    """What placement ``auto`` reads: the CUDA GPUs and the cores this process may use."""

    cuda_count: int
    cores: int

    @classmethod
    def detect(cls) -> Machine:
        """This machine, counted as the strategy counts it (NVML's GPU count: CUDA stays uninitialised here)."""
        return cls(num_cuda_devices(), available_cores())

    def auto_devices(self) -> list[str]:
        """Every replica's device under ``replica_devices: auto``, in rank order."""
        return [str(device) for device in auto_replica_devices(self.cuda_count, self.cores)]


@dataclass(frozen=True)
class Case:
    """One placement under one GPU emulation.

    Attributes:
        placement: ``gpu``, ``gpu_cpu`` or ``cpu``.
        weak_gpu: the slowdown asked of GPU ranks (1: none); the comparison group the case belongs to.
        devices: every rank's device, in rank order (empty where a skipped case's devices are unknown).
        overrides: the Hydra overrides that place the replicas and set the slowdown.
        threads: torch threads per replica set after Lightning's set-up, or ``None`` for the placement's own.
        skip: why the case cannot run here, or ``None``.
    """

    placement: str
    weak_gpu: float
    devices: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    threads: int | None = None
    skip: str | None = None

    @property
    def factors(self) -> tuple[float, ...] | None:
        """Each rank's slowdown factor, or ``None`` where nothing is slowed."""
        return gpu_factors(self.devices, self.weak_gpu)

    @property
    def emulated(self) -> bool:
        """Whether this case's GPU ranks are slowed (tables say "emulated" on these rows, skipped ones too)."""
        return self.weak_gpu > 1 and self.placement != "cpu"

    @property
    def name(self) -> str:
        """The case's name in files: the placement, with the weak GPU's factor where one is asked."""
        return self.placement if self.weak_gpu <= 1 else f"{self.placement}+weak{self.weak_gpu:g}"

    @property
    def run_key(self) -> tuple[tuple[str, ...], int | None]:
        """Cases with equal keys are one run (CPU replicas alone are the same with or without a weak GPU)."""
        return self.overrides, self.threads


def gpu_factors(devices: Sequence[str], weak_gpu: float) -> tuple[float, ...] | None:
    """Slowdown factors: ``weak_gpu`` on GPU ranks, 1 on CPU ranks; ``None`` without a weak GPU or a GPU rank.

    Example:
        >>> gpu_factors(["cuda:0", "cpu"], 20)
        (20.0, 1.0)
        >>> gpu_factors(["cpu", "cpu"], 20) is None
        True
    """
    if weak_gpu <= 1 or not any(device.startswith("cuda") for device in devices):
        return None
    return tuple(float(weak_gpu) if device.startswith("cuda") else 1.0 for device in devices)


def slowdown_override(factors: Sequence[float] | None) -> str:
    """The ``devices.slowdown`` override of ``factors``: the ``step`` mode at base 1, or ``null``.

    Base 1 leaves every CPU rank at its real speed; the ``step`` mode stretches the GPU's compute, never its waits.

    Example:
        >>> slowdown_override([20.0, 1.0])
        'devices.slowdown={mode:step,base:1,factors:[20,1]}'
    """
    if factors is None:
        return "devices.slowdown=null"
    return "devices.slowdown={mode:step,base:1,factors:[" + ",".join(f"{f:g}" for f in factors) + "]}"


def emulations(weak_gpu: float) -> tuple[float, ...]:
    """The comparison groups: real devices, then the weak GPU unless ``weak_gpu`` is 0 or 1.

    Example:
        >>> emulations(20), emulations(1), emulations(0)
        ((1.0, 20.0), (1.0,), (1.0,))
    """
    return (1.0,) if weak_gpu <= 1 else (1.0, float(weak_gpu))


def build_cases(machine: Machine, weak_gpu: float, placements: Sequence[str] = PLACEMENTS) -> list[Case]:
    """Every placement under every emulation, real devices first; cases that cannot run here say why."""
    return [_case(placement, weak, machine) for weak in emulations(weak_gpu) for placement in placements]


def baseline_of(case: Case, cases: Sequence[Case]) -> Case | None:
    """The GPU alone under ``case``'s emulation among ``cases``, ``None`` where it is not one of them."""
    return next((c for c in cases if c.placement == BASELINE and c.weak_gpu == case.weak_gpu), None)


def _case(placement: str, weak_gpu: float, machine: Machine) -> Case:
    if placement not in PLACEMENTS:
        raise ValueError(f"Unknown placement {placement!r}; choose from {', '.join(PLACEMENTS)}.")
    devices = _devices(placement, machine)
    skip = _skip_reason(placement, devices, machine)
    if skip is not None:
        return Case(placement, weak_gpu, devices, skip=skip)
    overrides = (*_placement_overrides(placement, devices), slowdown_override(gpu_factors(devices, weak_gpu)))
    return Case(placement, weak_gpu, devices, overrides, _cpu_alone_threads(placement, machine))


def _devices(placement: str, machine: Machine) -> tuple[str, ...]:
    auto = machine.auto_devices()
    if placement == "gpu":
        return ("cuda:0",)
    if placement == "gpu_cpu":
        return tuple(auto) if machine.cuda_count else ()  # without a GPU, "auto" would be CPU replicas alone
    return tuple(device for device in auto if device == "cpu")


def _skip_reason(placement: str, devices: tuple[str, ...], machine: Machine) -> str | None:
    if placement != "cpu":
        return None if machine.cuda_count else NO_GPU
    if devices:
        return None
    spare = machine.cores - GPU_FEEDER_CORES * machine.cuda_count
    return (
        f"devices=gpu_cpu adds no CPU replica here: {machine.cores} cores leave {spare} beside "
        f"{machine.cuda_count} GPU(s), fewer than {MIN_CPU_REPLICA_CORES}"
    )


def _placement_overrides(placement: str, devices: tuple[str, ...]) -> list[str]:
    if placement == "gpu_cpu":
        return [DEVICES_PROFILE]  # the profile as users run it: `replica_devices: auto`
    placed = [DEVICES_PROFILE, f"launch.replica_devices=[{','.join(devices)}]"]
    # CPU replicas alone never need CUDA: Lightning's own accelerator is then the CPU, as each replica's is.
    return placed if placement == "gpu" else [*placed, "trainer.accelerator=cpu"]


def _cpu_alone_threads(placement: str, machine: Machine) -> int | None:
    """The threads a CPU replica gets beside the GPUs, so that CPU replicas alone are the replicas gpu_cpu adds.

    Alone they would take the GPU feeders' cores too; ``None`` elsewhere (each placement sets its own).
    """
    if placement != "cpu" or not machine.cuda_count:
        return None
    auto = auto_replica_devices(machine.cuda_count, machine.cores)
    first_cpu = next(rank for rank, device in enumerate(auto) if device.type == "cpu")
    return replica_threads(auto, first_cpu, machine.cores)
