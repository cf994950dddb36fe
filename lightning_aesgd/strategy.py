"""The ``adaptive_elastic`` Lightning strategy: one replica per process, batches that follow measured speeds.

Processes are launched exactly as Lightning's DDP launches them (popen script launcher, spawn, torchrun,
SLURM). By default (``sync="gradients"``) the model is wrapped in ``DistributedDataParallel`` and every step
applies the sum of the replicas' gradients, each weighted by its share of the step's samples: DDP's update at
speed-proportional batches (:class:`~lightning_aesgd.engine.gradient_sync.GradientSync`). With
``sync="models"`` (Adaptive SGD and its relatives) the model is never wrapped: every Lightning step is one local
update of every replica, and replicas are merged by a :class:`~lightning_aesgd.core.merge.MergeRule` every
``period`` steps (:class:`~lightning_aesgd.engine.model_merge.ModelMerge`). The strategy is only Lightning's
hooks: each delegates to the Lightning-free engine. The hooks live in :class:`AdaptiveElasticMixin`, which is
free of namespace imports, so the same code serves ``pytorch_lightning`` (this module) and the unified
``lightning`` package (:mod:`lightning_aesgd.unified`).
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import signal
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from pytorch_lightning.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_aesgd.checks import (
    UnsupportedSettingError,
    check_fit_settings,
    check_gradient_settings,
    check_switches,
    check_sync,
    check_timeout,
)
from lightning_aesgd.core.merge import MergeRule, as_merge_rule
from lightning_aesgd.core.planners import Planner
from lightning_aesgd.core.weights import MergeWeights
from lightning_aesgd.emulation import StepStretcher, as_profile
from lightning_aesgd.engine.averager import MergeSettings, OptimizerStateMode
from lightning_aesgd.engine.comm import ReplicaStalledError, default_communicator
from lightning_aesgd.engine.gradient_sync import GradientSync
from lightning_aesgd.engine.loading import SampleCosts
from lightning_aesgd.engine.model_merge import ModelMerge
from lightning_aesgd.engine.pipeline import CHECKPOINT_KEY, StepPipeline
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.routing import Router
from lightning_aesgd.placement import SharedDevices
from lightning_aesgd.sigterm import StopCheck, replace_stop_broadcast
from lightning_aesgd.torchrun_store import attempt_store, destroy_process_group, shared_store_warning

log = logging.getLogger(__name__)

# torch 2.13 renamed DDP's per-forward buffer broadcast (`broadcast_buffers`); both keep the broadcast at wrapping.
_NO_BUFFER_SYNC_AT_FORWARD = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


class AdaptiveElasticMixin(SharedDevices):
    """Adaptive elastic training, for any Lightning namespace's ``DDPStrategy``.

    Args:
        period: local steps between merges after warm-up (torch's ``PeriodicModelAverager`` semantics).
        warmup_steps: steps at the start that each end with a merge.
        merge_rule: a :class:`~lightning_aesgd.core.merge.MergeRule` object (``ElasticAverage(alpha, momentum)``,
            ``SMA(...)``, ``EASGD(...)``), or the name of one with its defaults (``"elastic_average"``, ``"sma"``,
            ``"easgd"``).
        merge_weights: each replica's merge weight: ``"samples"`` since the last merge, ``"updates"`` or
            ``"uniform"``.
        l2_nudge: Adaptive SGD's "adaptive normalization": after warm-up, while the merged model's L2 norm keeps
            growing, the largest merge weight is raised by 10% and the smallest lowered by 10% (weights then
            renormalised; the authors' code does not renormalise).
        merge_buffers: average floating buffers (BatchNorm statistics) too; otherwise they stay local.
        optimizer_state: at a merge, ``"keep"``, ``"reset"`` or ``"average"`` the local optimizer's state.
        planner: how per-replica batch sizes follow measurements: ``"proportional"`` (share ∝ speed),
            ``"balanced"`` (equal predicted step times, fixed per-step costs included), ``"additive"`` (the paper's
            ±step rule), ``"static"`` (fixed ``shares``), or a :class:`~lightning_aesgd.core.planners.Planner`.
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
        plan_gain: fraction γ of the way to the planner's target that each new plan moves (damping); the first
            plan, from the initial split, moves all the way.
        plan_after_warmup: keep the initial plan through the ``warmup_steps`` (speeds are still measured) and
            adapt only after them, as the authors' code does; otherwise plans adapt from the first measurements.
        sample_costs: per-sample cost for cost-aware splitting: ``None`` (count samples), ``"dataset"`` (the
            dataset's ``sample_costs`` attribute), ``"auto"`` (those where the dataset has them) or a function of
            the dataset.
        lr_scaling: scale each replica's learning rate by its batch size over the nominal one during its step
            (the paper's ``lrᵢ = η·bᵢ/B``). With ``merge_weights="updates"`` this weighs every sample equally, as
            ``merge_weights="samples"`` does without scaling.
        lr_schedule: a factor on each replica's learning rate during its step, a function of the global step
            (e.g. :class:`~lightning_aesgd.core.lr.InverseTimeDecay`, the paper's warm-up ramp and ``1/(1 + decay·t)``);
            it multiplies ``lr_scaling``'s factor and, like it, leaves the optimizer's own rate (and the user's
            schedulers) alone between steps.
        sync: what the replicas synchronise. ``"gradients"`` (the default): DDP's reducer with each replica's
            gradient weighted by its share of the step's samples, ``Σᵢ (bᵢ/M)·gᵢ``, the gradient of the whole step
            batch: DDP's update for any optimizer, at speed-proportional batches (see
            :mod:`lightning_aesgd.engine.gradients`); the merge options (period, merge_rule, merge_weights,
            l2_nudge, merge_buffers, optimizer_state, lr_scaling) do not apply to it. ``"models"``: local steps and
            elastic model merges (the options above): Adaptive SGD, SMA, EASGD, local SGD.
        gradient_delay: with ``sync="gradients"``, 1 applies each step's sum one step later while the next step
            computes (ABS-SGD); 0 applies it at once.
        compensate_momentum: with ``gradient_delay=1``, give parameters whose optimizer group has a momentum
            ``μ > 0`` (SGD) ``(1 + μ)·Ĝ_{t−1} − μ·Ĝ_{t−2}`` in place of the stale sum ``Ĝ_{t−1}`` (spike compensation,
            Kosson et al., MLSys 2021): a one-step-stale gradient under momentum 0.9 otherwise overshoots.
        gradient_delay_warmup: with ``gradient_delay=1``, the first this many global steps apply their own sum at
            once (synchronous); the delay starts after them. The first steps, where the gradient changes fastest,
            suffer most from staleness.
        gradient_delay_lr_scale: with ``gradient_delay=1``, a factor on the learning rate of every update that
            applies a stale sum, one computed before the latest update (the optimizer's own rate and schedulers are
            left alone; a sum whose step applied nothing, the first after a start or a flush, is fresh). 1 is the
            paper's rule; ½ (``algorithm=abs_sgd``) keeps the stability margin of the synchronous step size, which
            a stale update halves (:func:`~lightning_aesgd.core.lr.stale_update_scale`).
        find_unused_parameters: with ``sync="gradients"``, DistributedDataParallel's option of that name.
        slowdown: emulate slower devices by a factor per replica, in the ``step`` mode: the spans where each
            replica's device computes take ``fᵣ`` times as long (see :mod:`lightning_aesgd.emulation`; the other
            modes come from :class:`~lightning_aesgd.callbacks.SlowdownCallback`).
        checkpoint_replicas: save every replica's own model and optimizer state, so that resuming continues
            exactly; otherwise every replica resumes from the merged model.
        telemetry: log ``aesgd/...`` metrics at every merge and print a per-replica summary when fit ends.
        replicas_per_device: replica processes on every device (e.g. 4 replicas sharing one GPU, over gloo, to
            run and measure several replicas on a single-GPU machine); 1, one per device, as DDP.
        process_group_backend: torch.distributed backend; gloo on CPU and nccl on CUDA by default (gloo where
            replicas share a GPU).
        timeout: timeout of collectives.
        start_method: how processes are launched: ``"popen"`` (re-run the script), ``"spawn"`` or ``"fork"``.
        accelerator: set by Lightning's connector, as for every parallel strategy.
        parallel_devices: set by Lightning's connector.
        cluster_environment: set by Lightning's connector.
        checkpoint_io: set by Lightning's connector.
        precision_plugin: set by Lightning's connector.
        **unexpected: none is accepted: a misspelt option fails with the list of valid ones.
    """

    strategy_name = "adaptive_elastic"

    def __init__(
        self,
        *,
        period: int = MergeSettings.period,
        warmup_steps: int = MergeSettings.warmup_steps,
        merge_rule: MergeRule | str = "elastic_average",
        merge_weights: MergeWeights = MergeSettings.weights,
        l2_nudge: bool = False,
        merge_buffers: bool = MergeSettings.merge_buffers,
        optimizer_state: OptimizerStateMode = MergeSettings.optimizer_state,
        planner: str | Planner = PlanSettings.planner,
        shares: Sequence[float] | None = PlanSettings.shares,
        min_batch: int = PlanSettings.min_batch,
        min_share: float = PlanSettings.min_share,
        max_batch: int | None = PlanSettings.max_batch,
        step_batch_size: int | None = None,
        plan_lag: int | None = None,
        speed_smoothing: float = PlanSettings.speed_smoothing,
        plan_gain: float = PlanSettings.plan_gain,
        plan_after_warmup: bool = False,
        sample_costs: SampleCosts = None,
        lr_scaling: bool = False,
        lr_schedule: Callable[[int], float] | None = None,
        sync: Literal["models", "gradients"] = "gradients",
        gradient_delay: int = 0,
        compensate_momentum: bool = True,
        gradient_delay_warmup: int = 0,
        gradient_delay_lr_scale: float = 1.0,
        find_unused_parameters: bool = False,
        slowdown: Any = None,
        checkpoint_replicas: bool = True,
        telemetry: bool = True,
        replicas_per_device: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        **unexpected: Any,
    ) -> None:
        # Every argument is explicit, so that LightningCLI and jsonargparse list exactly these (not DDP's, which a
        # strategy without DistributedDataParallel would ignore); `unexpected` exists only to name typos.
        unknown = sorted(unexpected)
        if {"alpha", "momentum"} & set(unknown):
            raise TypeError(
                f"{type(self).__name__} takes no {sorted({'alpha', 'momentum'} & set(unknown))}: they belong to the "
                "merge rule. HINT: pass merge_rule=ElasticAverage(alpha=..., momentum=...) (or SMA(...), EASGD(...))."
            )
        if unknown:
            # DDPStrategy would pass them to DistributedDataParallel, which this strategy never builds: a typo
            # would vanish silently.
            raise TypeError(
                f"{type(self).__name__} got unexpected arguments {unknown}. HINT: check the spelling against "
                "the options in its docstring (period, warmup_steps, merge_rule, planner, ...)."
            )
        check_switches(
            l2_nudge=l2_nudge,
            lr_scaling=lr_scaling,
            plan_after_warmup=plan_after_warmup,
            checkpoint_replicas=checkpoint_replicas,
            telemetry=telemetry,
            find_unused_parameters=find_unused_parameters,
            compensate_momentum=compensate_momentum,
        )
        check_timeout(timeout)
        # Checked in either mode, so that a wrong value is named as such before sync='gradients' refuses the option.
        merging = MergeSettings(
            as_merge_rule(merge_rule), period, warmup_steps, merge_weights, merge_buffers, optimizer_state
        )
        check_sync(
            sync,
            gradient_delay,
            gradient_delay_warmup,
            gradient_delay_lr_scale,
            merge_options={
                "period": (period, MergeSettings.period),
                "merge_rule": (merge_rule, "elastic_average"),
                "merge_weights": (merge_weights, MergeSettings.weights),
                "l2_nudge": (l2_nudge, False),
                "merge_buffers": (merge_buffers, MergeSettings.merge_buffers),
                "optimizer_state": (optimizer_state, MergeSettings.optimizer_state),
                "lr_scaling": (lr_scaling, False),
                "find_unused_parameters": (find_unused_parameters, False),
            },
        )
        # Buffers (BatchNorm statistics) go from rank zero at evaluation, checkpoints and the end of fit instead of
        # at every forward: DDP's per-forward broadcast would be a second synchronisation point per step, which
        # arrival sensing would count as work and which the delayed sum could not overlap (see GradientSync).
        ddp_options: dict[str, Any] = (
            {"find_unused_parameters": find_unused_parameters, **_NO_BUFFER_SYNC_AT_FORWARD}
            if sync == "gradients"
            else {}
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            replicas_per_device=replicas_per_device,
            **ddp_options,
        )
        self.sync = sync
        self.merging = merging  # checked in either mode; used by model merging only
        profile = as_profile(slowdown)
        self.slowdown = profile if profile is not None and profile.mode == "step" else None
        hold_steps = warmup_steps if plan_after_warmup else 0
        planning = PlanSettings(
            planner, shares, min_batch, max_batch, min_share, speed_smoothing, plan_gain, hold_steps=hold_steps
        )
        if sync == "gradients":
            self.engine: StepPipeline = GradientSync(
                planning,
                delay=gradient_delay,
                compensate_momentum=compensate_momentum,
                delay_warmup=gradient_delay_warmup,
                delay_lr_scale=float(gradient_delay_lr_scale),
                lr_schedule=lr_schedule,
                step_batch_size=step_batch_size,
                plan_lag=plan_lag,
                sample_costs=sample_costs,
            )
        else:
            self.engine = ModelMerge(
                merging,
                planning,
                l2_nudge=l2_nudge,
                lr_scaling=lr_scaling,
                lr_schedule=lr_schedule,
                step_batch_size=step_batch_size,
                plan_lag=plan_lag,
                sample_costs=sample_costs,
                checkpoint_replicas=checkpoint_replicas,
            )
        self.telemetry = telemetry
        self._checkpoint_extras: dict[str, Any] | None = None
        self._stop_check: StopCheck | None = None

    @property
    def router(self) -> Router:
        """The engine's router: measured speeds, plans and their history."""
        return self.engine.router

    @property
    def period(self) -> int:
        """Local steps between merges after warm-up."""
        return self.merging.period

    @property
    def warmup_steps(self) -> int:
        """Steps at the start that each end with a merge."""
        return self.merging.warmup_steps

    @property
    def merge_rule(self) -> MergeRule:
        """The merge rule in use."""
        return self.merging.rule

    @property
    def _module(self) -> Any:
        module = self.lightning_module
        assert module is not None, "the strategy is not connected to a LightningModule"
        return module

    # --- set-up -------------------------------------------------------------------------------------------

    @override
    def configure_ddp(self) -> None:
        """Leave the model unwrapped (replicas are merged), or, for ``sync="gradients"``, wrap it as DDP does.

        Under gradient synchronisation the wrapper's communication hook sums the replicas' gradients, each weighted
        by its share of the step's samples (see :meth:`backward`).
        """
        if self.engine.wraps_model:
            super().configure_ddp()
            assert self.model is not None
            self.engine.configure_model(self.model)

    @override
    def setup_distributed(self) -> None:
        """Lightning's process group, with a store of its own per attempt under a single-node torchrun.

        torchrun's agent keeps one store across restarts, and a restarted group could read the dead attempt's
        keys (see :mod:`lightning_aesgd.torchrun_store`). Where that applies the group is created here on a store whose
        keys belong to this attempt; Lightning's own set-up then finds it initialised and keeps it.
        """
        warning = shared_store_warning()
        if warning is not None and self.global_rank == 0:
            log.warning(warning)
        store = attempt_store(self._timeout)
        if store is not None and not torch.distributed.is_initialized():
            self._init_process_group_on(store)
        super().setup_distributed()
        # A group left to the interpreter's exit may abort the process after a successful fit ("terminate called
        # without an active exception": gloo's threads outlive the group's destruction order at shutdown), which a
        # launcher counts as a failure. Destroyed first at exit instead; forked replicas leave by os._exit.
        _destroy_group_at_exit()

    def _init_process_group_on(self, store: Any) -> None:
        """What Lightning's ``_init_dist_connection`` does, on the given store instead of ``env://``."""
        self.set_world_ranks()
        assert self.cluster_environment is not None
        torch.distributed.init_process_group(
            self._get_process_group_backend(),
            store=store,
            rank=self.cluster_environment.global_rank(),
            world_size=self.cluster_environment.world_size(),
            timeout=self._timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )

    @override
    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == "fit":
            check_fit_settings(trainer, self._module)
            check_gradient_settings(self.engine, trainer, self.precision_plugin)
        super().setup(trainer)
        if trainer.state.fn != "fit":
            return
        if self.slowdown is not None:  # emulated slower devices, told of each compute span by the engine
            self.slowdown.check_replicas(self.world_size)
            self.engine.compute_spans = StepStretcher(self.slowdown, self.root_device)
        self.engine.start(self._module, default_communicator(self.root_device), self.root_device)
        self.engine.before_own_update = self._clip_gradients
        self._stop_check = replace_stop_broadcast(trainer, self.engine)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        if not self.engine.running or not self._module.trainer.training:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            # Without its own loader the strategy cannot split the steps: replicas would train on unknown shares.
            raise UnsupportedSettingError(
                "adaptive_elastic splits each step's samples among replicas by rebuilding the training DataLoader; "
                f"the training data is a {type(dataloader).__name__}, not a torch DataLoader. HINT: return "
                "torch.utils.data.DataLoader(dataset, batch_size=..., shuffle=...) over a map-style dataset, or "
                "train with strategy='ddp'."
            )
        return self.engine.training_loader(dataloader, _resumed_position(self._module.trainer))

    # --- training -----------------------------------------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        trainer = self._module.trainer
        self.engine.begin_step(trainer.current_epoch, batch_idx, trainer.global_step)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        if not self.engine.ready:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = self._module.trainer
        closure = self.engine.after_backward_of(closure)
        output = self.engine.optimizer_step(
            optimizer,
            lambda: super(AdaptiveElasticMixin, self).optimizer_step(optimizer, closure, model, **kwargs),
            lambda: bool(getattr(trainer, "received_sigterm", False)),
            grad_scaler=getattr(self.precision_plugin, "scaler", None),
        )
        if self.telemetry and self.is_global_zero and _logs_this_step(trainer):
            self._log_telemetry(trainer)
        return output

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's backward; under ``sync="gradients"`` of the loss times this replica's share ``bᵢ/M``.

        The gradient then enters DDP's sum already weighted: one multiplication, where weighting the buckets
        would cost a pass over every gradient (and a sparse embedding gradient holds a row per occurrence).
        """
        if self.engine.ready and self.engine.loss_weight != 1.0:
            closure_loss = closure_loss * self.engine.loss_weight
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _clip_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """The Trainer's gradient clipping, for an update the strategy applies itself (a flushed delayed sum)."""
        trainer = self._module.trainer
        self._module.configure_gradient_clipping(
            optimizer,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
        )

    def _log_telemetry(self, trainer: Any) -> None:
        # Every rank holds the same numbers (those of the latest merge), so rank zero hands them to the loggers
        # directly: through `LightningModule.log_dict` a score of metrics costs tens of milliseconds.
        metrics = self.engine.telemetry()
        if metrics is not None:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    # --- evaluation and the end of fit ------------------------------------------------------------------------

    @override
    def on_validation_start(self) -> None:
        if self.engine.running:
            self.engine.begin_evaluation()
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        if self.engine.running:
            self.engine.end_evaluation()
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        # The module leaves fit holding the merged model: that is what `trainer.test` and users' code see.
        if self.engine.running:
            self.engine.finish()
            table = self.engine.summary() if self.telemetry and self.is_global_zero else None
            if table is not None:
                log.info("%s", table)
                _save_summary(self._module.trainer, self.engine.summary_record())
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A stalled replica does not outlive the job: the replicas this process launched end with it.

        Under the script launcher rank zero starts the other ranks; Lightning ends them when a child fails, but
        when rank zero fails first (its merge timed out because a child stalls, or the rendezvous failed) the child
        would live on as an orphan until it wakes. torchrun, the spawn launcher and SLURM end their processes
        themselves.
        """
        super().on_exception(exception)
        # torch's DistError covers a failed rendezvous too, where the children would wait for rank zero's store.
        if isinstance(exception, ReplicaStalledError | torch.distributed.DistError):
            _end_launched_replicas(self.launcher)

    @override
    def teardown(self) -> None:
        if self._stop_check is not None:
            self._stop_check.restore()
            self._stop_check = None
        self.engine.stop()
        super().teardown()

    # --- checkpoints --------------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The merged model (a collective: Lightning calls this on every rank), plus the replicas' own states."""
        if not self.engine.running:
            return super().lightning_module_state_dict()
        state = self.engine.global_model_state(self._module)
        self._checkpoint_extras = self.engine.training_state(self.optimizers[0] if self.optimizers else None)
        return state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # Weights-only checkpoints carry no training state, so they get no replica states either.
        if self._checkpoint_extras is not None and "optimizer_states" in checkpoint:
            checkpoint[CHECKPOINT_KEY] = self._checkpoint_extras
        if self.engine.ready:
            # The loop's own progress is the loader's position: leaving the loader's copy out lets DDP resume
            # from this checkpoint (its plain loader has no state to take it).
            checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).pop("combined_loader", None)
        self._checkpoint_extras = None
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        extras = checkpoint.get(CHECKPOINT_KEY)
        if extras is not None and self.engine.running:
            optimizer = self.optimizers[0] if self.optimizers else None
            self.engine.load_training_state(extras, optimizer, self.root_device)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the strategy's names, idempotently, as Lightning registers DDP's.

        ``adaptive_elastic`` (popen launcher: the script runs again per replica), ``adaptive_elastic_spawn``, and
        ``adaptive_elastic_fork`` and ``adaptive_elastic_notebook`` (forked replicas, as ``ddp_fork`` and
        ``ddp_notebook``: the only kind that works from a notebook or an interactive session, on Linux and macOS,
        with nothing initialised on CUDA before the fork).
        """
        entries = (
            (cls.strategy_name, "popen", ""),
            (f"{cls.strategy_name}_spawn", "spawn", ""),
            (f"{cls.strategy_name}_fork", "fork", ""),
            (f"{cls.strategy_name}_notebook", "fork", " (for notebooks and interactive sessions)"),
        )
        for name, start_method, use in entries:
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"Adaptive elastic training at measured speeds with start_method '{start_method}'{use}",
                    start_method=start_method,
                )


class AdaptiveElasticStrategy(AdaptiveElasticMixin, DDPStrategy):
    """Adaptive elastic training as a ``pytorch_lightning`` strategy. See :class:`AdaptiveElasticMixin`."""


def _destroy_group_at_exit() -> None:
    """Register :func:`destroy_process_group` to run at interpreter exit, once per process."""
    if not getattr(_destroy_group_at_exit, "registered", False):
        atexit.register(destroy_process_group)
        _destroy_group_at_exit.registered = True  # type: ignore[attr-defined]


def _resumed_position(trainer: Any) -> tuple[int, int] | None:
    """Where a restored training loop resumes: (epoch, batches of it processed), or None for a fresh fit."""
    if not trainer.fit_loop.restarting:
        return None
    return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.processed


def _end_launched_replicas(launcher: Any) -> None:
    """Kill the processes a script launcher started (Lightning's own answer to a failed child: SIGKILL)."""
    children = getattr(launcher, "procs", None)
    if not children:
        return
    # SIGTERM is not enough: a process blocked in a collective or a C extension may never handle it.
    kill = getattr(signal, "SIGKILL", signal.SIGTERM)
    for child in children:
        if child.poll() is None:
            log.error("Ending replica process %d, launched by this one, as the job cannot go on.", child.pid)
            child.send_signal(kill)


SUMMARY_FILE = "aesgd_summary.json"
"""The end-of-fit summary as JSON, in the first logger's directory (see :func:`_save_summary`)."""


def _save_summary(trainer: Any, record: dict[str, Any] | None) -> None:
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


def _logs_this_step(trainer: Any) -> bool:
    """Whether Lightning's loggers write at this step."""
    every, step = max(1, int(trainer.log_every_n_steps)), int(trainer.global_step)
    return (step + 1) % every == 0
