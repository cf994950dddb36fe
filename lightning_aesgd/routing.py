"""Routing work by measured speed: stamp each replica's arrivals at merges, plan from every replica's reports.

:class:`Router` is the Lightning-free part of the strategy that makes the split of every step follow the
replicas' speeds. It stamps when this replica is released from a merge and when it arrives at the next, so its
report measures everything the replica did in between (data loading, hooks, compute, throttling) and none of
the time it waited for peers (:mod:`lightning_aesgd.core.sensing`). The reports travel inside the merge's
all-reduce; every replica computes the same next plan from the same numbers, and the plan takes effect ``lag``
steps later (see :class:`~lightning_aesgd.sampler.PlanBook`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
from torch import Tensor

from lightning_aesgd.core.planning import apportion
from lightning_aesgd.core.policies import PlanPolicy, StaticPolicy, get_plan_policy
from lightning_aesgd.core.sensing import ArrivalModel, PeriodReport, batch_floor, check_plan_damping, damped_plan
from lightning_aesgd.core.speed import BusyTimer, StepTime
from lightning_aesgd.sampler import PlanBook, StepRecord
from lightning_aesgd.slowdown import ComputeClock, SlowdownProfile, as_profile, emulated_slowdown

SampleCosts = Union[None, Literal["dataset", "auto"], Callable[[Any], "Sequence[float] | Tensor"]]  # noqa: UP007


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
    """

    merge_weight: float
    speed: float
    samples: float
    wait_fraction: float
    step_seconds: float
    busy_seconds: float = 0.0


def resolve_sample_costs(spec: SampleCosts, dataset: Any) -> Tensor | None:
    """Per-sample costs for cost-aware splitting, from the dataset's ``sample_costs`` or a function of it.

    ``"auto"`` uses the dataset's ``sample_costs`` where it has them and counts samples otherwise.
    """
    if spec is None or (spec == "auto" and not hasattr(dataset, "sample_costs")):
        return None
    if spec == "auto":
        spec = "dataset"
    if spec == "dataset":
        if not hasattr(dataset, "sample_costs"):
            raise TypeError(
                f"sample_costs='dataset' needs a `sample_costs` attribute on {type(dataset).__name__} (one cost "
                "per sample, e.g. its number of non-zeros). HINT: add it, or pass a function of the dataset."
            )
        costs = dataset.sample_costs
    elif callable(spec):
        costs = spec(dataset)
    else:
        raise ValueError(f"sample_costs must be None, 'auto', 'dataset' or a function of the dataset, got {spec!r}.")
    costs = torch.as_tensor(costs, dtype=torch.float64)
    if costs.ndim != 1 or not bool(torch.isfinite(costs).all()) or bool((costs < 0).any()):
        raise ValueError("Sample costs must be one finite, non-negative number per sample.")
    return costs


class Router:
    """Measures this replica's arrivals and turns every replica's reports into batch-size plans.

    The router never communicates: at a merge it hands the strategy this replica's
    :class:`~lightning_aesgd.core.sensing.PeriodReport` (:meth:`report`), the strategy sends it inside the merge's
    all-reduce, and hands back every replica's report (:meth:`receive`). Every rank then updates the same
    :class:`~lightning_aesgd.core.sensing.ArrivalModel` and schedules the same plan ``lag`` steps ahead.

    Args:
        planner: ``"proportional"`` (shares ∝ speed), ``"balanced"`` (equal predicted step times, fixed per-step
            costs included), ``"additive"`` (the paper's ±step rule), ``"static"``, or any
            :class:`~lightning_aesgd.core.policies.PlanPolicy`.
        shares: fixed shares for the static planner (equal when omitted).
        min_batch: smallest batch per replica.
        max_batch: largest batch per replica.
        min_share: adaptive plans give every replica at least this fraction of the equal share ``M/n``.
        speed_smoothing: smoothing β of the moving averages.
        plan_gain: fraction γ of the way to the planner's target that each new plan moves.
        plan_dead_band: no plan is made while the predicted step times agree within this relative tolerance, and a
            plan stays while every replica's relative move is below it.
        slowdown: an emulated slowdown profile (its ``step`` mode: slowness inside the optimizer step).
        clock: wall clock in seconds (tests pass a scripted one).
        planner_options: extra arguments of the planner (e.g. ``step`` of the additive rule).
    """

    def __init__(
        self,
        planner: str | PlanPolicy = "proportional",
        shares: Sequence[float] | None = None,
        min_batch: int = 1,
        max_batch: int | None = None,
        min_share: float = 0.1,
        speed_smoothing: float = 0.8,
        plan_gain: float = 0.5,
        plan_dead_band: float = 0.03,
        slowdown: SlowdownProfile | Sequence[float] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        **planner_options: Any,
    ) -> None:
        self.planner, self.shares, self.planner_options = planner, shares, planner_options
        self.min_batch, self.max_batch = min_batch, max_batch
        check_plan_damping(min_share, plan_gain, plan_dead_band)
        self.min_share, self.plan_gain, self.plan_dead_band = min_share, plan_gain, plan_dead_band
        self.adaptive = planner != "static"
        self.speed_smoothing = speed_smoothing
        profile = as_profile(slowdown)
        # Other modes put the slowness outside the strategy (SlowdownCallback): the router must not add its own.
        self.slowdown = profile if profile is not None and profile.mode == "step" else None
        self.clock = clock
        self.cost_aware = False
        self.plan_book: PlanBook | None = None
        # Built now so that bad options fail at construction; rebuilt with the floor once the step batch is known.
        self.policy: PlanPolicy | None = _make_policy(planner, shares, min_batch, max_batch, planner_options)
        self.model: ArrivalModel | None = None
        self.floor = min_batch
        self.lag = 1
        self.total = 0
        self.rank = 0
        self.stop_requested = False
        self.merge_weights: list[float] = []  # every replica's weight at the latest merge
        self.latest_reports: list[PeriodReport] = []
        # Every merge's step, measured speeds and latest plan, for the benchmark's plots; bounded for long runs.
        self.history: deque[tuple[int, tuple[float, ...], tuple[int, ...]]] = deque(maxlen=100_000)
        self._saved_state: dict[str, Any] | None = None
        self._timer: BusyTimer | None = None
        self._clock: ComputeClock | None = None
        self._period = _Period()
        self._release: float | None = None  # None while paused
        self._active_before = 0.0  # active seconds of this period before a pause
        self._arrival = 0.0
        self._wait_fraction = 0.0
        self._next_plan = 0

    # --- lifecycle ----------------------------------------------------------------------------------------

    def attach(self, num_replicas: int, rank: int, device: torch.device) -> None:
        """Start measuring replica ``rank`` of ``num_replicas`` on ``device``."""
        if self.slowdown is not None:
            self.slowdown.check_replicas(num_replicas)
        self.rank = rank
        if self.model is None or self.model.num_replicas != num_replicas:
            self.model = ArrivalModel(num_replicas, self.speed_smoothing)
        self._timer = BusyTimer(device)
        self._clock = ComputeClock(device)
        self.stop_requested = False
        self.interrupt()

    def detach(self) -> None:
        """Stop measuring (fit ended); plans and models are kept for a later fit on the same Trainer."""
        self._timer = self._clock = None

    def plan_book_for(self, total: int, num_replicas: int, lag: int) -> PlanBook:
        """The plan book for steps of ``total`` samples, created on first use or restored from a checkpoint."""
        self.lag, self.total = lag, total
        self.floor = batch_floor(total, num_replicas, self.min_batch, self.min_share if self.adaptive else 0.0)
        self.policy = _make_policy(self.planner, self.shares, self.floor, self.max_batch, self.planner_options)
        book = self.plan_book
        if book is None or len(book.latest) != num_replicas or sum(book.latest) != total:
            shares = self.shares if self.shares is not None else [1.0] * num_replicas
            if len(shares) != num_replicas:
                raise ValueError(f"Got {len(shares)} static shares for {num_replicas} replicas.")
            book = self.plan_book = PlanBook(apportion(total, shares, self.floor, self.max_batch))
        self._load_saved_state()
        return book

    # --- per step -----------------------------------------------------------------------------------------

    @contextmanager
    def timing(self, record: StepRecord, step: int, loader_seconds: float = 0.0) -> Iterator[None]:
        """Account one local step whose batch took the loader ``loader_seconds`` to produce.

        Its busy time goes to telemetry; the ``step`` slowdown emulation runs around it.
        """
        assert self._timer is not None
        assert self._clock is not None
        factor = self.slowdown.factor(self.rank, step) if self.slowdown is not None else 1.0
        self._timer.start()
        with emulated_slowdown(self._clock, factor):
            yield
        self._timer.stop()
        self._period.add(record.cost if self.cost_aware else float(record.num_samples), record.planned)
        self._period.loader += loader_seconds
        # On CUDA a step's busy time is known a step or two later; only complete regions are counted.
        self._period.busy += sum(self._timer.pop_completed())

    def interrupt(self) -> None:
        """A new epoch began (loader workers started, epoch-end hooks ran): restart the period's clock.

        A period that already holds steps then measures nothing; an empty one measures from now.
        """
        if self._period.steps:
            self._period.measured = False
        self._release = self.clock()
        self._active_before = 0.0

    def pause(self) -> None:
        """Stop the period's clock while something other than training runs (validation, a checkpoint).

        The time since the release, the replica's hooks after its last step included, stays in the period.
        """
        if self._release is not None:
            self._active_before += self.clock() - self._release
            self._release = None

    def resume(self) -> None:
        """Restart the period's clock after :meth:`pause`."""
        if self._release is None:
            self._release = self.clock()

    # --- at a merge ---------------------------------------------------------------------------------------

    def report(self, merge_weight: float, stop: bool = False) -> PeriodReport:
        """This replica's report for the merge it is arriving at; stamps the arrival."""
        self._arrival = self.clock()
        period = self._period
        measured = period.measured and self._release is not None
        active = self._active_before + (self._arrival - self._release if self._release is not None else 0.0)
        return PeriodReport(
            merge_weight=merge_weight,
            work=period.work,
            planned=period.planned,
            steps=float(period.steps) if measured else 0.0,
            active=active,
            loader=period.loader,
            busy=period.busy,
            wait_fraction=self._wait_fraction,
            stop=1.0 if stop else 0.0,
        )

    def receive(self, rows: Sequence[Sequence[float]], step: int) -> None:
        """Take every replica's report (rank order) after the merge; update the models and schedule a plan.

        Every rank passes the same rows, so every rank takes the same decision.
        """
        assert self.plan_book is not None
        assert self.model is not None
        released = self.clock()
        active = self._active_before + (self._arrival - self._release if self._release is not None else 0.0)
        wall = active + released - self._arrival
        self._wait_fraction = (released - self._arrival) / wall if wall > 0 else 0.0
        self._release = released
        self._active_before = 0.0
        reports = [PeriodReport.from_row(row) for row in rows]
        self.model.update(reports)
        self.stop_requested = any(report.stop > 0 for report in reports)
        self.merge_weights = [report.merge_weight for report in reports]
        models = self.model.models()
        if self.adaptive and models is not None and self._plans_now(step, models):
            assert self.policy is not None
            current = self.plan_book.latest
            sizes = self.policy.plan(current, models, self.total)
            if isinstance(self.planner, str):  # a PlanPolicy object of the user's is obeyed as it is
                sizes = damped_plan(current, sizes, self.plan_gain, self.plan_dead_band, self.floor, self.max_batch)
            if tuple(sizes) != current:
                self.plan_book.schedule(step + self.lag, sizes)
        self.latest_reports = reports
        self.history.append((step, tuple(self.model.rates()), self.plan_book.latest))
        self._period = _Period()

    def _plans_now(self, step: int, models: Sequence[StepTime]) -> bool:
        """Whether to ask a named planner for a new plan at this merge (a PlanPolicy object is always asked).

        Not before the previous plan has been applied and measured: plans piled on plans that no arrival has
        reflected yet overshoot. Not while the latest plan's predicted step times agree within the dead band:
        the named planners all aim at equal step times. The check costs a few float operations where planning
        costs a few hundred microseconds.
        """
        if not isinstance(self.planner, str):
            return True
        if step < self._next_plan:
            return False
        assert self.plan_book is not None
        times = [model.seconds(size) for model, size in zip(models, self.plan_book.latest, strict=True)]
        if max(times) <= (1 + self.plan_dead_band) * min(times):
            return False
        self._next_plan = step + self.lag + 1
        return True

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
            self.plan_book.load_state_dict(state["plans"])
        if state.get("arrivals") is not None and self.model is not None:
            self.model.load_state_dict(state["arrivals"])
        weights = state.get("merge_weights") or []
        if self.model is not None and len(weights) == self.model.num_replicas:
            self.merge_weights = list(weights)


class _Period:
    """Work, planned samples, steps and busy time since the last merge."""

    def __init__(self) -> None:
        self.work = 0.0
        self.planned = 0.0
        self.steps = 0
        self.busy = 0.0
        self.loader = 0.0
        self.measured = True

    def add(self, work: float, planned: int) -> None:
        self.work += work
        self.planned += planned
        self.steps += 1


def _make_policy(
    planner: str | PlanPolicy,
    shares: Sequence[float] | None,
    min_batch: int,
    max_batch: int | None,
    options: dict[str, Any],
) -> PlanPolicy:
    if not isinstance(planner, str):
        return planner
    if planner == "static":
        return StaticPolicy(shares)
    if shares is not None:
        raise ValueError(f"`shares` fix the plan of the 'static' planner; the {planner!r} planner measures them.")
    return get_plan_policy(planner, min_batch=min_batch, max_batch=max_batch, **options)
