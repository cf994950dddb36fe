"""Several replica processes on one device: the placement that lets one GPU run the multi-replica paths.

Lightning starts one process per entry of a strategy's ``parallel_devices``, and process ``r`` works on entry
``r`` (``root_device``). Repeating every device ``k`` times therefore starts ``k`` replicas per device, each with
its own model, optimizer and batches: on a single-GPU machine the plans, merges, sampler, telemetry and slowdown
profiles of several replicas run on CUDA. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so such
a group uses gloo, which reduces CUDA tensors too (through host memory).

:class:`SharedDevices` adds this to any ``DDPStrategy`` (this project's strategy and the DDP baseline alike, so
that comparisons share the device the same way).

``replica_devices`` places every rank explicitly instead, e.g. ``["cuda:0", "cpu", "cpu"]`` or ``"auto"`` (every
GPU, plus CPU replicas on the cores the GPUs leave spare): Adaptive Hogbatch's CPU replicas beside GPU replicas
(Ma, Rusu, Wu, Sim 2021). Each rank then takes its own accelerator, precision (32-bit on CPU) and thread count, and
ranks on different device types connect over gloo. Gloo runs collectives on CUDA tensors by staging them through
pinned host memory itself (its CUDA work waits on the tensors' stream, so the staging copy is also where the GPU
replica's step has arrived); the engine's buckets need no copy of their own.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning_fabric.accelerators.cuda import num_cuda_devices
from lightning_fabric.utilities.distributed import _init_dist_connection

from lightning_aesgd.core.values import is_whole
from lightning_aesgd.forked_threads import threads_that_run_after_fork

if TYPE_CHECKING:
    from pytorch_lightning.strategies import DDPStrategy

    _Base = DDPStrategy
else:
    _Base = object


def check_replicas_per_device(value: Any) -> int:
    """Return ``value`` if it is a whole number of at least 1; raise with the fix otherwise.

    >>> check_replicas_per_device(2)
    2
    """
    if not is_whole(value) or value < 1:
        raise ValueError(
            f"replicas_per_device must be a whole number >= 1, got {value!r}. HINT: 1 (one replica per device, as "
            "DDP) or e.g. 4 to run 4 replicas on every device."
        )
    return int(value)


def repeat_devices(devices: Sequence[torch.device], replicas_per_device: int) -> list[torch.device]:
    """Every device ``replicas_per_device`` times, each device's replicas next to each other.

    >>> [str(d) for d in repeat_devices([torch.device("cuda", 0), torch.device("cuda", 1)], 2)]
    ['cuda:0', 'cuda:0', 'cuda:1', 'cuda:1']
    """
    return [device for device in devices for _ in range(replicas_per_device)]


def shares_a_device(devices: Sequence[torch.device]) -> bool:
    """Whether two replicas of ``devices`` work on the same accelerator (CPU cores are not counted as shared).

    >>> shares_a_device([torch.device("cuda", 0), torch.device("cuda", 0)])
    True
    >>> shares_a_device([torch.device("cpu"), torch.device("cpu")])
    False
    """
    accelerators = [device for device in devices if device.type != "cpu"]
    return len(set(accelerators)) < len(accelerators)


def mixes_device_types(devices: Sequence[torch.device]) -> bool:
    """Whether ``devices`` hold replicas of more than one device type (GPU replicas beside CPU replicas).

    >>> mixes_device_types([torch.device("cuda", 0), torch.device("cpu")])
    True
    """
    return len({device.type for device in devices}) > 1


def process_group_backend(devices: Sequence[torch.device], chosen: str | None) -> str | None:
    """The backend for replicas on ``devices``: gloo where replicas share a GPU or mix device types, else ``chosen``.

    Raises:
        ValueError: if ``chosen`` is not gloo while replicas share a GPU or mix device types.
    """
    shared, mixed = shares_a_device(devices), mixes_device_types(devices)
    if not (shared or mixed):
        return chosen
    if chosen is not None and chosen != "gloo":
        reason = "replicas that share a GPU (NCCL needs one GPU per rank)" if shared else "CPU and GPU replicas"
        raise ValueError(
            f"process_group_backend={chosen!r} cannot connect {reason}. HINT: leave process_group_backend unset "
            "(gloo is chosen), or place one replica per GPU and no CPU replicas."
        )
    return "gloo"


def bound_device(backend: str, device: torch.device) -> torch.device | None:
    """The device to bind a new default process group to (``init_process_group``'s ``device_id``), if any.

    Only NCCL uses the binding (an eagerly formed communicator, subgroups split from it). Lightning binds every
    group whose root device is a GPU; a bound gloo group makes ``new_group`` call ``perform_nocolor_split`` on each
    rank a subgroup leaves out, which gloo lacks (torch 2.11 and 2.13): replicas sharing a GPU then fail as soon as
    one of them sits out a step.

    >>> bound_device("nccl", torch.device("cuda", 1)), bound_device("gloo", torch.device("cuda", 0))
    (device(type='cuda', index=1), None)
    """
    return device if backend == "nccl" and device.type != "cpu" else None


GPU_FEEDER_CORES = 2
"""Cores kept for each GPU replica's process: its training loop and the data loading that feeds the GPU."""

CORES_PER_CPU_REPLICA = 8
"""Cores of one CPU replica under ``replica_devices="auto"``. Small batches gain little from more threads (the XMC
network on EURLex's shape: 7,664 samples/s on 4 threads, 10,278 on 16), so more spare cores make more replicas."""

MIN_CPU_REPLICA_CORES = 4
"""Fewest spare cores worth a CPU replica beside GPUs under ``"auto"``."""


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, which container CPU sets narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_replica_devices(cuda_count: int, cores: int) -> list[torch.device]:
    """Every GPU, then CPU replicas on the cores the GPUs leave spare (``"auto"``).

    With ``g`` GPUs the spare cores are ``s = cores − 2g``; they make ``max(1, s // 8)`` CPU replicas when
    ``s ≥ 4`` and none otherwise. Without a GPU, every core goes to ``max(1, cores // 8)`` CPU replicas.

    >>> [str(d) for d in auto_replica_devices(1, 16)]
    ['cuda:0', 'cpu']
    >>> [str(d) for d in auto_replica_devices(2, 6)]
    ['cuda:0', 'cuda:1']
    """
    gpus = [torch.device("cuda", index) for index in range(cuda_count)]
    spare = cores - GPU_FEEDER_CORES * cuda_count if gpus else cores
    if gpus and spare < MIN_CPU_REPLICA_CORES:
        return gpus
    return gpus + [torch.device("cpu")] * max(1, spare // CORES_PER_CPU_REPLICA)


def parse_replica_devices(spec: Any, cuda_count: int, cores: int) -> list[torch.device]:
    """The device of every replica on a node, from ``replica_devices``.

    ``"auto"`` (:func:`auto_replica_devices`), or a list such as ``["cuda:0", "cpu", "cpu"]``, where a device may
    repeat: two entries ``"cuda:0"`` are two replicas on one GPU.

    Raises:
        ValueError: for anything but ``"auto"`` or a non-empty list of ``"cpu"`` and ``"cuda:<index>"``, and for
            a GPU this machine does not have.
    """
    if spec == "auto":
        return auto_replica_devices(cuda_count, cores)
    if isinstance(spec, (str, torch.device)) or not isinstance(spec, Sequence) or not spec:
        raise ValueError(
            f"replica_devices must be 'auto' or a non-empty list of devices, got {spec!r}. HINT: e.g. "
            "replica_devices=['cuda:0', 'cpu'] (one GPU replica and one CPU replica), or 'auto'."
        )
    return [_replica_device(entry, cuda_count) for entry in spec]


def _replica_device(entry: Any, cuda_count: int) -> torch.device:
    try:
        device = torch.device(entry)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cuda" and device.index is None):
        raise ValueError(
            f"replica_devices entry {entry!r} is not a replica's device. HINT: write 'cpu' or 'cuda:<index>' "
            "(the GPU's index, e.g. 'cuda:0')."
        )
    if device.type == "cuda" and device.index is not None and device.index >= cuda_count:
        found = f"has {cuda_count} CUDA GPU(s)" if cuda_count else "has no CUDA GPU (or torch is a CPU build)"
        raise ValueError(
            f"replica_devices names {device}, but this machine {found}. HINT: name only GPUs that "
            "torch.cuda.device_count() counts, use CPU replicas alone (e.g. ['cpu', 'cpu']), or 'auto'."
        )
    return torch.device("cpu") if device.type == "cpu" else device


def replica_threads(devices: Sequence[torch.device], local_rank: int, cores: int) -> int | None:
    """Intra-op threads of the replica on ``devices[local_rank]``; ``None`` leaves torch's choice.

    CPU replicas split the cores that GPU replicas leave (``cores − 2·GPU replicas``) evenly, at least one thread
    each, so that they never take the cores feeding a GPU; a GPU replica beside them keeps 2 threads.
    """
    cpu_replicas = sum(device.type == "cpu" for device in devices)
    gpu_replicas = len(devices) - cpu_replicas
    if devices[local_rank].type != "cpu":
        return GPU_FEEDER_CORES if cpu_replicas else None
    return max(1, (cores - GPU_FEEDER_CORES * gpu_replicas) // cpu_replicas)


class SharedDevices(_Base):
    """A ``DDPStrategy`` mixin: where each replica process runs.

    By default ``replicas_per_device`` processes on every device Lightning assigns. With ``replica_devices``, one
    process per entry, wherever Lightning's ``devices`` point; each then sets up its own device, precision and
    threads (:meth:`setup_environment`).

    Args:
        replicas_per_device: replica processes per device (1: one per device, as DDP).
        replica_devices: every replica's device on each node, e.g. ``["cuda:0", "cpu", "cpu"]``, or ``"auto"``
            (every GPU, then CPU replicas on the spare cores: :func:`auto_replica_devices`); ``None`` to take
            Lightning's devices.
        **kwargs: the strategy's own arguments.

    Raises:
        ValueError: for a bad ``replicas_per_device`` or ``replica_devices`` (a GPU this machine lacks among them),
            or both set.
    """

    def __init__(self, *args: Any, replicas_per_device: int = 1, replica_devices: Any = None, **kwargs: Any) -> None:
        # Set before the base class assigns parallel_devices through the property below.
        self.replicas_per_device = check_replicas_per_device(replicas_per_device)
        if replica_devices is not None and replicas_per_device != 1:
            raise ValueError(
                "replica_devices and replicas_per_device both place replicas; set one. HINT: repeat a device in "
                "replica_devices for several replicas on it, e.g. ['cuda:0', 'cuda:0', 'cpu']."
            )
        self.replica_devices = replica_devices
        self._placed = (
            None
            if replica_devices is None
            else parse_replica_devices(replica_devices, num_cuda_devices(), available_cores())
        )
        super().__init__(*args, **kwargs)

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """Every replica's device: ``replica_devices``, or Lightning's devices each ``replicas_per_device`` times."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if self._placed is not None:
            self._parallel_devices = list(self._placed)
            return
        self._parallel_devices = None if devices is None else repeat_devices(devices, self.replicas_per_device)

    @property
    def connects_over_gloo(self) -> bool:
        """Whether the replicas connect over gloo whatever the accelerator: they share a GPU or mix device types."""
        if self.replicas_per_device > 1:
            return True
        return self._placed is not None and process_group_backend(self._placed, None) == "gloo"

    def _get_process_group_backend(self) -> str:
        devices = self.parallel_devices or []
        chosen = process_group_backend(devices, self._process_group_backend)
        return chosen or super()._get_process_group_backend()

    def setup_distributed(self) -> None:
        """Lightning's set-up, but a gloo group is created bound to no device (:func:`bound_device`)."""
        backend = self._get_process_group_backend()
        if not dist.is_initialized() and bound_device(backend, self.root_device) is None:
            assert self.cluster_environment is not None  # as Lightning's own set-up asserts
            self.set_world_ranks()
            # Lightning's own connection (its environment variables and log lines), without ``device_id``; its
            # set-up below then finds the group initialised and keeps it.
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        super().setup_distributed()

    def _sums_gradients(self) -> bool:
        """Whether replicas sum gradients (DDP): then every replica's gradients must share one loss scale."""
        return True

    def setup_environment(self) -> None:
        """Under ``replica_devices``, this rank's accelerator, precision and threads, then Lightning's set-up.

        A forked replica keeps its intra-op threads only where they can run (:mod:`~lightning_aesgd.forked_threads`).
        """
        if self._placed is not None:
            self._take_own_device(self._placed)
        if getattr(self, "_start_method", None) == "fork" and multiprocessing.parent_process() is not None:
            threads_that_run_after_fork(warn=self._first_replica())
        super().setup_environment()

    def _first_replica(self) -> bool:
        """Whether this is the job's first replica, also before the world ranks are set.

        The global rank is still 0 in every process then; the launcher has already set each one's local rank.
        """
        return self.local_rank == 0 and self.node_rank == 0

    def _take_own_device(self, devices: list[torch.device]) -> None:
        device = self.root_device
        lightning = _lightning_namespace(type(self))
        plugin = self.precision_plugin
        if mixes_device_types(devices) and self._sums_gradients() and getattr(plugin, "scaler", None) is not None:
            raise ValueError(
                "precision='16-mixed' scales GPU replicas' losses by a GradScaler, while CPU replicas train in "
                "32-bit without one: their summed gradients would mix scales. HINT: precision='bf16-mixed' (no "
                "scaler) or '32-true', or sync='models' (each replica steps on its own gradients)."
            )
        if mixes_device_types(devices) and self._sums_gradients() and self._first_replica():
            warnings.warn(
                "CPU and GPU replicas sum their gradients every step over gloo, through host memory, even while a "
                "CPU replica is left out of the step. HINT: beside a fast GPU use sync='models' "
                "(algorithm=hogbatch): merges then wait while the GPU replica trains alone.",
                stacklevel=2,
            )
        accelerators = importlib.import_module(f"{lightning}.accelerators")
        self.accelerator = accelerators.CUDAAccelerator() if device.type == "cuda" else accelerators.CPUAccelerator()
        self.precision_plugin = precision_for(device, plugin, importlib.import_module(f"{lightning}.plugins.precision"))
        if device.type == "cpu" and self.lightning_module is not None:
            # Lightning's spawn launcher gives each process private tensors only where the Trainer's accelerator
            # is the CPU; beside a GPU rank the CPU ranks would otherwise all write the parent's shared memory.
            unshare_tensors(self.lightning_module)
        threads = replica_threads(devices, self.local_rank, available_cores())
        if threads is not None:
            torch.set_num_threads(threads)


def unshare_tensors(module: Any) -> None:
    """Give every parameter and buffer of ``module`` held in shared memory (a spawned process's) a private copy."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_shared():
            tensor.data = tensor.data.clone()


def precision_for(device: torch.device, plugin: Any, precision: Any) -> Any:
    """The precision plugin of a replica on ``device``, from the Trainer's ``plugin``.

    Mixed precision autocasts on the device it was made for: a CPU replica trains in 32-bit instead (autocast
    slows most CPUs, and fp16 needs a GradScaler), and a GPU replica of a job whose Trainer chose the CPU gets the
    same mixed precision on CUDA. Every other plugin is kept, so that all replicas' parameters share a dtype.

    Args:
        device: the replica's device.
        plugin: the Trainer's precision plugin.
        precision: the Lightning namespace's ``plugins.precision`` module.
    """
    if not isinstance(plugin, precision.MixedPrecision):
        return plugin
    if device.type == "cpu":
        return precision.Precision()
    if plugin.device == device.type:
        return plugin
    scaler = torch.amp.GradScaler("cuda") if plugin.precision == "16-mixed" else None
    return precision.MixedPrecision(plugin.precision, device=device.type, scaler=scaler)


def _lightning_namespace(strategy_class: type) -> str:
    """``"pytorch_lightning"`` or ``"lightning.pytorch"``: the package of the ``DDPStrategy`` a strategy extends."""
    for base in strategy_class.__mro__:
        if base.__name__ == "DDPStrategy":
            return base.__module__.split(".strategies")[0]
    raise TypeError(f"{strategy_class.__name__} does not extend a Lightning DDPStrategy")
