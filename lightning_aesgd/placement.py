"""Several replica processes on one device: the placement that lets one GPU run the multi-replica paths.

Lightning starts one process per entry of a strategy's ``parallel_devices``, and process ``r`` works on entry
``r`` (``root_device``). Repeating every device ``k`` times therefore starts ``k`` replicas per device, each with
its own model, optimizer and batches: on a single-GPU machine the plans, merges, sampler, telemetry and slowdown
profiles of several replicas run on CUDA. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so such
a group uses gloo, which reduces CUDA tensors too (through host memory).

:class:`SharedDevices` adds this to any ``DDPStrategy`` (this project's strategy and the DDP baseline alike, so
that comparisons share the device the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

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
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"replicas_per_device must be a whole number >= 1, got {value!r}. HINT: 1 (one replica per device, as "
            "DDP) or e.g. 4 to run 4 replicas on every device."
        )
    return value


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


def process_group_backend(devices: Sequence[torch.device], chosen: str | None) -> str | None:
    """The backend for replicas on ``devices``: gloo where replicas share an accelerator, else ``chosen``.

    Raises:
        ValueError: if ``chosen`` is NCCL while replicas share a GPU.
    """
    if not shares_a_device(devices):
        return chosen
    if chosen is not None and chosen != "gloo":
        raise ValueError(
            f"process_group_backend={chosen!r} cannot connect replicas that share a GPU (NCCL needs one GPU per "
            "rank). HINT: leave process_group_backend unset (gloo is chosen), or set replicas_per_device=1."
        )
    return "gloo"


class SharedDevices(_Base):
    """A ``DDPStrategy`` mixin: ``replicas_per_device`` processes on every device Lightning assigns.

    Args:
        replicas_per_device: replica processes per device (1: one per device, as DDP).
        **kwargs: the strategy's own arguments.
    """

    def __init__(self, *args: Any, replicas_per_device: int = 1, **kwargs: Any) -> None:
        # Set before the base class assigns parallel_devices through the property below.
        self.replicas_per_device = check_replicas_per_device(replicas_per_device)
        super().__init__(*args, **kwargs)

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The device of every replica process, each device repeated ``replicas_per_device`` times."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._parallel_devices = None if devices is None else repeat_devices(devices, self.replicas_per_device)

    def _get_process_group_backend(self) -> str:
        devices = self.parallel_devices or []
        chosen = process_group_backend(devices, self._process_group_backend)
        return chosen or super()._get_process_group_backend()
