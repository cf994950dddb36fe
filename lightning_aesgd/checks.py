"""Early, explicit errors for Trainer and model settings the strategy does not support."""

from __future__ import annotations

import math
import numbers
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


def _check_delay_lr_scale(delay_lr_scale: Any, gradient_delay: Any) -> None:
    if isinstance(delay_lr_scale, bool) or not isinstance(delay_lr_scale, numbers.Real):
        raise ValueError(f"gradient_delay_lr_scale={delay_lr_scale!r} is a factor. HINT: pass a number > 0 (e.g. 0.5).")
    if not math.isfinite(delay_lr_scale):
        raise ValueError(
            f"gradient_delay_lr_scale={delay_lr_scale!r} is not a finite number. HINT: pass a finite number > 0 "
            "(1: the paper's rule; 0.5, the abs_sgd config's, halves the rate of stale updates)."
        )
    if delay_lr_scale <= 0:
        raise ValueError(
            f"gradient_delay_lr_scale={delay_lr_scale!r} would stop or reverse the stale updates. HINT: pass a "
            "number > 0 (1: the paper's rule; 0.5, the abs_sgd config's, halves the rate of stale updates)."
        )
    if delay_lr_scale != 1 and not gradient_delay:
        raise ValueError(
            "gradient_delay_lr_scale scales the stale updates of gradient_delay=1, which is not set. HINT: add "
            "sync='gradients', gradient_delay=1 (ABS-SGD), or remove gradient_delay_lr_scale."
        )


def check_sync(
    sync: Any, gradient_delay: Any, delay_warmup: Any, delay_lr_scale: Any, merge_options: dict[str, tuple[Any, Any]]
) -> None:
    """Raise unless ``sync`` and ``gradient_delay`` are valid and no merge option is set for gradient sync.

    Args:
        sync: ``"models"`` or ``"gradients"``.
        gradient_delay: 0 or 1.
        delay_warmup: synchronous steps before the delay starts: a whole number >= 0, > 0 only with the delay.
        delay_lr_scale: the factor on stale updates' learning rate: a finite number > 0, other than 1 only with the
            delay.
        merge_options: each option that only model merging uses, as (value given, default).

    Raises:
        ValueError: naming the option and the fix.
    """
    if sync not in ("models", "gradients"):
        raise ValueError(f"sync={sync!r} is not one of 'models', 'gradients'. HINT: pick one of them.")
    if gradient_delay not in (0, 1) or isinstance(gradient_delay, bool):
        raise ValueError(f"gradient_delay={gradient_delay!r}: 0 (synchronous) or 1 (ABS-SGD) only.")
    if not isinstance(delay_warmup, int) or isinstance(delay_warmup, bool) or delay_warmup < 0:
        raise ValueError(
            f"gradient_delay_warmup={delay_warmup!r} counts steps. HINT: pass a whole number >= 0 (0: delay from the "
            "first step)."
        )
    if delay_warmup and not gradient_delay:
        raise ValueError(
            "gradient_delay_warmup delays the start of gradient_delay=1, which is not set. HINT: add "
            "sync='gradients', gradient_delay=1 (ABS-SGD), or remove gradient_delay_warmup."
        )
    _check_delay_lr_scale(delay_lr_scale, gradient_delay)
    if sync == "models":
        if gradient_delay:
            raise ValueError(
                "gradient_delay applies to gradient synchronisation only. HINT: add sync='gradients' (ABS-SGD)."
            )
        if merge_options["find_unused_parameters"][0]:
            raise ValueError(
                "find_unused_parameters is DistributedDataParallel's option, used with sync='gradients' only; "
                "model merging needs no such search. HINT: remove it, or add sync='gradients'."
            )
        return
    if gradient_delay and merge_options["find_unused_parameters"][0]:
        raise ValueError(
            "gradient_delay=1 with find_unused_parameters=True: DDP writes no gradient for a parameter unused in a "
            "step, which would drop the delayed sum it should apply there. HINT: use gradient_delay=0, or make "
            "every parameter take part in every step."
        )
    given = sorted(name for name, (value, default) in merge_options.items() if _differs(value, default))
    given = [name for name in given if name != "find_unused_parameters"]
    if given:
        raise ValueError(
            f"{given} configure model merging, which sync='gradients' does not do (every step applies the sum "
            "of the replicas' weighted gradients). HINT: remove them, or use sync='models'."
        )


def check_gradient_settings(engine: Any, trainer: Any, precision_plugin: Any) -> None:
    """Raise for Trainer settings that delayed gradient sums (ABS-SGD) cannot honour.

    Raises:
        UnsupportedSettingError: naming the setting and the fix.
    """
    if not getattr(engine, "delay", 0):
        return
    if getattr(precision_plugin, "scaler", None) is not None:
        raise UnsupportedSettingError(
            "gradient_delay=1 with a GradScaler (precision='16-mixed'): a delayed sum was scaled by an earlier "
            "step's loss scale, which the scaler's unscale of the current step would get wrong. HINT: use "
            "precision='bf16-mixed' or '32-true', or gradient_delay=0."
        )


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:  # an object without equality (a merge rule instance): it was given
        return True
