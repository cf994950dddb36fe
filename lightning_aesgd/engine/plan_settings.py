"""How batch sizes follow the measurements: the planner, its bounds, damping and smoothing, checked when built."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_aesgd.core.apportion import High, Low, apportion, per_replica
from lightning_aesgd.core.planners import Planner, StaticPlanner, get_planner
from lightning_aesgd.core.sensing import batch_floor, check_plan_damping
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.core.values import is_real, is_whole


@dataclass(frozen=True)
class PlanSettings:
    """How batch sizes follow the measurements; checked once, when built. The defaults are the strategy's.

    Args:
        planner: ``"proportional"`` (shares ∝ speed), ``"balanced"`` (equal predicted step times, fixed per-step
            costs included), ``"additive"`` (the paper's ±step rule), ``"static"``, or any
            :class:`~lightning_aesgd.core.planners.Planner`.
        shares: fixed shares for the static planner (equal when omitted).
        min_batch: smallest batch per replica; a list gives one per replica (rank order), e.g. a GPU's and a CPU's.
        max_batch: largest batch per replica (``None``: no limit), or a list of one per replica.
        min_share: adaptive plans give every replica at least this fraction of the equal share ``M/n``, or a list
            of one fraction per replica.
        speed_smoothing: smoothing β of the moving averages, per report of up to ``lag + 1`` steps (a longer report
            weighs as steps / (lag + 1) reports).
        plan_gain: fraction γ of the way to the planner's target that each new plan moves; the first plan, from the
            initial (equal or static) split, and the first after a replica's speed changed, move all the way.
        plan_dead_band: no plan is made while the predicted step times agree within this relative tolerance, and a
            plan stays while every replica's relative move is below it; the smallest band: the replicas' measured
            step-time noise widens it (:func:`~lightning_aesgd.core.noise.noise_band`, at most 25%).
        planner_options: extra arguments of a named planner (e.g. ``step`` of the additive rule).
        hold_steps: no new plan for steps before this one (speeds are still measured): the authors' code keeps
            batches fixed through its warm-up and adapts only after it.
        leave_out_stragglers: a replica that lengthens the step whatever its batch gets none (a named adaptive
            planner's plans; :mod:`~lightning_aesgd.engine.admission`), and is probed now and then.
    """

    planner: str | Planner = "proportional"
    shares: Sequence[float] | None = None
    min_batch: Low = 1
    max_batch: High = None
    min_share: float | Sequence[float] = 0.1
    speed_smoothing: float = 0.8
    plan_gain: float = 0.5
    plan_dead_band: float = 0.03
    planner_options: Mapping[str, Any] = field(default_factory=dict)
    hold_steps: int = 0
    leave_out_stragglers: bool = True

    def __post_init__(self) -> None:
        # Types first: a string from a config file would otherwise fail deep inside a comparison, or (a planner
        # that is neither a name nor a Planner) only at the first plan.
        for name in ("min_batch", "max_batch"):
            for value in _values(getattr(self, name)):
                if not (is_whole(value) or (name == "max_batch" and value is None)):
                    raise TypeError(
                        f"`{name}` is a batch size, or a list of one per replica; got {getattr(self, name)!r}. HINT: "
                        "pass a whole number such as 4, or a list such as [256, 32]."
                    )
        if not isinstance(self.leave_out_stragglers, bool):
            raise TypeError(
                f"`leave_out_stragglers` is a switch, got {self.leave_out_stragglers!r}. HINT: pass True or False."
            )
        if not is_whole(self.hold_steps) or self.hold_steps < 0:
            raise ValueError(f"`hold_steps` counts steps, got {self.hold_steps!r}. HINT: pass a whole number >= 0.")
        for name in ("speed_smoothing", "plan_gain", "plan_dead_band"):
            if not is_real(getattr(self, name)):
                raise TypeError(f"`{name}` must be a number, got {getattr(self, name)!r}. HINT: pass a float.")
        if not all(is_real(share) for share in _values(self.min_share)):
            raise TypeError(
                f"`min_share` must be a number or a list of one per replica, got {self.min_share!r}. HINT: pass a "
                "float such as 0.1."
            )
        if not 0.0 <= self.speed_smoothing < 1.0:
            raise ValueError(
                f"`speed_smoothing` is the weight β of the past in the speed averages, got {self.speed_smoothing}. "
                "HINT: pass a value in [0, 1) (0.8 by default; 0 keeps only the latest period)."
            )
        if not isinstance(self.planner, str) and not callable(getattr(self.planner, "plan", None)):
            raise TypeError(
                f"`planner` must be a name or a Planner (an object with a `plan` method), got {self.planner!r}. "
                "HINT: pass 'proportional', 'balanced', 'additive' or 'static'."
            )
        if self.shares is not None:
            if isinstance(self.shares, (str, bytes)) or not isinstance(self.shares, Sequence):
                raise TypeError(f"`shares` must be a list of numbers, got {self.shares!r}. HINT: e.g. [2, 1, 1].")
            if not all(is_real(share) for share in self.shares):
                raise TypeError(f"`shares` must all be numbers, got {list(self.shares)}. HINT: e.g. [2, 1, 1].")
            if not self.shares or not all(0.0 < share < math.inf for share in self.shares):
                raise ValueError(
                    f"`shares` must be one finite share > 0 per replica, got {list(self.shares)}. HINT: e.g. "
                    "[2, 1, 1] gives the first of three replicas half of every step."
                )
        for min_share in _values(self.min_share):
            check_plan_damping(min_share, self.plan_gain, self.plan_dead_band)
        self.build_planner(self.min_batch, self.max_batch)  # bad planner options fail here, not at the first plan

    def check_replicas(self, num_replicas: int) -> None:
        """Raise, naming the option, unless every option given per replica describes ``num_replicas`` replicas.

        Known once the Trainer knows its devices, before any replica starts.
        """
        if self.shares is not None and len(self.shares) != num_replicas:
            raise ValueError(
                f"Got {len(self.shares)} static shares for {num_replicas} replicas. HINT: pass one share per "
                "replica (Trainer devices × num_nodes) in `shares`."
            )
        lows = per_replica(self.min_batch, num_replicas, "min_batch")
        highs = per_replica(self.max_batch, num_replicas, "max_batch")
        per_replica(self.min_share, num_replicas, "min_share")
        for rank, (low, high) in enumerate(zip(lows, highs, strict=True)):
            if high is not None and high < low:
                raise ValueError(
                    f"Replica {rank}'s max_batch={high} is below its min_batch={low}. HINT: give every replica a "
                    "max_batch >= its min_batch."
                )

    def check_step(self, step_batch_size: int, num_replicas: int) -> None:
        """Raise, naming the options to change, unless steps of ``step_batch_size`` samples can be split so.

        Known once the training DataLoader is (``step_batch_size`` is its batch size × replicas by default).
        """
        self.check_replicas(num_replicas)
        if step_batch_size < num_replicas:
            raise ValueError(
                f"Steps of {step_batch_size} samples cannot give each of the {num_replicas} replicas one. HINT: "
                f"raise the strategy's step_batch_size (or the DataLoader's batch_size) to at least {num_replicas}."
            )
        lows = per_replica(self.min_batch, num_replicas, "min_batch")
        highs = per_replica(self.max_batch, num_replicas, "max_batch")
        if sum(lows) > step_batch_size:
            raise ValueError(
                f"min_batch={self.min_batch} for {num_replicas} replicas ({sum(lows)} samples) exceeds the "
                f"{step_batch_size} samples of a step. HINT: lower the strategy's min_batch, or raise "
                "step_batch_size (or the DataLoader's batch_size)."
            )
        if None not in highs and sum(high for high in highs if high is not None) < step_batch_size:
            raise ValueError(
                f"max_batch={self.max_batch} for {num_replicas} replicas cannot hold the {step_batch_size} samples "
                "of a step. HINT: raise the strategy's max_batch (or set it to None), or lower step_batch_size (or "
                "the DataLoader's batch_size)."
            )
        if not isinstance(self.planner, str):
            _trial_plan(self.planner, step_batch_size, num_replicas)

    @property
    def adaptive(self) -> bool:
        """Whether plans follow the measurements (every planner but ``"static"``)."""
        return self.planner != "static"

    def floors(self, step_batch_size: int, num_replicas: int) -> list[int]:
        """Each replica's smallest batch: ``max(min_batch, ⌈φ·M/n⌉)`` (:func:`batch_floor`; adaptive plans only)."""
        lows = per_replica(self.min_batch, num_replicas, "min_batch")
        shares = per_replica(self.min_share if self.adaptive else 0.0, num_replicas, "min_share")
        return [batch_floor(step_batch_size, num_replicas, low, share) for low, share in zip(lows, shares, strict=True)]

    def build_planner(self, floor: Low, cap: High) -> Planner:
        """The planner with ``floor`` as its smallest batch and ``cap`` as its largest (a named one).

        Each bound is one value or one per replica planned. A Planner object is used as it is.
        """
        if not isinstance(self.planner, str):
            return self.planner
        if self.planner == "static":
            return StaticPlanner(self.shares)
        if self.shares is not None:
            raise ValueError(
                f"`shares` fix the plan of the 'static' planner; the {self.planner!r} planner measures them. "
                "HINT: pass planner='static' with shares, or leave shares unset."
            )
        return get_planner(self.planner, min_batch=floor, max_batch=cap, **self.planner_options)


def _trial_plan(planner: Planner, step_batch_size: int, num_replicas: int) -> None:
    """Ask a user's Planner object for one plan of equal replicas, so that it fails now rather than mid-training.

    Raises:
        ValueError: if it raises, or returns anything but one whole batch size >= 1 per replica summing to
            ``step_batch_size``.
    """
    equal = apportion(step_batch_size, [1.0] * num_replicas)
    hint = (
        f"HINT: the planner must return {num_replicas} whole batch sizes >= 1 summing to {step_batch_size} (one per "
        "replica: Trainer devices × num_nodes), or pass a planner by name."
    )
    try:
        sizes = list(planner.plan(equal, [StepTime(0.0, 1.0)] * num_replicas, step_batch_size))
    except Exception as error:  # any failure of user code: named with the fix, the original chained
        raise ValueError(f"The planner {planner!r} failed a trial plan of {equal}: {error}. {hint}") from error
    if len(sizes) != num_replicas or sum(sizes) != step_batch_size or not all(is_whole(s) and s >= 1 for s in sizes):
        raise ValueError(f"The planner {planner!r} returned {sizes} for a trial plan of {equal}. {hint}")


def _values(bound: Any) -> list[Any]:
    """The values of a bound given for every replica (one) or per replica (a list)."""
    if isinstance(bound, Sequence) and not isinstance(bound, (str, bytes)):
        return list(bound)
    return [bound]
