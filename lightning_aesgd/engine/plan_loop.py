"""The plan loop: every replica's reports → step-time models → planner → plan book, identically on every rank.

At each sync point every replica's :class:`~lightning_aesgd.core.sensing.PeriodReport` (measured by its
:class:`~lightning_aesgd.engine.arrivals.ArrivalClock`) reaches every rank inside the sync point's collective.
:class:`PlanLoop` updates the :class:`~lightning_aesgd.core.sensing.ArrivalModel` from them, asks the planner for
the next plan, damps it, and schedules it ``lag`` steps ahead in the
:class:`~lightning_aesgd.engine.sampler.PlanBook`. Every rank holds the same numbers, so every rank takes the same
decision without another message.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_aesgd.core.apportion import apportion, in_multiples, per_replica
from lightning_aesgd.core.noise import noise_band
from lightning_aesgd.core.planners import Planner
from lightning_aesgd.core.sensing import ArrivalModel, PeriodReport, damped_plan
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.engine.admission import LOCKSTEP_PROBE_REPORTS, SITTING_OUT_PROBE_REPORTS, Admission
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.sampler import PlanBook

log = logging.getLogger(__name__)

NOISE_PERIODS = 3
"""Comparable periods of every replica before the first plan, unless the imbalance exceeds :data:`CLEAR_IMBALANCE`:
a first plan, which moves all the way, made before the noise is known would split equal replicas by their noise,
and the band the noise then sets would keep it."""

CLEAR_IMBALANCE = 1.0
"""Predicted step times this far apart (the slowest twice the fastest) are planned for at once: step-time noise of a
few tens of percent does not explain them, and a short run cannot afford to wait."""

HISTORY_LENGTH = 4096
"""Sync points the loop remembers (step, speeds, plan) for plots: a ring, so memory stays flat over long runs."""


@dataclass(frozen=True)
class PlanRecord:
    """The plan loop at one sync point, for plots: the step, the smoothed speeds and the latest plan."""

    step: int
    speeds: tuple[float, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class ReplicaStats:
    """One replica as the latest sync point saw it, for telemetry and the end-of-fit summary.

    Attributes:
        merge_weight: the replica's merge weight at the latest sync point (its share ``bᵢ/M`` of the step under
            gradient synchronisation).
        speed: smoothed samples (or cost units) per active second.
        samples: samples (or cost units) processed in the latest period.
        wait_fraction: share of its wall time the replica spent blocked on peers.
        step_seconds: smoothed active seconds per step (release of a sync point to arrival at the next).
        busy_seconds: seconds per step inside the optimizer step (forward, backward, update).
        active_seconds: the latest period's active seconds per step, as measured (not smoothed); 0 when it
            measured nothing.
        loader_seconds: the latest period's data loader seconds per step (its workers' production time, where it
            has workers).
        finite: whether the replica's model was finite at the latest sync point (otherwise it was left out).
        noise: relative standard deviation of its step time from period to period
            (:class:`~lightning_aesgd.core.noise.StepNoise`), which widens the plans' dead band.
    """

    merge_weight: float
    speed: float
    samples: float
    wait_fraction: float
    step_seconds: float
    busy_seconds: float = 0.0
    active_seconds: float = 0.0
    loader_seconds: float = 0.0
    finite: bool = True
    noise: float = 0.0


class PlanLoop:
    """Turns every replica's reports into batch-size plans; never communicates.

    Args:
        settings: the planner and its bounds, damping and smoothing.
    """

    def __init__(self, settings: PlanSettings | None = None) -> None:
        self.settings = settings if settings is not None else PlanSettings()
        self.planner: Planner = self.settings.build_planner(self.settings.min_batch, self.settings.max_batch)
        self.arrival_model: ArrivalModel | None = None
        self.plan_book: PlanBook | None = None
        self.floors: list[int] = []  # each replica's smallest batch while it takes part (set with the plan book)
        self.caps: list[int | None] = []  # each replica's largest batch
        self.lag = 1
        self.step_batch_size = 0
        self.cost_aware = False
        self.learners = 1  # learners per replica: every batch is a multiple of it (set by the engine)
        self.stop_requested = False
        self.merge_weights: list[float] = []  # every replica's weight at the latest sync point
        self.latest_reports: list[PeriodReport] = []
        self.history: deque[PlanRecord] = deque(maxlen=HISTORY_LENGTH)
        self._saved_state: dict[str, Any] | None = None
        self._next_plan = 0
        self._speed_changed = False  # a replica's estimates restarted at a new speed since the latest plan
        self.admission = Admission()
        self.leaving_out_forbidden: str | None = None  # why no replica may be left out in this fit
        self._segment_steps = 0
        self.held_out: frozenset[int] = frozenset()  # the replicas sitting out the current segment
        self._left_out_once: set[int] = set()  # replicas left out at least once in this fit
        self._restart_from: dict[int, int] = {}  # replica → the step from which its models restart

    def attach(self, num_replicas: int) -> None:
        """Start a fit of ``num_replicas`` replicas; the models of an earlier fit of as many are kept."""
        if self.arrival_model is None or self.arrival_model.num_replicas != num_replicas:
            self.arrival_model = ArrivalModel(num_replicas, self.settings.speed_smoothing)
        self.stop_requested = False
        self.leaving_out_forbidden = None
        self._restart_from = {}
        self._note_left_out()

    @property
    def segment_steps(self) -> int:
        """Steps of a sitting-out segment (:mod:`~lightning_aesgd.engine.sitting_out`); 0: no replica sits out."""
        return self._segment_steps

    @segment_steps.setter
    def segment_steps(self, steps: int) -> None:
        # Probes fall where segments begin, and a probe then holds the others for its whole (short) segment.
        self._segment_steps = steps
        self.admission.align = max(1, steps)
        self.admission.probe_reports = SITTING_OUT_PROBE_REPORTS if steps else LOCKSTEP_PROBE_REPORTS

    def forbid_leaving_out(self, reason: str) -> None:
        """Keep every replica in the steps for the rest of this fit (their training step communicates)."""
        if self.leaving_out_forbidden is None and self.settings.leave_out_stragglers:
            log.warning("Every replica stays in the steps (leave_out_stragglers is off for this fit): %s.", reason)
        self.leaving_out_forbidden = reason

    def plan_book_for(
        self, step_batch_size: int, num_replicas: int, lag: int, cost_aware: bool = False, report_steps: int = 0
    ) -> PlanBook:
        """The plan book for steps of ``step_batch_size`` samples, created on first use or restored from a checkpoint.

        With ``cost_aware`` a replica's work is the cost of its samples (e.g. non-zeros), not their count.
        ``report_steps`` is the steps a report usually spans (the merge period under model merging); reports of
        more steps weigh more in the speed models. By default ``lag + 1``: a plan is measured that long after it is
        made, so reports under gradient synchronisation are never shorter.
        """
        self.lag, self.step_batch_size, self.cost_aware = lag, step_batch_size, cost_aware
        if self.arrival_model is not None:
            self.arrival_model.reference_steps = max(report_steps, lag + 1)
        settings = self.settings
        settings.check_step(step_batch_size, num_replicas)
        check_learner_blocks(step_batch_size, num_replicas, self.learners)
        floors = settings.floors(step_batch_size, num_replicas)
        self.floors = [-(-floor // self.learners) * self.learners for floor in floors]  # a sample per learner
        self.caps = per_replica(settings.max_batch, num_replicas, "max_batch")
        self.planner = settings.build_planner(self.floors, self.caps)
        book = self.plan_book
        if book is None or len(book.latest) != num_replicas or sum(book.latest) != step_batch_size:
            shares = settings.shares if settings.shares is not None else [1.0] * num_replicas
            sizes = apportion(step_batch_size, shares, self.floors, self.caps)
            book = self.plan_book = PlanBook(in_multiples(sizes, self.learners, self.caps))
            self.admission = Admission()  # every replica takes part in a fresh book
            self.segment_steps = self.segment_steps  # its probes follow the segments
        self._load_saved_state()
        self._note_left_out()
        # A new loader has drawn nothing yet: a fit after lr_find, or the LearningRateFinder callback's restore of
        # the loop to step 0 within one fit, must not find its first plans refused as late.
        book.forget_served()
        return book

    def _note_left_out(self) -> None:
        """A fit starts with the replicas its plans leave out already counted as left out (a resumed fit's too)."""
        latest = self.plan_book.latest if self.plan_book is not None else ()
        self._left_out_once = {rank for rank, size in enumerate(latest) if size == 0}

    def receive(self, rows: Sequence[Sequence[float]], step: int) -> None:
        """Take every replica's report (rank order, as rows) from the sync point at ``step``; maybe schedule a plan.

        Every rank passes the same rows, so every rank takes the same decision.
        """
        assert self.plan_book is not None, "call plan_book_for() first"
        assert self.arrival_model is not None, "call attach() first"
        reports = [PeriodReport.from_row(row) for row in rows]
        for rank, start in list(self._restart_from.items()):
            if self.plan_book.latest[rank] == 0:  # left out since: nothing of it to restart while it idles
                del self._restart_from[rank]
            elif reports[rank].measured and reports[rank].first_step >= start:  # only steps from then on
                self.arrival_model.restart_next(rank)
                del self._restart_from[rank]
        self.arrival_model.update(reports)
        self.stop_requested = any(report.stop > 0 for report in reports)
        self.merge_weights = [report.merge_weight for report in reports]
        models = self.arrival_model.models()
        settings = self.settings
        self._speed_changed = self._speed_changed or any(self.arrival_model.shifted)
        if settings.adaptive and models is not None and step >= settings.hold_steps and self._plans_now(step, models):
            self._plan(step, models)
        self.latest_reports = reports
        self.history.append(PlanRecord(step, tuple(self.arrival_model.rates()), self.plan_book.latest))

    def _plan(self, step: int, models: Sequence[StepTime]) -> None:
        """Ask the planner for the next plan, damp it (a named planner's), and schedule it ``lag`` steps ahead.

        With ``leave_out_stragglers``, replicas that cannot help (:mod:`~lightning_aesgd.engine.admission`) get 0
        and the planner splits the step among the others.
        """
        assert self.plan_book is not None
        assert self.arrival_model is not None
        settings, current = self.settings, self.plan_book.latest
        named = isinstance(settings.planner, str)  # a Planner object of the user's is obeyed as it is
        taking_part = [True] * len(current)
        if named and settings.leave_out_stragglers and self.leaving_out_forbidden is None and len(current) > 1:
            pending = self.arrival_model.restarts_pending()
            taking_part = self.admission.decide(
                step, models, current, self.floors, self.caps, self.lag, held_out=self.held_out
            )
            for rank, takes_part in enumerate(taking_part):
                if takes_part and current[rank] == 0:  # a probe, or back in: its model is from before it idled
                    self.arrival_model.restart_next(rank)
                elif rank in pending and current[rank] > 0:
                    taking_part[rank] = True  # a probe not measured yet: judged once its period is reported
            self._restart_others_at_a_first_leaving(step, current, taking_part)
        for rank in self.held_out:  # sitting out until its segment ends, whoever plans (engine.sitting_out)
            taking_part[rank] = False
        ranks = [rank for rank, takes_part in enumerate(taking_part) if takes_part]
        # A replica let back in enters at the floor batch of the planner's inputs (its model predates its idling).
        floors, caps = [self.floors[rank] for rank in ranks], [self.caps[rank] for rank in ranks]
        part = [max(current[rank], floor) for rank, floor in zip(ranks, floors, strict=True)]
        part = apportion(self.step_batch_size, part, floors, caps)
        planner = settings.build_planner(floors, caps) if len(ranks) < len(current) else self.planner
        target = planner.plan(part, [models[rank] for rank in ranks], self.step_batch_size)
        if named and taking_part == [size > 0 for size in current]:
            # The initial split is a guess, not a measured plan, and a replica whose speed just changed has
            # restarted its estimates at the new level: the plan then moves all the way to the target.
            gain = 1.0 if not self.plan_book.revised or self._speed_changed else settings.plan_gain
            target = damped_plan(part, target, gain, self.dead_band, floors, caps)
        self._speed_changed = False
        sizes = [0] * len(current)
        for rank, size in zip(ranks, target, strict=True):
            sizes[rank] = size
        sizes = in_multiples(sizes, self.learners, self.caps)
        if tuple(sizes) != current:
            self.plan_book.schedule(step + self.lag, sizes)

    def _restart_others_at_a_first_leaving(self, step: int, current: Sequence[int], taking_part: list[bool]) -> None:
        """When a replica is left out for the first time in this fit, the others' models restart once it applies.

        The others' contention changes (one process fewer on shared cores or a shared device). Their models might
        not follow: the change can be small (1.3x), and a level shift is only what the plans' moves of their batches
        do not explain. A probe's verdict, which leaves a replica out again, changes nothing the models knew.
        """
        leaving = {rank for rank, takes_part in enumerate(taking_part) if not takes_part and current[rank] > 0}
        if leaving - self._left_out_once:
            for rank, takes_part in enumerate(taking_part):
                if takes_part:
                    self._restart_from[rank] = step + self.lag
        self._left_out_once |= leaving

    def _plans_now(self, step: int, models: Sequence[StepTime]) -> bool:
        """Whether to ask a named planner for a new plan at this sync point (a Planner object is always asked).

        Not before the previous plan has been applied and measured: plans piled on plans that no arrival has
        reflected yet overshoot. Not while the latest plan's predicted step times agree within the dead band:
        the named planners all aim at equal step times. The check costs a few float operations where planning
        costs a few hundred microseconds.
        """
        if not isinstance(self.settings.planner, str):
            return True
        assert self.arrival_model is not None
        assert self.plan_book is not None
        noise_unknown = not self.arrival_model.noise_known(NOISE_PERIODS)
        if not self.plan_book.revised and noise_unknown and self._agree_within(models, CLEAR_IMBALANCE):
            return False
        left_out = 0 in self.plan_book.latest
        if self.admission.probe_due(step, self.plan_book.latest) or (left_out and self.leaving_out_forbidden):
            self._next_plan = step + self.lag + 1
            return True
        # A replica's changed speed was measured at its current batch, so its new plan need not wait.
        waiting = step < self._next_plan and not self._speed_changed
        if waiting:
            return False
        if self._agree_within(models, self.dead_band):
            self._speed_changed = False  # every replica changed alike: nothing to move
            return False
        self._next_plan = step + self.lag + 1
        return True

    def sitting_out_between(self, start: int, end: int) -> frozenset[int]:
        """The replicas that may sit out steps ``start`` to ``end`` (exclusive): no plan gives them work there.

        A replica qualifies when every plan in force over those steps leaves it out and its probe cannot come
        before ``end`` (a probe is chosen at a sync point at or after its step, so one due at ``end`` or later
        falls in a later segment). Every rank holds the same plans and probes at a segment's start, so all agree.
        Rank zero never sits out: Lightning's rank-zero code (loggers, telemetry, callbacks that write files) then
        always sees the model and plans as they train.
        """
        book, model, settings = self.plan_book, self.arrival_model, self.settings
        leaves_out = isinstance(settings.planner, str) and settings.leave_out_stragglers
        if not (self.segment_steps and leaves_out) or book is None or model is None or self.leaving_out_forbidden:
            return frozenset()
        probes, pending = self.admission.probe_at, model.restarts_pending()
        return frozenset(
            rank
            for rank in range(1, len(book.latest))
            if rank not in pending and probes.get(rank, -1) >= end and book.left_out_throughout(rank, start, end)
        )

    def slowest_step_seconds(self) -> float:
        """The longest smoothed step time among the replicas the latest plan gives work (0 before any)."""
        if self.arrival_model is None or self.plan_book is None:
            return 0.0
        seconds = self.arrival_model.step_seconds()
        return max((t for t, size in zip(seconds, self.plan_book.latest, strict=True) if size > 0), default=0.0)

    def shared_state(self) -> dict[str, Any]:
        """Everything the ranks' copies of the loop hold alike, for a replica that missed some sync points.

        More than :meth:`state_dict`: the estimators' whole objects (their latest misses decide the next level
        shift) and the latest reports (the next report's spacing), so that the copies stay identical afterwards.
        """
        book = self.plan_book
        return {
            "plans": None if book is None else book.state_dict(),
            "arrival_model": self.arrival_model,
            "admission": self.admission,
            "merge_weights": list(self.merge_weights),
            "latest_reports": list(self.latest_reports),
            "stop_requested": self.stop_requested,
            "next_plan": self._next_plan,
            "speed_changed": self._speed_changed,
            "left_out_once": set(self._left_out_once),
            "restart_from": dict(self._restart_from),
        }

    def adopt_shared_state(self, state: dict[str, Any]) -> None:
        """Take a peer's :meth:`shared_state`; the plan book stays this sampler's, with the plans replaced."""
        if state["plans"] is not None and self.plan_book is not None:
            self.plan_book.load_state_dict(state["plans"], keep_served=True)
        self.arrival_model = state["arrival_model"]
        self.admission = state["admission"]
        self.merge_weights = list(state["merge_weights"])
        self.latest_reports = list(state["latest_reports"])
        self.stop_requested = bool(state["stop_requested"])
        self._next_plan = int(state["next_plan"])
        self._speed_changed = bool(state["speed_changed"])
        self._left_out_once = set(state["left_out_once"])
        self._restart_from = dict(state["restart_from"])

    def lone_taker(self, step: int) -> int | None:
        """The only replica with samples in step ``step``'s plan, or ``None`` (several, or no plan book yet)."""
        if self.plan_book is None:
            return None
        takers = [rank for rank, size in enumerate(self.plan_book.sizes_at(step)) if size > 0]
        return takers[0] if len(takers) == 1 else None

    def reports_can_wait(self, step: int) -> bool:
        """Whether the sync point after step ``step`` may pass without reports while one replica trains alone.

        Not when a left-out replica is due for a probe (its probe is planned from reports), nor while a probe
        waits for its measurement. Every rank holds the same plan book and probe schedule, so all agree.
        """
        assert self.plan_book is not None
        assert self.arrival_model is not None
        probing = self.admission.probe_due(step, self.plan_book.latest) or bool(self.arrival_model.restarts_pending())
        return not probing

    def next_probe(self) -> int | None:
        """The step of the earliest probe of a left-out replica; ``None`` where none is scheduled.

        A probe is planned at the first sync point from that step: a replica sitting out comes back there, at a
        segment's start, and no plan made while it sat out may give it work (its loader drew those steps already).
        """
        return self.admission.next_probe(self.plan_book.latest) if self.plan_book is not None else None

    @property
    def dead_band(self) -> float:
        """The plans' dead band now: ``plan_dead_band``, widened to the replicas' measured step-time noise.

        See :func:`~lightning_aesgd.core.noise.noise_band`: the band within which smoothed step times differ by
        noise alone, so that equal replicas keep equal plans while noise jostles their estimates.
        """
        settings = self.settings
        if self.arrival_model is None:
            return settings.plan_dead_band
        noise = self.arrival_model.noise()
        if self.plan_book is not None:  # a left-out replica's noise says nothing about the others' plans
            noise = [sigma for sigma, size in zip(noise, self.plan_book.latest, strict=True) if size > 0]
        # The smoothing the latest reports were averaged with: long reports weigh more (ArrivalModel).
        return noise_band(noise, self.arrival_model.smoothing_now, settings.plan_dead_band)

    def balanced_within(self, spread: float) -> bool:
        """Whether the latest plan's predicted step times agree within ``spread`` (``max ≤ (1 + spread)·min``).

        From the models every rank updates alike, so every rank gives the same answer; ``False`` before any model.
        """
        models = self.arrival_model.models() if self.arrival_model is not None else None
        if models is None or self.plan_book is None:
            return False
        assert self.arrival_model is not None
        # A probe waiting for its measurement is not settled: reports stay frequent, so the probe ends soon.
        return not self.arrival_model.restarts_pending() and self._agree_within(models, spread)

    def _agree_within(self, models: Sequence[StepTime], spread: float) -> bool:
        """Whether the predicted step times of the replicas taking part agree within ``spread``.

        Batches are whole samples, so the test is ``max tᵢ(bᵢ) ≤ (1 + spread)·min tⱼ(bⱼ + 1)``: times that one sample
        more on the quickest replica would reverse count as agreeing (else large fleets of small batches replan
        forever for a plan that rounds back to the same sizes). A probed replica not measured yet is left out.
        """
        assert self.plan_book is not None
        assert self.arrival_model is not None
        pending = self.arrival_model.restarts_pending()
        kept = [
            (model, size)
            for rank, (model, size) in enumerate(zip(models, self.plan_book.latest, strict=True))
            if size > 0 and rank not in pending
        ]
        if not kept:
            return True
        slowest = max(model.seconds(size) for model, size in kept)
        return slowest <= (1 + spread) * min(model.seconds(size + 1) for model, size in kept)

    def stats(self) -> list[ReplicaStats]:
        """Every replica as the latest sync point saw it (empty before the first)."""
        if self.arrival_model is None or not self.latest_reports:
            return []
        model = self.arrival_model
        rates, seconds, noise = model.rates(), model.step_seconds(), model.noise()
        return [
            ReplicaStats(
                merge_weight=report.merge_weight,
                speed=rate,
                samples=report.work,
                wait_fraction=report.wait_fraction,
                step_seconds=step_seconds,
                busy_seconds=report.busy / report.steps if report.steps > 0 else 0.0,
                active_seconds=report.active / report.steps if report.steps > 0 else 0.0,
                loader_seconds=report.loader / report.steps if report.steps > 0 else 0.0,
                finite=report.finite > 0,
                noise=relative_noise,
            )
            for report, rate, step_seconds, relative_noise in zip(
                self.latest_reports, rates, seconds, noise, strict=True
            )
        ]

    # --- checkpoints: identical on every replica ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plans, the arrival model and the latest merge weights."""
        return {
            "plans": None if self.plan_book is None else self.plan_book.state_dict(),
            "arrivals": None if self.arrival_model is None else self.arrival_model.state_dict(),
            "merge_weights": list(self.merge_weights),
            "admission": self.admission.state_dict(),
            "next_plan": self._next_plan,
            "speed_changed": self._speed_changed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (now, or once the plan book exists)."""
        self._saved_state = state
        if self.plan_book is not None:
            self._load_saved_state()

    def _load_saved_state(self) -> None:
        state, self._saved_state = self._saved_state, None
        if state is None:
            return
        if state.get("plans") is not None and self.plan_book is not None:
            if _plans_fit(state["plans"], len(self.plan_book.latest), self.step_batch_size, self.learners):
                self.plan_book.load_state_dict(state["plans"])
                self.admission.load_state_dict(state.get("admission") or {})
                self._next_plan = int(state.get("next_plan", 0))
                self._speed_changed = bool(state.get("speed_changed", False))
                self.admission.schedule_missing_probes(self.plan_book.latest, self._next_plan)
            else:
                # Another number of replicas or another step batch (a resume across shapes): plan afresh.
                log.info(
                    "The checkpoint's plans are for another number of replicas, step batch or learners: planning "
                    "afresh."
                )
        if state.get("arrivals") is not None and self.arrival_model is not None:
            self.arrival_model.load_state_dict(state["arrivals"])
        weights = state.get("merge_weights") or []
        if self.arrival_model is not None and len(weights) == self.arrival_model.num_replicas:
            self.merge_weights = list(weights)


def _plans_fit(plans: dict[str, Any], num_replicas: int, step_batch_size: int, learners: int = 1) -> bool:
    """Whether saved plans (:meth:`PlanBook.state_dict`) split steps of ``step_batch_size`` among ``num_replicas``.

    Each replica's batch must also be whole blocks of ``learners`` samples (one block: a sample per learner).
    """
    return all(
        len(sizes) == num_replicas and sum(sizes) == step_batch_size and all(size % learners == 0 for size in sizes)
        for sizes in plans["sizes"]
    )


def check_learner_blocks(step_batch_size: int, num_replicas: int, learners: int) -> None:
    """Raise, naming the fix, unless steps of ``step_batch_size`` samples give every learner the same batch."""
    if learners > 1 and step_batch_size % learners:
        raise ValueError(
            f"Steps of {step_batch_size} samples cannot be split equally among the {learners} learners of a "
            f"replica. HINT: set step_batch_size to a multiple of {learners} (by default it is the DataLoader's "
            f"batch_size × {num_replicas} replicas × {learners} learners)."
        )
