"""Reports beside the gradient sums: launched with a step's last bucket, taken in after its backward.

Under gradient synchronisation every step is a sync point: a report rides in the last gradient bucket's
all-reduce, and has a small all-reduce of its own only where that bucket cannot carry it. The
:class:`ReportExchange` sends one every ``lag + 1`` steps until the plan is settled (a plan is made only after
the previous one has been applied and measured), then about every quarter second of training
(:func:`~lightning_aesgd.core.schedule.report_interval`). Every replica decides from the same received reports,
so all agree on which steps report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from lightning_aesgd.core.schedule import report_interval, report_seconds
from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.engine.comm import Communicator, completed, copy_from_host
from lightning_aesgd.engine.flat import to_host
from lightning_aesgd.engine.plan_loop import PlanLoop

Carrier = Callable[[Tensor], "torch.futures.Future[Tensor] | None"]
"""Takes a report table into a sum launched anyway and returns its future, or ``None`` where it cannot."""

SETTLED_SPREAD = 0.1
"""A plan whose predicted step times agree within this fraction counts as settled: reports may then space out."""


FIRST_REPORT_STEP = 3
"""A fit's first report, at its fourth step (counted from 0): the clock measures none of its first step
(:data:`~lightning_aesgd.engine.arrivals.ONE_TIME_STEP`) nor its second, in which DDP rebuilds its buckets
(:data:`~lightning_aesgd.engine.gradient_sync.BUCKET_REBUILD_STEP`); the third is whole once the fourth begins."""


class ReportExchange:
    """When reports are due, and the report all-reduces in flight, for one replica under gradient sync."""

    def __init__(self) -> None:
        self._in_flight: list[torch.futures.Future[Tensor]] = []
        self._next_report: int | None = None  # the global step of the next report (None: FIRST_REPORT_STEP)
        self._every = 0  # steps between reports, from the latest reports (0: none received yet)
        self._latest = 0  # the global step of the latest report launched

    def start(self) -> None:
        """A fit begins: its step :data:`FIRST_REPORT_STEP` reports, and nothing of an earlier fit is in flight.

        Not sooner: a report carries the whole steps completed before it
        (:class:`~lightning_aesgd.engine.arrivals.ArrivalClock`), and the first that one measures is step 2, so a
        report before step 3 would measure nothing, and the first plan would wait ``lag + 1`` steps more (on a
        device's deferred timeline a report shows the steps of the one before, and the first measured report comes
        a report later). A fit of 3 steps or fewer exchanges no report.
        """
        self._in_flight, self._next_report, self._every, self._latest = [], None, 0, 0

    def due(self, global_step: int, plans: PlanLoop) -> bool:
        """Whether this step reports; if so, the next report is scheduled ``lag + 1`` steps or more later.

        :meth:`space_out` may bring it sooner for a probe, where replicas sit out.
        """
        if self._next_report is None:
            self._next_report = global_step + FIRST_REPORT_STEP
        if global_step < self._next_report:
            return False
        self._next_report = global_step + max(self._every, plans.lag + 1)
        self._latest = global_step
        return True

    def launch(
        self,
        row: list[float],
        comm: Communicator,
        device: torch.device,
        slot: int | None = None,
        rows: int = 0,
        carrier: Carrier | None = None,
    ) -> None:
        """Launch the sum of every replica's report row, this replica's ``row`` in its own place.

        Over a group of some replicas (the others sitting out), ``slot`` is this replica's world rank and ``rows``
        the world's size: the rows of the replicas outside the group arrive as zeros. A ``carrier`` takes the
        table into a sum it launches anyway over ``comm`` (the last gradient bucket's:
        :meth:`~lightning_aesgd.engine.gradients.GradientSum.carry`); where it cannot, the table has an all-reduce
        of its own.
        """
        table = torch.zeros(rows or comm.world_size, len(row), dtype=torch.float64, device=device)
        copy_from_host(table[comm.rank if slot is None else slot], row)  # pinned, non-blocking: no wait here
        carried = carrier(table) if carrier is not None else None
        self._in_flight.append(carried if carried is not None else _summed(table, comm))

    def received(
        self,
        keep: int,
        waiting: Callable[[], AbstractContextManager[Any]],
        beside: Callable[[], Tensor | None] = lambda: None,
    ) -> Iterator[tuple[list[list[float]], list[float] | None]]:
        """Every exchange but the latest ``keep``, oldest first, as rows; the wait for each inside ``waiting()``.

        Each comes with the numbers of what ``beside()`` then gives (``None`` where it gives nothing), read in the
        same wait where they share the rows' device: one host read per exchange.
        """
        while len(self._in_flight) > keep:
            future = self._in_flight.pop(0)
            with waiting():
                table = future.wait()
            extra = beside()
            if extra is not None and extra.device == table.device:
                numbers = to_host(torch.cat([table.reshape(-1), extra.reshape(-1).to(table.dtype)]))
            else:
                numbers = to_host(table) + ([] if extra is None else to_host(extra))
            width, cells = table.shape[1], table.numel()
            rows = [numbers[start : start + width] for start in range(0, cells, width)]
            yield rows, None if extra is None else numbers[cells:]

    def state_dict(self) -> dict[str, int | None]:
        """When the next report is due (for a replica that missed some): nothing in flight is included."""
        return {"next_report": self._next_report, "every": self._every, "latest": self._latest}

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        """Take what :meth:`state_dict` returned."""
        next_report = state["next_report"]
        self._next_report = None if next_report is None else int(next_report)
        self._every = int(state["every"] or 0)
        self._latest = int(state["latest"] or 0)  # a handoff's state, within one fit: never from an older version

    def space_out(self, plans: PlanLoop, key_offset: int = 0) -> None:
        """Set the steps to the next report from the reports just received.

        ``key_offset`` is the plans' step key minus Lightning's global step, which reports count (they differ from
        the second epoch on where an epoch stops early, e.g. under ``limit_train_batches``).

        ``lag + 1`` until the plan is settled, then about a quarter second's worth (more for hundreds of replicas:
        :func:`~lightning_aesgd.core.schedule.report_seconds`). Settled: the plan's predicted
        step times agree within :data:`SETTLED_SPREAD` (the plan loop's smoothed models, so timing noise on equal
        devices does not count), and every report measured at least ``lag + 1`` steps (the reports after an epoch's
        start, or a fit's, hold fewer: the step running into the epoch and a fit's first two steps are not measured).
        """
        shortest = plans.lag + 1
        reports = [report for rank, report in enumerate(plans.latest_reports) if rank not in plans.held_out]
        settled = plans.balanced_within(SETTLED_SPREAD) and all(report.steps >= shortest for report in reports)
        seconds = report_seconds(len(plans.latest_reports))
        self._every = report_interval(_step_seconds(reports), shortest, seconds=seconds) if settled else shortest
        # A shorter interval counts from the latest report, not from the one after it: the report that starts a
        # probe (or a new plan) was scheduled at the settled plan's interval, and the probe held every step at the
        # probed replica's pace until a second such interval had passed (about 30 steps instead of lag + 1).
        soonest = self._latest + self._every
        self._next_report = soonest if self._next_report is None else min(self._next_report, soonest)
        # A probe is planned from the reports at its step, where a replica sitting out comes back: a report falls
        # there, so that the probe and its verdict fit in the short segment it comes back for (engine.sitting_out),
        # sooner than lag + 1 steps after the latest if need be.
        probe = plans.next_probe()
        if probe is not None:
            earliest = self._latest + (1 if plans.segment_steps else shortest)
            self._next_report = min(self._next_report, max(earliest, probe - key_offset))


def _summed(table: Tensor, comm: Communicator) -> torch.futures.Future[Tensor]:
    """The all-reduce of a report table on its own; none over a group of one replica, whose table is the sum."""
    if comm.world_size == 1:  # a job of one replica, or the one replica present in a segment
        return completed(table)
    summed: torch.futures.Future[list[Tensor]] = comm.all_reduce_sum_async(table)
    return summed.then(lambda future: future.value()[0])


def _step_seconds(reports: list[PeriodReport]) -> float:
    """The longest measured step of the latest reports (active seconds per step), 0 where none was measured."""
    return max((report.active / report.steps for report in reports if report.steps > 0), default=0.0)
