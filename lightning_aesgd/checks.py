"""Early, explicit errors for Trainer and model settings the strategy does not support."""

from __future__ import annotations

from datetime import timedelta
from typing import Any


class UnsupportedSettingError(ValueError):
    """A Trainer or LightningModule setting that ``adaptive_elastic`` cannot honour."""


def check_switches(**switches: Any) -> None:
    """Raise unless every on/off option is a bool: a string such as ``"no"`` from a config file is truthy.

    Raises:
        TypeError: naming the option.
    """
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"`{name}` is a switch, got {value!r}. HINT: pass {name}=True or {name}=False.")


def check_timeout(timeout: Any) -> None:
    """Raise unless ``timeout`` (of collectives) is a ``datetime.timedelta`` or None, before any process starts.

    Raises:
        TypeError: naming the option.
    """
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"`timeout` is the time collectives may wait, got {timeout!r}. HINT: pass a datetime.timedelta, e.g. "
            "timeout=timedelta(minutes=30), or leave it unset."
        )


def check_fit_settings(trainer: Any, module: Any) -> None:
    """Raise before training starts if the run uses something the strategy cannot do correctly.

    Args:
        trainer: the Trainer about to fit.
        module: the LightningModule it fits.

    Raises:
        UnsupportedSettingError: naming the setting and the fix.
    """
    if not module.automatic_optimization:
        raise UnsupportedSettingError(
            "adaptive_elastic supports automatic optimization only: it times and merges each replica around "
            "Lightning's optimizer step. HINT: remove `self.automatic_optimization = False` from "
            f"{type(module).__name__}, or train it with strategy='ddp'."
        )
    if trainer.accumulate_grad_batches != 1:
        raise UnsupportedSettingError(
            "adaptive_elastic does not support gradient accumulation "
            f"(accumulate_grad_batches={trainer.accumulate_grad_batches}): every Lightning step is one local "
            "update of every replica. HINT: set accumulate_grad_batches=1 and raise the DataLoader's batch_size "
            "instead."
        )
