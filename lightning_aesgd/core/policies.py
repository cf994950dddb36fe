"""Planner policies: how the next plan follows the replicas' measured step times.

Every rank calls the same policy with the same all-gathered :class:`~lightning_aesgd.core.speed.StepTime`
models and gets the same plan. A plan is a list of integer batch sizes, one per replica, summing exactly to the
global step batch ``M``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_aesgd.core.planning import _check_same_length, _checked_shares, apportion, balance_step_times
from lightning_aesgd.core.speed import StepTime

__all__ = [
    "AdditivePolicy",
    "BalancedPolicy",
    "PlanPolicy",
    "ProportionalPolicy",
    "StaticPolicy",
    "get_plan_policy",
]


class PlanPolicy(Protocol):
    """A rule that turns the current plan and the replicas' measured step times into the next plan."""

    def plan(self, current: Sequence[int], step_times: Sequence[StepTime], total: int) -> list[int]:
        """Return the next batch sizes, one per replica, summing exactly to ``total``.

        Args:
            current: The batch sizes in use, one per replica.
            step_times: Each replica's measured busy time per step as a function of its batch size.
            total: The global step batch ``M``.
        """
        ...


def speeds_at(current: Sequence[int], step_times: Sequence[StepTime]) -> list[float]:
    """Each replica's samples per second at its current batch size."""
    _check_same_length(current, step_times)
    return [t.speed_at(max(size, 1)) for size, t in zip(current, step_times, strict=True)]


@dataclass(frozen=True)
class ProportionalPolicy:
    """Batch size proportional to measured speed at the current size: ``b_i = apportion(M, speed_i)``.

    If a replica's per-sample time does not depend on its batch size, ``b_i ∝ speed_i`` makes every replica's
    step last ``b_i / speed_i = M / Σ speed``: balance in one plan. With fixed per-step costs its fixed point is
    still equal step times, reached over several plans; :class:`BalancedPolicy` solves for it directly.

    Args:
        min_batch: Smallest batch per replica (each replica makes one update per step, so at least 1).
        max_batch: Largest batch per replica, e.g. the device's memory limit; ``None`` for no limit.
    """

    min_batch: int = 1
    max_batch: int | None = None

    def __post_init__(self) -> None:
        _check_batch_bounds(self.min_batch, self.max_batch)

    def plan(self, current: Sequence[int], step_times: Sequence[StepTime], total: int) -> list[int]:
        """Return ``apportion(total, speeds, min_batch, max_batch)`` with the speeds at the current sizes."""
        return apportion(total, speeds_at(current, step_times), self.min_batch, self.max_batch)


@dataclass(frozen=True)
class BalancedPolicy:
    """Sizes whose predicted step times are equal: :func:`~lightning_aesgd.core.planning.balance_step_times`.

    The fixed point that Adaptive SGD's rules converge to — every replica finishes its step together, so all
    make the same number of updates per unit of time — computed in one plan from the fitted ``a + c·b`` step-time
    models, fixed per-step costs included. Without fixed costs it is :class:`ProportionalPolicy`.

    Args:
        min_batch: Smallest batch per replica.
        max_batch: Largest batch per replica; ``None`` for no limit.
    """

    min_batch: int = 1
    max_batch: int | None = None

    def __post_init__(self) -> None:
        _check_batch_bounds(self.min_batch, self.max_batch)

    def plan(self, current: Sequence[int], step_times: Sequence[StepTime], total: int) -> list[int]:
        """Return the balanced split of ``total``; ``current`` only fixes the replica count."""
        _check_same_length(current, step_times)
        return balance_step_times(total, step_times, self.min_batch, self.max_batch)


@dataclass(frozen=True)
class AdditivePolicy:
    """The paper's additive batch-size rule (Ma et al. 2021), adapted to lockstep replicas.

    In the authors' code ``p_i`` is replica ``i``'s share of the batches completed since the last merge; a
    replica with ``p_i > 1/n`` grows by ``step``, one with ``p_i < 1/n`` shrinks by ``step``, within
    ``[min_batch, max_batch]``. In lockstep every replica makes the same number of updates, so ``p_i`` is
    replaced by the share the replica *would* have if it ran freely: ``u_i = speed_i / b_i`` (updates per
    second) and ``p_i = u_i / Σ u``. The steady state is the paper's: all ``p_i = 1/n``, i.e. every replica
    takes the same time per step.

    Departure from the paper: there, the global batch per merge period floats. Here ``M`` is constant, so the
    adjusted sizes are renormalised with ``apportion(M, adjusted, min_batch, max_batch)``; the moves keep
    their direction but not always their exact length.

    Args:
        step: Additive change per plan (32 in the paper).
        min_batch: Smallest batch per replica (32 in the paper).
        max_batch: Largest batch per replica (1024 in the paper); ``None`` for no limit.
    """

    step: int = 32
    min_batch: int = 32
    max_batch: int | None = 1024

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"`step` must be >= 1, got {self.step}")
        _check_batch_bounds(self.min_batch, self.max_batch)

    def adjust(self, current: Sequence[int], step_times: Sequence[StepTime]) -> list[int]:
        """Apply ``b_i ± step`` by the sign of ``p_i − 1/n``, clamped to the bounds, before renormalisation."""
        if any(size < 1 for size in current):
            raise ValueError(f"`current` batch sizes must be >= 1, got {list(current)}")
        speeds = _checked_shares(speeds_at(current, step_times))
        update_rates = [speed / size for speed, size in zip(speeds, current, strict=True)]
        mean_rate = math.fsum(update_rates) / len(update_rates)
        upper = self.max_batch if self.max_batch is not None else math.inf
        return [
            int(min(max(size + self.step * _direction(rate, mean_rate), self.min_batch), upper))
            for size, rate in zip(current, update_rates, strict=True)
        ]

    def plan(self, current: Sequence[int], step_times: Sequence[StepTime], total: int) -> list[int]:
        """Return :meth:`adjust` renormalised to sum exactly to ``total``."""
        return apportion(total, self.adjust(current, step_times), self.min_batch, self.max_batch)


@dataclass(frozen=True)
class StaticPolicy:
    """Fixed shares regardless of speed: ``b_i = apportion(M, shares)``; equal shares mean what DDP means.

    Args:
        shares: Positive relative share per replica; ``None`` for equal shares.
    """

    shares: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if self.shares is not None:
            checked = tuple(_checked_shares(self.shares))
            if min(checked) <= 0.0:
                raise ValueError(f"static `shares` must all be > 0, got {list(checked)}")
            object.__setattr__(self, "shares", checked)

    def plan(self, current: Sequence[int], step_times: Sequence[StepTime], total: int) -> list[int]:
        """Return ``apportion(total, shares)``; the measurements are ignored."""
        _check_same_length(current, step_times)
        shares = self.shares if self.shares is not None else [1.0] * len(current)
        _check_same_length(current, shares)
        return apportion(total, shares)


_PLAN_POLICIES: dict[str, Callable[..., PlanPolicy]] = {
    "additive": AdditivePolicy,
    "balanced": BalancedPolicy,
    "proportional": ProportionalPolicy,
    "static": StaticPolicy,
}


def get_plan_policy(name: str, **kwargs: Any) -> PlanPolicy:
    """Build the plan policy registered as ``name`` (balanced, proportional, additive, static) with ``kwargs``.

    Raises:
        ValueError: If ``name`` is not registered.
    """
    if name not in _PLAN_POLICIES:
        raise ValueError(f"Unknown plan policy {name!r}; valid names: {', '.join(sorted(_PLAN_POLICIES))}")
    return _PLAN_POLICIES[name](**kwargs)


def _check_batch_bounds(min_batch: int, max_batch: int | None) -> None:
    if min_batch < 1:
        raise ValueError(f"`min_batch` must be >= 1 (every replica makes one update per step), got {min_batch}")
    if max_batch is not None and max_batch < min_batch:
        raise ValueError(f"`max_batch` must be >= `min_batch` ({min_batch}) or None, got {max_batch}")


def _direction(rate: float, mean_rate: float) -> int:
    """+1 if a replica would make more than its ``1/n`` share of updates, −1 if fewer, 0 if balanced."""
    # Rates equal up to rounding (e.g. speeds exactly proportional to sizes) count as balanced.
    if math.isclose(rate, mean_rate, rel_tol=1e-9, abs_tol=0.0):
        return 0
    return 1 if rate > mean_rate else -1
