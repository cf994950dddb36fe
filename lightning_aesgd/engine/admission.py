"""Which replicas take part in the steps: a replica that cannot help gets no work, and is probed now and then.

Every replica of a synchronous step holds the others at the sync point. A replica whose step at the smallest
batch outlasts what the others need for the whole step batch (a CPU replica beside a GPU, a process under an
eighth of a core, a GPU fifty times slower than its peers) makes every step slower than leaving it out, whatever
its batch (:func:`~lightning_aesgd.core.planners.admitted_replicas`). It is then planned a batch of 0: it skips
its forward over data (a zero loss's backward keeps it in the sums) and joins the sync point with nothing to add,
so the others no longer wait for its compute; it still takes part in every step's collectives.

Its speed is no longer measured while it idles, so it is probed: given the smallest batch for one plan, after a
number of steps chosen so that probes cost :data:`PROBE_BUDGET` of the training time, and re-admitted when the
fresh measurement says it helps. A probe holds the others for a few report intervals of ``lag + 1`` steps (reports
stay frequent meanwhile): :data:`LOCKSTEP_PROBE_REPORTS` where the replica idles in lockstep anyway;
:data:`SITTING_OUT_PROBE_REPORTS` where it would otherwise sit out (:mod:`~lightning_aesgd.engine.sitting_out`),
whose probe's segment also holds its idle steps around the probe.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from lightning_aesgd.core.planners import admitted_replicas, balanced_step_time
from lightning_aesgd.core.speed import StepTime

PROBE_BUDGET = 0.02
"""Largest fraction of the training time that probing left-out replicas may cost."""

LOCKSTEP_PROBE_REPORTS = 2
"""Report intervals a probe holds the others where the probed replica idles in lockstep anyway, from its plan's start
to the verdict's: a report whose period mixes idle steps in measures nothing (at ``lag >= 2``), then one that
measures it, then the verdict's lag."""

SITTING_OUT_PROBE_REPORTS = 3
"""Report intervals a probe's segment lasts where the probed replica otherwise sits out: the probe plan's lag, a
report whose period mixes idle steps in, then one that measures it and the verdict's lag. The replica holds the
others throughout, idle or not."""

MIN_PROBE_INTERVAL = 50
"""Fewest steps between two probes of one replica."""


class Admission:
    """Decides, identically on every rank, which replicas the next plan gives work.

    Args:
        margin: a replica is left out only if the step without it is shorter by more than this fraction.
        align: probes fall on multiples of it: a replica that sits out (:mod:`~lightning_aesgd.engine.sitting_out`)
            comes back only where a segment of steps begins.
        probe_reports: report intervals a probe holds the others (:data:`LOCKSTEP_PROBE_REPORTS` or
            :data:`SITTING_OUT_PROBE_REPORTS`).
    """

    def __init__(self, margin: float = 0.1, align: int = 1, probe_reports: int = LOCKSTEP_PROBE_REPORTS) -> None:
        self.margin = margin
        self.align = align
        self.probe_reports = probe_reports
        self.probe_at: dict[int, int] = {}  # left-out replica → the step of its next probe
        self.probed: set[int] = set()  # replicas probed at least once in this fit

    def probe_due(self, step: int, current: Sequence[int]) -> bool:
        """Whether a replica left out of the plan in force (``current``) is due to be probed at this sync point."""
        return any(step >= due and current[rank] == 0 for rank, due in self.probe_at.items())

    def next_probe(self, current: Sequence[int]) -> int | None:
        """The step of the earliest probe of a replica left out of the plan in force (``current``); ``None``: none."""
        return min((due for rank, due in self.probe_at.items() if current[rank] == 0), default=None)

    def schedule_missing_probes(self, current: Sequence[int], step: int) -> None:
        """Give every left-out replica without one (a checkpoint that predates the schedule) a probe."""
        for rank, size in enumerate(current):
            if size == 0 and rank not in self.probe_at:
                self.probe_at[rank] = step + MIN_PROBE_INTERVAL

    def decide(
        self,
        step: int,
        models: Sequence[StepTime],
        current: Sequence[int],
        floors: Sequence[int],
        caps: Sequence[int | None],
        lag: int,
        held_out: Collection[int] = (),
    ) -> list[bool]:
        """Which replicas the plan made at ``step`` gives work: those that help, and those due for a probe.

        Args:
            step: the sync point's step.
            models: every replica's step-time model (a left-out replica's from its latest measured period).
            current: the plan in force; 0 for a left-out replica.
            floors: each replica's smallest batch while it takes part.
            caps: each replica's largest batch (``None``: no limit).
            lag: steps before a plan applies.
            held_out: replicas sitting out until their probe: they get no work, and their probe stays as it is.
        """
        total = sum(current)
        helping = admitted_replicas(total, models, floors, caps, self.margin)
        chosen = list(helping)
        for rank, helps in enumerate(helping):
            if rank in held_out:
                chosen[rank] = False
            elif helps:
                self.probe_at.pop(rank, None)
            elif current[rank] == 0 and step >= self.probe_at.get(rank, step + 1):
                chosen[rank] = True  # its probe: measured at the smallest batch, then judged again
                del self.probe_at[rank]
                self.probed.add(rank)
            elif rank not in self.probe_at:
                # The first verdict may rest on one period's hiccup (a page-fault storm, a kernel's first load),
                # which the budget's interval would hold out for thousands of steps: the first probe comes soon,
                # and measures the replica afresh; later intervals follow that measurement.
                holds = self.probe_reports * (lag + 1)
                interval = probe_interval(total, models, helping, rank, floors, caps, holds)
                due = step + (interval if rank in self.probed else MIN_PROBE_INTERVAL)
                self.probe_at[rank] = -(-due // self.align) * self.align
        return chosen

    def state_dict(self) -> dict[str, Any]:
        """The probe schedule, for checkpoints."""
        return {"probe_at": dict(self.probe_at), "probed": sorted(self.probed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.probe_at = {int(rank): int(due) for rank, due in state.get("probe_at", {}).items()}
        self.probed = {int(rank) for rank in state.get("probed", [])}


def probe_interval(
    total: int,
    models: Sequence[StepTime],
    helping: Sequence[bool],
    rank: int,
    floors: Sequence[int],
    caps: Sequence[int | None],
    probe_steps: int,
) -> int:
    """Steps between probes of a left-out replica, so that probing costs at most :data:`PROBE_BUDGET`.

    A probe holds ``probe_steps`` steps up by at most ``tᵣ(floorᵣ) − T``, where ``T`` is the step time without it:

        ``interval = max(MIN_PROBE_INTERVAL, ⌈probe_steps·(tᵣ(floorᵣ)/T − 1) / PROBE_BUDGET⌉)``

    Example:
        >>> probe_interval(96, [StepTime(0.0, 1.0), StepTime(0.0, 50.0)], [True, False], 1, [4, 4], [None, None], 2)
        109
    """
    others = [i for i, helps in enumerate(helping) if helps]
    without = balanced_step_time(
        total, [models[i] for i in others], [floors[i] for i in others], [caps[i] for i in others]
    )
    excess = max(models[rank].seconds(floors[rank]) / without - 1.0, 0.0) if without > 0 else 0.0
    return max(MIN_PROBE_INTERVAL, math.ceil(probe_steps * excess / PROBE_BUDGET))
