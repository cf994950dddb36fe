"""What the strategy reads from the Trainer and hands to its loggers, outside Lightning's hooks.

Where a restored training loop resumes, the end of the fit loop (where the strategy finishes the fit), training
data set up before the fit began, the
Trainer's gradient clipping for updates the strategy applies itself, whether a callback monitors a training metric,
whether the loggers write at this step, the telemetry metrics handed to them, and the end-of-fit summary saved as
JSON next to their logs. Each takes the Trainer (or module) of either Lightning namespace; nothing here imports
Lightning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUMMARY_FILE = "aesgd_summary.json"
"""The end-of-fit summary as JSON, in the first logger's directory (see :func:`save_summary`)."""


def resumed_position(trainer: Any) -> tuple[int, int] | None:
    """Where a restored training loop resumes: (epoch, batches of it processed), or None for a fresh fit."""
    if not trainer.fit_loop.restarting:
        return None
    return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.processed


def judges_training_metrics(trainer: Any) -> bool:
    """Whether a callback of the fit monitors a metric logged in training (an ``EarlyStopping`` on the loss).

    Its vote at a validation's end then reads a training metric, as its vote inside the training steps does. The
    names are those Lightning gives the training results (``loss``, or ``loss_step`` and ``loss_epoch`` where both
    are logged); Lightning keeps them in the fit loop's ``_results`` (2.6).
    """
    monitored = {getattr(callback, "monitor", None) for callback in trainer.callbacks} - {None}
    if not monitored:
        return False
    results = getattr(trainer.fit_loop.epoch_loop, "_results", {})
    logged = {
        name
        for metric in results.values()
        for name in (metric.meta.name, metric.meta.forked_name(True), metric.meta.forked_name(False))
    }
    return not monitored.isdisjoint(logged)


def loop_start(trainer: Any, batches: int) -> tuple[int, int]:
    """Where the training loop starts this fit, as its reset will set it: (epoch, batches of it done).

    Read while the training data is set up, before the loop's reset (the loader's workers may draw their first
    batches then). ``batches`` is the epoch's length before ``limit_train_batches``. Besides the saved position:

    * a fit that is not restarting (a fresh one, or one whose checkpoint closed its epoch) starts the epoch after
      the ones its loop processed, from its start;
    * a checkpoint written at a batch's end (``ModelCheckpoint`` every ``n`` training steps) whose batches done
      reach the epoch's length (under this fit's ``limit_train_batches``) starts the next epoch where that batch
      was the epoch's last, and that epoch over where the limit is smaller than the saved run's.
    """
    loop = trainer.fit_loop
    if not loop.restarting:
        return int(loop.epoch_progress.current.processed), 0
    epoch, progress = int(trainer.current_epoch), loop.epoch_loop.batch_progress
    done = int(progress.current.processed)
    limit = trainer.limit_train_batches
    length = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    if progress.current.completed < done and done >= length:
        return (epoch + 1, 0) if progress.is_last_batch else (epoch, 0)
    return epoch, done


def before_train_end(trainer: Any, run: Callable[[], None]) -> Callable[[], None] | None:
    """Run ``run`` when the fit loop ends, before Lightning's ``on_train_end`` hooks; returns what undoes it.

    Lightning calls the callbacks' and the module's ``on_train_end`` before the strategy's: the strategy finishes
    the fit first, so that they see the trained model. ``None`` where the Trainer has no such loop (the strategy's
    own ``on_train_end`` then finishes the fit).
    """
    loop: Any = getattr(trainer, "fit_loop", None)
    original = getattr(loop, "on_run_end", None)
    if loop is None or original is None:
        return None

    def on_run_end(*args: Any, **kwargs: Any) -> Any:
        run()
        return original(*args, **kwargs)

    loop.on_run_end = on_run_end  # the instance's, over the class's method

    def undo() -> None:
        if vars(loop).get("on_run_end") is on_run_end:
            del loop.on_run_end

    return undo


def set_up_training_data_again(trainer: Any) -> float | None:
    """Have the fit loop set its training data up again, through the strategy, if it did so before the fit began.

    Reading ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` (Lightning's recipe for a per-step
    schedule such as OneCycleLR) sets the training data up during the strategy's own set-up, before its engine runs:
    the loader kept then is the user's, unplanned, and the fit loop would keep it. Its iterator is let go first
    (workers it may have started). Lightning keeps the set-up in ``fit_loop._combined_loader`` (2.6).

    Returns:
        The batches per epoch of the loader set up before (what the estimate counted), or ``None`` where none was.
    """
    loop: Any = getattr(trainer, "fit_loop", None)
    if loop is None or getattr(loop, "_combined_loader", None) is None:
        return None
    counted = loop.max_batches
    fetcher = getattr(loop, "_data_fetcher", None)
    if fetcher is not None:
        fetcher.teardown()
        loop._data_fetcher = None
    loop._combined_loader = None
    return float(counted)


def warn_if_estimate_differs(trainer: Any, counted: float | None) -> None:
    """Warn where the planned loader has another number of steps per epoch than the estimate read before it.

    The planned loader takes ``⌈N / step batch⌉`` steps an epoch: another number than the user's loader where
    ``step_batch_size`` or ``learners_per_device`` change the step batch. A schedule sized by
    ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` then ends early or runs out (OneCycleLR raises).
    """
    planned = getattr(trainer, "num_training_batches", None)
    if counted is None or planned is None or planned == counted:
        return
    log.warning(
        "configure_optimizers read trainer.estimated_stepping_batches from the training loader as given, %g batches "
        "an epoch; the strategy's planned loader takes %g (its step batch differs: step_batch_size or "
        "learners_per_device). A schedule sized by it ends at the wrong step (OneCycleLR raises past its end). "
        "HINT: size the schedule from the steps the fit takes (epochs x %g), or keep the default step batch.",
        counted,
        planned,
        planned,
    )


def clip_gradients(module: Any, optimizer: Any) -> None:
    """The Trainer's gradient clipping, for an update the strategy applies itself (a flushed delayed sum)."""
    trainer = module.trainer
    module.configure_gradient_clipping(
        optimizer,
        gradient_clip_val=trainer.gradient_clip_val,
        gradient_clip_algorithm=trainer.gradient_clip_algorithm,
    )


def logs_this_step(trainer: Any) -> bool:
    """Whether Lightning's loggers write at this step, called in the optimizer step (before it is counted).

    Lightning's rule (its logger connector's ``should_update_logs``): every ``log_every_n_steps``-th step, never
    at ``log_every_n_steps=0``, and whenever the Trainer is about to stop.
    """
    every = int(trainer.log_every_n_steps)
    if every == 0:
        return False
    return (int(trainer.global_step) + 1) % every == 0 or bool(trainer.should_stop)


def log_metrics(trainer: Any, metrics: dict[str, float] | None) -> None:
    """Hand ``metrics`` (if any) to every logger of the Trainer, at its global step; called on rank zero only."""
    # Every rank holds the same numbers (those of the latest merge), so rank zero hands them to the loggers
    # directly: through `LightningModule.log_dict` a score of metrics costs tens of milliseconds.
    if metrics is not None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def save_summary(trainer: Any, record: dict[str, Any] | None) -> None:
    """Write the end-of-fit summary to ``<log_dir>/aesgd_summary.json`` where the fit has a logger with a directory."""
    log_dir = getattr(trainer.logger, "log_dir", None) if record is not None else None
    if not log_dir:
        return
    path = Path(log_dir) / SUMMARY_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
    except OSError as error:  # a summary that cannot be saved is no reason to fail a finished fit
        log.warning("Could not save the end-of-fit summary to %s: %s", path, error)
