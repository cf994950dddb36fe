"""The ``adaptive_elastic`` Lightning strategy: one replica per process, uneven batches, elastic model merges.

Processes are launched exactly as Lightning's DDP launches them (popen script launcher, spawn, torchrun,
SLURM), but the model is never wrapped in ``DistributedDataParallel``: every Lightning step is one local update
of every replica, and replicas are merged by a :class:`~lightning_aesgd.core.merge.MergeRule` every ``period``
steps. The logic lives in :class:`AdaptiveElasticMixin`, which is free of namespace imports, so the same code
serves ``pytorch_lightning`` (this module) and the unified ``lightning`` package
(:mod:`lightning_aesgd.unified`).
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from pytorch_lightning.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_aesgd.averager import OPTIMIZER_STATE_POLICIES, ElasticAverager, OptimizerStatePolicy
from lightning_aesgd.checkpointing import CHECKPOINT_KEY, gather_training_state, restore_training_state
from lightning_aesgd.checks import check_fit_settings
from lightning_aesgd.comm import Communicator, LocalCommunicator, TorchCommunicator
from lightning_aesgd.core.merge import MergeRule, get_merge_rule
from lightning_aesgd.core.policies import PlanPolicy
from lightning_aesgd.core.schedule import validate_schedule
from lightning_aesgd.core.weights import L2Trend, WeightPolicy, nudge_factor, replica_weight
from lightning_aesgd.dataloader import LoaderClock, build_elastic_loader, check_train_loader, prefetch_depth
from lightning_aesgd.flat import FlatView, floating_buffers, trainable_parameters
from lightning_aesgd.routing import Router, SampleCosts, resolve_sample_costs
from lightning_aesgd.sampler import ElasticBatchSampler
from lightning_aesgd.telemetry import replica_metrics, summary_table

if TYPE_CHECKING:
    _Base = DDPStrategy
else:
    _Base = object

log = logging.getLogger(__name__)

# What Lightning's connector passes to every parallel strategy; anything else is a mistake.
_LIGHTNING_ARGUMENTS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}


class AdaptiveElasticMixin(_Base):
    """Adaptive elastic training, for any Lightning namespace's ``DDPStrategy``.

    Args:
        period: local steps between merges after warm-up (torch's ``PeriodicModelAverager`` semantics).
        warmup_steps: steps at the start that each end with a merge.
        merge_rule: a :class:`~lightning_aesgd.core.merge.MergeRule` or one of its names
            (``"elastic_average"``, ``"sma"``, ``"easgd"``).
        alpha: elastic coefficient α of a rule given by name (α = 1: replicas are reset to the merged model).
        momentum: outer momentum μ of ``"elastic_average"`` given by name.
        merge_weights: each replica's merge weight: ``"samples"`` since the last merge, ``"updates"`` or
            ``"uniform"``.
        l2_nudge: Adaptive SGD's "adaptive normalization": after warm-up, while the merged model's L2 norm keeps
            growing, the largest merge weight is raised by 10% and the smallest lowered by 10% (weights then
            renormalised; the authors' code does not renormalise).
        merge_buffers: average floating buffers (BatchNorm statistics) too; otherwise they stay local.
        optimizer_state: at a merge, ``"keep"``, ``"reset"`` or ``"average"`` the local optimizer's state.
        planner: how per-replica batch sizes follow measurements: ``"proportional"`` (share ∝ speed),
            ``"balanced"`` (equal predicted step times, fixed per-step costs included), ``"additive"`` (the paper's
            ±step rule), ``"static"`` (fixed ``shares``), or a :class:`~lightning_aesgd.core.policies.PlanPolicy`.
        shares: fixed shares of the step batch for the ``"static"`` planner (equal when omitted).
        min_batch: smallest batch a replica may get.
        min_share: adaptive plans give every replica at least this fraction of the equal share ``M/n``, so that a
            slow replica is never starved to a useless batch while the others wait for it.
        max_batch: largest batch a replica may get.
        step_batch_size: indices consumed per step by all replicas together; by default the DataLoader's batch
            size times the number of replicas, so that an equal plan means what DDP means.
        plan_lag: steps between deciding a plan and applying it; by default just above the prefetch depth.
        speed_smoothing: smoothing β of the speed moving averages; 0.8 follows a 4× slowdown within about 16
            steps while averaging out single noisy steps.
        plan_gain: fraction γ of the way to the planner's target that each new plan moves (damping).
        sample_costs: per-sample cost for cost-aware splitting: ``None`` (count samples), ``"dataset"`` (the
            dataset's ``sample_costs`` attribute), ``"auto"`` (those where the dataset has them) or a function of
            the dataset.
        lr_scaling: scale each replica's learning rate by its batch size over the nominal one during its step
            (the paper's ``lrᵢ = η·bᵢ/B``). With ``merge_weights="updates"`` this weighs every sample equally, as
            ``merge_weights="samples"`` does without scaling.
        slowdown: emulate slower devices by a factor per replica (see :mod:`lightning_aesgd.slowdown`).
        checkpoint_replicas: save every replica's own model and optimizer state, so that resuming continues
            exactly; otherwise every replica resumes from the merged model.
        telemetry: log ``aesgd/...`` metrics at every merge and print a per-replica summary when fit ends.
        process_group_backend: torch.distributed backend; gloo on CPU and nccl on CUDA by default.
        timeout: timeout of collectives.
        start_method: how processes are launched: ``"popen"`` (re-run the script), ``"spawn"`` or ``"fork"``.
        **kwargs: accelerator, parallel_devices, cluster_environment, checkpoint_io and precision_plugin, as
            Lightning passes them to every strategy.
    """

    strategy_name = "adaptive_elastic"

    def __init__(
        self,
        *,
        period: int = 1,
        warmup_steps: int = 0,
        merge_rule: MergeRule | str = "elastic_average",
        alpha: float | None = None,
        momentum: float | None = None,
        merge_weights: WeightPolicy = "samples",
        l2_nudge: bool = False,
        merge_buffers: bool = True,
        optimizer_state: OptimizerStatePolicy = "keep",
        planner: str | PlanPolicy = "proportional",
        shares: Sequence[float] | None = None,
        min_batch: int = 1,
        min_share: float = 0.1,
        max_batch: int | None = None,
        step_batch_size: int | None = None,
        plan_lag: int | None = None,
        speed_smoothing: float = 0.8,
        plan_gain: float = 0.5,
        sample_costs: SampleCosts = None,
        lr_scaling: bool = False,
        slowdown: Any = None,
        checkpoint_replicas: bool = True,
        telemetry: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - _LIGHTNING_ARGUMENTS)
        if unknown:
            # DDPStrategy would pass them to DistributedDataParallel, which this strategy never builds: a typo
            # would vanish silently.
            raise TypeError(
                f"{type(self).__name__} got unexpected arguments {unknown}. HINT: check the spelling against "
                "the options in its docstring (period, warmup_steps, merge_rule, planner, ...)."
            )
        super().__init__(
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **kwargs
        )
        validate_schedule(period, warmup_steps)
        replica_weight(merge_weights, 0.0, 0)  # fails early on an unknown policy name
        if optimizer_state not in OPTIMIZER_STATE_POLICIES:
            raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATE_POLICIES}, got {optimizer_state!r}.")
        self.merge_rule = _resolve_rule(merge_rule, alpha, momentum)
        self.period = period
        self.warmup_steps = warmup_steps
        self.merge_weights: WeightPolicy = merge_weights
        self.l2_nudge = l2_nudge
        self._l2_trend = L2Trend()
        self.merge_buffers = merge_buffers
        # Not `self.optimizer_state`: that name is Strategy's method returning an optimizer's state dict.
        self.merge_optimizer_state: OptimizerStatePolicy = optimizer_state
        self.step_batch_size = step_batch_size
        self.plan_lag = plan_lag
        self.sample_costs = sample_costs
        self.lr_scaling = lr_scaling
        if lr_scaling and merge_weights == "samples":
            # Both favour large batches: together they count a sample of a large batch twice.
            warnings.warn(
                "lr_scaling=True with merge_weights='samples' weighs large batches twice. HINT: use "
                "merge_weights='updates' with lr_scaling (the paper's form), or samples without lr_scaling.",
                stacklevel=2,
            )
        self.checkpoint_replicas = checkpoint_replicas
        self.telemetry = telemetry
        self.router = Router(
            planner=planner,
            shares=shares,
            min_batch=min_batch,
            min_share=min_share,
            max_batch=max_batch,
            speed_smoothing=speed_smoothing,
            plan_gain=plan_gain,
            slowdown=slowdown,
        )
        self._averager: ElasticAverager | None = None
        self._sampler: ElasticBatchSampler | None = None
        self._step_key = 0
        self._last_lr: float | None = None
        self._checkpoint_extras: dict[str, Any] | None = None
        self._stop_check: _StopCheck | None = None
        self._loader_clock: LoaderClock | None = None
        self.merged_last_step = False
        self._first_batch = True

    @property
    def _module(self) -> Any:
        module = self.lightning_module
        assert module is not None, "the strategy is not connected to a LightningModule"
        return module

    # --- set-up -------------------------------------------------------------------------------------------

    @override
    def configure_ddp(self) -> None:
        """Leave the model unwrapped: replicas are merged, not gradient-synchronised."""

    @override
    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == "fit":
            check_fit_settings(trainer, self._module)
        super().setup(trainer)
        if trainer.state.fn != "fit":
            return
        module = self._module
        comm = self._communicator()
        # Replicas must start from one model; DDP guarantees this by broadcasting rank 0's weights.
        _broadcast_module(module, comm, self.merge_buffers)
        self._averager = ElasticAverager(
            module,
            self.merge_rule,
            comm,
            period=self.period,
            warmup_steps=self.warmup_steps,
            weights=self.merge_weights,
            merge_buffers=self.merge_buffers,
            optimizer_state=self.merge_optimizer_state,
        )
        self.router.attach(comm.world_size, comm.rank, self.root_device)
        self._first_batch = True
        self._stop_check = _replace_stop_broadcast(trainer, self)

    def _communicator(self) -> Communicator:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return TorchCommunicator(self.root_device)
        return LocalCommunicator()

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self._module.trainer
        if self._averager is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        batch_size = check_train_loader(dataloader)
        lag = self.plan_lag if self.plan_lag is not None else prefetch_depth(dataloader) + 1
        costs = resolve_sample_costs(self.sample_costs, dataloader.dataset)
        total = self.step_batch_size or batch_size * self.world_size
        plan_book = self.router.plan_book_for(total, self.world_size, lag)
        loader = build_elastic_loader(
            dataloader,
            num_replicas=self.world_size,
            rank=self.global_rank,
            plan_book=plan_book,
            step_batch_size=self.step_batch_size,
            costs=costs,
        )
        self._sampler = loader.batch_sampler
        self._loader_clock = loader.loader_clock
        self.router.cost_aware = costs is not None
        return loader

    # --- training -----------------------------------------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._sampler is not None:
            self._step_key = self._sampler.step_key(self._module.trainer.current_epoch, batch_idx)
        if batch_idx == 0 or self._first_batch:
            # A new epoch (loader workers started, epoch-end hooks ran) or a fit's first step, resumed mid-epoch
            # included (checkpoint restore, first fetch): not a training period.
            self.router.interrupt()
            self._first_batch = False
        self.router.resume()  # after whatever paused the clock (validation, a checkpoint)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        averager, sampler = self._averager, self._sampler
        if averager is None or sampler is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        record = sampler.pop_record(self._step_key)
        self._reset_on_lr_drop(optimizer, averager)
        averager.before_local_step()
        factor = record.num_samples / (sampler.step_batch_size / self.world_size) if self.lr_scaling else 1.0
        loader_seconds = self._loader_clock.read(self._step_key) if self._loader_clock is not None else 0.0
        timing = self.router.timing(record, self._module.trainer.global_step, loader_seconds)
        with _scaled_learning_rate(optimizer, factor), timing:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.merged_last_step = averager.after_local_step(record.num_samples)
        if self.merged_last_step:
            self._merge(averager, optimizer)
        if self.telemetry and self.is_global_zero and self.router.latest_reports and self._logs_this_step():
            self._log_telemetry()
        return output

    def _log_telemetry(self) -> None:
        # Every rank holds the same numbers (those of the latest merge), so rank zero hands them to the loggers
        # directly: through `LightningModule.log_dict` a score of metrics costs tens of milliseconds.
        assert self.router.plan_book is not None
        trainer = self._module.trainer
        metrics = replica_metrics(self.router.stats(), self.router.plan_book.latest)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _merge(self, averager: ElasticAverager, optimizer: torch.optim.Optimizer) -> None:
        weight = averager.own_weight()
        nudging = self.l2_nudge and self._l2_trend.active and averager.local_steps > self.warmup_steps
        if nudging and self.router.merge_weights:
            # Which replica is fastest or slowest is decided from the previous merge's weights, which every
            # replica holds: the nudge then needs no collective of its own.
            weight *= nudge_factor(self.router.merge_weights, self.global_rank)
        stop = bool(getattr(self._module.trainer, "received_sigterm", False))
        report = self.router.report(weight, stop=stop)
        center, rows = averager.merge(weight, optimizer, report.as_row())
        if self.l2_nudge:
            self._l2_trend.update(float(center.norm()))
        self.router.receive(rows, self._step_key)

    def _logs_this_step(self) -> bool:
        # Only on the steps Lightning's loggers write.
        trainer = self._module.trainer
        every, step = max(1, int(trainer.log_every_n_steps)), int(trainer.global_step)
        return (step + 1) % every == 0

    def _reset_on_lr_drop(self, optimizer: torch.optim.Optimizer, averager: ElasticAverager) -> None:
        # Crossbow copies the central model into every replica when the learning rate drops.
        lr = float(optimizer.param_groups[0]["lr"])
        if averager.rule.resets_on_lr_drop and self._last_lr is not None and lr < self._last_lr:
            averager.reset_to_center()
        self._last_lr = lr

    # --- evaluation and the end of fit ------------------------------------------------------------------------

    @override
    def on_validation_start(self) -> None:
        if self._averager is not None:
            self.router.pause()  # before the swap-in's collective: waiting for peers is not this replica's time
            self._averager.swap_in_global_model()
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        if self._averager is not None:
            self._averager.swap_out()
            self.router.resume()
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        # The module leaves fit holding the merged model: that is what `trainer.test` and users' code see.
        if self._averager is not None:
            self._averager.adopt_global_model()
            if self.telemetry and self.is_global_zero and self.router.latest_reports:
                stats, sizes = self.router.stats(), self.router.history[-1][2]
                unit = "units" if self.router.cost_aware else "samples"
                table = summary_table(stats, sizes, self._averager.merges, unit, self.router.floor)
                log.info("\n%s", table)
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self._stop_check is not None:
            self._stop_check.restore()
            self._stop_check = None
        self._averager = None
        self._sampler = None
        self.router.detach()
        super().teardown()

    # --- checkpoints --------------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The merged model (a collective: Lightning calls this on every rank), plus the replicas' own states."""
        averager = self._averager
        if averager is None:
            return super().lightning_module_state_dict()
        self.router.pause()  # writing a checkpoint is not training time
        was_swapped = averager.swapped_in
        averager.swap_in_global_model()
        state = {name: tensor.clone() for name, tensor in self._module.state_dict().items()}
        if not was_swapped:
            averager.swap_out()
        optimizer = self.optimizers[0] if self.optimizers else None
        self._checkpoint_extras = gather_training_state(
            averager, self.router, self._l2_trend, optimizer, with_replicas=self.checkpoint_replicas
        )
        return state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # Weights-only checkpoints carry no training state, so they get no replica states either.
        if self._checkpoint_extras is not None and "optimizer_states" in checkpoint:
            checkpoint[CHECKPOINT_KEY] = self._checkpoint_extras
        self._checkpoint_extras = None
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        extras = checkpoint.get(CHECKPOINT_KEY)
        if extras is not None and self._averager is not None:
            optimizer = self.optimizers[0] if self.optimizers else None
            restore_training_state(extras, self._averager, self.router, self._l2_trend, optimizer, self.root_device)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``adaptive_elastic`` (popen launcher) and ``adaptive_elastic_spawn``, idempotently."""
        entries = ((cls.strategy_name, "popen"), (f"{cls.strategy_name}_spawn", "spawn"))
        for name, start_method in entries:
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"Adaptive elastic model-averaging SGD with start_method '{start_method}'",
                    start_method=start_method,
                )


class AdaptiveElasticStrategy(AdaptiveElasticMixin, DDPStrategy):
    """Adaptive elastic training as a ``pytorch_lightning`` strategy. See :class:`AdaptiveElasticMixin`."""


# Which constructor argument of each named rule the strategy's `alpha` and `momentum` set.
_RULE_ARGUMENTS = {
    "elastic_average": {"alpha": "alpha", "momentum": "momentum"},
    "sma": {"alpha": "alpha", "momentum": "central_momentum"},
    "easgd": {},
}


def _resolve_rule(rule: MergeRule | str, alpha: float | None, momentum: float | None) -> MergeRule:
    given = {name: value for name, value in (("alpha", alpha), ("momentum", momentum)) if value is not None}
    if not isinstance(rule, str):
        if given:
            raise ValueError(f"Set {sorted(given)} on the {type(rule).__name__} object, not on the strategy.")
        return rule
    names = _RULE_ARGUMENTS.get(rule, {})
    unknown = sorted(set(given) - set(names))
    if unknown and rule in _RULE_ARGUMENTS:
        raise ValueError(
            f"The {rule!r} merge rule takes no {unknown}. HINT: pass merge_rule=EASGD(beta=...) to tune EASGD."
        )
    return get_merge_rule(rule, **{names[key]: value for key, value in given.items()})


def _broadcast_module(module: torch.nn.Module, comm: Communicator, with_buffers: bool) -> None:
    for view in (FlatView(trainable_parameters(module)), FlatView(floating_buffers(module) if with_buffers else [])):
        if view:
            flat = view.read()
            comm.broadcast_(flat, src=0)
            view.write_(flat)


class _StopCheck:
    """Lightning's per-step SIGTERM check, answered from the merge that just ran instead of a broadcast.

    Lightning's training epoch loop broadcasts rank zero's "received SIGTERM" flag at the start of every step:
    a collective per step, and a synchronisation point where fast replicas would wait for slow ones outside
    the merge, hiding what the arrival sensing must see. Every replica's flag travels in the merge's report
    instead: after a step that merged, once any replica asked to stop, every replica stops before the next
    step. After a step without a merge (``period > 1``) Lightning's own broadcast runs, as under DDP.
    """

    def __init__(self, loop: Any, strategy: AdaptiveElasticMixin) -> None:
        self.loop = loop
        self.strategy = strategy
        self.broadcast = loop._broadcast_sigterm_tensor
        # The loop's own module imports the exception of whichever Lightning namespace is running.
        self.exception = sys.modules[type(loop).__module__].SIGTERMException
        loop._broadcast_sigterm_tensor = self

    def __call__(self) -> None:
        if not self.strategy.merged_last_step:
            self.broadcast()
        elif self.strategy.router.stop_requested:
            raise self.exception()

    def restore(self) -> None:
        """Give the loop back its own method."""
        if self.loop.__dict__.get("_broadcast_sigterm_tensor") is self:
            del self.loop._broadcast_sigterm_tensor


def _replace_stop_broadcast(trainer: Any, strategy: AdaptiveElasticMixin) -> _StopCheck | None:
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    module = sys.modules.get(type(loop).__module__) if loop is not None else None
    if not hasattr(loop, "_broadcast_sigterm_tensor") or not hasattr(module, "SIGTERMException"):
        return None  # another Lightning version: keep its check, and its collective
    return _StopCheck(loop, strategy)


@contextmanager
def _scaled_learning_rate(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Scale every param group's learning rate for one optimizer step, then restore it.

    Restoring keeps the user's schedulers in charge: they read and write the unscaled rate between steps.
    """
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
