"""This replica's arrival clock: what it did between sync points, measured on its device's own timeline.

:class:`ArrivalClock` stamps when the replica is released from a sync point and when it arrives at the next, so
its report measures everything the replica did in between (data loading, hooks, compute, throttling) and none of
the time it waited for peers (:mod:`lightning_aesgd.core.sensing`). The reports travel inside the sync point's
collective, and :class:`~lightning_aesgd.engine.plan_loop.PlanLoop` turns every replica's reports into plans.

The stamps lie on the device's own timeline (:mod:`lightning_aesgd.engine.timing`). On a CUDA device the host
runs ahead of the kernels and a collective returns once queued, so host clocks would put a step's wait for the
slowest replica into the next step's arrival; events on the compute stream do not, but are readable only once
the device has passed them. There a report carries the previous period's numbers, all of one period, read
without waiting unless the device is still a whole period behind the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.engine.timing import HostTimeline, SpanLedger, Timeline, timeline_for


class ArrivalClock:
    """Stamps one replica's releases, arrivals, waits and optimizer steps; hands out its period reports.

    A period runs from the release of one sync point to the arrival at the next. Outside training (validation, a
    checkpoint) the clock is paused, and time spent blocked on peers is waiting, not activity.

    Args:
        clock: wall clock in seconds, the stamps of a replica that does not work on a CUDA device (tests pass a
            scripted one).
        timeline: where to stamp whatever the device (tests pass a scripted one); by default the device's own
            (:func:`~lightning_aesgd.engine.timing.timeline_for`).
        throttle: the seconds this process has been frozen by a CPU quota so far
            (:class:`~lightning_aesgd.engine.throttling.ThrottleMeter`); frozen time inside a wait for peers is
            this replica's own (the peers waited for it) and counts as active. On the host's clock only.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        timeline: Timeline | None = None,
        throttle: Callable[[], float] | None = None,
    ) -> None:
        self.clock = clock
        self.throttle = throttle  # seconds this process was frozen by a CPU quota so far (see throttling)
        self._frozen_at = 0.0  # the throttle's reading when the running wait began
        self._chosen_timeline = timeline
        self._timeline = timeline if timeline is not None else HostTimeline(clock)
        self._period = _Period(self._timeline)
        self._previous: _Period | None = None  # the period before this one, once it ended (its wait included)
        self._release: Any = None  # the stamp the running active span began at; None while paused
        self._arrival: Any = None  # the stamp of the latest report
        self._wait_started: Any = None
        self._in_step = False  # inside an optimizer step, whose waits for peers are not busy time

    def attach(self, device: torch.device) -> None:
        """Start measuring a replica that works on ``device``."""
        chosen = self._chosen_timeline
        self._timeline = chosen if chosen is not None else timeline_for(device, self.clock)
        self.detach()
        self.new_epoch()

    def detach(self) -> None:
        """Forget the periods: a fit's first report measures nothing, an earlier fit's periods are not its own."""
        self._period, self._previous = _Period(self._timeline), None
        self._release = self._arrival = self._wait_started = None

    # --- within a period ------------------------------------------------------------------------------------

    @contextmanager
    def step(self, work: float, planned: int, loader_seconds: float = 0.0) -> Iterator[None]:
        """Account one local step of ``work`` samples (or cost units) whose batch took ``loader_seconds``.

        The body is the optimizer step: its busy time, less its waits for peers (DDP's reducer waits inside the
        backward), goes to telemetry; the arrival measures the rest.
        """
        # The work counts from the start: under gradient synchronisation the replica reports mid-step.
        self._period.add(work, planned)
        self._period.loader += loader_seconds
        started = self._timeline.stamp()
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
        self._period.spans.add(_BUSY, started, self._timeline.stamp())

    def new_epoch(self) -> None:
        """A new epoch began (loader workers started, epoch-end hooks ran): restart the period's clock.

        A period that already holds steps then measures nothing; an empty one measures from now.
        """
        if self._period.steps:
            self._period.measured = False
        self._period.spans.discard(_ACTIVE)
        self._release = self._timeline.stamp()

    def pause(self) -> None:
        """Stop the clock while something other than training runs (validation, a checkpoint).

        The time since the release, the replica's hooks after its last step included, stays in the period.
        """
        if self._release is not None:
            self._pause_at(self._timeline.stamp())

    def resume(self) -> None:
        """Restart the clock after :meth:`pause`."""
        if self._release is None:
            self._resume_at(self._timeline.stamp())

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time blocked on peers outside a sync point (overlapped synchronisation): not active, counted as waiting."""
        if self._release is None:  # already paused (validation, a checkpoint): the wait is part of that
            yield
            return
        start, frozen = self._timeline.stamp(), self._frozen()
        self._pause_at(start)
        try:
            yield
        finally:
            end = self._timeline.stamp()
            self._resume_at(end)
            self._add_wait(start, end)
            self._period.frozen += self._frozen() - frozen

    def begin_wait(self) -> None:
        """Start blocking on peers until :meth:`end_wait`: :meth:`waiting` split across two callbacks.

        DDP's reducer starts the wait in its hook and the step ends it; on CUDA this stamp lies on the compute
        stream before the collective is launched, that of :meth:`end_wait` after the step's sums were awaited.
        """
        self._wait_started = None
        if self._release is not None:  # not already paused
            self._wait_started = self._timeline.stamp()
            self._frozen_at = self._frozen()
            self._pause_at(self._wait_started)

    def end_wait(self) -> None:
        """Stop blocking on peers (see :meth:`begin_wait`)."""
        if self._wait_started is not None:
            released = self._timeline.stamp()
            self._resume_at(released)
            self._add_wait(self._wait_started, released)
            self._period.frozen += self._frozen() - self._frozen_at
            self._wait_started = None

    def _add_wait(self, start: Any, end: Any) -> None:
        self._period.spans.add(_WAITED, start, end)
        if self._in_step:
            self._period.spans.add(_WAITED_IN_STEP, start, end)

    # --- at a sync point ------------------------------------------------------------------------------------

    def arrive(
        self, merge_weight: float, stop: bool = False, finite: bool = True, center_norm: float = -1.0
    ) -> PeriodReport:
        """Stamp the arrival at a sync point and return this replica's report for it.

        On a deferred timeline (a CUDA device) the numbers are the previous period's, read now, blocking the host
        at most once (if the device has not yet reached that period's end); a fit's first report measures
        nothing. On the host's clock they are this period's. The wait fraction is always the previous period's:
        its wait at the sync point that ended it is known only after its report.
        """
        period = self._period
        self._arrival = self._timeline.stamp()
        self._frozen_at = self._frozen()
        # A period with idle steps (batch 0) beside working ones measures neither: an idle step pays no fixed cost,
        # so the average would fall below the working steps' line (a probe's first period, with lag >= 2).
        period.reported_measured = period.measured and self._release is not None and not period.mixes_idle_steps
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
            active=shown.spans.total(_ACTIVE) + shown.frozen,
            loader=shown.loader,
            busy=shown.spans.total(_BUSY) - shown.spans.total(_WAITED_IN_STEP),
            wait_fraction=previous.wait_fraction() if previous is not None else 0.0,
            stop=1.0 if stop else 0.0,
            finite=1.0 if finite else 0.0,
            center_norm=center_norm,
        )

    def release(self) -> None:
        """The sync point is over: the time since the arrival was waiting for the slowest; a new period starts."""
        released = self._timeline.stamp()
        if self._arrival is not None:
            self._period.spans.add(_WAITED, self._arrival, released)
        self._release = released
        self._end_period()
        # Frozen while its peers waited at this sync point: reported with the next period (this one's is sent).
        self._period.frozen += self._frozen() - self._frozen_at

    def continue_after_arrival(self) -> None:
        """Start the next period at the arrival just stamped: the replica works on while the reports travel.

        For overlapped synchronisation (a delayed gradient sum), where the replica blocks on peers later, inside
        :meth:`waiting` or :meth:`begin_wait`; there is then no :meth:`release`.
        """
        self._release = self._arrival
        self._end_period()

    def _reported_period(self) -> _Period:
        """The period whose numbers a report carries: this one on the host's clock, the previous one on a device."""
        if not self._timeline.deferred:
            return self._period  # the host's readings were read as they were taken
        if self._previous is None:  # nothing has completed before a fit's first report
            empty = _Period(self._timeline)
            empty.reported_measured = False
            return empty
        return self._previous

    def _frozen(self) -> float:
        """The throttle's reading; 0 without one, or on a device's deferred timeline."""
        return self.throttle() if self.throttle is not None and not self._timeline.deferred else 0.0

    def _pause_at(self, stamp: Any) -> None:
        self._period.spans.add(_ACTIVE, self._release, stamp)
        self._release = None

    def _resume_at(self, stamp: Any) -> None:
        if self._release is None:
            self._release = stamp

    def _end_period(self) -> None:
        self._previous, self._period = self._period, _Period(self._timeline)


_ACTIVE, _WAITED, _BUSY, _WAITED_IN_STEP = "active", "waited", "busy", "waited in step"
"""A period's spans: released to arrived (or paused), blocked on peers, inside the optimizer step, and blocked on
peers inside the optimizer step."""


class _Period:
    """Work, planned samples, steps, loader time and timed spans (:data:`_ACTIVE` …) since the last sync point."""

    def __init__(self, timeline: Timeline) -> None:
        self.work = 0.0
        self.planned = 0.0
        self.steps = 0
        self.idle_steps = 0
        self.loader = 0.0
        self.frozen = 0.0  # seconds frozen by a CPU quota while waiting for peers: this replica's own time
        self.spans = SpanLedger(timeline)
        self.measured = True  # no interruption so far
        self.reported_measured = True  # whether its report measured it (not paused at the arrival)

    def wait_fraction(self) -> float:
        """Share of the period's wall time spent blocked on peers; its spans must all have been read."""
        active, waited = self.spans.total(_ACTIVE), self.spans.total(_WAITED)
        return waited / (active + waited) if active + waited > 0 else 0.0

    @property
    def mixes_idle_steps(self) -> bool:
        """Whether some but not all of the period's steps were idle (planned 0)."""
        return 0 < self.idle_steps < self.steps

    def add(self, work: float, planned: int) -> None:
        self.work += work
        self.planned += planned
        self.steps += 1
        self.idle_steps += planned == 0
