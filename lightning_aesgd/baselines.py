"""Baselines that are not this project's strategy: Lightning's post-local-SGD DDP, runnable on CPU too.

Post-local SGD (Lin, Stich, Patel, Jaggi, "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020) trains
like DDP for ``warmup_steps`` steps (gradients all-reduced every step), then lets every replica step alone and
replaces the replicas by their plain average every ``period`` steps:

    x ← (1/n) Σᵢ xᵢ   after steps s ≥ warmup_steps with (s − warmup_steps) mod period = 0

torch implements it as a DDP communication hook (``post_localSGD_hook``, which stops the gradient all-reduce
after the warm-up) plus a ``PeriodicModelAverager`` run after every optimizer step; Lightning's ``DDPStrategy``
wires both from ``ddp_comm_state``, ``ddp_comm_hook`` and ``model_averaging_period``. Two things keep that from
working as a Hydra-configured baseline on CPU:

* ``PostLocalSGDState`` holds process groups, which exist only after the strategy set up the distributed
  environment in the launched process, so it cannot be built in a config;
* Lightning registers communication hooks only when the root device is CUDA. torch itself allows them on gloo:
  ``DistributedDataParallel.register_comm_hook`` restricts only the bf16 compression hooks to NCCL, and the
  hook's ``all_reduce(..., async_op=True).get_future()`` is supported by gloo for collectives.

:class:`PostLocalSGDStrategy` builds the state once the process group exists and registers the hook on any
device. Lightning's ``DDPStrategy.setup`` then sees the state and installs its ``PeriodicModelAverager``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_aesgd.placement import SharedDevices
from lightning_aesgd.settings import NO_BUFFER_SYNC_AT_FORWARD


class SharedDeviceDDPStrategy(SharedDevices, DDPStrategy):
    """Lightning's ``DDPStrategy`` unchanged but for ``replicas_per_device`` processes on every device.

    The fair baseline where this project's strategy runs several replicas on one GPU
    (``AdaptiveElasticStrategy(replicas_per_device=k)``): both then share the device alike, over gloo.

    Args:
        replicas_per_device: replica processes per device.
        sync_buffers_at_forward: DDP's broadcast of the buffers (BatchNorm statistics) from rank zero at every
            forward, Lightning's default; ``False`` skips it as this project's strategy does, for a model whose
            buffers would otherwise cost a second collective per step (the fairest DDP to race it against).
        **kwargs: everything ``DDPStrategy`` takes.
    """

    def __init__(self, *args: Any, sync_buffers_at_forward: bool = True, **kwargs: Any) -> None:
        options = kwargs if sync_buffers_at_forward else {**NO_BUFFER_SYNC_AT_FORWARD, **kwargs}
        super().__init__(*args, **options)
        self.sync_buffers_at_forward = sync_buffers_at_forward


class PostLocalSGDStrategy(SharedDeviceDDPStrategy):
    """Lightning's ``DDPStrategy`` running post-local SGD, with its communication hook on CPU (gloo) too.

    DDP's per-forward buffer broadcast (``sync_buffers_at_forward``, see :class:`SharedDeviceDDPStrategy`) would run
    in the local phase too: a collective every step where local SGD means to have none between averages.

    Args:
        period: steps between model averages after the warm-up (torch's ``PeriodicModelAverager.period``).
        warmup_steps: steps of plain DDP before local SGD starts (``start_localSGD_iter`` and the averager's
            ``warmup_steps``, which torch requires to be equal).
        post_local_gradient_allreduce: after the warm-up, still all-reduce gradients every step within each
            node's subgroup (torch's default, meant for many nodes). Off by default: on one machine the
            subgroup is every replica, and the run would be DDP plus redundant averaging.
        **kwargs: everything :class:`SharedDeviceDDPStrategy` takes (``replicas_per_device``,
            ``sync_buffers_at_forward``, ``start_method``, ``process_group_backend``, DDP's own arguments) except the
            three post-local-SGD arguments set here.

    Raises:
        ValueError: if ``period`` is below 1 or ``warmup_steps`` is negative.
    """

    def __init__(
        self, period: int = 8, warmup_steps: int = 10, post_local_gradient_allreduce: bool = False, **kwargs: Any
    ) -> None:
        if period < 1 or warmup_steps < 0:
            raise ValueError(f"Need period >= 1 and warmup_steps >= 0, got {period} and {warmup_steps}.")
        super().__init__(ddp_comm_hook=post_localSGD_hook, model_averaging_period=period, **kwargs)
        self.period = period
        self.warmup_steps = warmup_steps
        self.post_local_gradient_allreduce = post_local_gradient_allreduce

    @override
    def _register_ddp_hooks(self) -> None:
        # Called from `configure_ddp` inside `setup`, after `setup_environment` created the process group.
        assert isinstance(self.model, DistributedDataParallel)
        subgroup = None
        if self.post_local_gradient_allreduce:
            # One subgroup per node; torch's own default sizes them by the number of CUDA devices, which is 0
            # on CPU. Every rank must create every subgroup, so this runs on all of them.
            subgroup, _ = dist.new_subgroups(group_size=self.num_processes)  # type: ignore[no-untyped-call]
        self._ddp_comm_state = PostLocalSGDState(  # type: ignore[no-untyped-call]
            process_group=None,
            subgroup=subgroup,
            start_localSGD_iter=self.warmup_steps,
            post_local_gradient_allreduce=self.post_local_gradient_allreduce,
        )
        self.model.register_comm_hook(self._ddp_comm_state, post_localSGD_hook)


def single_device_strategy(accelerator: str = "auto") -> SingleDeviceStrategy:
    """Lightning's plain one-process strategy on the accelerator's first device: no replicas, no synchronisation.

    The floor any parallel strategy's per-step overhead is measured against (``algorithm=single_device``).

    Args:
        accelerator: the Trainer's accelerator (``"gpu"``/``"cuda"``: ``cuda:0``; ``"auto"``: CUDA where present).
    """
    # The device count comes from NVML, which leaves CUDA uninitialised (replicas may still be forked).
    cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.device_count() > 0)
    return SingleDeviceStrategy(device=torch.device("cuda", 0) if cuda else torch.device("cpu"))
