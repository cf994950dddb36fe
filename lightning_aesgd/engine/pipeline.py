"""The step pipeline both sync modes share: the planned loader, the plans, the arrival clock and telemetry.

:class:`StepPipeline` owns, for one replica, what does not depend on how replicas synchronise: the training
loader rebuilt around the plan-driven sampler, the :class:`~lightning_aesgd.engine.arrivals.ArrivalClock`
(stamps and reports), the :class:`~lightning_aesgd.engine.plan_loop.PlanLoop` (reports to plans), the per-step
learning-rate schedule, the compute-span listener, telemetry and the plans' part of checkpoints. Its two
siblings say how replicas meet at a sync point: :class:`~lightning_aesgd.engine.gradient_sync.GradientSync`
(``sync="gradients"``, the default: DDP's reducer sums share-weighted gradients every step) and
:class:`~lightning_aesgd.engine.model_merge.ModelMerge` (``sync="models"``: local steps, merged every ``period``
steps). Each implements the template methods below; the strategy's Lightning hooks call the pipeline and never
ask which sibling it is.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_aesgd.engine.arrivals import ArrivalClock
from lightning_aesgd.engine.comm import Communicator
from lightning_aesgd.engine.learners import LearnerStep
from lightning_aesgd.engine.loading import (
    LoaderClock,
    PlannedDataLoader,
    SampleCosts,
    build_planned_loader,
    check_sample_costs,
    check_step_options,
    inspect_train_loader,
    prefetch_depth,
    resolve_sample_costs,
)
from lightning_aesgd.engine.plan_loop import PlanLoop
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.sampler import PlannedBatchSampler, StepRecord
from lightning_aesgd.engine.telemetry import replica_metrics, summary_record, summary_table
from lightning_aesgd.engine.throttling import ThrottleMeter
from lightning_aesgd.engine.timing import ComputeSpans, NoComputeSpans

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "adaptive_elastic"
"""Where a checkpoint holds the pipeline's state (see :meth:`StepPipeline.training_state`)."""

T = TypeVar("T")


class NonFiniteReplicasError(FloatingPointError):
    """No replica's model (or gradient) stayed finite: training cannot continue from any of them."""


def _never() -> bool:
    """No stop requested (a module-level function, so that the pipeline pickles for the spawn launcher)."""
    return False


def _nothing(optimizer: torch.optim.Optimizer) -> None:
    """Nothing to do before an update."""


class StepOptions(TypedDict, total=False):
    """The step pipeline's own options, which each sync mode takes and passes on (see :class:`StepPipeline`)."""

    lr_schedule: Callable[[int], float] | None
    step_batch_size: int | None
    plan_lag: int | None
    sample_costs: SampleCosts


@dataclass(frozen=True)
class TrainerHooks:
    """What the fit's Trainer lends the pipeline, given at :meth:`StepPipeline.start`.

    Attributes:
        stop_requested: whether this replica received SIGTERM; asked at each report, whose flag carries it to
            every replica.
        grad_scaler: the precision plugin's ``GradScaler`` (16-bit mixed precision), if any: under model merging
            the steps it skips carry no merge weight.
        before_own_update: what runs before an update the pipeline applies itself, outside Lightning's optimizer
            step (the Trainer's gradient clipping, for a flushed delayed sum).
        reducer_meets_every_step: whether DDP's reducer itself talks to every replica in each step
            (``find_unused_parameters``), so that no replica can sit out of a step's gradient sum.
        collective_timeout: seconds a collective may wait before it times out (``None``: no limit).
        mixed_device_types: whether replicas run on different device types (CPU and CUDA), whose kernels may
            round the same update differently.
    """

    stop_requested: Callable[[], bool] = _never
    grad_scaler: Any = None
    before_own_update: Callable[[torch.optim.Optimizer], None] = _nothing
    reducer_meets_every_step: bool = False
    collective_timeout: float | None = None
    mixed_device_types: bool = False


class StepPipeline(ABC):
    """One replica's training machinery around Lightning's loop, Lightning-free; a sync mode completes it.

    Args:
        planning: how batch sizes follow the measured speeds.
        lr_schedule: a factor on the learning rate during each step, a function of the global step (``None``: 1).
        step_batch_size: indices consumed per step by all replicas; by default the loader's batch size times
            the number of replicas, so that an equal plan means what DDP means.
        plan_lag: steps between deciding a plan and applying it; by default just above the prefetch depth.
        sample_costs: per-sample costs for cost-aware splitting (see :func:`~.loading.resolve_sample_costs`).
    """

    learners = 1
    """Models each replica trains side by side (``learners_per_device``); batches are multiples of it."""

    learner_step: LearnerStep | None = None
    """Runs the training step of several learners batched (model merging with ``learners_per_device > 1``)."""

    sync_name = "sync points"
    """What this sync mode's sync points are called in the summary (``"merges"``, ``"gradient sums"``)."""

    def __init__(
        self,
        planning: PlanSettings,
        *,
        lr_schedule: Callable[[int], float] | None = None,
        step_batch_size: int | None = None,
        plan_lag: int | None = None,
        sample_costs: SampleCosts = None,
    ) -> None:
        check_step_options(step_batch_size, plan_lag)
        check_sample_costs(sample_costs)
        check_lr_schedule(lr_schedule)
        self.arrivals = ArrivalClock(throttle=ThrottleMeter())
        self.plans = PlanLoop(planning)
        self.lr_schedule = lr_schedule
        self.step_batch_size = step_batch_size
        self.plan_lag = plan_lag
        self.sample_costs = sample_costs
        self.sampler: PlannedBatchSampler | None = None
        self.loader_clock: LoaderClock | None = None
        self.synced_last_step = False  # whether the latest step ended at a sync point (its reports were read)
        # Told where the device computes in each step (an emulation of slower devices listens; by default nobody).
        self.compute_spans: ComputeSpans = NoComputeSpans()
        self.hooks = TrainerHooks()
        # This replica's fraction of the running training step's samples, while its training step runs (None
        # otherwise): what the step's logged means are weighted by (:meth:`sharing`).
        self.step_share: float | None = None
        self._comm_in_use: Communicator | None = None
        self._step_key = 0
        self._global_step = 0
        self._saved_step_batch_size: int | None = None  # the checkpoint's, when resuming

    # --- what each sync mode implements ---------------------------------------------------------------------

    @property
    def loss_weight(self) -> float:
        """The factor on this replica's loss before its backward (1: the loss as it is)."""
        return 1.0

    @property
    @abstractmethod
    def sync_count(self) -> int:
        """Sync points passed in this fit (gradient sums, or merges)."""

    @abstractmethod
    def _start(self, module: nn.Module, comm: Communicator, device: torch.device) -> None:
        """The sync mode's part of :meth:`start`."""

    def _report_steps(self) -> int:
        """Steps a report usually spans, beyond ``lag + 1`` (0: none); longer reports weigh more in the speed models."""
        return 0

    @abstractmethod
    def _stop(self) -> None:
        """The sync mode's part of :meth:`stop`."""

    @abstractmethod
    def optimizer_step(self, optimizer: torch.optim.Optimizer, run_step: Callable[[], T]) -> T:
        """Run one step (``run_step``: Lightning's optimizer step) and this sync mode's synchronisation."""

    def wraps_model(self, world_size: int) -> bool:
        """Whether the strategy wraps the model in DistributedDataParallel, for a job of ``world_size`` replicas."""
        return False

    @abstractmethod
    def configure_model(self, model: nn.Module) -> None:
        """Take the model as the strategy prepared it (DistributedDataParallel where :meth:`wraps_model`)."""

    def after_backward_of(self, closure: Callable[[], T]) -> Callable[[], T]:
        """Lightning's closure (forward and backward) as the optimizer step should run it: unchanged by default."""
        return closure

    @abstractmethod
    def begin_evaluation(self) -> None:
        """Validation starts: the model every replica evaluates is put in place (a collective)."""

    @abstractmethod
    def end_evaluation(self) -> None:
        """Validation ended: training resumes."""

    def one_model_shapes(self) -> dict[int, torch.Size]:
        """One model's shape of each parameter holding a row per learner, by ``id`` (none with one learner)."""
        return {}

    @abstractmethod
    def finish(self) -> None:
        """Fit ends: the module is left holding the model the run produced (a collective)."""

    @abstractmethod
    def global_model_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The state dict a checkpoint saves as the model (a collective)."""

    @abstractmethod
    def training_state(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """What a checkpoint needs to resume exactly, under :data:`CHECKPOINT_KEY`."""

    @abstractmethod
    def load_training_state(
        self, state: dict[str, Any], optimizer: torch.optim.Optimizer | None, device: torch.device
    ) -> None:
        """Put back what :meth:`training_state` saved (or the plans of the other sync mode's checkpoint)."""

    # --- a fit's lifecycle ----------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether a fit is in progress (between :meth:`start` and :meth:`stop`)."""
        return self._comm_in_use is not None

    @property
    def ready(self) -> bool:
        """Whether training steps go through the pipeline: a fit is running and its loader was built here."""
        return self._comm_in_use is not None and self.sampler is not None

    def _comm(self) -> Communicator:
        assert self._comm_in_use is not None, "the pipeline is not running: call start() first"
        return self._comm_in_use

    def start(
        self, module: nn.Module, comm: Communicator, device: torch.device, hooks: TrainerHooks | None = None
    ) -> None:
        """Begin a fit of ``module`` on ``device``, with the other replicas behind ``comm`` and the Trainer's hooks."""
        self._comm_in_use = comm
        self.plans.learners = self.learners
        self.hooks = hooks if hooks is not None else TrainerHooks()
        self.arrivals.attach(device)
        self.plans.attach(comm.world_size)
        self._saved_step_batch_size = None
        self._start(module, comm, device)

    def stop(self) -> None:
        """End a fit; plans and measurements stay for a later fit of the same strategy."""
        self._stop()
        self._comm_in_use = None
        self.hooks = TrainerHooks()  # the Trainer's checks hold the Trainer: not kept past the fit
        self.sampler = self.loader_clock = None
        self.arrivals.detach()

    @property
    def learners_undecided(self) -> bool:
        """Whether ``learners_per_device="auto"`` has yet to measure and choose (:meth:`choose_learners`)."""
        return False

    def choose_learners(self, measure: Callable[[int], float]) -> int:
        """Measure 1, 2, ... learners per replica (``measure(k)``: samples/s) and keep what pays; a collective.

        Only model merging trains several learners (Crossbow): elsewhere there is nothing to choose.
        """
        return self.learners

    def training_loader(
        self, dataloader: DataLoader[Any], position: tuple[int, int] | None = None
    ) -> PlannedDataLoader:
        """The training loader rebuilt so that every replica's batches follow the plans.

        Args:
            dataloader: the user's training loader.
            position: where the training loop resumes, as (epoch, steps of it done); the loader continues there
                (any checkpoint, DDP's included, records the loop's position; none records the loader's).
        """
        comm = self._comm()
        facts = inspect_train_loader(dataloader)
        depth = prefetch_depth(dataloader)
        if self.plan_lag is not None and self.plan_lag <= depth:
            # A plan must reach every replica before any of them draws the step it applies to.
            raise ValueError(
                f"plan_lag={self.plan_lag} is not above the training DataLoader's prefetch depth {depth} "
                "(num_workers × prefetch_factor + 1): replicas could split a step differently. HINT: set "
                f"plan_lag >= {depth + 1}, or leave it unset."
            )
        lag = self.plan_lag if self.plan_lag is not None else depth + 1
        costs = resolve_sample_costs(self.sample_costs, dataloader.dataset)
        step_batch_size = self._step_batch_size(facts.batch_size * comm.world_size * self.learners, position)
        plan_book = self.plans.plan_book_for(
            step_batch_size, comm.world_size, lag, cost_aware=costs is not None, report_steps=self._report_steps()
        )
        loader = build_planned_loader(
            dataloader,
            facts,
            num_replicas=comm.world_size,
            rank=comm.rank,
            plan_book=plan_book,
            step_batch_size=step_batch_size,
            costs=costs,
            learners=self.learners,
            min_batch=self.plans.settings.min_batch,
        )
        self.sampler, self.loader_clock = loader.batch_sampler, loader.loader_clock
        if position is not None:
            epoch, steps_done = position
            saved = self._saved_step_batch_size or step_batch_size  # DDP checkpoints: steps of the same size
            self.sampler.load_state_dict({"epoch": epoch, "steps_done": steps_done, "step_batch_size": saved})
        return loader

    def _step_batch_size(self, default: int, position: tuple[int, int] | None) -> int:
        """Samples per step: the option, else the checkpoint's while its epoch is under way, else ``default``."""
        if self.step_batch_size is not None:
            return self.step_batch_size
        saved = self._saved_step_batch_size
        if saved is None or saved == default or position is None or position[1] == 0:
            return default
        if saved % self.learners:
            raise ValueError(
                f"The checkpoint stopped {position[1]} steps into epoch {position[0]} with steps of {saved} "
                f"samples, which {self.learners} learners per replica cannot split equally (finishing that epoch "
                f"exactly needs steps of that size). HINT: resume with a learners_per_device that divides {saved}, "
                "or from a checkpoint saved at the end of an epoch."
            )
        # Another number of replicas or another loader batch size: steps of the checkpoint's size finish the
        # epoch exactly (every sample once), as elastic training keeps the global batch.
        log.info(
            "Resuming %d steps into epoch %d whose steps had %d samples: this fit keeps %d per step (the loader's "
            "batch size × replicas would give %d). Set the strategy's step_batch_size to choose.",
            position[1],
            position[0],
            saved,
            saved,
            default,
        )
        return saved

    # --- training steps -------------------------------------------------------------------------------------

    def begin_step(self, epoch: int, batch_idx: int, global_step: int) -> None:
        """A training step is about to run its batch (``batch_idx`` within the epoch, ``global_step`` overall)."""
        if self.sampler is not None:
            self._step_key = self.sampler.step_key(epoch, batch_idx)
        self._global_step = global_step
        # A new epoch (loader workers started, epoch-end hooks ran): the step before it is no training step's time.
        # A fit's first step, resumed mid-epoch included, is the clock's own to leave out (its one-time costs).
        key = self._step_key if self.sampler is not None else None
        self.arrivals.begin_step(new_epoch=batch_idx == 0, key=key)

    def _scheduled_lr_factor(self) -> float:
        """The learning-rate schedule's factor for this step (1 without a schedule)."""
        return float(self.lr_schedule(self._global_step)) if self.lr_schedule is not None else 1.0

    def _loader_seconds(self) -> float:
        """Seconds the loader spent producing this step's batch (in its workers, where it has them)."""
        return self.loader_clock.read(self._step_key) if self.loader_clock is not None else 0.0

    @property
    def sits_out(self) -> bool:
        """Whether this replica sits out the current step: no forward, sum or update (:mod:`.sitting_out`)."""
        return False

    @property
    def stop_requested(self) -> bool:
        """Whether a replica asked to stop in the latest reports."""
        return self.plans.stop_requested

    # --- telemetry ------------------------------------------------------------------------------------------

    def telemetry(self) -> dict[str, float] | None:
        """``aesgd/...`` metrics of the latest reports (identical on every replica); ``None`` before the first."""
        if not self.plans.latest_reports or self.plans.plan_book is None:
            return None
        # The batches trained at this step: the latest plan is for steps `plan_lag` ahead, already in the loader.
        metrics = replica_metrics(self.plans.stats(), self.plans.plan_book.sizes_at(self._step_key))
        metrics["aesgd/excluded"] = float(self.exclusion_count)
        return metrics

    @property
    def exclusion_count(self) -> int:
        """Replicas left out of sync points in this fit for not being finite (each a replica at one sync point)."""
        return 0

    def summary(self) -> str | None:
        """The end-of-fit table of every replica as the latest reports saw it; ``None`` before the first."""
        record = self.summary_record()
        return None if record is None else summary_table(record)

    def summary_record(self) -> dict[str, Any] | None:
        """The end-of-fit summary as plain data (:func:`~lightning_aesgd.engine.telemetry.summary_record`)."""
        plans = self.plans
        if not plans.latest_reports:
            return None
        unit = "units" if plans.cost_aware else "samples"
        sizes = plans.history[-1].sizes
        return summary_record(plans.stats(), sizes, self.sync_count, unit, plans.floors, self.sync_name)

    # --- the sync point's bookkeeping and the plans' part of checkpoints ----------------------------------------

    @contextmanager
    def sharing(self, record: StepRecord) -> Iterator[None]:
        """Hold this replica's share of the step's samples in :attr:`step_share` while its training step runs.

        A mean the step logs with ``sync_dist=True`` is then weighted by it, as DDP's mean of equal batches is the
        mean over the step's samples (the strategy's ``reduce``).
        """
        self.step_share = record.num_samples / record.step_samples if record.step_samples else None
        try:
            yield
        finally:
            self.step_share = None

    @contextmanager
    def _timed_step(self, record: StepRecord) -> Iterator[None]:
        """Account one local step on the arrival clock: its work, planned samples and loader time."""
        work = record.cost if self.plans.cost_aware else float(record.num_samples)
        with self.arrivals.step(work, record.planned, self._loader_seconds()):
            yield

    def _receive(self, rows: list[list[float]], released: bool = True) -> None:
        """Take every replica's reports from the sync point: release this replica, then plan.

        ``released=False``: the replica worked on from its arrival (overlapped synchronisation).
        """
        if released:
            self.arrivals.release()
        self.plans.receive(rows, self._step_key)

    def _plan_state(self) -> dict[str, Any]:
        """The plan loop's state and the step batch: what every sync mode's checkpoint holds."""
        shared: dict[str, Any] = {"plans": self.plans.state_dict()}
        if self.sampler is not None:
            shared["step_batch_size"] = self.sampler.step_batch_size
        return shared

    def _load_plan_state(self, shared: dict[str, Any]) -> None:
        """Put back :meth:`_plan_state`'s part of a checkpoint (of either sync mode)."""
        self.plans.load_state_dict(shared["plans"])
        self._saved_step_batch_size = shared.get("step_batch_size")


def check_lr_schedule(lr_schedule: Any) -> None:
    """Raise unless ``lr_schedule`` is a function of the global step or None.

    Raises:
        TypeError: naming the option.
    """
    if lr_schedule is not None and not callable(lr_schedule):
        raise TypeError(
            f"`lr_schedule` is a function of the global step, got {lr_schedule!r}. HINT: pass e.g. "
            "lightning_aesgd.InverseTimeDecay(decay=0.05, warmup_steps=10), or None."
        )


@contextmanager
def scaled_learning_rate(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Scale every param group's learning rate for one optimizer step, then restore it.

    Restoring keeps the user's schedulers in charge: they read and write the unscaled rate between steps.
    """
    if factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
