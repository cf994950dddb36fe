"""Replicas that sit out: a left-out replica leaves the per-step collectives until its probe.

A replica the plan leaves out (:mod:`~lightning_aesgd.engine.admission`) computes nothing, but in lockstep it still
runs each of Lightning's steps beside the others and joins every step's gradient sum. Such a step costs it about a
millisecond of CPU (the loop, a zero backward, the sum): a process under an eighth of a core needs eight times
that, and its quota's throttling freezes it for most of each period, so the others wait for it at every sum
however little it computes. Under ``sync="gradients"`` it therefore *sits out*:

* Steps fall in segments that end at multiples of :data:`SEGMENT_STEPS` (but for a probe's). At a segment's first
  step every rank
  holds the same plans and probe schedule, and names the same replicas to sit the segment out
  (:meth:`~lightning_aesgd.engine.plan_loop.PlanLoop.sitting_out_between`): those that no plan in force over the
  segment gives work and whose probe cannot come within it. Probes fall on segment starts, where a report plans
  them, and a segment in which a replica is back lasts only a probe's few report intervals
  (:data:`~lightning_aesgd.engine.admission.SITTING_OUT_PROBE_REPORTS`): the probed replica then sits out again
  if its verdict leaves it out. The probe budget counts that whole segment. No plan made while a replica sits out
  gives it work: its loader has drawn the steps that plan applies to before the handoff tells it.
* Within the segment the others sum gradients and reports over a process group of their own, and plan without the
  replicas sitting out. Those run Lightning's loop by themselves (an idle batch, a bare zero loss, no update and
  no collective), so their throttling holds nobody until the segment ends.
* At the segment's end, and before anything the whole world does together (evaluation, a checkpoint, the end of
  fit), the lowest-ranked replica taking part hands every replica its model, optimizer state and plan loop
  (the pipeline's ``handoff``): the replicas that sat out then hold what lockstep would have given them.

Lightning's loop keeps every rank at the same number of steps, so a replica sitting out still runs each step's
hooks; only its share of the machinery's collectives is gone. A segment's handoff waits for it, so it sits out only
where its own steps keep up with the others' (idle steps cost far less than working ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_aesgd.engine.admission import SITTING_OUT_PROBE_REPORTS
from lightning_aesgd.engine.comm import Communicator
from lightning_aesgd.engine.plan_loop import PlanLoop

SEGMENT_STEPS = 16
"""Steps between the handoffs that bring replicas sitting out up to date (and may let them back in)."""

LOCKSTEP_STEPS = 2
"""Steps of a fit every replica takes part in: DDP's reducer rebuilds its buckets at its second forward, a broadcast
among every rank."""

Handoff = Callable[[int, frozenset[int]], None]
"""Gives every replica the state of the replica ``source`` (first argument); the second names those sitting out."""


class SittingOut:
    """Which replicas sit out the current segment, and the group the others sum over; the same on every rank.

    Args:
        segment_steps: steps per segment.
        max_wait: seconds a collective may wait before it times out (``None``: no limit). A replica sitting out
            that is ahead waits for the others' whole segment inside the handoff, so nobody sits out where the
            others' segment could take half of it.
    """

    def __init__(self, segment_steps: int = SEGMENT_STEPS, max_wait: float | None = None) -> None:
        if segment_steps < 1:
            raise ValueError(f"A segment needs at least one step, got {segment_steps}.")
        self.segment_steps = segment_steps
        self.max_wait = max_wait
        self.max_step_seconds = 0.0  # the slowest replica taking part, per step, as the plans measured it at entry
        self.absent: frozenset[int] = frozenset()  # the replicas sitting out the current segment
        self.comm: Communicator | None = None  # the present replicas' communicator (None where this one is absent)
        self._world: Any = None  # the world's communicator, where replicas may sit out; None otherwise
        self._start: int | None = None  # the current segment's first step (None before the first)
        self._end = 0  # the first step after the current segment
        self._groups: dict[tuple[int, ...], Communicator | None] = {}
        self._behind = False  # whether a step ran since the latest handoff while a replica sat out
        self._steps = 0  # steps of this fit

    @property
    def enabled(self) -> bool:
        """Whether replicas may sit out in this fit."""
        return self._world is not None

    def start(self, world: Communicator, enabled: bool) -> None:
        """A fit begins with every replica taking part; replicas sit out later only where ``enabled``.

        ``world`` must then create subgroups (:meth:`~lightning_aesgd.engine.comm.TorchCommunicator.subgroup`).
        """
        self._world = world if enabled and world.world_size > 1 and hasattr(world, "subgroup") else None
        self.comm = world
        self.absent, self._start, self._end, self._behind, self._steps = frozenset(), None, 0, False, 0

    def stop(self) -> None:
        """The fit ended: nobody sits out, and the groups go with the fit's process group."""
        self._world, self.comm, self.absent, self._start, self._end = None, None, frozenset(), None, 0
        for group in self._groups.values():
            close = getattr(group, "close", None)
            if close is not None:
                close()
        self._groups = {}

    @property
    def sits_out(self) -> bool:
        """Whether this replica sits out the current segment."""
        return self._world is not None and self._world.rank in self.absent

    @property
    def present(self) -> list[int]:
        """The world ranks taking part in the current segment's collectives."""
        size = self._world.world_size if self._world is not None else 0
        return [rank for rank in range(size) if rank not in self.absent]

    @property
    def segment(self) -> tuple[int, int]:
        """The current segment's first step and the first step after it."""
        return (self._start if self._start is not None else 0), self._end

    def stepped(self) -> None:
        """A training step ran: the replicas sitting out are behind the others from here."""
        self._steps += 1
        if self.absent:
            self._behind = True

    def starts_segment(self, step: int) -> bool:
        """Whether step ``step`` is the first of a segment this fit has not entered yet (where replicas may sit out)."""
        if self._world is None:
            return False
        return self._start is None or not self._start <= step < self._end

    def enter(self, step: int, plans: PlanLoop, handoff: Handoff) -> frozenset[int]:
        """At step ``step``; at a segment's first step, bring the replicas that sat out up to date and choose anew.

        Every rank calls it at every step, in the same order. Returns the replicas that received a handoff.

        Raises:
            ValueError: if every replica would sit out (no plan leaves all of them out).
        """
        if not self.starts_segment(step):
            return frozenset()
        caught_up = self.catch_up(handoff)
        # After the handoff: a replica that sat out holds stale models until it, and every rank must judge alike.
        self.max_step_seconds = plans.slowest_step_seconds()
        start, end = step, (step // self.segment_steps + 1) * self.segment_steps
        absent = plans.sitting_out_between(start, end)
        if self.absent - absent:
            # A replica back from sitting out is probed, most often, and left out again once measured: a segment
            # of the probe's length (planned, applied within lag steps, measured, judged, the verdict applied)
            # lets it sit out again sooner. Segments still end at multiples of segment_steps, where probes fall.
            end = min(end, start + SITTING_OUT_PROBE_REPORTS * (plans.lag + 1))
            absent = plans.sitting_out_between(start, end)
        too_long = self.max_wait is not None and self.segment_steps * self.max_step_seconds > self.max_wait / 2
        if self._steps < LOCKSTEP_STEPS or too_long:
            absent = frozenset()
        if len(absent) >= self._world.world_size:
            raise ValueError(f"Every replica would sit out steps {start}+: the plans give nobody work.")
        self.absent = plans.held_out = absent
        self._start, self._end = start, end
        self.comm = self._group(tuple(self.present)) if absent else self._world
        return caught_up

    def catch_up(self, handoff: Handoff) -> frozenset[int]:
        """Before the world acts together: hand the replicas sitting out the others' state, if they are behind.

        Returns the replicas that received it.
        """
        if not self._behind:
            return frozenset()
        handoff(min(self.present), self.absent)
        self._behind = False
        return self.absent

    def _group(self, members: tuple[int, ...]) -> Communicator | None:
        # Every rank reaches a segment's start with the same plans, so every rank asks for the same group here: the
        # world's processes all take part in creating it, as torch requires.
        if members not in self._groups:
            self._groups[members] = self._world.subgroup(members)
        return self._groups[members]
