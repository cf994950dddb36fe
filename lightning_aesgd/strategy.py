"""The ``adaptive_elastic`` Lightning strategy: one replica per process, batches that follow measured speeds.

Processes are launched exactly as Lightning's DDP launches them (popen script launcher, spawn, torchrun,
SLURM). The strategy is only Lightning's hooks, each delegating to the Lightning-free engine that its
:class:`~lightning_aesgd.settings.StrategySettings` build: gradient sums weighted by each replica's share of the
step's samples (``sync="gradients"``, the default) or periodic model merges (``sync="models"``). The hooks live in
:class:`AdaptiveElasticMixin`, which is free of namespace imports, so the same code serves ``pytorch_lightning``
(this module) and the unified ``lightning`` package (:mod:`lightning_aesgd.unified`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import torch
from pytorch_lightning.strategies import DDPStrategy
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_aesgd.checks import (
    check_callbacks,
    check_delayed_optimizers,
    check_fit_settings,
    check_gradient_settings,
    check_learner_settings,
    check_one_training_loader,
    check_training_loader,
    warn_unrepeatable_plans,
)
from lightning_aesgd.core.apportion import High, Low
from lightning_aesgd.core.merge import MergeRule
from lightning_aesgd.core.planners import Planner
from lightning_aesgd.core.weights import MergeWeights
from lightning_aesgd.emulation import StepStretcher
from lightning_aesgd.engine.averager import OptimizerStateMode
from lightning_aesgd.engine.collective_watch import device_group_timeout
from lightning_aesgd.engine.comm import HOST_WAITING_BACKENDS, ReplicaStalledError, default_communicator
from lightning_aesgd.engine.learner_tuning import measure_learners
from lightning_aesgd.engine.loading import SampleCosts, is_idle
from lightning_aesgd.engine.optimizer_shapes import fit_optimizer_state, one_model_state
from lightning_aesgd.engine.pipeline import CHECKPOINT_KEY, StepPipeline, TrainerHooks
from lightning_aesgd.engine.plan_loop import PlanLoop
from lightning_aesgd.idle_steps import (
    bare_zero,
    batch_hooks_in_training,
    collectives_in_training,
    idle_training_step,
)
from lightning_aesgd.placement import SharedDevices, mixes_device_types
from lightning_aesgd.settings import StrategySettings, check_launch, refuse_unknown_options
from lightning_aesgd.sigterm import StopCheck, replace_stop_broadcast
from lightning_aesgd.torchrun_store import destroy_group_at_exit, end_launched_replicas, init_attempt_group
from lightning_aesgd.trainer_io import SUMMARY_FILE as SUMMARY_FILE  # re-exported: where tests and users import it
from lightning_aesgd.trainer_io import (
    before_train_end,
    clip_gradients,
    judges_training_metrics,
    log_metrics,
    logs_this_step,
    loop_start,
    resumed_position,
    save_summary,
    set_up_training_data_again,
    warn_if_estimate_differs,
)
from lightning_aesgd.user_collectives import (
    StepCollectives,
    check_rows,
    check_same_shapes,
    padded_rows,
    rows_in_rank_order,
    shape_descriptor,
    shapes_from,
)

log = logging.getLogger(__name__)

UNUSED_PARAMETERS = re.compile(r".*Expected to have finished reduction in the prior iteration.*", re.DOTALL)
"""What DDP's reducer says when a parameter got no gradient in the previous step."""
UNUSED_PARAMETERS_HINT = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step. HINT: if this is intentional, let the strategy detect them: "
    "AdaptiveElasticStrategy(find_unused_parameters=True) (Hydra: +algorithm.find_unused_parameters=true)."
)


class AdaptiveElasticMixin(SharedDevices):
    """Adaptive elastic training, for any Lightning namespace's ``DDPStrategy``.

    One replica per process, each step's samples split among the replicas by their measured speeds, and every
    hook delegated to the Lightning-free engine that the strategy's settings build.

    Args:
        training options: ``sync``, ``period``, ... ``telemetry``: documented and checked, with their defaults, by
            :class:`~lightning_aesgd.settings.StrategySettings`, to which they are forwarded.
        replicas_per_device: replica processes on every device (e.g. 4 replicas sharing one GPU, over gloo, to
            run and measure several replicas on a single-GPU machine); 1, one per device, as DDP.
        replica_devices: every replica's device on each node, in place of Lightning's devices: e.g.
            ``["cuda:0", "cpu", "cpu"]`` (CPU replicas beside a GPU replica, as Adaptive Hogbatch), or ``"auto"``
            (every GPU, then CPU replicas on the spare cores). Each rank sets up its own accelerator, precision
            (32-bit on CPU) and threads; see :mod:`lightning_aesgd.placement`.
        process_group_backend: torch.distributed backend; gloo on CPU and nccl on CUDA by default (gloo where
            replicas share a GPU or mix CPU and GPU).
        timeout: timeout of collectives.
        start_method: how processes are launched: ``"popen"`` (re-run the script), ``"spawn"`` or ``"fork"``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: set by Lightning's
            connector, as for every parallel strategy.
        **unexpected: none is accepted: a misspelt option fails with the list of valid ones.
    """

    strategy_name = "adaptive_elastic"

    def __init__(
        self,
        *,
        period: int = StrategySettings.period,
        warmup_steps: int = StrategySettings.warmup_steps,
        merge_rule: MergeRule | str = StrategySettings.merge_rule,
        merge_weights: MergeWeights = StrategySettings.merge_weights,
        l2_nudge: bool = StrategySettings.l2_nudge,
        merge_buffers: bool = StrategySettings.merge_buffers,
        optimizer_state: OptimizerStateMode = StrategySettings.optimizer_state,
        planner: str | Planner = StrategySettings.planner,
        shares: Sequence[float] | None = StrategySettings.shares,
        min_batch: Low = StrategySettings.min_batch,
        min_share: float | Sequence[float] = StrategySettings.min_share,
        max_batch: High = StrategySettings.max_batch,
        step_batch_size: int | None = StrategySettings.step_batch_size,
        plan_lag: int | None = StrategySettings.plan_lag,
        speed_smoothing: float = StrategySettings.speed_smoothing,
        plan_gain: float = StrategySettings.plan_gain,
        plan_after_warmup: bool = StrategySettings.plan_after_warmup,
        leave_out_stragglers: bool = StrategySettings.leave_out_stragglers,
        sample_costs: SampleCosts = StrategySettings.sample_costs,
        lr_scaling: bool = StrategySettings.lr_scaling,
        lr_schedule: Callable[[int], float] | None = StrategySettings.lr_schedule,
        sync: Literal["models", "gradients"] = StrategySettings.sync,
        gradient_delay: int = StrategySettings.gradient_delay,
        compensate_momentum: bool = StrategySettings.compensate_momentum,
        gradient_delay_warmup: int = StrategySettings.gradient_delay_warmup,
        gradient_delay_lr_scale: float = StrategySettings.gradient_delay_lr_scale,
        find_unused_parameters: bool = StrategySettings.find_unused_parameters,
        gradient_as_bucket_view: bool = StrategySettings.gradient_as_bucket_view,
        slowdown: Any = StrategySettings.slowdown,
        checkpoint_replicas: bool = StrategySettings.checkpoint_replicas,
        telemetry: bool = StrategySettings.telemetry,
        learners_per_device: int | Literal["auto"] = StrategySettings.learners_per_device,
        max_learners: int = StrategySettings.max_learners,
        learner_min_gain: float = StrategySettings.learner_min_gain,
        replicas_per_device: int = 1,
        replica_devices: Sequence[str] | Literal["auto"] | None = None,
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
        arguments = locals()  # every argument by name: the settings take theirs by their field names
        options = [name for name in arguments if name not in ("self", "unexpected") and not name.startswith("_")]
        refuse_unknown_options(type(self).__name__, unexpected, known=options)
        self.settings = StrategySettings(**{name: arguments[name] for name in StrategySettings.option_names()})
        check_launch(timeout, start_method)
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
            replica_devices=replica_devices,
            **self.settings.ddp_options(),
        )
        self.sync = self.settings.sync
        self.merging = self.settings.merging  # checked in either mode; used by model merging only
        self.slowdown = self.settings.step_slowdown
        self.telemetry = self.settings.telemetry
        self.engine: StepPipeline = self.settings.build_engine()
        self._checkpoint_extras: dict[str, Any] | None = None
        self._idle_safety_checked = False  # whether the training step was checked for collectives (once per fit)
        self._trained_last_step = True  # whether this replica's latest training step drew data (its metrics are new)
        self._step_collectives = StepCollectives()  # the strategy's collectives that the user's training step calls
        self._stop_check: StopCheck | None = None
        self._undo_train_end: Callable[[], None] | None = None
        self._fit_finished = False
        self._counted_batches: float | None = None  # batches an epoch an estimate read before the fit began

    # LightningCLI's help describes each argument from the docstrings: the training options' are the settings'.
    __init__.__doc__ = StrategySettings.__doc__

    @property
    def plans(self) -> PlanLoop:
        """The engine's plan loop: every replica's measured speeds, the plans and their history."""
        return self.engine.plans

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
    def _sums_gradients(self) -> bool:
        return self.settings.sync == "gradients"

    @override
    def configure_ddp(self) -> None:
        """Leave the model unwrapped (replicas are merged), or, for ``sync="gradients"``, wrap it as DDP does.

        Under gradient synchronisation the wrapper's communication hook sums the replicas' gradients, each weighted
        by its share of the step's samples (see :meth:`backward`); a job of one replica has no sum to run and
        trains its model unwrapped (:meth:`~lightning_aesgd.engine.gradient_sync.GradientSync.wraps_model`).
        """
        if self.engine.wraps_model(self.world_size):
            super().configure_ddp()
            assert self.model is not None
            self.engine.configure_model(self.model)

    @override
    def setup_distributed(self) -> None:
        """Lightning's process group, on a store of this attempt's own under torchrun, destroyed first at exit.

        See :mod:`lightning_aesgd.torchrun_store`: a restarted group could read a dead attempt's keys, and a group
        left to the interpreter's exit may abort a process that finished its fit. A group whose collectives the host
        does not wait in (NCCL) waits :data:`~lightning_aesgd.engine.collective_watch.GRACE_SECONDS` longer than
        ``timeout``, so that the communicator's collective watch names a stall at ``timeout``, before the group's
        watchdog ends the process.
        """
        timeout = self._timeout
        if timeout is not None and self._watch_after() is not None:
            self._timeout = device_group_timeout(timeout)
        try:
            init_attempt_group(self)
            super().setup_distributed()
        finally:
            self._timeout = timeout
        destroy_group_at_exit()

    def _watch_after(self) -> float | None:
        """Seconds after which the communicator names a stalled device collective; ``None`` where the host waits."""
        if self._timeout is None or self._get_process_group_backend() in HOST_WAITING_BACKENDS:
            return None
        return self._timeout.total_seconds()

    @override
    def _configure_launcher(self) -> None:
        # The Trainer's connector calls this once it knows every replica (devices × nodes), before any replica
        # starts: options given per replica fail here, once, rather than in every replica after the launch.
        self.settings.check_replicas(self.world_size)
        super()._configure_launcher()

    @override
    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == "fit":
            self._idle_safety_checked = False
            self._trained_last_step = True
            check_fit_settings(trainer, self._module)
            check_callbacks(trainer, self.sync)
            warn_unrepeatable_plans(self.settings.planner)
            check_gradient_settings(self.engine, self.precision_plugin)
        super().setup(trainer)
        if trainer.state.fn != "fit":
            return
        check_delayed_optimizers(self.engine, self.optimizers)
        check_learner_settings(self.engine, trainer, self._module)
        if self.slowdown is not None:  # emulated slower devices, told of each compute span by the engine
            self.slowdown.check_replicas(self.world_size)
            self.engine.compute_spans = StepStretcher(self.slowdown, self.root_device)
        hooks = TrainerHooks(
            stop_requested=lambda: self._sigterm_received(trainer),
            grad_scaler=getattr(self.precision_plugin, "scaler", None),
            before_own_update=partial(clip_gradients, self._module),  # for a flushed delayed sum
            reducer_meets_every_step=self.settings.find_unused_parameters,  # DDP's own all-reduce of its map
            collective_timeout=timeout.total_seconds() if (timeout := getattr(self, "_timeout", None)) else None,
            mixed_device_types=mixes_device_types(self.parallel_devices or []),
        )
        comm = default_communicator(self.root_device, self._watch_after())
        self.engine.start(self._module, comm, self.root_device, hooks)
        self._counted_batches = set_up_training_data_again(trainer)
        self._stop_check = replace_stop_broadcast(trainer, self.engine)
        self._fit_finished = False
        self._undo_train_end = before_train_end(trainer, self._finish_fit)

    def _sigterm_received(self, trainer: Any) -> bool:
        """Whether this process received SIGTERM during the fit (the strategy's handler, else Lightning's flag)."""
        own = self._stop_check is not None and self._stop_check.received
        return own or bool(getattr(trainer, "received_sigterm", False))

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        if not self.engine.running or not self._module.trainer.training:
            return dataloader
        check_training_loader(dataloader)
        if self.engine.learners_undecided:
            self._choose_learners(dataloader)
        trainer = self._module.trainer
        position = resumed_position(trainer)
        loader = self.engine.training_loader(dataloader, position)
        start = loop_start(trainer, len(loader))
        if start != (position or (0, 0)):  # the loader's workers draw before the loop's reset: where it will start
            loader.batch_sampler.load_state_dict({"epoch": start[0], "steps_done": start[1]})
        loader.batch_sampler.sampler.loop_epoch = lambda: trainer.current_epoch  # steps are keyed by the loop's
        return loader

    def _choose_learners(self, dataloader: Any) -> None:
        """``learners_per_device="auto"``: time the training step of 1, 2, ... learners on the loader's first batch.

        The step is Lightning's own (the precision's context, the module's ``training_step``), on the batch as the
        training loop hands it over: converted by the precision (``*-true`` casts floats), through the module's
        batch-transfer hooks, on the device.
        """
        first = next(iter(dataloader), None)
        if first is None:
            raise ValueError(
                "learners_per_device='auto' times the training step on the training DataLoader's first batch, and "
                "the DataLoader gave none (an empty dataset, or drop_last with fewer samples than one batch). HINT: "
                "give the DataLoader at least one full batch, or set learners_per_device to a number."
            )
        batch = self._module.trainer.precision_plugin.convert_input(first)
        batch = self._module.on_before_batch_transfer(batch, dataloader_idx=0)
        batch = self.batch_to_device(batch, dataloader_idx=0)
        run_step = super().training_step
        quiet = not self.is_global_zero  # every replica measures the same step: one warning is enough
        try:
            sharers = sum(device == self.root_device for device in self.parallel_devices or []) or 1
            measure = partial(measure_learners, self._module, run_step, batch, quiet=quiet, sharers=sharers)
            self.engine.choose_learners(measure)
        except (ReplicaStalledError, torch.distributed.DistError):
            raise  # a peer's failure, as it is: the launcher ends the replicas on these
        except Exception as error:
            # Lightning hands each of several training loaders here alone, before any check sees them together.
            raise RuntimeError(
                f"learners_per_device='auto' times the training step on the training DataLoader's first batch before "
                f"the fit starts, and the step failed: {type(error).__name__}: {error}. HINT: where the fit trains on "
                "several DataLoaders at once (a dict or list of them), put the datasets behind one DataLoader, which "
                "adaptive_elastic needs; otherwise set learners_per_device to a number to see the step fail in "
                "training."
            ) from error

    # --- training -----------------------------------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        check_one_training_loader(self._module.trainer)
        if self.is_global_zero:
            warn_if_estimate_differs(self._module.trainer, self._counted_batches)
        # A resumed optimizer state may be another model shape's: one model's for several learners, or back.
        self._fit_optimizer_states()
        super().on_train_start()

    def _fit_optimizer_states(self) -> None:
        for optimizer in self.optimizers:
            fit_optimizer_state(optimizer)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        trainer = self._module.trainer
        self.engine.begin_step(trainer.current_epoch, batch_idx, trainer.global_step)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's training step; a replica left out of the step (an idle batch) computes a zero loss."""
        batch = args[0] if args else kwargs.get("batch")
        self._trained_last_step = not (self.engine.sits_out or is_idle(batch))
        if self.engine.sits_out:
            if not is_idle(batch):
                raise RuntimeError(f"A replica sitting out drew a batch of data ({type(batch).__name__}): a bug.")
            return bare_zero(self._module)  # no collective: not even DDP's forward, which would expect a sum
        if is_idle(batch):
            # Gradient sums need every parameter's zero gradient, and a grad scaler its inf checks; merges neither.
            wrapped = self.engine.wraps_model(self.world_size)
            every_parameter = wrapped or getattr(self.precision_plugin, "scaler", None) is not None
            with idle_training_step(self.lightning_module, every_parameter):
                return super().training_step(*args, **kwargs)
        learner_step = self.engine.learner_step if self.engine.ready else None
        self._step_collectives.watching = True
        try:
            if learner_step is not None:  # the replica's learners, batched: one call of the step for all of them
                output = learner_step(partial(super().training_step, **kwargs), *args)
            else:
                output = super().training_step(*args, **kwargs)
        finally:
            self._step_collectives.watching = False
        if self.engine.ready and not self._idle_safety_checked:
            # After the first step, before its reports are taken in: every rank decides alike, before any plan.
            self._idle_safety_checked = True
            trainer = self._module.trainer
            reason = (
                collectives_in_training(trainer, self._module)
                or self._step_collectives.reason()
                or batch_hooks_in_training(trainer, self._module)
            )
            if reason is not None:
                self.engine.plans.forbid_leaving_out(reason)
        return output

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Lightning's reduction (``self.log(..., sync_dist=True)``); inside a training step a mean is the step's.

        DDP's replicas hold equal batches, so the plain mean of their means is the mean over the step's samples.
        Here batches differ, so each replica's value counts with its share ``bᵢ/M`` of the step's samples:
        ``Σᵢ (bᵢ/M)·xᵢ``, sent as ``n·(bᵢ/M)·xᵢ`` into the mean. Outside training steps (validation, epoch ends,
        where Lightning weighs by the batch sizes itself) and over a group of the user's, it is Lightning's.
        """
        self._step_collectives.note("reduce")
        share = self.engine.step_share
        if share is not None and group is None and _is_mean(reduce_op) and _floating(tensor):
            tensor = tensor * (share * self.world_size)
        return super().reduce(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's vote of the replicas (a callback's stop or save); one left out of the latest step abstains.

        Its training metrics are those of its last step with data: an ``EarlyStopping`` or ``ModelCheckpoint``
        monitoring one would judge the run by a stale value (under ``all=False`` any replica stops the fit, under
        ``all=True`` any one keeps a checkpoint from being saved). It votes neither way instead: yes where all must
        agree, no where any one decides. It abstains inside the training steps, and at a validation's end of the fit
        where a callback monitors a training metric (then on every vote there: a vote does not say which callback
        casts it, so an unsynced validation metric of its own no longer counts). Otherwise (validation metrics:
        every replica's own, new) every replica votes as it decided, and so does rank zero always: some votes carry
        what only it knows (``ModelCheckpoint``'s whether a file of that name exists).
        """
        trainer = self._module.trainer if self._module is not None else None
        stale = not self._trained_last_step and not self.is_global_zero
        if stale and trainer is not None and (trainer.training or _fit_judges_training(trainer)):
            decision = all
        return super().reduce_boolean_decision(decision, all=all)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """Lightning's gather; inside a training step, tensors of different shapes fail with the fix, not a hang.

        At uneven batches a per-sample tensor differs in length from replica to replica, which a plain all-gather
        cannot take (gloo aborts the process): the shapes are gathered first, one small collective.
        """
        self._step_collectives.note("all_gather")
        if self._step_collectives.watching:  # a 0-dim tensor too: a batch of one squeezed may be 0-dim on one replica
            check_same_shapes(shapes_from(self._gathered_descriptors(tensor, group)))
        return super().all_gather(tensor, group, sync_grads)

    def _gathered_descriptors(self, tensor: torch.Tensor, group: Any | None = None) -> list[list[int]]:
        """Every replica's :func:`~lightning_aesgd.user_collectives.shape_descriptor` of its ``tensor``."""
        own = torch.tensor(shape_descriptor(tensor), dtype=torch.long, device=tensor.device)
        return [[int(n) for n in row] for row in super().all_gather(own, group=group).reshape(-1, own.numel()).tolist()]

    def all_gather_rows(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        """Every replica's rows of ``tensor``, concatenated in rank order, whatever each replica's number of rows.

        The gather for per-sample tensors (a contrastive loss's embeddings) at speed-proportional batches: under
        DDP, ``self.all_gather(tensor).flatten(0, 1)``. Rows are padded to the longest, gathered, and cut back.

        Args:
            tensor: this replica's rows, shape ``(bᵢ, ...)``; the trailing shape the same on every replica.
            sync_grads: whether gradients flow back through the gather to each replica's own rows.
        """
        self._step_collectives.note("all_gather_rows")
        sizes = check_rows(shapes_from(self._gathered_descriptors(tensor)))
        gathered = super().all_gather(padded_rows(tensor, max(sizes)), sync_grads=sync_grads)
        return rows_in_rank_order(gathered.reshape(len(sizes), max(sizes), *tensor.shape[1:]), sizes)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._step_collectives.note("barrier")
        super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._step_collectives.note("broadcast")
        return super().broadcast(obj, src)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """An idle batch stays as it is: there is nothing to move, and the user's transfer hooks expect data."""
        if is_idle(batch):
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        if not self.engine.ready:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = self._module.trainer
        closure = self.engine.after_backward_of(closure)
        output = self.engine.optimizer_step(
            optimizer, lambda: super(AdaptiveElasticMixin, self).optimizer_step(optimizer, closure, model, **kwargs)
        )
        if self.telemetry and self.is_global_zero and logs_this_step(trainer):
            log_metrics(trainer, self.engine.telemetry())
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

    def _finish_fit(self) -> None:
        """End the fit (a collective, once): the module leaves fit holding the merged model.

        Run before Lightning's ``on_train_end`` hooks, so that they, ``trainer.test`` and users' code see it.
        """
        if self._fit_finished or not self.engine.running:
            return
        self._fit_finished = True
        self.engine.finish()
        self._fit_optimizer_states()  # the module holds one model now, and so should its optimizer
        table = self.engine.summary() if self.telemetry and self.is_global_zero else None
        if table is not None:
            log.info("%s", table)
            save_summary(self._module.trainer, self.engine.summary_record())

    @override
    def on_train_end(self) -> None:
        self._finish_fit()  # done already where the fit loop's end ran it
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A stalled replica does not outlive the job: the replicas this process launched end with it.

        DDP's reducer error about unused parameters names this strategy's option (Lightning's DDP would name its own
        strategies, which leave this one).
        """
        exception.args = tuple(
            UNUSED_PARAMETERS_HINT if isinstance(arg, str) and UNUSED_PARAMETERS.match(arg) else arg
            for arg in exception.args
        )
        super().on_exception(exception)
        # torch's DistError covers a failed rendezvous too, where the children would wait for rank zero's store.
        if isinstance(exception, ReplicaStalledError | torch.distributed.DistError):
            end_launched_replicas(self.launcher)

    @override
    def teardown(self) -> None:
        if self._stop_check is not None:
            self._stop_check.restore()
            self._stop_check = None
        if self._undo_train_end is not None:
            self._undo_train_end()
            self._undo_train_end = None
        self.engine.stop()
        self._fit_optimizer_states()
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
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """One model's optimizer state, which DDP and any number of learners resume from (the learners' mean)."""
        state = super().optimizer_state(optimizer)
        shapes = self.engine.one_model_shapes()
        return one_model_state(state, getattr(optimizer, "_optimizer", optimizer), shapes) if shapes else state

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


def _fit_judges_training(trainer: Any) -> bool:
    """Whether a vote outside the training steps reads a training metric: a fit's validation, judged by one."""
    return bool(trainer.state.fn == "fit" and judges_training_metrics(trainer))


def _is_mean(reduce_op: object) -> bool:
    """Whether a reduction of Lightning's is a mean (``"mean"``, ``"avg"`` or ``ReduceOp.AVG``); ``None`` sums."""
    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return getattr(reduce_op, "name", None) == "AVG"  # ReduceOp.AVG, whose type is ReduceOp.RedOpType


def _floating(tensor: Any) -> bool:
    """Whether ``tensor`` is a floating-point tensor (an integer one keeps Lightning's plain reduction)."""
    return isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
