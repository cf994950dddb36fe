"""What ``adaptive_elastic`` adds to a Lightning checkpoint, so that a resumed run continues exactly.

A checkpoint's ``state_dict`` is the merged model (loadable by any plain LightningModule). Under
:data:`CHECKPOINT_KEY` the strategy adds the state that is the same on every replica (schedule position, the
merge rule's buffers, plans, the L2 trend) and, unless disabled, every replica's own model, optimizer state and
measurements, gathered to rank zero, which writes the file.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_aesgd.averager import ElasticAverager
from lightning_aesgd.core.weights import L2Trend
from lightning_aesgd.routing import Router

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "adaptive_elastic"


def gather_training_state(
    averager: ElasticAverager,
    router: Router,
    l2_trend: L2Trend,
    optimizer: torch.optim.Optimizer | None,
    with_replicas: bool,
) -> dict[str, Any]:
    """The strategy's part of a checkpoint; a collective on every rank when ``with_replicas``."""
    shared = {"averager": averager.shared_state(), "router": router.shared_state(), "l2_trend": l2_trend.state_dict()}
    state: dict[str, Any] = {"world_size": averager.comm.world_size, "shared": shared, "replicas": None}
    if with_replicas:
        params, buffers = averager.local_model()
        own = {
            "params": params.cpu(),
            "buffers": buffers.cpu(),
            "optimizer": _on_cpu(optimizer.state_dict()) if optimizer is not None else None,
            "averager": averager.local_state(),
            "router": router.local_state(),
        }
        state["replicas"] = averager.comm.all_gather_object(own)
    return state


def restore_training_state(
    state: dict[str, Any],
    averager: ElasticAverager,
    router: Router,
    l2_trend: L2Trend,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
) -> None:
    """Put back what :func:`gather_training_state` saved; this replica's own part when the world size matches."""
    averager.load_shared_state(state["shared"]["averager"])
    router.load_shared_state(state["shared"]["router"])
    l2_trend.load_state_dict(state["shared"]["l2_trend"])
    replicas, world_size = state["replicas"], averager.comm.world_size
    if replicas is None:
        return
    if state["world_size"] != world_size:
        log.warning(
            "The checkpoint holds %d replicas, this run has %d: all start from the merged model.",
            state["world_size"],
            world_size,
        )
        return
    own = replicas[averager.comm.rank]
    averager.load_local_model(own["params"].to(device), own["buffers"].to(device))
    averager.load_local_state(own["averager"])
    router.load_local_state(own["router"])
    if optimizer is not None and own["optimizer"] is not None:
        optimizer.load_state_dict(own["optimizer"])


def _on_cpu(state: Any) -> Any:
    return apply_to_collection(state, torch.Tensor, lambda tensor: tensor.cpu())
