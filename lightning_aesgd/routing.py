"""Routing work by measured speed: time each replica's steps, exchange speeds at merges, schedule plans.

:class:`Router` is the Lightning-free part of the strategy that makes the split of every step follow the
replicas' speeds. Each replica times its own local steps (busy time: forward, backward, optimizer step; never
time spent waiting for peers) and keeps a moving average of its speed in samples (or cost units) per second. At
every merge the replicas all-gather a few statistics, so that every replica computes the same next plan from
the same numbers; the plan takes effect ``lag`` steps later (see :class:`~lightning_aesgd.sampler.PlanBook`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from typing import Any, Literal, Union

import torch
from torch import Tensor

from lightning_aesgd.comm import Communicator
from lightning_aesgd.core.planning import apportion
from lightning_aesgd.core.policies import PlanPolicy, StaticPolicy, get_plan_policy
from lightning_aesgd.core.speed import BusyTimer, SpeedEstimator, StepTime, StepTimeEstimator
from lightning_aesgd.sampler import PlanBook, StepRecord
from lightning_aesgd.slowdown import ComputeClock, SlowdownProfile, as_profile, emulated_slowdown

SampleCosts = Union[None, Literal["dataset", "auto"], Callable[[Any], "Sequence[float] | Tensor"]]  # noqa: UP007


@dataclass(frozen=True)
class ReplicaStats:
    """What one replica reports at a merge."""

    merge_weight: float
    speed: float
    samples: float
    wait_fraction: float
    step_seconds: float
    overhead: float
    per_sample: float

    @property
    def step_time(self) -> StepTime | None:
        """The replica's fitted step-time model, once it has measured a step."""
        return StepTime(self.overhead, self.per_sample) if self.per_sample > 0 else None


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
    """Measures this replica's speed and turns all replicas' speeds into batch-size plans.

    Args:
        planner: ``"balanced"`` (equal predicted step times, fixed per-step costs included), ``"proportional"``
            (shares ∝ speed), ``"additive"`` (the paper's ±step rule), ``"static"``, or any
            :class:`~lightning_aesgd.core.policies.PlanPolicy`.
        shares: fixed shares for the static planner (equal when omitted).
        min_batch: smallest batch per replica.
        max_batch: largest batch per replica.
        speed_smoothing: smoothing of the speed moving averages.
        slowdown: an emulated slowdown profile, or ``None`` for real speed.
        planner_options: extra arguments of the planner (e.g. ``step`` of the additive rule).
    """

    def __init__(
        self,
        planner: str | PlanPolicy = "static",
        shares: Sequence[float] | None = None,
        min_batch: int = 1,
        max_batch: int | None = None,
        speed_smoothing: float = 0.8,
        slowdown: SlowdownProfile | Sequence[float] | None = None,
        **planner_options: Any,
    ) -> None:
        self.policy = _make_policy(planner, shares, min_batch, max_batch, planner_options)
        self.shares = shares
        self.min_batch, self.max_batch = min_batch, max_batch
        self.adaptive = planner != "static"
        self.speed = SpeedEstimator(speed_smoothing)
        self.step_time = StepTimeEstimator(speed_smoothing)
        self.slowdown = as_profile(slowdown)
        self.cost_aware = False
        self.plan_book: PlanBook | None = None
        self.lag = 1
        self.total = 0
        # The latest exchanges, for the end-of-fit summary and the benchmark's plots; bounded for long runs.
        self.history: deque[tuple[int, list[ReplicaStats], tuple[int, ...]]] = deque(maxlen=100_000)
        self._saved_plans: dict[str, Any] | None = None
        self._comm: Communicator | None = None
        self._timer: BusyTimer | None = None
        self._clock: ComputeClock | None = None
        self._pending_work: deque[tuple[float, int]] = deque()
        self._period = _PeriodTotals()

    # --- lifecycle ----------------------------------------------------------------------------------------

    def attach(self, comm: Communicator, device: torch.device) -> None:
        """Start measuring on ``device`` and exchanging through ``comm``."""
        if self.slowdown is not None:
            self.slowdown.check_replicas(comm.world_size)
        self._comm = comm
        self._timer = BusyTimer(device)
        self._clock = ComputeClock(device)
        self._pending_work.clear()
        self._period = _PeriodTotals()

    def detach(self) -> None:
        """Stop measuring (fit ended); plans and speeds are kept for a later fit on the same Trainer."""
        self._comm = self._timer = self._clock = None

    def plan_book_for(self, total: int, num_replicas: int, lag: int) -> PlanBook:
        """The plan book for steps of ``total`` samples, created on first use or restored from a checkpoint."""
        self.lag, self.total = lag, total
        book = self.plan_book
        if book is None or len(book.latest) != num_replicas or sum(book.latest) != total:
            shares = self.shares if self.shares is not None else [1.0] * num_replicas
            if len(shares) != num_replicas:
                raise ValueError(f"Got {len(shares)} static shares for {num_replicas} replicas.")
            book = self.plan_book = PlanBook(apportion(total, shares, self.min_batch, self.max_batch))
        if self._saved_plans is not None:
            book.load_state_dict(self._saved_plans)
            self._saved_plans = None
        return book

    # --- per step -----------------------------------------------------------------------------------------

    @contextmanager
    def timing(self, record: StepRecord, step: int) -> Iterator[None]:
        """Time one local step (and emulate a slower device around it when a profile is set)."""
        assert self._timer is not None
        assert self._clock is not None
        assert self._comm is not None
        factor = self.slowdown.factor(self._comm.rank, step) if self.slowdown is not None else 1.0
        work = record.cost if self.cost_aware else float(record.num_samples)
        self._timer.start()
        with emulated_slowdown(self._clock, factor):
            yield
        self._timer.stop()
        self._pending_work.append((work, record.planned))
        self._period.samples += record.num_samples
        # On CUDA a step's time is known a step or two later; work and times pair up in order.
        for seconds in self._timer.pop_completed():
            work, planned = self._pending_work.popleft()
            self.record(work, seconds, planned)

    def record(self, work: float, seconds: float, planned: int) -> None:
        """Account one finished local step of ``work`` samples (or cost units), planned at ``planned`` samples."""
        if seconds > 0 and planned > 0:  # a region that launched no device work measures nothing
            self.speed.update(work, seconds)
            self.step_time.update(planned, seconds)
            self._period.busy += seconds

    def own_stats(self, merge_weight: float) -> ReplicaStats:
        """What this replica reports at the coming exchange."""
        model = self.step_time.model() or StepTime(0.0, 0.0)
        return ReplicaStats(
            merge_weight,
            self.speed.rate or 0.0,
            self._period.samples,
            self._period.wait_fraction(),
            self.speed.mean_seconds or 0.0,
            model.overhead,
            model.per_sample,
        )

    def exchange(self, merge_weight: float, step: int) -> list[ReplicaStats]:
        """All-gather every replica's statistics (a collective) and schedule the next plan from their speeds."""
        assert self._comm is not None
        assert self.plan_book is not None
        own = astuple(self.own_stats(merge_weight))
        stats = [ReplicaStats(*row) for row in self._comm.all_gather_floats(own)]
        step_times = [s.step_time for s in stats]
        # Every replica sees the same numbers, so every replica takes the same decision here.
        if self.adaptive and all(t is not None for t in step_times):
            sizes = self.policy.plan(self.plan_book.latest, [t for t in step_times if t is not None], self.total)
            if tuple(sizes) != self.plan_book.latest:
                self.plan_book.schedule(step + self.lag, sizes)
        self.history.append((step, stats, self.plan_book.latest))
        self._period = _PeriodTotals()
        return stats

    # --- checkpoints --------------------------------------------------------------------------------------

    def shared_state(self) -> dict[str, Any]:  # noqa: D102
        return {"plans": None if self.plan_book is None else self.plan_book.state_dict()}

    def local_state(self) -> dict[str, Any]:  # noqa: D102
        return {"speed": self.speed.state_dict(), "step_time": self.step_time.state_dict()}

    def load_shared_state(self, state: dict[str, Any]) -> None:  # noqa: D102
        self._saved_plans = state["plans"]
        if self.plan_book is not None and self._saved_plans is not None:
            self.plan_book.load_state_dict(self._saved_plans)
            self._saved_plans = None

    def load_local_state(self, state: dict[str, Any]) -> None:  # noqa: D102
        self.speed.load_state_dict(state["speed"])
        self.step_time.load_state_dict(state["step_time"])


class _PeriodTotals:
    """Wall time, busy time and samples since the last exchange, for the waiting fraction."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.busy = 0.0
        self.samples = 0.0

    def wait_fraction(self) -> float:
        wall = time.perf_counter() - self.started
        return min(1.0, max(0.0, 1.0 - self.busy / wall)) if wall > 0 else 0.0


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
