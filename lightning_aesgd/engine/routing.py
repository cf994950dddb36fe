"""Routing work by measured speed: stamp each replica's arrivals at merges, plan from every replica's reports.

:class:`Router` is the Lightning-free part of the strategy that makes the split of every step follow the
replicas' speeds. It stamps when this replica is released from a merge and when it arrives at the next, so its
report measures everything the replica did in between (data loading, hooks, compute, throttling) and none of
the time it waited for peers (:mod:`lightning_aesgd.core.sensing`). The reports travel inside the merge's
all-reduce; every replica computes the same next plan from the same numbers, and the plan takes effect ``lag``
steps later (see :class:`~lightning_aesgd.engine.sampler.PlanBook`).

The stamps lie on the device's own timeline (:mod:`lightning_aesgd.engine.timing`). On a CUDA device the host
runs ahead of the kernels and a collective returns once queued, so host clocks would put a step's wait for the
slowest replica into the next step's arrival; events on the compute stream do not, but are readable only once
the device has passed them. There a report carries the previous period's numbers, all of one period, read
without waiting unless the device is still a whole period behind the host.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_aesgd.core.apportion import apportion
from lightning_aesgd.core.planners import Planner
from lightning_aesgd.core.sensing import ArrivalModel, PeriodReport, batch_floor, damped_plan
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.sampler import PlanBook, StepRecord
from lightning_aesgd.engine.timing import HostTimeline, SpanLedger, Timeline, timeline_for

log = logging.getLogger(__name__)

HISTORY_LENGTH = 4096
"""Merges the router remembers (step, speeds, plan) for plots: a ring, so memory stays flat over long runs."""


@dataclass(frozen=True)
class ReplicaStats:
    """One replica as the latest merge saw it, for telemetry and the end-of-fit summary.

    Attributes:
        merge_weight: the replica's merge weight at the latest merge.
        speed: smoothed samples (or cost units) per active second.
        samples: samples (or cost units) processed in the latest period.
        wait_fraction: share of its wall time the replica spent inside merges (waiting for peers included).
        step_seconds: smoothed active seconds per step (release of a merge to arrival at the next).
        busy_seconds: seconds per step inside the optimizer step (forward, backward, update).
        finite: whether the replica's model was finite at the latest merge (otherwise it was left out).
    """

    merge_weight: float
    speed: float
    samples: float
    wait_fraction: float
    step_seconds: float
    busy_seconds: float = 0.0
    finite: bool = True


class Router:
    """Measures this replica's arrivals and turns every replica's reports into batch-size plans.

    The router never communicates: at a merge it hands the strategy this replica's
    :class:`~lightning_aesgd.core.sensing.PeriodReport` (:meth:`report`), the strategy sends it inside the merge's
    all-reduce, and hands back every replica's report (:meth:`receive`). Every rank then updates the same
    :class:`~lightning_aesgd.core.sensing.ArrivalModel` and schedules the same plan ``lag`` steps ahead.

    Args:
        settings: the planner and its bounds, damping and smoothing.
        clock: wall clock in seconds, the stamps of a replica that does not work on a CUDA device (tests pass a
            scripted one).
        timeline: where to stamp arrivals and releases whatever the device (tests pass a scripted one); by
            default the device's own (:func:`~lightning_aesgd.engine.timing.timeline_for`).
    """

    def __init__(
        self,
        settings: PlanSettings | None = None,
        clock: Callable[[], float] = time.perf_counter,
        timeline: Timeline | None = None,
    ) -> None:
        self.settings = settings if settings is not None else PlanSettings()
        self.clock = clock
        self._chosen_timeline = timeline
        self._timeline = timeline if timeline is not None else HostTimeline(clock)
        self.cost_aware = False
        self.plan_book: PlanBook | None = None
        self.planner: Planner = self.settings.build_planner(self.settings.min_batch)
        self.model: ArrivalModel | None = None
        self.floor = self.settings.min_batch
        self.lag = 1
        self.total = 0
        self.stop_requested = False
        self.merge_weights: list[float] = []  # every replica's weight at the latest merge
        self.latest_reports: list[PeriodReport] = []
        # The latest merges' step, measured speeds and plan, for the benchmark's plots.
        self.history: deque[tuple[int, tuple[float, ...], tuple[int, ...]]] = deque(maxlen=HISTORY_LENGTH)
        self._saved_state: dict[str, Any] | None = None
        self._period = _Period(self._timeline)
        self._previous: _Period | None = None  # the period before this one, once it ended (its wait included)
        self._release: Any = None  # the stamp the running active span began at; None while paused
        self._arrival: Any = None  # the stamp of the latest report
        self._wait_started: Any = None
        self._next_plan = 0

    # --- lifecycle ----------------------------------------------------------------------------------------

    def attach(self, num_replicas: int, device: torch.device) -> None:
        """Start measuring one of ``num_replicas`` replicas, working on ``device``."""
        if self.model is None or self.model.num_replicas != num_replicas:
            self.model = ArrivalModel(num_replicas, self.settings.speed_smoothing)
        chosen = self._chosen_timeline
        self._timeline = chosen if chosen is not None else timeline_for(device, self.clock)
        self._forget_periods()
        self.stop_requested = False
        self.interrupt()

    def detach(self) -> None:
        """Stop measuring (fit ended); plans and models are kept for a later fit on the same Trainer."""
        self._forget_periods()

    def _forget_periods(self) -> None:
        # A fit's first report measures nothing: the periods of an earlier fit are not this one's.
        self._period, self._previous = _Period(self._timeline), None
        self._release = self._arrival = self._wait_started = None

    def plan_book_for(self, total: int, num_replicas: int, lag: int, cost_aware: bool = False) -> PlanBook:
        """The plan book for steps of ``total`` samples, created on first use or restored from a checkpoint.

        With ``cost_aware`` a replica's work is the cost of its samples (e.g. non-zeros), not their count.
        """
        self.lag, self.total, self.cost_aware = lag, total, cost_aware
        settings = self.settings
        settings.check_step(total, num_replicas)
        min_share = settings.min_share if settings.adaptive else 0.0
        self.floor = batch_floor(total, num_replicas, settings.min_batch, min_share)
        self.planner = settings.build_planner(self.floor)
        book = self.plan_book
        if book is None or len(book.latest) != num_replicas or sum(book.latest) != total:
            shares = settings.shares if settings.shares is not None else [1.0] * num_replicas
            if len(shares) != num_replicas:
                raise ValueError(f"Got {len(shares)} static shares for {num_replicas} replicas.")
            book = self.plan_book = PlanBook(apportion(total, shares, self.floor, settings.max_batch))
        self._load_saved_state()
        return book

    # --- per step -----------------------------------------------------------------------------------------

    @contextmanager
    def timing(self, record: StepRecord, loader_seconds: float = 0.0) -> Iterator[None]:
        """Account one local step whose batch took the loader ``loader_seconds`` to produce.

        Its busy time (inside the body) goes to telemetry; the arrival at the next merge measures the rest.
        """
        # The work counts from the start: under gradient synchronisation the replica reports mid-step.
        self._period.add(record.cost if self.cost_aware else float(record.num_samples), record.planned)
        self._period.loader += loader_seconds
        started = self._timeline.stamp()
        yield
        self._period.spans.add(_BUSY, started, self._timeline.stamp())

    def interrupt(self) -> None:
        """A new epoch began (loader workers started, epoch-end hooks ran): restart the period's clock.

        A period that already holds steps then measures nothing; an empty one measures from now.
        """
        if self._period.steps:
            self._period.measured = False
        self._period.spans.discard(_ACTIVE)
        self._release = self._timeline.stamp()

    def pause(self) -> None:
        """Stop the period's clock while something other than training runs (validation, a checkpoint).

        The time since the release, the replica's hooks after its last step included, stays in the period.
        """
        if self._release is not None:
            self._pause_at(self._timeline.stamp())

    def resume(self) -> None:
        """Restart the period's clock after :meth:`pause`."""
        if self._release is None:
            self._resume_at(self._timeline.stamp())

    def _pause_at(self, stamp: Any) -> None:
        self._period.spans.add(_ACTIVE, self._release, stamp)
        self._release = None

    def _resume_at(self, stamp: Any) -> None:
        if self._release is None:
            self._release = stamp

    # --- at a merge ---------------------------------------------------------------------------------------

    def report(
        self, merge_weight: float, stop: bool = False, finite: bool = True, center_norm: float = -1.0
    ) -> PeriodReport:
        """This replica's report for the merge it is arriving at; stamps the arrival.

        On a deferred timeline (a CUDA device) the numbers are the previous period's, read now, blocking the host
        at most once (if the device has not yet reached that period's end); a fit's first report measures
        nothing. On the host's clock they are this period's. The wait fraction is always the previous period's:
        its wait at the merge that ended it is known only after its report.
        """
        period = self._period
        self._arrival = self._timeline.stamp()
        period.reported_measured = period.measured and self._release is not None
        if self._release is not None:
            period.spans.add(_ACTIVE, self._release, self._arrival)
            self._release = self._arrival
        previous = self._previous
        if previous is not None:
            previous.spans.settle()  # on a device, the report's only wait, and only while it lags a whole period
        shown = self._reported_period()
        return PeriodReport(
            merge_weight=merge_weight,
            work=shown.work,
            planned=shown.planned,
            steps=float(shown.steps) if shown.reported_measured else 0.0,
            active=shown.spans.total(_ACTIVE),
            loader=shown.loader,
            busy=shown.spans.total(_BUSY),
            wait_fraction=previous.wait_fraction() if previous is not None else 0.0,
            stop=1.0 if stop else 0.0,
            finite=1.0 if finite else 0.0,
            center_norm=center_norm,
        )

    def _reported_period(self) -> _Period:
        """The period whose numbers a report carries: this one on the host's clock, the previous one on a device."""
        if not self._timeline.deferred:
            return self._period  # the host's readings were read as they were taken
        if self._previous is None:  # nothing has completed before a fit's first report
            empty = _Period(self._timeline)
            empty.reported_measured = False
            return empty
        return self._previous

    def continue_after_arrival(self) -> None:
        """Start the next period at the arrival just reported: the replica works on while the reports travel.

        For overlapped synchronisation (a delayed gradient sum), where the replica blocks on peers later, inside
        :meth:`pause`/:meth:`resume`; the reports then come back through ``receive(..., released=False)``.
        """
        self._release = self._arrival
        self._end_period()

    def begin_wait(self) -> None:
        """Start blocking on peers (counted as waiting, not active) until :meth:`end_wait`; see :meth:`waiting`.

        On CUDA the stamps lie on the compute stream: this one before the collective is launched, that of
        :meth:`end_wait` once the step's sums were awaited, after them on the device.
        """
        self._wait_started = None
        if self._release is not None:  # not already paused
            self._wait_started = self._timeline.stamp()
            self._pause_at(self._wait_started)

    def end_wait(self) -> None:
        """Stop blocking on peers (see :meth:`begin_wait`)."""
        if self._wait_started is not None:
            released = self._timeline.stamp()
            self._resume_at(released)
            self._period.spans.add(_WAITED, self._wait_started, released)
            self._wait_started = None

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time blocked on peers outside a merge (overlapped synchronisation): not active, counted as waiting."""
        if self._release is None:  # already paused (validation, a checkpoint): the wait is part of that
            yield
            return
        start = self._timeline.stamp()
        self._pause_at(start)
        try:
            yield
        finally:
            end = self._timeline.stamp()
            self._resume_at(end)
            self._period.spans.add(_WAITED, start, end)

    def receive(self, rows: Sequence[Sequence[float]], step: int, released: bool = True) -> None:
        """Take every replica's report (rank order) after the merge; update the models and schedule a plan.

        Every rank passes the same rows, so every rank takes the same decision. ``released``: this replica leaves
        the merge now (the next period starts); ``False`` after :meth:`continue_after_arrival`.
        """
        assert self.plan_book is not None
        assert self.model is not None
        if released:
            self._release_now()
        reports = [PeriodReport.from_row(row) for row in rows]
        self.model.update(reports)
        self.stop_requested = any(report.stop > 0 for report in reports)
        self.merge_weights = [report.merge_weight for report in reports]
        models = self.model.models()
        settings = self.settings
        planning = settings.adaptive and models is not None and step >= settings.hold_steps
        if planning and models is not None and self._plans_now(step, models):
            current = self.plan_book.latest
            sizes = self.planner.plan(current, models, self.total)
            if isinstance(settings.planner, str):  # a Planner object of the user's is obeyed as it is
                # The initial split is a guess, not a measured plan: the first plan moves all the way to the target.
                gain = settings.plan_gain if self.plan_book.revised else 1.0
                sizes = damped_plan(current, sizes, gain, settings.plan_dead_band, self.floor, settings.max_batch)
            if tuple(sizes) != current:
                self.plan_book.schedule(step + self.lag, sizes)
        self.latest_reports = reports
        self.history.append((step, tuple(self.model.rates()), self.plan_book.latest))
        if released:
            self._end_period()

    def _release_now(self) -> None:
        released = self._timeline.stamp()
        if self._arrival is not None:
            self._period.spans.add(_WAITED, self._arrival, released)  # the merge: waiting for the slowest
        self._release = released

    def _end_period(self) -> None:
        self._previous, self._period = self._period, _Period(self._timeline)

    def _plans_now(self, step: int, models: Sequence[StepTime]) -> bool:
        """Whether to ask a named planner for a new plan at this merge (a Planner object is always asked).

        Not before the previous plan has been applied and measured: plans piled on plans that no arrival has
        reflected yet overshoot. Not while the latest plan's predicted step times agree within the dead band:
        the named planners all aim at equal step times. The check costs a few float operations where planning
        costs a few hundred microseconds.
        """
        if not isinstance(self.settings.planner, str):
            return True
        if step < self._next_plan:
            return False
        assert self.plan_book is not None
        times = [model.seconds(size) for model, size in zip(models, self.plan_book.latest, strict=True)]
        if max(times) <= (1 + self.settings.plan_dead_band) * min(times):
            return False
        self._next_plan = step + self.lag + 1
        return True

    def balanced_within(self, spread: float) -> bool:
        """Whether the latest plan's predicted step times agree within ``spread`` (``max ≤ (1 + spread)·min``).

        From the models every rank updates alike, so every rank gives the same answer; ``False`` before any model.
        """
        models = self.model.models() if self.model is not None else None
        if models is None or self.plan_book is None:
            return False
        times = [model.seconds(size) for model, size in zip(models, self.plan_book.latest, strict=True)]
        return max(times) <= (1 + spread) * min(times)

    def stats(self) -> list[ReplicaStats]:
        """Every replica as the latest merge saw it (empty before the first merge)."""
        if self.model is None or not self.latest_reports:
            return []
        reports = self.latest_reports
        rates, seconds = self.model.rates(), self.model.step_seconds()
        return [
            ReplicaStats(
                merge_weight=report.merge_weight,
                speed=rate,
                samples=report.work,
                wait_fraction=report.wait_fraction,
                step_seconds=step_seconds,
                busy_seconds=report.busy / report.steps if report.steps > 0 else 0.0,
                finite=report.finite > 0,
            )
            for report, rate, step_seconds in zip(reports, rates, seconds, strict=True)
        ]

    # --- checkpoints --------------------------------------------------------------------------------------

    def shared_state(self) -> dict[str, Any]:
        """Plans and the arrival model: identical on every replica."""
        return {
            "plans": None if self.plan_book is None else self.plan_book.state_dict(),
            "arrivals": None if self.model is None else self.model.state_dict(),
            "merge_weights": list(self.merge_weights),
        }

    def local_state(self) -> dict[str, Any]:
        """Nothing: every measurement the router keeps is shared."""
        return {}

    def load_shared_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`shared_state` returned (now, or once the plan book exists)."""
        self._saved_state = state
        if self.plan_book is not None:
            self._load_saved_state()

    def load_local_state(self, state: dict[str, Any]) -> None:
        """Accept a replica's saved local state (older checkpoints kept per-replica speeds; they are re-measured)."""

    def _load_saved_state(self) -> None:
        state, self._saved_state = self._saved_state, None
        if state is None:
            return
        if state.get("plans") is not None and self.plan_book is not None:
            if _plans_fit(state["plans"], len(self.plan_book.latest), self.total):
                self.plan_book.load_state_dict(state["plans"])
            else:
                # Another number of replicas or another step size (a resume across shapes): plan afresh.
                log.info("The checkpoint's plans are for another number of replicas or step size: planning afresh.")
        if state.get("arrivals") is not None and self.model is not None:
            self.model.load_state_dict(state["arrivals"])
        weights = state.get("merge_weights") or []
        if self.model is not None and len(weights) == self.model.num_replicas:
            self.merge_weights = list(weights)


def _plans_fit(plans: dict[str, Any], num_replicas: int, total: int | None) -> bool:
    """Whether saved plans (:meth:`PlanBook.state_dict`) split steps of ``total`` among ``num_replicas``."""
    return all(len(sizes) == num_replicas and sum(sizes) == total for sizes in plans["sizes"])


_ACTIVE, _WAITED, _BUSY = "active", "waited", "busy"
"""A period's spans: released to arrived (or paused), blocked on peers, inside the optimizer step."""


class _Period:
    """Work, planned samples, steps, loader time and timed spans (:data:`_ACTIVE` …) since the last merge."""

    def __init__(self, timeline: Timeline) -> None:
        self.work = 0.0
        self.planned = 0.0
        self.steps = 0
        self.loader = 0.0
        self.spans = SpanLedger(timeline)
        self.measured = True  # no interruption so far
        self.reported_measured = True  # whether its report measured it (not paused at the arrival)

    def wait_fraction(self) -> float:
        """Share of the period's wall time spent blocked on peers; its spans must all have been read."""
        active, waited = self.spans.total(_ACTIVE), self.spans.total(_WAITED)
        return waited / (active + waited) if active + waited > 0 else 0.0

    def add(self, work: float, planned: int) -> None:
        self.work += work
        self.planned += planned
        self.steps += 1
