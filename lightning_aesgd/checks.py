"""Early, explicit errors for Trainer and model settings the strategy does not support.

The strategy's own options are checked where they are gathered, by :class:`~lightning_aesgd.settings.StrategySettings`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_aesgd.core.planners import StaticPlanner
from lightning_aesgd.engine.flat import check_stackable, trainable_parameters


class UnsupportedSettingError(ValueError):
    """A Trainer or LightningModule setting that ``adaptive_elastic`` cannot honour."""


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
    if not getattr(getattr(trainer, "_accelerator_connector", None), "use_distributed_sampler", True):
        rank_zero_warn(
            "Trainer(use_distributed_sampler=False) has no effect here: the strategy's planned sampler still splits "
            "every step's samples among the replicas (that is how batches follow their speeds), where DDP would give "
            "each replica the whole dataset in its own sampler's order."
        )


WEIGHT_AVERAGING_CALLBACKS = ("StochasticWeightAveraging", "WeightAveraging")
"""Lightning's callbacks that average the module's weights over steps or epochs (SWA, EMA)."""


def check_callbacks(trainer: Any, sync: str) -> None:
    """Raise before training for callbacks that change what a step is, or read a replica's own model as the model.

    Raises:
        UnsupportedSettingError: naming the callback and the fix.
    """
    for callback in trainer.callbacks:
        name = type(callback).__name__
        schedule = getattr(callback, "scheduling", None)
        if name == "GradientAccumulationScheduler" and isinstance(schedule, dict) and set(schedule.values()) != {1}:
            raise UnsupportedSettingError(
                f"adaptive_elastic does not support gradient accumulation ({name} with {schedule}): every Lightning "
                "step is one local update of every replica, each weighted by its share of that step. HINT: remove "
                "the callback and raise the DataLoader's batch_size instead."
            )
        averaging = {kind.__name__ for kind in type(callback).__mro__} & set(WEIGHT_AVERAGING_CALLBACKS)
        if sync == "models" and averaging:
            raise UnsupportedSettingError(
                f"{name} with sync='models': it averages the module's weights between merges, where each replica "
                "holds its own model, so the replicas would end the fit with different averages. HINT: use "
                "sync='gradients' (every replica holds the same model after every step), or average checkpoints "
                "after training."
            )


def warn_unrepeatable_plans(planner: Any) -> None:
    """Warn where the Trainer asks for deterministic algorithms while the batch sizes follow measured speeds."""
    if not torch.are_deterministic_algorithms_enabled() or planner == "static" or isinstance(planner, StaticPlanner):
        return
    rank_zero_warn(
        "Trainer(deterministic=True) with batch sizes that follow the speeds measured in each run: two runs split "
        "their steps differently, so their weights differ in rounding under sync='gradients' (about 1e-7) and "
        "more under sync='models', where each replica's local steps depend on its batches. HINT: "
        "planner='static' (equal batches, or shares=[...]) for runs that repeat bit for bit."
    )


def check_one_training_loader(trainer: Any) -> None:
    """Raise where the fit trains on several DataLoaders at once (a dict or list of them: Lightning's CombinedLoader).

    The strategy plans each step's samples over one loader; the others' batches would keep their equal split while
    every loss counts with the planned share. Read once the fit loop has set its data up, before the first step.

    Raises:
        UnsupportedSettingError: naming the fix.
    """
    combined: Any = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    loaders = getattr(combined, "flattened", None) or []
    if len(loaders) > 1:
        raise UnsupportedSettingError(
            f"adaptive_elastic plans each step's samples over one training DataLoader; the training data holds "
            f"{len(loaders)} (a {type(combined.iterables).__name__} of loaders), whose batches but one would keep an "
            "equal split while their losses count with the planned shares. HINT: put the datasets behind one "
            "DataLoader (torch.utils.data.ConcatDataset for one stream of samples, or a Dataset whose items hold a "
            "sample of each), or train with strategy='ddp'."
        )


def check_training_loader(dataloader: Any) -> None:
    """Raise unless the training data comes from a torch ``DataLoader``, which the strategy rebuilds to split steps.

    Raises:
        UnsupportedSettingError: for any other iterable (Lightning accepts them), naming the fix.
    """
    if not isinstance(dataloader, DataLoader):
        # Without its own loader the strategy cannot split the steps: replicas would train on unknown shares.
        raise UnsupportedSettingError(
            "adaptive_elastic splits each step's samples among replicas by rebuilding the training DataLoader; "
            f"the training data is a {type(dataloader).__name__}, not a torch DataLoader. HINT: return "
            "torch.utils.data.DataLoader(dataset, batch_size=..., shuffle=...) over a map-style dataset, or "
            "train with strategy='ddp'."
        )


def check_gradient_settings(engine: Any, precision_plugin: Any) -> None:
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


def check_delayed_optimizers(engine: Any, optimizers: Any) -> None:
    """Raise if a delayed gradient sum (ABS-SGD) would reach an optimizer whose step needs a closure (LBFGS).

    Such an optimizer re-evaluates the loss within its step; a delayed sum is the gradient of an earlier step, which
    no closure can recompute, and the end of fit applies the last sum without one.

    Raises:
        UnsupportedSettingError: naming the optimizer and the fix.
    """
    if not getattr(engine, "delay", 0):
        return
    for optimizer in filter(_needs_closure, optimizers):
        raise UnsupportedSettingError(
            f"gradient_delay=1 with {type(optimizer).__name__}, whose step needs a closure (it evaluates the loss "
            "again): a delayed sum is the gradient of an earlier step, which no closure can recompute. HINT: use "
            "a first-order optimizer (SGD, Adam, Adagrad), or gradient_delay=0."
        )


def _needs_closure(optimizer: Any) -> bool:
    """Whether the optimizer's step must be given a closure (LBFGS evaluates the loss again within its step)."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def check_learner_settings(engine: Any, trainer: Any, module: Any) -> None:
    """Raise for what several learners per device (one batched step over stacked models) cannot do.

    Raises:
        UnsupportedSettingError: naming the setting and the fix.
    """
    learners = "auto" if getattr(engine, "auto_learners", False) else getattr(engine, "learners", 1)
    if learners == 1:
        return
    hint = f"learners_per_device={learners!r}"
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value":
        raise UnsupportedSettingError(
            f"{hint} with gradient clipping by norm: one norm over the stacked learners would clip each by the "
            "others' gradients. HINT: set gradient_clip_algorithm='value', or learners_per_device=1."
        )
    sparse = [name for name, layer in module.named_modules() if getattr(layer, "sparse", False) is True]
    if sparse:
        raise UnsupportedSettingError(
            f"{hint} with sparse gradients ({sparse}): torch.func.vmap batches dense tensors only. HINT: build these "
            "layers with sparse=False, or use learners_per_device=1."
        )
    for optimizer in trainer.optimizers:
        _check_learner_optimizer(hint, optimizer)
    check_stackable(trainable_parameters(module))  # before "auto" measures, where the error would be the step's


ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
)
"""torch's optimizers whose update of each element reads that element's gradient and state only: on stacked
learners (``k × shape``) one step updates each learner as its own optimizer would."""

MIXING_OPTIMIZERS = ("Adafactor",)
"""torch's optimizers whose update reads whole tensors (Adafactor: row and column factors, the parameter's RMS)."""


def _check_learner_optimizer(hint: str, optimizer: Any) -> None:
    name = type(optimizer).__name__
    if _needs_closure(optimizer):
        raise UnsupportedSettingError(
            f"{hint} with {name}, whose step treats all parameters as one vector: the learners would share its "
            "line search. HINT: use an elementwise optimizer (SGD, Adam, Adagrad), or learners_per_device=1."
        )
    if any(isinstance(optimizer, getattr(torch.optim, other, ())) for other in MIXING_OPTIMIZERS):
        raise UnsupportedSettingError(
            f"{hint} with {name}, whose update of a tensor reads the whole tensor (its factored moments, its RMS): "
            "on stacked learners each would be updated by the others' values. HINT: use an elementwise optimizer "
            "(SGD, Adam, AdamW, Adagrad), or learners_per_device=1."
        )
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        rank_zero_warn(
            f"{hint} with {name}: the learners are stacked in each parameter (learners × shape), which is right "
            "only for an optimizer whose update of each element reads that element alone (Adam's kind, Lion). One "
            "that reads whole tensors (LAMB's or LARS's trust ratio, Adafactor, Shampoo) would mix the learners: "
            "use learners_per_device=1 with it."
        )
