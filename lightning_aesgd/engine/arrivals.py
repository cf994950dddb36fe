"""This replica's arrival clock: what its whole steps took, measured on its device's own timeline.

:class:`ArrivalClock` times each step from its beginning to the next step's, so that its reports measure
everything the replica did for its steps (data loading, compute, the update, the hooks after it, throttling) and
none of the time it waited for peers (:mod:`lightning_aesgd.core.sensing`). A report, sent at a sync point inside a
step (after its last gradient bucket, or at a merge after its update), carries the whole steps completed since the
latest report. A period running from one sync point to the next would pair each step's tail (its update and the
hooks after it) with the next step's batch: where that tail grows with the batch (an ``on_train_batch_end`` hook),
the batch change at a new plan then read as a fixed cost per step, and a fit's first report held no tail at all.
The reports travel inside the sync point's collective, and :class:`~lightning_aesgd.engine.plan_loop.PlanLoop`
turns every replica's reports into plans.

The stamps lie on the device's own timeline (:mod:`lightning_aesgd.engine.timing`). On a CUDA device the host
runs ahead of the kernels and a collective returns once queued, so host clocks would put a step's wait for the
slowest replica into the next step's arrival; events on the compute stream do not, but are readable only once
the device has passed them. There a report carries the previous report's steps, read without waiting unless the
device is still that far behind the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.engine.timing import HostTimeline, SpanLedger, Timeline, timeline_for

ONE_TIME_STEP = 0
"""The step of a fit (counted from 0) that no report measures, or a replica's first step with samples where it sat
out or idled the fit's first steps (a resumed fit whose plans leave it out). Its one-time costs (lazy
initialisation, the first allocations, the optimizer's state, on a GPU the libraries' setup and kernel selection)
are common to every replica. Measured, they made a first step about 2.5 times a settled one (XMC mini on CPU
replicas), and the speed models, slow to forget it, restarted one replica at a time as their misses crossed the
level-shift threshold: equal replicas then looked unequal, and their first plan moved by up to a fifth."""


class ArrivalClock:
    """Times one replica's steps, less its waits for peers; hands out a report of its whole steps at each sync point.

    A step runs from its beginning (:meth:`begin_step`, after its batch is fetched) to the next step's. Outside
    training (validation, a checkpoint) the clock is paused, and time spent blocked on peers is waiting, not activity.

    Args:
        clock: wall clock in seconds, the stamps of a replica that does not work on a CUDA device (tests pass a
            scripted one).
        timeline: where to stamp whatever the device (tests pass a scripted one); by default the device's own
            (:func:`~lightning_aesgd.engine.timing.timeline_for`).
        throttle: the seconds this process has been frozen by a CPU quota so far
            (:class:`~lightning_aesgd.engine.throttling.ThrottleMeter`); frozen time inside a wait for peers is
            this replica's own (the peers waited for it) and counts as active. On the host's clock only.
        unmeasured_step: a step of each fit (counted from 0) that no report measures, where the replica waits for
            peers in a way the clock cannot tell from its own work (under gradient synchronisation, DDP's bucket
            rebuild: :data:`~lightning_aesgd.engine.gradient_sync.BUCKET_REBUILD_STEP`); ``None``: none. A fit's
            first step is never measured either (:data:`ONE_TIME_STEP`).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        timeline: Timeline | None = None,
        throttle: Callable[[], float] | None = None,
        unmeasured_step: int | None = None,
    ) -> None:
        self.clock = clock
        self.unmeasured_step = unmeasured_step
        self.throttle = throttle  # seconds this process was frozen by a CPU quota so far (see throttling)
        self._frozen_at = 0.0  # the throttle's reading when the running wait began
        self._chosen_timeline = timeline
        self._timeline = timeline if timeline is not None else HostTimeline(clock)
        self._step = _Period(self._timeline)  # the running step, from its beginning
        self._period = _Period(self._timeline)  # the whole steps since the latest report
        self._previous: _Period | None = None  # the steps the latest report covered
        self._release: Any = None  # the stamp the running active span began at; None while paused
        self._arrival: Any = None  # the stamp of the latest arrival, until its release; None if paused there
        self._wait_started: Any = None
        self._in_step = False  # inside an optimizer step, whose waits for peers are not busy time
        self._steps_begun = 0  # steps of this fit begun so far
        self._worked = False  # whether a step of this fit has had samples (the first that does is not measured)

    def attach(self, device: torch.device) -> None:
        """Start measuring a replica that works on ``device``."""
        chosen = self._chosen_timeline
        self._timeline = chosen if chosen is not None else timeline_for(device, self.clock)
        self.detach()

    def detach(self) -> None:
        """Forget the steps: an earlier fit's are not the next one's."""
        self._step, self._period, self._previous = _Period(self._timeline), _Period(self._timeline), None
        self._release = self._arrival = self._wait_started = None
        self._steps_begun = 0
        self._worked = False

    # --- within a step --------------------------------------------------------------------------------------

    def begin_step(self, new_epoch: bool = False, key: int | None = None) -> None:
        """A step begins (its batch fetched): the step before it is complete. Starts the clock if paused.

        The step before joins the next report, but for the fit's first step with samples (:data:`ONE_TIME_STEP`) and
        its ``unmeasured_step``, a step that ran into a new epoch (``new_epoch``: loader workers started, epoch-end
        hooks ran), and a step without an optimizer step (a replica sitting out), whose time trained nothing.
        ``key`` names the beginning step in the plans' numbering
        (:meth:`~lightning_aesgd.engine.sampler.PlanBook.sizes_at`); by default, the steps begun in this fit.
        """
        now = self._timeline.stamp()
        if self._release is not None:
            self._step.spans.add(_ACTIVE, self._release, now)
        worked = self._step.planned > 0
        first_work = worked and not self._worked  # its one-time costs: ONE_TIME_STEP, unless the replica sat out
        unmeasured = first_work or self._steps_begun - 1 == self.unmeasured_step  # counted from the fit's first (0)
        self._worked = self._worked or worked
        if self._step.steps and not (new_epoch or unmeasured):
            self._period.absorb(self._step)
        self._step = _Period(self._timeline, first_step=self._steps_begun if key is None else key)
        self._release = now
        self._steps_begun += 1

    def restart(self) -> None:
        """Forget the steps since the latest report, the running one's time included, and run the clock from now.

        For a replica that sat steps out (:mod:`~lightning_aesgd.engine.sitting_out`): its idle steps trained
        nothing. On a deferred timeline the steps of the latest report, due to be read at the next, go too: they
        were measured before the replica sat out.
        """
        running = _Period(self._timeline, first_step=self._step.first_step)  # the same step, timed from now
        self._step, self._period, self._previous = running, _Period(self._timeline), None
        self._release = self._timeline.stamp()

    @contextmanager
    def step(self, work: float, planned: int, loader_seconds: float = 0.0) -> Iterator[None]:
        """Account the running step's ``work`` samples (or cost units), whose batch took ``loader_seconds``.

        The body is the optimizer step: its busy time, less its waits for peers (DDP's reducer waits inside the
        backward), goes to telemetry; the step's whole time, from its beginning to the next step's, to the report.
        """
        self._step.add(work, planned)
        self._step.loader += loader_seconds
        started = self._timeline.stamp()
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
        self._step.spans.add(_BUSY, started, self._timeline.stamp())

    def pause(self) -> None:
        """Stop the clock while something other than training runs (validation, a checkpoint).

        The time since the release, the replica's hooks after its last step included, stays in the step.
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
            self._step.frozen += self._frozen() - frozen

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
            self._step.frozen += self._frozen() - self._frozen_at
            self._wait_started = None

    def _add_wait(self, start: Any, end: Any) -> None:
        self._step.spans.add(_WAITED, start, end)
        if self._in_step:
            self._step.spans.add(_WAITED_IN_STEP, start, end)

    # --- at a sync point ------------------------------------------------------------------------------------

    def arrive(
        self, merge_weight: float, stop: bool = False, finite: bool = True, center_norm: float = -1.0
    ) -> PeriodReport:
        """Stamp the arrival at a sync point and return this replica's report of its whole steps since the last.

        The replica works on from here; under model merging it blocks on peers until :meth:`release`. On a
        deferred timeline (a CUDA device) the numbers are those of the steps the previous report covered, read now,
        blocking the host at most once (if the device has not yet reached their end).
        """
        self._arrival = None  # paused (a merge at validation): the wait until the release is part of the pause
        if self._release is not None:
            self._arrival = self._timeline.stamp()
            self._step.spans.add(_ACTIVE, self._release, self._arrival)
            self._release = self._arrival  # working on (overlapped synchronisation) until a release says otherwise
        self._frozen_at = self._frozen()
        shown = self._period
        if self._timeline.deferred:
            shown = self._previous if self._previous is not None else _Period(self._timeline)
            shown.spans.settle()  # on a device, the report's only wait, and only while it lags that far
        self._previous, self._period = self._period, _Period(self._timeline)
        return PeriodReport(
            merge_weight=merge_weight,
            work=shown.work,
            planned=shown.planned,
            # A period with idle steps (batch 0) beside working ones measures neither: an idle step pays no fixed
            # cost, so the average would fall below the working steps' line (a probe's first period, with lag >= 2).
            steps=0.0 if shown.mixes_idle_steps else float(shown.steps),
            active=shown.spans.total(_ACTIVE) + shown.frozen,
            loader=shown.loader,
            busy=shown.spans.total(_BUSY) - shown.spans.total(_WAITED_IN_STEP),
            wait_fraction=shown.wait_fraction(),
            stop=1.0 if stop else 0.0,
            finite=1.0 if finite else 0.0,
            center_norm=center_norm,
            first_step=float(shown.first_step),
        )

    def release(self) -> None:
        """The sync point is over: the time since the arrival was waiting for the slowest replica."""
        if self._arrival is None:  # arrived paused, or not at all: the clock stays as it is
            return
        released = self._timeline.stamp()
        self._step.spans.add(_WAITED, self._arrival, released)
        self._release, self._arrival = released, None
        # Frozen while its peers waited at this sync point: the replica's own time, in its step.
        self._step.frozen += self._frozen() - self._frozen_at

    def _frozen(self) -> float:
        """The throttle's reading; 0 without one, or on a device's deferred timeline."""
        return self.throttle() if self.throttle is not None and not self._timeline.deferred else 0.0

    def _pause_at(self, stamp: Any) -> None:
        self._step.spans.add(_ACTIVE, self._release, stamp)
        self._release = None

    def _resume_at(self, stamp: Any) -> None:
        if self._release is None:
            self._release = stamp


_ACTIVE, _WAITED, _BUSY, _WAITED_IN_STEP = "active", "waited", "busy", "waited in step"
"""A period's spans: running (not paused), blocked on peers, inside the optimizer step, and blocked on peers inside
the optimizer step."""


class _Period:
    """Work, planned samples, steps, loader time and timed spans (:data:`_ACTIVE` …) of one step or several."""

    def __init__(self, timeline: Timeline, first_step: int = -1) -> None:
        self.first_step = first_step  # the key of the first step (−1: no step yet)
        self.work = 0.0
        self.planned = 0.0
        self.steps = 0
        self.idle_steps = 0
        self.loader = 0.0
        self.frozen = 0.0  # seconds frozen by a CPU quota while waiting for peers: this replica's own time
        self.spans = SpanLedger(timeline)

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

    def absorb(self, step: _Period) -> None:
        """Add ``step``'s work and spans to this period's (``step`` began after all of this period's spans)."""
        if not self.steps:
            self.first_step = step.first_step
        self.work += step.work
        self.planned += step.planned
        self.steps += step.steps
        self.idle_steps += step.idle_steps
        self.loader += step.loader
        self.frozen += step.frozen
        self.spans.absorb(step.spans)
