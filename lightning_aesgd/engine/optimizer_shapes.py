"""Optimizer state across models of another shape: one model's moments for several learners, and back.

With several learners per device (:mod:`~lightning_aesgd.engine.learners`) each trainable parameter holds a row
per learner (``k × shape``), and so do the optimizer's moments. A checkpoint holds one model's optimizer state
(the learners' mean), which DDP, ``sync="gradients"`` and any number of learners can resume from: each learner
then starts from that state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_aesgd.engine.flat import rows_mean

log = logging.getLogger(__name__)

COUNTERS = ("step",)
"""State entries that count steps rather than hold a value per element (torch's optimizers call theirs ``step``)."""


def fitted_state(state: Mapping[str, Any], shape: torch.Size) -> dict[str, Any] | None:
    """One parameter's optimizer state with its per-element tensors fitted to a parameter of ``shape``.

    A tensor of ``k × shape`` (learners' moments, for one model) becomes the mean of its rows; a tensor of
    ``shape[1:]`` (one model's, for ``shape[0]`` learners) becomes a copy per row; a tensor of ``shape`` stays.

    Returns:
        A new dict (the tensors that fit are the same objects), or ``None`` where a tensor fits in none of
        these ways (another model's state).

    Example:
        >>> state = {"step": torch.tensor(3.0), "exp_avg": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
        >>> fitted_state(state, torch.Size([2]))["exp_avg"]
        tensor([2., 3.])
    """
    fitted = dict(state)
    for key, value in state.items():
        if key in COUNTERS or not isinstance(value, Tensor) or not value.is_floating_point():
            continue
        if value.shape == shape:
            continue
        if value.dim() == len(shape) + 1 and value.shape[1:] == shape:
            fitted[key] = rows_mean(value)
        elif len(shape) == value.dim() + 1 and shape[1:] == value.shape:
            fitted[key] = value.expand(shape).clone()
        else:
            return None
    return fitted


def one_model_state(
    state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, shapes: Mapping[int, torch.Size]
) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` for one model: moments of stacked learners become their mean.

    Args:
        state_dict: the optimizer's ``state_dict()`` (its tensors are not changed).
        optimizer: the optimizer it came from (its parameters, in the state dict's order).
        shapes: one model's shape of each stacked parameter, by ``id``; other parameters keep theirs.
    """
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state = {}
    for index, entry in state_dict["state"].items():
        param = params[index]
        fitted = fitted_state(entry, shapes.get(id(param), param.shape))
        state[index] = entry if fitted is None else fitted
    return {**state_dict, "state": state}


def fit_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Fit the optimizer's state to its parameters' shapes now, in place (after a resume, before training).

    A state that fits in no way (a checkpoint of another model) is dropped with a warning: the optimizer starts
    afresh rather than fail at its first step.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            fitted = fitted_state(state, param.shape)
            if fitted is None:
                log.warning(
                    "The optimizer state resumed does not fit a parameter of shape %s: the optimizer starts afresh.",
                    tuple(param.shape),
                )
                optimizer.state.clear()
                return
            optimizer.state[param] = fitted
