"""Model merging (``sync="models"``): local steps, and replicas merged every ``period`` steps by a merge rule.

:class:`ModelMerge` is the :class:`~lightning_aesgd.engine.pipeline.StepPipeline` of Adaptive SGD and its
relatives (SMA, EASGD, local SGD): the model is not wrapped, every Lightning step is one local update of every
replica, and at a merge the replicas' models are averaged with weights and written back elastically
(:class:`~lightning_aesgd.engine.averager.ElasticAverager`, the rules of :mod:`lightning_aesgd.core.merge`). The
algorithm rules that act between steps live here too: adaptive normalization, Crossbow's reset on a learning-rate
drop, per-replica learning-rate scaling, and the exclusion of a replica whose model is not finite.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from typing_extensions import Unpack

from lightning_aesgd.core.schedule import LearningRateDrop
from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.core.tuning import rates_text
from lightning_aesgd.core.weights import AdaptiveNormalization, linear_lr_scale
from lightning_aesgd.engine import stalls
from lightning_aesgd.engine.admission import MIN_PROBE_INTERVAL
from lightning_aesgd.engine.averager import ElasticAverager, MergeSettings, ReducedMerge
from lightning_aesgd.engine.comm import Communicator, NoMergeWeightError, Number
from lightning_aesgd.engine.flat import floating_buffers
from lightning_aesgd.engine.gradients import update_skipped
from lightning_aesgd.engine.handoff import broadcast_tensors
from lightning_aesgd.engine.learner_tuning import LearnerTuning, tune_learners
from lightning_aesgd.engine.learners import LearnerStep
from lightning_aesgd.engine.pipeline import NonFiniteReplicasError, StepOptions, StepPipeline, scaled_learning_rate
from lightning_aesgd.engine.plan_settings import PlanSettings

log = logging.getLogger(__name__)

T = TypeVar("T")


class ModelMerge(StepPipeline):
    """Local steps and weighted elastic merges: the step pipeline of ``sync="models"``.

    The strategy owns the options' defaults (its signature); the pipeline takes every option explicitly.

    Args:
        merging: the merge rule, schedule and weights.
        planning: how batch sizes follow the measured speeds.
        l2_nudge: Adaptive SGD's adaptive normalization of merge weights.
        lr_scaling: scale the replica's learning rate by its batch over the nominal one during its step.
        checkpoint_replicas: save every replica's own model and optimizer state in checkpoints.
        learners: models this replica trains side by side (:mod:`~lightning_aesgd.engine.learners`), or ``"auto"``
            to choose them by measurement before the first step (:meth:`choose_learners`).
        learner_tuning: how ``"auto"`` chooses.
        **step_options: the pipeline's own options (:class:`~lightning_aesgd.engine.pipeline.StepPipeline`).
    """

    sync_name = "merges"

    @property
    def exclusion_count(self) -> int:
        """Replicas left out of merges in this fit (each a replica at one merge)."""
        return len(self.exclusions)

    def __init__(
        self,
        merging: MergeSettings,
        planning: PlanSettings,
        *,
        l2_nudge: bool,
        lr_scaling: bool,
        checkpoint_replicas: bool,
        learners: int | Literal["auto"] = 1,
        learner_tuning: LearnerTuning | None = None,
        **step_options: Unpack[StepOptions],
    ) -> None:
        super().__init__(planning, **step_options)
        self.auto_learners = learners == "auto"
        self.learners = 1 if learners == "auto" else int(learners)
        self.learner_tuning = learner_tuning or LearnerTuning()
        self.learner_rates: list[float] = []  # the job's samples/s at 1, 2, ... learners, when "auto" measured them
        self._learners_chosen = not self.auto_learners
        self._module: nn.Module | None = None
        self.merging = merging
        self.normalization = AdaptiveNormalization(l2_nudge, merging.warmup_steps)
        self.lr_scaling = lr_scaling
        self.checkpoint_replicas = checkpoint_replicas
        self.averager: ElasticAverager | None = None
        self.exclusions: list[tuple[int, int]] = []  # (global step, rank) of every replica left out of a merge
        # Kept across fits of the same strategy: a fit that starts at a lower rate than the last one ended at is
        # a drop too.
        self._lr_drop = LearningRateDrop()
        # The merged model's norm after the latest merge, for adaptive normalization: left on the device until the
        # next merge reads it back with its other numbers.
        self._center_norm: torch.Tensor | float = -1.0
        self._maybe_skipped: list[tuple[Any, float]] = []  # (skipped?, samples) of the steps since the last merge
        self.alone = TrainingAlone()
        if lr_scaling and merging.weights == "samples":
            # Both favour large batches: together they count a sample of a large batch twice.
            warnings.warn(
                "lr_scaling=True with merge_weights='samples' weighs large batches twice. HINT: use "
                "merge_weights='updates' with lr_scaling (the paper's form), or samples without lr_scaling.",
                stacklevel=4,  # the user's call: strategy, settings, engine, here
            )

    @property
    def sync_count(self) -> int:
        """Merges in this fit."""
        return self._running_averager().merges

    def _running_averager(self) -> ElasticAverager:
        assert self.averager is not None, "the pipeline is not running: call start() first"
        return self.averager

    def _report_steps(self) -> int:
        """A report per merge: the merge period's steps weigh as one report (more while one replica trains alone)."""
        return self.merging.period

    def _start(self, module: nn.Module, comm: Communicator, device: torch.device) -> None:
        """Replicas start from rank zero's model, as DDP's do."""
        _broadcast_module(module, comm, self.merging.merge_buffers)
        self._module = module
        if self.auto_learners:  # chosen anew in each fit, before its first step (or taken from its checkpoint)
            self.learners, self.learner_rates, self._learners_chosen = 1, [], False
        self._use_learners(self.learners)
        self._center_norm = -1.0
        self._maybe_skipped.clear()
        self.alone = TrainingAlone()

    def _use_learners(self, learners: int) -> None:
        """Train ``learners`` learners from now on: before the first step, as merges hold no state of theirs yet."""
        assert self._module is not None, "the pipeline is not running: call start() first"
        if self.averager is not None:
            self.averager.unstack()
        self.learners = self.plans.learners = learners
        self.averager = ElasticAverager(self._module, self._comm(), self.merging, learners)
        self.learner_step = None
        if learners > 1:
            stacked = [*self.averager.params.tensors, *self.averager.buffers.tensors]
            self.learner_step = LearnerStep(self._module, stacked, learners)

    @property
    def learners_undecided(self) -> bool:
        """Whether ``learners_per_device="auto"`` has yet to measure and choose, before the fit's first step."""
        return self.running and not self._learners_chosen

    def choose_learners(self, measure: Callable[[int], float]) -> int:
        """Crossbow's tuner (a collective): measure 1, 2, ... learners (``measure(k)``: samples/s), keep what pays.

        Returns:
            The number of learners this fit trains, the same on every replica.
        """
        learners, self.learner_rates = tune_learners(measure, self._comm(), self.learner_tuning)
        if self._comm().rank == 0:
            rates = rates_text(self.learner_rates)
            log.info("learners_per_device='auto': samples/s by learners per replica {%s}; trains %d.", rates, learners)
        self._use_learners(learners)
        self._learners_chosen = True
        return learners

    def _stop(self) -> None:
        if self.averager is not None:  # a fit that failed leaves one model too, not a stack of learners
            self.averager.unstack()
        self.averager = self._module = None
        self.learner_step = None

    def one_model_shapes(self) -> dict[int, torch.Size]:  # noqa: D102
        return self.averager.one_model_shapes() if self.averager is not None else {}

    @property
    def loss_weight(self) -> float:
        """``k`` with ``k`` learners: their batched step returns the mean of their losses, each learner's own."""
        return float(self.learners)

    def configure_model(self, model: nn.Module) -> None:
        """The model stays unwrapped: replicas synchronise by merges, not through DistributedDataParallel."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, run_step: Callable[[], T]) -> T:
        """Run one local step (``run_step``: Lightning's optimizer step), then merge when one is due.

        A step the Trainer's grad scaler skipped carries no merge weight; a SIGTERM is asked at the merge, whose
        reports carry it to every replica.
        """
        averager, sampler = self._running_averager(), self.sampler
        assert sampler is not None, "the training loader was not built by training_loader()"
        record = sampler.pop_record(self._step_key)
        if averager.rule.resets_on_lr_drop and self._lr_drop.observe(float(optimizer.param_groups[0]["lr"])):
            averager.reset_to_center()
        averager.before_local_step()
        nominal = sampler.step_batch_size / averager.comm.world_size
        # An idle step (batch 0) applies no update: its rate is not scaled (there is no batch to scale it by).
        factor = linear_lr_scale(record.num_samples, nominal) if self.lr_scaling and record.num_samples else 1.0
        factor *= self._scheduled_lr_factor()
        grad_scaler = self.hooks.grad_scaler
        scale_before = _loss_scale(grad_scaler)
        # A replica left out of the step (batch 0) computed a zero gradient: it must not move its model (momentum,
        # weight decay), and its step counts for nothing in its merge weight.
        idle = record.num_samples == 0
        keep_model = update_skipped(optimizer) if idle else nullcontext()
        with scaled_learning_rate(optimizer, factor), self._timed_step(record), keep_model, self.sharing(record):
            if idle:  # no device work at all (its loss reaches no parameter): nothing for a slower device to stretch
                output = run_step()
            else:
                self.compute_spans.begin()  # the whole local step is the device's compute, up to the merge
                output = run_step()
                self.compute_spans.end(averager.comm.rank, self._global_step)
        self.synced_last_step = averager.after_local_step(record.num_samples)
        if idle:
            averager.take_back_step(0.0)
        if scale_before is not None:
            self._maybe_skipped.append((_loss_scale(grad_scaler) < scale_before, float(record.num_samples)))
        self.alone.observe(self.plans.lone_taker(self._step_key))
        waited = self.synced_last_step and self._merge_can_wait(averager)
        if waited:
            self.synced_last_step = False
        elif self.alone.owes_merge and self.plans.lone_taker(self._step_key + 1) != self.alone.taker:
            # Another replica is planned in next step (a probe, a plan without leave-out): it must start from the
            # lone replica's model, so the merge that waited happens now, due or not.
            self.synced_last_step = True
        if self.synced_last_step:
            with stalls.doing(f"the merge after global step {self._global_step}"):
                self._merge(averager, optimizer, self.hooks.stop_requested())
            self.alone.merged()
        return output

    def _merge_can_wait(self, averager: ElasticAverager) -> bool:
        """Whether the merge due now may wait: one replica trains alone, and a merge would leave its model as it is.

        With one replica holding every sample since the last merge (the others left out, weight 0) and a rule
        that replaces replicas by the weighted mean, the merge gives that replica its own model back; only the
        left-out replicas' copies and the reports would move. So merges wait, and the replica trains with no
        collective at all, until the next step plans another taker, a probe is due or waits for its measurement,
        or ``MAX_STEPS_ALONE`` steps have passed (reports, and a SIGTERM in them, still travel that often; see
        :mod:`lightning_aesgd.sigterm`). Every rank decides from the same plan book and schedule, so all skip the
        same merges.
        """
        if averager.comm.world_size == 1 or self.learners > 1:  # several models to merge, even on a lone replica
            return False
        # Only where the merge is the weighted mean and nothing else: no outer momentum or center of the rule's
        # own, no adaptive normalization, and the optimizer's state kept (a merge may reset or average it).
        plain = getattr(averager.rule, "replaces_replicas_with_mean", False) and self.merging.optimizer_state == "keep"
        if not plain or self.normalization.enabled:
            return False
        taker = self.alone.taker
        if taker is None or self.alone.steps >= MAX_STEPS_ALONE:
            return False
        if self.plans.lone_taker(self._step_key + 1) != taker or not self.plans.reports_can_wait(self._step_key):
            return False
        if not self.alone.waited and averager.comm.rank == 0:
            log.info("Replica %d takes every sample: merges wait until another replica is planned in.", taker)
        self.alone.waited += 1
        self.alone.owes_merge = True
        return True

    def _merge(self, averager: ElasticAverager, optimizer: torch.optim.Optimizer, stop_requested: bool) -> None:
        """Merge with every replica, the host reading the device once, after the collective.

        The merge weight hangs on what only the device knows: whether the model is finite, and (with a
        GradScaler) which steps were skipped. Both are computed there and travel in the collective, with the
        merged model's norm for adaptive normalization; the host reads them back with the rows. A replica that is
        not finite (a NaN loss or gradient) sends weight 0, but its NaNs may still reach the sum (0·NaN): its row
        says so, and every replica merges again with weights the host checked (:meth:`_merge_again`). Then the
        replica is left out and restored from the merged model: replicas are whole models, so the others carry on.
        """
        rank = averager.comm.rank
        finite = torch.isfinite(averager.finite_probe()).to(torch.float64)
        weight = self._own_weight(averager)
        host_weight = None if isinstance(weight, torch.Tensor) else weight  # exact, where the host knows it
        row: list[Number] = list(self.arrivals.arrive(0.0, stop=stop_requested).as_row())
        row[_WEIGHT], row[_FINITE], row[_CENTER_NORM] = weight, finite, self._center_norm
        self._maybe_skipped.clear()
        reduced: ReducedMerge | None
        try:
            # The weight as sent (not finite: 0); the row keeps it as computed, for a merge again.
            reduced = averager.reduce(finite * weight, optimizer, row)
            rows = reduced.rows
        except NoMergeWeightError as error:
            reduced, rows = None, error.rows
        own = PeriodReport.from_row(rows[rank])
        own_finite = bool(own.finite)
        if not all(PeriodReport.from_row(other).finite for other in rows):
            own_finite = own_finite or averager.is_finite()  # a sum that overflowed on finite values
            if host_weight is not None:
                own = replace(own, merge_weight=host_weight)  # not the row's, rounded to the carrier's precision
            reduced = self._merge_again(averager, optimizer, replace(own, finite=float(own_finite)))
            if reduced is None:
                return
            rows, own = reduced.rows, PeriodReport.from_row(reduced.rows[rank])
        elif reduced is None:  # every replica's updates since the last merge were skipped: its model is unchanged
            averager.skip_merge()
            self._receive(rows)
            return
        exact = host_weight if host_weight is not None and own_finite else own.merge_weight
        center = averager.apply(reduced, exact, optimizer)
        if not own_finite:
            averager.restore_from(center, optimizer)
        self._note_exclusions(rows)
        if self.normalization.enabled:
            # Rank zero's norm, carried in its report, decides for every replica: norms computed on different
            # devices may differ in the last bit, and replicas that judged the trend differently would mix
            # nudged and plain weights in one merge.
            self.normalization.observe(PeriodReport.from_row(rows[0]).center_norm)
            self._center_norm = center.norm()  # now, as `center` may be scratch that the next merge overwrites
        self._receive(rows)

    def _own_weight(self, averager: ElasticAverager) -> Number:
        """This replica's merge weight, nudged; on the device when a GradScaler's skips are still unread there."""
        factor = self.normalization.factor(averager.comm.rank, self.plans.merge_weights, averager.local_steps)
        if not self._maybe_skipped:
            return averager.own_weight() * factor
        # The scaler lowers its scale exactly when it skips a step: its flags, summed where they lie. A flag made
        # before the scaler held a scale of its own lies on the CPU: it joins the others on the device.
        device = averager.device
        flags = torch.stack([skipped.to(device, non_blocking=True) for skipped, _ in self._maybe_skipped])
        flags = flags.to(torch.float64)
        samples = [num_samples for _, num_samples in self._maybe_skipped]
        skipped_samples = torch.stack([flag * num for flag, num in zip(flags.unbind(), samples, strict=True)]).sum()
        return averager.own_weight_less(skipped_samples, flags.sum()) * factor

    def _merge_again(
        self, averager: ElasticAverager, optimizer: torch.optim.Optimizer, own: PeriodReport
    ) -> ReducedMerge | None:
        """A replica's model was not finite: merge again, each replica's weight checked on the host (rare).

        Returns:
            The merge, or ``None`` where there is nothing to merge: every replica's updates since the last merge
            were skipped (the models are unchanged; the merge is skipped).

        Raises:
            NonFiniteReplicasError: if no replica's model is finite.
            NoMergeWeightError: if the replicas whose models are finite all have weight 0 (every update skipped).
            ReplicaStalledError: if a peer stopped answering during the merge.
        """
        weight = own.merge_weight if own.finite else 0.0
        try:
            return averager.reduce(weight, optimizer, replace(own, merge_weight=weight).as_row())
        except NoMergeWeightError as error:
            lost = [r for r, row in enumerate(error.rows) if not PeriodReport.from_row(row).finite]
            if not lost:
                averager.skip_merge()
                self._receive(error.rows)
                return None
            if len(lost) == averager.comm.world_size:
                raise NonFiniteReplicasError(
                    f"Every replica's model ({lost}) is not finite at step {self._global_step}: nothing is left to "
                    "merge. HINT: lower the learning rate, clip gradients (gradient_clip_val) or check the loss "
                    "for NaN; resume from the last checkpoint."
                ) from error
            raise

    def _note_exclusions(self, rows: list[list[float]]) -> None:
        lost = [rank for rank, row in enumerate(rows) if not PeriodReport.from_row(row).finite]
        for rank in lost:
            self.exclusions.append((self._global_step, rank))
            if self._comm().rank == 0:
                log.warning(
                    "Replica %d's model was not finite at step %d: left out of the merge and restored from the "
                    "merged model (its optimizer state reset).",
                    rank,
                    self._global_step,
                )

    def summary_record(self) -> dict[str, Any] | None:
        """The pipeline's summary, with the learners per replica (and the rates ``"auto"`` chose them by)."""
        record = super().summary_record()
        if record is not None and (self.learners > 1 or self.auto_learners):
            record["learners"] = {"per_replica": self.learners, "measured": list(self.learner_rates)}
        return record

    # --- evaluation and the end of fit ----------------------------------------------------------------------

    def begin_evaluation(self) -> None:
        """Swap the global model in for validation (a collective); waiting for peers is not training time."""
        self.arrivals.pause()
        self.normalization.new_window()  # the authors re-judge the L2 trend before every evaluation pass
        with stalls.doing(f"the global model's mean for an evaluation after global step {self._global_step}"):
            self._running_averager().swap_in_global_model()

    def end_evaluation(self) -> None:
        """Put the replica's own model back and resume training."""
        self._running_averager().swap_out()
        self.arrivals.resume()

    def finish(self) -> None:
        """Make the global model the replica's own (a collective): what the module holds after fit."""
        with stalls.doing(f"the global model's mean at the end of fit, global step {self._global_step}"):
            self._running_averager().adopt_global_model()

    # --- checkpoints --------------------------------------------------------------------------------------

    def global_model_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's state dict holding the global model (a collective); the replica's own model stays."""
        averager = self._running_averager()
        self.arrivals.pause()  # writing a checkpoint is not training time
        was_swapped = averager.swapped_in
        averager.swap_in_global_model()
        state = {name: tensor.clone() for name, tensor in module.state_dict().items()}
        if not was_swapped:
            averager.swap_out()
        return state

    def training_state(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """What a checkpoint needs to resume exactly (a collective when replicas are saved).

        The state every replica shares (schedule position, the rule's buffers, plans, the L2 trend) and, with
        ``checkpoint_replicas``, every replica's own model, optimizer state and counters, on the CPU, gathered
        to rank zero over the host group (on other ranks ``"replicas"`` is ``None``): only rank zero writes the
        checkpoint, and gathering every replica's model onto every rank would hold ``n`` models on each.
        """
        averager = self._running_averager()
        shared = self._plan_state()
        shared.update({"averager": averager.shared_state(), "l2_trend": self.normalization.state_dict()})
        shared["alone"] = self.alone.state_dict()
        shared["learners"] = self.learners
        state: dict[str, Any] = {"world_size": averager.comm.world_size, "shared": shared, "replicas": None}
        if self.checkpoint_replicas:
            params, buffers = averager.local_model()
            own = {
                "params": params,
                "buffers": buffers,
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "averager": averager.local_state(),
            }
            state["replicas"] = averager.comm.gather_object(_on_cpu(own), dst=0)
        return state

    def load_training_state(
        self, state: dict[str, Any], optimizer: torch.optim.Optimizer | None, device: torch.device
    ) -> None:
        """Put back what :meth:`training_state` saved; this replica's own part when the world size matches.

        Every rank reads the checkpoint file that rank zero wrote, so every rank finds every replica's part there.
        """
        saved_learners = state["shared"].get("learners", 1)
        if self.auto_learners and not self._learners_chosen and "learners" in state["shared"]:
            # The fit that saved it measured already (a checkpoint of sync="gradients" or DDP did not: measure).
            self._use_learners(saved_learners)
            self._learners_chosen = True
        averager = self._running_averager()
        self._load_plan_state(state["shared"])
        if "averager" not in state["shared"]:  # a checkpoint of sync="gradients": only its plans carry over
            return
        averager.load_shared_state(state["shared"]["averager"])
        self.alone.load_state_dict(state["shared"].get("alone") or {})
        self.normalization.load_state_dict(state["shared"]["l2_trend"])
        replicas, world_size = state["replicas"], averager.comm.world_size
        warn = log.warning if averager.comm.rank == 0 else log.debug  # every rank restores alike: one warning
        if saved_learners != self.learners:
            # Every learner starts from the merged model and the checkpoint's optimizer state, which is one model's
            # (Lightning loaded it already; the strategy fits it to the learners before the first step).
            warn(
                "The checkpoint's replicas trained %d learners each, this run trains %d: all start from the merged "
                "model and rank zero's optimizer state.",
                saved_learners,
                self.learners,
            )
            return
        if replicas is None:
            return
        if state["world_size"] != world_size:
            warn(
                "The checkpoint holds %d replicas, this run has %d: all start from the merged model.",
                state["world_size"],
                world_size,
            )
            return
        own = replicas[averager.comm.rank]
        if not self.alone.owes_merge or self.alone.taker == averager.comm.rank:
            # A left-out replica whose merge was waiting holds a stale model: it keeps the checkpoint's global model
            # (the lone replica's), which its owed merge would have given it.
            averager.load_local_model(own["params"].to(device), own["buffers"].to(device))
        averager.load_local_state(own["averager"])
        if optimizer is not None and own["optimizer"] is not None:
            optimizer.load_state_dict(own["optimizer"])


_WEIGHT, _FINITE, _CENTER_NORM = (PeriodReport.field_index(name) for name in ("merge_weight", "finite", "center_norm"))

MAX_STEPS_ALONE = MIN_PROBE_INTERVAL
"""Most steps a replica training alone goes without a merge (as long as the shortest probe interval)."""


@dataclass
class TrainingAlone:
    """Who has held every sample since the last merge, and for how many steps (the same on every rank).

    Attributes:
        taker: the one replica with samples in every step since the last merge, or ``None``.
        steps: steps since the last merge.
        waited: merges that waited in this fit.
        owes_merge: whether a merge waited since the last one.
    """

    taker: int | None = None
    steps: int = 0
    waited: int = 0
    owes_merge: bool = False

    def observe(self, lone_taker: int | None) -> None:
        """Count a step whose plan has ``lone_taker`` as its only replica with samples (``None``: several)."""
        self.taker = lone_taker if self.steps == 0 or self.taker == lone_taker else None
        self.steps += 1

    def merged(self) -> None:
        """A merge happened: the count starts anew."""
        self.taker, self.steps, self.owes_merge = None, 0, False

    def state_dict(self) -> dict[str, int | None]:  # noqa: D102
        return {"taker": self.taker, "steps": self.steps, "owes_merge": int(self.owes_merge)}

    def load_state_dict(self, state: dict[str, int | None]) -> None:  # noqa: D102
        self.taker, self.steps = state.get("taker"), int(state.get("steps") or 0)
        self.owes_merge = bool(state.get("owes_merge"))


def _broadcast_module(module: nn.Module, comm: Communicator, with_buffers: bool) -> None:
    # Every parameter, frozen ones too (as DDP does): an unseeded frozen layer would otherwise differ per replica,
    # and merges, which skip frozen parameters, would never make them agree.
    buffers = floating_buffers(module) if with_buffers else []
    broadcast_tensors(comm, [*module.parameters(), *buffers], src=0)


def _loss_scale(grad_scaler: Any) -> Any:
    """The scaler's current loss scale (a tensor on its device, read without a host sync), or None without one."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return None
    scale = getattr(grad_scaler, "_scale", None)
    if scale is None:  # before the first scaled loss: the scale it will start from
        return torch.tensor(float(grad_scaler.get_scale()))
    return scale.clone()


def _on_cpu(state: Any) -> Any:
    return tree_map_only(torch.Tensor, torch.Tensor.cpu, state)
