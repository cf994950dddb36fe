"""Gradient synchronisation (``sync="gradients"``, the default): DDP's reducer sums share-weighted gradients.

:class:`GradientSync` is the :class:`~lightning_aesgd.engine.pipeline.StepPipeline` whose sync point is every
step's gradient sum: it gives each step's gradient the weight ``bᵢ/M`` (``loss_weight``, by which the strategy
scales the loss) for DDP's communication hook to sum
(:class:`~lightning_aesgd.engine.gradients.GradientSum`), and the replicas' reports ride in the last gradient
bucket's all-reduce. Every replica holds the same model and optimizer state, as
under DDP, so evaluation and checkpoints need no merged model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from torch import nn
from typing_extensions import Unpack

from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.engine import stalls
from lightning_aesgd.engine.comm import (
    Communicator,
    ReplicaStalledError,
    is_peer_failure,
    stalled_error,
)
from lightning_aesgd.engine.gradients import (
    GradientSum,
    apply_gradients,
    gradient_sum_hook,
    pending_from_list,
    pending_to_list,
    update_skipped,
)
from lightning_aesgd.engine.handoff import broadcast_optimizer_state, broadcast_tensors
from lightning_aesgd.engine.pipeline import NonFiniteReplicasError, StepOptions, StepPipeline, scaled_learning_rate
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.report_exchange import ReportExchange
from lightning_aesgd.engine.sampler import PlannedBatchSampler, StepRecord
from lightning_aesgd.engine.sitting_out import SittingOut

log = logging.getLogger(__name__)

NON_FINITE_STEPS_LIMIT = 10
"""Consecutive steps without any finite replica after which training stops (each such step applies no update)."""

BUCKET_REBUILD_STEP = 1
"""The step of a fit (counted from 0) in whose forward DDP's reducer rebuilds its gradient buckets: a broadcast that
holds every replica until the slowest arrives, waiting the arrival clock cannot tell from the replica's own work,
so that no report measures that step."""

T = TypeVar("T")


class GradientSync(StepPipeline):
    """Uneven batches with DDP's exact update (``delay=0``) or ABS-SGD's one-step-stale one (``delay=1``).

    Args:
        planning: how batch sizes follow the measured speeds.
        delay: 0, or 1 for ABS-SGD (see :mod:`lightning_aesgd.engine.gradients`).
        compensate_momentum: with ``delay``, spike compensation of SGD momentum for the stale gradient.
        delay_warmup: global steps before this one apply their own sum at once (synchronous); the delay starts
            after them, its first step applying nothing.
        delay_lr_scale: a factor on the learning rate of every update that applies a stale sum, one computed
            before the latest update (see :func:`~lightning_aesgd.core.lr.stale_update_scale`); 1 is the paper's
            rule. The sum of a step that applied nothing (the first after a start or a flush) is fresh when applied.
        **step_options: the pipeline's own options (:class:`~lightning_aesgd.engine.pipeline.StepPipeline`).
    """

    sync_name = "gradient sums"

    def __init__(
        self,
        planning: PlanSettings,
        *,
        delay: int,
        compensate_momentum: bool = True,
        delay_warmup: int = 0,
        delay_lr_scale: float = 1.0,
        **step_options: Unpack[StepOptions],
    ) -> None:
        super().__init__(planning, **step_options)
        self.arrivals.unmeasured_step = BUCKET_REBUILD_STEP
        self.reduce = GradientSum(
            delay,
            on_last_bucket=self._arrive,
            waiting=self._waiting_for_peers,
            compensate_momentum=compensate_momentum,
            sparse_reduction="auto",
        )
        self._delay = delay
        self.delay_warmup = delay_warmup
        self.delay_lr_scale = delay_lr_scale
        self._pending_is_stale = False  # whether the weights moved after the sum in flight was computed
        self.syncs = 0
        self.excluded = 0
        self.sat_out_steps = 0  # steps this replica sat out in this fit (engine.sitting_out)
        self._params: list[nn.Parameter] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._share = 1.0
        self.reports = ReportExchange()
        self._device = torch.device("cpu")
        self._module: nn.Module | None = None
        self._arrived = 0.0
        self._hooked = True  # whether DDP's reducer calls GradientSum's hook (see wraps_model)
        # Replicas apply the same summed gradient, but CPU and CUDA kernels may round an update differently: where
        # replicas run on different device types, rank zero's parameters travel with its buffers (from the hooks).
        self.share_parameters = False
        # Left-out replicas sit out the per-step sums (engine.sitting_out). Not where DDP's reducer itself talks to
        # every rank in each step (find_unused_parameters; the hooks say), nor where state outlives a step: a
        # delayed sum in flight, or a grad scaler's scale.
        self.sitting = SittingOut()
        self._stop_decided = False  # a stop the replicas agreed on at a segment's start (engine.sitting_out)
        self._failure: NonFiniteReplicasError | None = None  # held until a segment's start while a replica sits out

    def wraps_model(self, world_size: int) -> bool:
        """DistributedDataParallel's reducer runs the sums, through GradientSum's hook; not for one replica alone.

        A job of one replica has nothing to sum: its model trains unwrapped, as Lightning's single-device strategy
        trains it (DDP's reducer and hooks cost a small model's step a third of its time on one core), and the
        arrival comes after the backward. A delayed sum (ABS-SGD) still needs the hook to hold it for a step.
        """
        return world_size > 1 or self._delay > 0

    @property
    def delay(self) -> int:
        """Steps between computing a gradient and applying it after the warm-up (1: ABS-SGD)."""
        return self._delay

    @property
    def loss_weight(self) -> float:
        """This replica's weight ``bᵢ/M`` in the step's gradient sum: the strategy scales the loss by it."""
        return self._share

    @property
    def sync_count(self) -> int:
        """Gradient sums in this fit."""
        return self.syncs

    @property
    def exclusion_count(self) -> int:
        """Replicas left out of gradient sums in this fit for non-finite gradients (each a replica at one step)."""
        return self.excluded

    # --- a fit's lifecycle --------------------------------------------------------------------------------

    def _start(self, module: nn.Module, comm: Communicator, device: torch.device) -> None:
        """DistributedDataParallel has already made every replica start from rank zero's model."""
        self._module = module
        self._params = [p for p in module.parameters() if p.requires_grad]
        self.reduce.comm = comm  # every sum, sparse ones included, goes through the communicator
        self.reduce.alone = comm.world_size == 1  # the whole job, not a segment's group of present replicas
        self._hooked = self.wraps_model(comm.world_size)  # otherwise no hook marks the arrival: the closure does
        scaler = self.hooks.grad_scaler
        self.reduce.guard = scaler is None or not scaler.is_enabled()  # a scaler handles overflow itself
        self.reduce.sums_in_place = device.type == "cpu" and not self.hooks.mixed_device_types
        self.reduce.hold(None)  # nothing in flight from an earlier fit that ended by an exception
        self._pending_is_stale = False
        self.reduce.applied = {}
        self.reports.start()
        self._device = device
        self.syncs = self.excluded = self.sat_out_steps = 0
        self.share_parameters = self.hooks.mixed_device_types
        if self.hooks.reducer_meets_every_step:
            # An idle replica's zero loss reaches every parameter, so one that no working replica used would get a
            # zero gradient where DDP gives none: weight decay and momentum would step it. A loss reaching none
            # leaves DDP's reducer waiting.
            self.plans.forbid_leaving_out(
                "with find_unused_parameters=True an idle replica would give every parameter a gradient, where DDP "
                "gives none to those no replica used"
            )
        allowed = not self.hooks.reducer_meets_every_step and self._delay == 0 and self.reduce.guard
        self.sitting.max_wait = self.hooks.collective_timeout
        self.sitting.start(comm, allowed)
        self._stop_decided, self._failure = False, None
        self.plans.segment_steps = self.sitting.segment_steps if self.sitting.enabled else 0
        self.plans.held_out = frozenset()

    def _stop(self) -> None:
        self.sitting.stop()
        self.plans.held_out = frozenset()
        self._optimizer = None
        self.reports.start()  # nothing of this fit is awaited past its end
        self.reduce.comm = None
        self.reduce.alone = False

    def configure_model(self, model: nn.Module) -> None:
        """Register the gradient sum as DistributedDataParallel's communication hook on the wrapped ``model``."""
        model.register_comm_hook(self.reduce, gradient_sum_hook)  # type: ignore[operator]

    # --- training steps -----------------------------------------------------------------------------------

    def after_backward_of(self, closure: Callable[[], T]) -> Callable[[], T]:
        """Lightning's closure, followed by taking in the replicas' reports: the release from the step's sum."""

        def closure_then_reports() -> T:
            output = closure()
            if self.sitting.sits_out:
                return output
            if not self._hooked:
                self._arrive()  # the backward is over: an unwrapped model's gradients are its sum
            self._take_reports()
            if not self.reduce.delay:
                # DDP's reducer has made the compute stream wait for the sums: on CUDA the stamp lands after them.
                self.arrivals.end_wait()  # released from the step's sums
            self.compute_spans.begin()  # the update's compute, after the release
            return output

        return closure_then_reports

    def optimizer_step(self, optimizer: torch.optim.Optimizer, run_step: Callable[[], T]) -> T:
        """Run one step whose gradient counts with this replica's share of the step's samples (``loss_weight``).

        A step a grad scaler skips is skipped on every replica alike (they all see the same summed gradient).
        """
        record = self._sampler_in_use().pop_record(self._step_key)
        self._optimizer = optimizer
        self.sitting.stepped()
        if self.sitting.sits_out:  # no sum, no report, no update: the segment's handoff brings the model
            self._share = 0.0
            self.sat_out_steps += 1
            with update_skipped(optimizer):
                return run_step()
        skip, factor = self._begin_sums(optimizer, record)
        timing = self._timed_step(record)
        # A collective watch (NCCL) names the sums launched in the backward, as they fill, by this step.
        step, key = f"the gradient sum of global step {self._global_step}", _roll_call_key(self._global_step)
        self.compute_spans.begin()  # the forward and backward, up to the arrival
        self._arrived = time.monotonic()  # until the arrival: a peer failing before it waited from here
        try:
            with scaled_learning_rate(optimizer, factor), timing, skip, self.sharing(record), stalls.doing(step, key):
                output = run_step()
        except RuntimeError as error:  # a peer failed in DDP's reducer or the reports: name who and where
            if isinstance(error, ReplicaStalledError) or not is_peer_failure(error):
                raise
            raise self._stalled(error) from error
        self.compute_spans.end(self._comm().rank, self._global_step)
        self.reduce.end_step()
        self.syncs += 1
        self.synced_last_step = True
        return output

    def _sampler_in_use(self) -> PlannedBatchSampler:
        """The planned sampler, whose records give each step's shares; a clear error where the loader has none."""
        if self.sampler is None:
            raise TypeError(
                "sync='gradients' needs the training loader to be a torch DataLoader, which it rebuilds so that each "
                "replica's share of every step is known (its gradient's weight). HINT: return a "
                "torch.utils.data.DataLoader from train_dataloader(), or use sync='models'."
            )
        return self.sampler

    def _begin_sums(
        self, optimizer: torch.optim.Optimizer, record: StepRecord
    ) -> tuple[AbstractContextManager[Any], float]:
        """Set up this step's sums (its share, its delay); returns the update's skip, if any, and its lr factor."""
        self._share = record.num_samples / record.step_samples if record.step_samples else 1.0
        self.reduce.share = self._share  # carried with each bucket, for a renormalised sum (finite_guard)
        self.reduce.delay = self._delay if self._global_step >= self.delay_warmup else 0
        self.reduce.begin_step()
        self.reduce.read_momentum(optimizer)
        applies = self.reduce.applies_update
        skip = nullcontext() if applies else update_skipped(optimizer)
        factor = self._lr_factor(stale=bool(self.reduce.delay) and self._pending_is_stale)
        # This step's sum, applied at the next step or flushed, is stale if this step moves the weights.
        self._pending_is_stale = bool(self.reduce.delay) and applies
        return skip, factor

    def _lr_factor(self, stale: bool) -> float:
        """The factor on the learning rate of this step's update: the schedule's, and ``delay_lr_scale`` if stale."""
        factor = self._scheduled_lr_factor()
        return factor * self.delay_lr_scale if stale else factor

    def _stalled(self, error: RuntimeError) -> ReplicaStalledError:
        """The error of a step whose sums a peer never joined, after the roll call (waited: since the arrival)."""
        comm, step = self._step_comm(), self._global_step
        members = self.sitting.present if self.sitting.absent else None
        stalled = stalled_error(
            error,
            "gradient all-reduce",
            _roll_call_key(step),
            comm.rank,
            comm.world_size,
            self._arrived,
            members=members,
        )
        return stalled.during(f"the gradient sum of global step {step}")

    def _step_comm(self) -> Communicator:
        """The communicator of this step's sums: the world's, or the group of the replicas not sitting out."""
        return self.sitting.comm if self.sitting.comm is not None else self._comm()

    def _arrive(self) -> None:
        """The last bucket is ready: report this replica's period, carried in that bucket's sum where it can be.

        The arrival clock stamps the arrival before any collective is launched; on CUDA the stamp lies on the compute
        stream, after the backward, so the host does not wait for the device here. The forward and backward's
        compute span ends here, before the arrival; the sums' own work is outside every span.
        """
        self.compute_spans.end(self._comm().rank, self._global_step)
        self._arrived = time.monotonic()
        stalls.entering(_roll_call_key(self._global_step))  # a peer's roll call then sees this replica arrive
        if self.reports.due(self._global_step, self.plans):
            # The period's report travels beside the sums; the replica works on from its arrival (the time it then
            # blocks on peers is counted as waiting, below and in the first bucket's wait for delayed sums).
            report = self.arrivals.arrive(self._share, stop=self.hooks.stop_requested())
            world, step_comm = self._comm(), self._step_comm()
            # In the last bucket's sum where it can (over the same replicas): no collective of the report's own.
            carrier = self.reduce.carry if self._hooked and self.reduce.comm is step_comm else None
            self.reports.launch(report.as_row(), step_comm, self._device, world.rank, world.world_size, carrier)
        if not self.reduce.delay and not self.reduce.alone:
            self.arrivals.begin_wait()  # DDP's reducer now waits for the slowest replica's buckets

    def _take_reports(self) -> None:
        # Synchronous: this step's reports. Delayed: the previous exchange's, while this one's travel.
        keep, waiting = (1, self._waiting_for_peers) if self.reduce.delay else (0, nullcontext)
        exclusions = self.reduce.exclusions
        for rows, counts in self.reports.received(keep, waiting, exclusions.take):
            for rank in self.sitting.absent:  # no report from a replica sitting out: a period that measures nothing
                rows[rank] = PeriodReport(merge_weight=0.0).as_row()
            self._receive(rows, released=False)
            self.reports.space_out(self.plans, self._step_key - self._global_step)
            self._count_exclusions(exclusions.counted(counts))

    def _count_exclusions(self, counts: tuple[int, int] | None = None) -> None:
        """Take in the replicas left out of sums since the last count: ``counts`` if read with the reports, else now.

        While a replica sits out, a failure waits for the segment's end, where every replica raises it together.
        """
        excluded, run = self.reduce.exclusions.read() if counts is None else counts
        self.excluded += excluded
        try:
            _judge_exclusions(excluded, run, self._global_step, self._comm().rank == 0)
        except NonFiniteReplicasError as error:
            if not self.sitting.absent:
                raise
            self._failure = self._failure or error

    def _waiting_for_peers(self) -> AbstractContextManager[None]:
        return self.arrivals.waiting()

    # --- replicas sitting out (engine.sitting_out) -----------------------------------------------------------

    def begin_step(self, epoch: int, batch_idx: int, global_step: int) -> None:
        """A step begins; at a segment's start, the replicas that sat out catch up and the next ones are chosen."""
        super().begin_step(epoch, batch_idx, global_step)
        if not self.sitting.starts_segment(self._step_key):
            return
        if self.sitting.absent:
            self._decide_together()
        with self.arrivals.waiting():  # the handoff waits for the replicas that sat out
            caught_up = self.sitting.enter(self._step_key, self.plans, self._handoff)
        self.reduce.comm = self._step_comm()
        if self._comm().rank in caught_up:
            self.arrivals.restart()  # its idle steps trained nothing

    @property
    def sits_out(self) -> bool:  # noqa: D102
        return self.sitting.sits_out

    @property
    def stop_requested(self) -> bool:
        """Whether every replica stops now: a replica asked to in the latest reports, or at a segment's start.

        While a replica sits out, the reports it misses cannot stop it: stops then wait for the segment's end.
        """
        return self._stop_decided or (not self.sitting.absent and self.plans.stop_requested)

    def _decide_together(self) -> None:
        """At the end of a segment a replica sat out: every replica learns of a stop or a failure (a collective)."""
        asked = self.plans.stop_requested or self.hooks.stop_requested()
        flags = torch.tensor([float(asked), float(self._failure is not None)], dtype=torch.float64)
        self._comm().host_all_reduce_sum_(flags)
        stop, failed = flags.tolist()
        if failed:
            raise self._failure or NonFiniteReplicasError(
                f"{failed:.0f} replica(s) found no finite gradient for {NON_FINITE_STEPS_LIMIT} steps in a row while "
                "this one sat out: training cannot continue. HINT: lower the learning rate, clip gradients "
                "(gradient_clip_val) or check the loss for NaN; resume from the last checkpoint."
            )
        self._stop_decided = self._stop_decided or stop > 0

    def _handoff(self, source: int, absent: frozenset[int]) -> None:
        """Give every replica replica ``source``'s model, optimizer state and plan loop (a collective of the world).

        The replicas that sat out (``absent``) take them; the others hold the same already.
        """
        world = self._comm()
        if self._module is not None:
            broadcast_tensors(world, [*self._module.parameters(), *self._module.buffers()], source)
        optimizer_state = broadcast_optimizer_state(world, self._optimizer, source, self._device)
        sent: dict[str, Any] = {}
        if world.rank == source:
            sent["plans"], sent["reports"] = self.plans.shared_state(), self.reports.state_dict()
            sent["exclusions"] = self.reduce.exclusions.state_dict()
        received = world.broadcast_object(sent, src=source)
        if world.rank not in absent:
            return
        if optimizer_state is not None and self._optimizer is not None:  # after the collectives: see the callee
            self._optimizer.load_state_dict(optimizer_state)
        self.plans.adopt_shared_state(received["plans"])
        self.reports.load_state_dict(received["reports"])
        self.reduce.exclusions.load_state_dict(received["exclusions"], self._device)

    def flush(self) -> None:
        """Apply the delayed sum still in flight (ABS-SGD), so that none is lost: before evaluation and at the end."""
        pending = self.reduce.take_pending()
        for rows, _ in self.reports.received(0, nullcontext):
            self._receive(rows, released=False)
        self._count_exclusions()
        optimizer = self._optimizer
        if pending is None:
            return
        if optimizer is None:  # no step has run in this fit: nothing can be in flight, but keep what is held
            self.reduce.hold(pending)
            return
        self.reduce.read_momentum(optimizer)
        apply_gradients(self._params, self.reduce.compensated(pending))
        self.hooks.before_own_update(optimizer)
        factor = self._lr_factor(stale=self._pending_is_stale)
        self._pending_is_stale = False  # nothing is in flight now
        self.compute_spans.begin()  # the flushed update is the update a step skipped: compute like any
        with scaled_learning_rate(optimizer, factor):
            optimizer.step()
        self.compute_spans.end(self._comm().rank, self._global_step)
        optimizer.zero_grad(set_to_none=True)

    # --- evaluation and the end of fit ----------------------------------------------------------------------

    def _share_state(self) -> None:
        """Give every replica rank zero's buffers (a collective), as DDP's broadcast at each forward would have.

        During training a BatchNorm layer normalises with its batch's statistics, so only evaluation, checkpoints
        and the final model read the running statistics: broadcasting them there gives what DDP gives (rank zero's
        own running statistics) without a synchronisation point in every step. With ``share_parameters`` (CPU and
        GPU replicas) rank zero's parameters travel too, so that rounding differences never accumulate past an
        evaluation and every replica evaluates, saves and ends with one model.
        """
        if self._module is None:
            return
        shared = [*self._module.buffers(), *(self._module.parameters() if self.share_parameters else ())]
        broadcast_tensors(self._comm(), shared, src=0)

    def begin_evaluation(self) -> None:
        """Apply what is in flight, then evaluate the model every replica shares."""
        self.arrivals.pause()
        self.sitting.catch_up(self._handoff)
        self.flush()
        self._share_state()

    def end_evaluation(self) -> None:  # noqa: D102
        self.arrivals.resume()

    def finish(self) -> None:
        """Apply the last delayed sum: the module leaves fit holding every update, and rank zero's buffers."""
        self.sitting.catch_up(self._handoff)
        self.flush()
        self._share_state()

    # --- checkpoints --------------------------------------------------------------------------------------

    def global_model_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's state (a collective): every replica holds the same parameters, and gets rank zero's buffers."""
        self.arrivals.pause()
        self.sitting.catch_up(self._handoff)
        self._share_state()
        return {name: tensor.clone() for name, tensor in module.state_dict().items()}

    def training_state(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Plans, the plan loop's measurements and (ABS-SGD) the sums the next step applies and the latest applied.

        Momentum compensation subtracts the latest applied sum from the next: resuming needs both.
        """
        shared = self._plan_state()
        shared["delayed_gradients"] = pending_to_list(self._params, self.reduce.peek_pending())
        shared["delayed_gradients_stale"] = self._pending_is_stale
        shared["applied_gradients"] = pending_to_list(self._params, self.reduce.applied)
        return {"world_size": self._comm().world_size, "shared": shared, "replicas": None, "sync": "gradients"}

    def load_training_state(
        self, state: dict[str, Any], optimizer: torch.optim.Optimizer | None, device: torch.device
    ) -> None:
        """Put back what :meth:`training_state` saved (a ``sync="models"`` checkpoint gives its plans only).

        A held sum from a checkpoint written before its staleness was saved counts as stale: its update then runs
        at ``delay_lr_scale`` (the rule for every delayed update but the first after a start or a flush).
        """
        shared = state["shared"]
        self._load_plan_state(shared)
        delayed = shared.get("delayed_gradients")
        if delayed is not None and self.delay:
            self.reduce.hold(pending_from_list(self._params, delayed))
            self._pending_is_stale = bool(shared.get("delayed_gradients_stale", True))
            self.reduce.applied = pending_from_list(
                self._params, shared.get("applied_gradients") or [None] * len(self._params)
            )
        elif delayed is not None:
            log.warning("The checkpoint holds a delayed gradient sum, which sync without delay does not apply.")


def _judge_exclusions(excluded: int, run: int, global_step: int, logs: bool) -> None:
    """Log replicas left out of gradient sums; stop once no replica has been finite for too many steps."""
    if excluded and logs:
        log.warning(
            "%d replica step(s) had non-finite gradients before global step %d: left out of the gradient sum, "
            "which the other replicas' finite samples made.",
            excluded,
            global_step,
        )
    if run >= NON_FINITE_STEPS_LIMIT:
        raise NonFiniteReplicasError(
            f"No replica's gradient was finite in {run} consecutive steps before global step {global_step}: "
            "training cannot continue. HINT: lower the learning rate, clip gradients (gradient_clip_val) or check "
            "the loss for NaN; resume from the last checkpoint."
        )


def _roll_call_key(global_step: int) -> str:
    """The roll call's key for the gradient sum of ``global_step`` (the same on every replica)."""
    return stalls.roll_call_key(f"step_{global_step}")
