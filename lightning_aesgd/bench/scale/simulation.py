"""Lockstep DDP against the real plan loop at 16 to 256 replicas, simulated: no Lightning, no processes.

Replica ``i`` has a cost factor ``fᵢ`` (its speed is ``1/fᵢ``), drawn log-uniformly between 1 and the spread ``s``,
and takes ``fᵢ · c · b · εᵢₖ`` seconds for a batch of ``b`` samples at step ``k``: ``c`` is the measured part's 1 ms
per sample at cost 1 (64 ms per 64-sample step), and ``εᵢₖ`` is per-step noise drawn from measured step times
(:mod:`.noise`). Every step lasts as long as its slowest replica (both strategies synchronise every step). Lockstep
DDP gives every replica ``M/n = 64`` samples. The adaptive side runs the strategy's own
:class:`~lightning_aesgd.engine.plan_loop.PlanLoop` with its default settings, and its plans apply ``LAG`` steps
later. Reports come when the strategy's own :class:`~lightning_aesgd.engine.report_exchange.ReportExchange`
(gradient sync, the default) has them come: every ``LAG + 1`` steps until the plan settles, then about every quarter
second of training; each replica's :class:`~lightning_aesgd.core.sensing.PeriodReport` holds its whole steps since
its previous report (not the step that reports, nor a fit's first two steps, its one-time costs and DDP's bucket
rebuild: as the strategy's :class:`~lightning_aesgd.engine.arrivals.ArrivalClock` has it); a period with idle steps
(batch 0) beside working ones measures nothing, as in the strategy. The plan loop's probes follow the strategy's
segments (:data:`~lightning_aesgd.engine.sitting_out.SEGMENT_STEPS`). What the model leaves out is the sums without a
left-out replica (it has no sums); no fleet the scale program draws (spreads up to 8) leaves one out. The time of
taking the reports in (the planning cost) is added to the step that reports. It is the CPU time of the calls: on a
shared machine their wall time also counts whatever else runs, and on a replica's own host the two agree (planning
is one thread).

Without noise, DDP's step lasts ``c·64·max f`` and the best split of ``M = 64·n`` samples lasts ``c·M / Σ 1/fᵢ``
(every replica busy for the same time), so the speedup is at most ``Σ vᵢ / (n · min v)`` with ``vᵢ = 1/fᵢ``
(:func:`speedup_bound`): no integer split beats it, since a step of length ``T`` holds at most ``T·vᵢ/c``
samples on replica ``i``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_aesgd.bench.slowness.cases import BATCH
from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.engine.arrivals import ONE_TIME_STEP
from lightning_aesgd.engine.gradient_sync import BUCKET_REBUILD_STEP
from lightning_aesgd.engine.plan_loop import PlanLoop
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.report_exchange import ReportExchange
from lightning_aesgd.engine.sitting_out import SEGMENT_STEPS

SECONDS_PER_SAMPLE = 0.064 / BATCH
"""A cost-1 replica's seconds per sample: the measured part's 64 ms per 64-sample step."""
LAG = 2
"""Steps from a plan to its use: the strategy's default without DataLoader workers (one prefetched batch + 1)."""
WARMUP_STEPS = 10
"""Steps left out of the throughput, as in the measured runs (``slowness.runner.WARMUP_STEPS``)."""
SMALLEST_NOISE = 0.05
"""Noise factors are kept above this, so that a scaled-up noise never makes a step take no time or less."""


@dataclass(frozen=True)
class Simulation:
    """One simulated fleet: its shape, both strategies' time over the steps after the warm-up, the final plan.

    Attributes:
        replicas: ``n``.
        spread: the spread the cost factors were drawn within (largest over smallest possible speed).
        costs: every replica's cost factor ``fᵢ``.
        steps: steps timed (after the warm-up).
        ddp_seconds: lockstep DDP's time for them.
        adaptive_seconds: the adaptive plans' time for them, planning left out.
        planning_seconds: the wall time of ``PlanLoop.receive`` over them.
        final_plan: the plan in force at the last step.
    """

    replicas: int
    spread: float
    costs: tuple[float, ...]
    steps: int
    ddp_seconds: float
    adaptive_seconds: float
    planning_seconds: float
    final_plan: tuple[int, ...]

    @property
    def speedup(self) -> float:
        """Adaptive throughput over DDP's, the planning cost included (equal samples per step: a time ratio)."""
        return self.ddp_seconds / (self.adaptive_seconds + self.planning_seconds)

    @property
    def speedup_without_planning(self) -> float:
        """:attr:`speedup` with the planning cost left out: what the plans alone achieve against the noise."""
        return self.ddp_seconds / self.adaptive_seconds

    @property
    def bound(self) -> float:
        """The noiseless bound of :attr:`speedup` for these cost factors (:func:`speedup_bound`)."""
        return speedup_bound(self.costs)

    @property
    def realised_spread(self) -> float:
        """The fleet's fastest speed over its slowest: the drawn spread, below :attr:`spread` for few replicas."""
        return max(self.costs) / min(self.costs)

    @property
    def planning_us_per_step(self) -> float:
        """Microseconds of planning per step."""
        return 1e6 * self.planning_seconds / self.steps

    @property
    def planning_share(self) -> float:
        """Planning's share of the adaptive step time."""
        return self.planning_seconds / (self.adaptive_seconds + self.planning_seconds)

    def step_ms(self, strategy: str) -> float:
        """Mean step time in milliseconds of ``"ddp"`` or ``"adaptive"`` (planning included)."""
        seconds = self.ddp_seconds if strategy == "ddp" else self.adaptive_seconds + self.planning_seconds
        return 1e3 * seconds / self.steps


def speedup_bound(costs: Sequence[float]) -> float:
    """``Σ vᵢ / (n · min v)`` with speeds ``vᵢ = 1/fᵢ``: the best split's throughput over equal batches'.

    Example:
        >>> speedup_bound([1.0, 4.0])
        2.5
        >>> speedup_bound([2.0, 2.0, 2.0])
        1.0
    """
    speeds = [1.0 / cost for cost in costs]
    return sum(speeds) / (len(speeds) * min(speeds))


def draw_costs(replicas: int, spread: float, rng: np.random.Generator) -> np.ndarray:
    """Cost factors drawn log-uniformly in ``[1, spread]``: as many slow devices per doubling of slowness."""
    return np.asarray(spread ** rng.uniform(0.0, 1.0, replicas))


def draw_noise(
    steps: int, replicas: int, ratios: Sequence[float], scale: float, rng: np.random.Generator
) -> np.ndarray:
    """Per-step noise factors ``1 + scale·(r − 1)``, ``r`` drawn from measured step-time ratios (steps × replicas).

    ``scale`` 0 gives no noise, 1 the measured noise.
    """
    drawn = rng.choice(np.asarray(ratios, dtype=float), size=(steps, replicas))
    return np.maximum(1.0 + scale * (drawn - 1.0), SMALLEST_NOISE)


def lockstep_step_times(costs: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """DDP's step times: every replica takes ``BATCH`` samples, and every step waits for the slowest."""
    return np.asarray((costs * SECONDS_PER_SAMPLE * BATCH * noise).max(axis=1))


def planned_step_times(
    costs: np.ndarray, noise: np.ndarray, clock: Callable[[], float] = time.process_time
) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """The adaptive side: the real plan loop's plans, step by step, from reports at the strategy's cadence.

    Args:
        costs: every replica's cost factor.
        noise: the noise factors, steps × replicas.
        clock: the clock that times ``PlanLoop.receive`` (a fake one makes the result deterministic).

    Returns:
        Each step's time (its slowest replica), each step's planning seconds, and the plan of the last step.
    """
    steps, replicas = noise.shape
    total = BATCH * replicas
    loop = PlanLoop(PlanSettings())
    loop.attach(replicas)
    loop.segment_steps = SEGMENT_STEPS  # as the strategy sets it under gradient sync, where replicas may sit out
    book = loop.plan_book_for(total, replicas, LAG)
    reports = ReportExchange()
    reports.start()
    times, planning = np.zeros(steps), np.zeros(steps)
    sizes: tuple[int, ...] = book.latest
    work, active, idle = np.zeros(replicas), np.zeros(replicas), np.zeros(replicas)  # since the previous report
    period_steps, first_step = 0, -1
    for step in range(steps):
        sizes = book.sizes_at(step)
        seconds = costs * SECONDS_PER_SAMPLE * np.asarray(sizes) * noise[step]
        times[step] = seconds.max()
        if reports.due(step, loop):
            # Each replica's period: its whole steps' time, the waits for peers left out; idle steps beside working
            # ones measure nothing (an idle step pays no fixed cost), as the strategy's arrival clock reports them.
            measured = np.where((idle > 0) & (idle < period_steps), 0, period_steps)
            table = report_table(np.asarray(sizes) / total, work, measured, active, first_step)
            start = clock()  # each replica wrote its own row; every rank reads the table the all-reduce returns
            loop.receive(table.tolist(), step)
            reports.space_out(loop)
            planning[step] = clock() - start
            work, active, idle, period_steps = np.zeros(replicas), np.zeros(replicas), np.zeros(replicas), 0
        if step not in (ONE_TIME_STEP, BUCKET_REBUILD_STEP):  # whole once the next step begins: the next report's
            first_step = first_step if period_steps else step
            work, active, period_steps = work + sizes, active + seconds, period_steps + 1
            idle += np.asarray(sizes) == 0
    return times, planning, sizes


def report_table(
    merge_weights: np.ndarray, work: np.ndarray, steps: np.ndarray, active: np.ndarray, first_step: int = -1
) -> np.ndarray:
    """Every replica's :class:`PeriodReport` row (planned samples = work), as the strategy's report all-reduce returns.

    ``first_step`` is the period's first step, the same on every replica.

    Example:
        >>> row = report_table(np.array([0.5]), np.array([64.0]), np.array([2]), np.array([0.128]), 6)[0]
        >>> report = PeriodReport(0.5, work=64.0, planned=64.0, steps=2, active=0.128, first_step=6)
        >>> PeriodReport.from_row(row.tolist()) == report
        True
    """
    table = np.tile(np.asarray(PeriodReport(0.0).as_row()), (len(work), 1))
    for name, column in (("merge_weight", merge_weights), ("work", work), ("planned", work), ("steps", steps)):
        table[:, PeriodReport.field_index(name)] = column
    table[:, PeriodReport.field_index("active")] = active
    table[:, PeriodReport.field_index("first_step")] = first_step
    return table


def simulate(
    replicas: int,
    spread: float,
    steps: int,
    ratios: Sequence[float],
    noise_scale: float = 1.0,
    seed: int = 0,
    clock: Callable[[], float] = time.process_time,
) -> Simulation:
    """Draw a fleet and its noise, run both strategies over the same draws, and time the steps after the warm-up.

    The same seed draws the same uniform numbers whatever the spread, so fleets of different spreads differ only
    in how far apart their speeds are.

    Args:
        replicas: ``n``.
        spread: cost factors are drawn in ``[1, spread]``.
        steps: steps simulated, the warm-up included (more than :data:`WARMUP_STEPS`).
        ratios: measured step times over their median, the noise's distribution.
        noise_scale: 0 for no noise, 1 for the measured noise.
        seed: the draws' seed.
        clock: times the planning.
    """
    if steps <= WARMUP_STEPS:
        raise ValueError(f"Simulate more than the {WARMUP_STEPS} warm-up steps, got steps={steps}.")
    rng = np.random.default_rng(seed)
    costs = draw_costs(replicas, spread, rng)
    noise = draw_noise(steps, replicas, ratios, noise_scale, rng)
    ddp = lockstep_step_times(costs, noise)
    adaptive, planning, final_plan = planned_step_times(costs, noise, clock)
    timed = slice(WARMUP_STEPS, None)
    return Simulation(
        replicas=replicas,
        spread=spread,
        costs=tuple(costs.tolist()),
        steps=steps - WARMUP_STEPS,
        ddp_seconds=float(ddp[timed].sum()),
        adaptive_seconds=float(adaptive[timed].sum()),
        planning_seconds=float(planning[timed].sum()),
        final_plan=tuple(final_plan),
    )
