"""When merges happen: after every local update during a warm-up, then every ``period`` updates.

The names and the post-warm-up predicate are those of torch's ``PeriodicModelAverager``. Method card:
``docs/methods/local_sgd.md`` (and ``docs/methods/sma.md`` for :class:`LearningRateDrop`).
"""

from __future__ import annotations

import math

from lightning_aesgd.core.values import is_whole

__all__ = [
    "REPORT_SECONDS",
    "REPORT_SECONDS_PER_REPLICA",
    "REPORT_SHARE",
    "LearningRateDrop",
    "merge_due",
    "report_interval",
    "report_seconds",
    "validate_schedule",
]

REPORT_SECONDS = 0.25
"""How often, in training time, replicas exchange reports under gradient synchronisation (see
:func:`report_interval`), where they are few enough that taking the reports in costs less (:func:`report_seconds`)."""
REPORT_SECONDS_PER_REPLICA = 10e-6
"""Host seconds a report costs per replica: every rank updates every replica's step-time model, speed and noise
(8-12 µs a replica, measured by ``python -m lightning_aesgd.bench scale`` on a 2-core CPU machine)."""
REPORT_SHARE = 0.005
"""The share of the training time that taking reports in may cost, once the plan has settled."""


def report_seconds(replicas: int) -> float:
    """Training seconds between reports of a settled plan: :data:`REPORT_SECONDS`, or longer for many replicas.

    Every rank takes in every replica's report (``n`` model updates, about :data:`REPORT_SECONDS_PER_REPLICA`
    each), so the reports of a large job would cost a growing share of its time (at 256 replicas about 3 ms a
    report, 1.2% of training at one report per quarter second). Reports then come far enough apart to keep that
    share at :data:`REPORT_SHARE`:

        seconds = max(REPORT_SECONDS, n · REPORT_SECONDS_PER_REPLICA / REPORT_SHARE)

    Every rank knows ``n``, so all agree. A plan that is not settled reports every ``lag + 1`` steps whatever ``n``.

    >>> report_seconds(8)
    0.25
    >>> round(report_seconds(256), 3)
    0.512
    """
    return max(REPORT_SECONDS, replicas * REPORT_SECONDS_PER_REPLICA / REPORT_SHARE)


def validate_schedule(period: int, warmup_steps: int = 0) -> None:
    """Check a merge schedule's settings.

    Args:
        period: Local updates between merges after the warm-up; at least 1.
        warmup_steps: Local updates during which every update is followed by a merge; at least 0.

    Raises:
        ValueError: If ``period < 1`` or ``warmup_steps < 0``.
    """
    if not is_whole(period) or not is_whole(warmup_steps):
        raise ValueError(
            f"`period` and `warmup_steps` count steps, got period={period!r}, warmup_steps={warmup_steps!r}. "
            "HINT: pass whole numbers (period=4, not 4.0 or '4')."
        )
    if period < 1:
        raise ValueError(f"`period` must be >= 1, got {period}. HINT: use 1 to merge after every local update.")
    if warmup_steps < 0:
        raise ValueError(
            f"`warmup_steps` must be >= 0, got {warmup_steps}. HINT: use 0 to start periodic merging at once."
        )


def merge_due(step: int, period: int, warmup_steps: int = 0) -> bool:
    """Whether a merge follows the local update with 0-based index ``step``.

    Always while ``step < warmup_steps``, then when ``(step − warmup_steps) mod period == 0`` (torch's predicate).

    Args:
        step: 0-based index of the local update just made; non-negative.
        period: Local updates between merges after the warm-up; at least 1.
        warmup_steps: Number of initial updates each followed by a merge; at least 0.

    Raises:
        ValueError: If ``step`` is negative or the schedule is invalid.

    Example:
        >>> [step for step in range(12) if merge_due(step, period=4, warmup_steps=3)]
        [0, 1, 2, 3, 7, 11]
    """
    validate_schedule(period, warmup_steps)
    if step < 0:
        raise ValueError(f"`step` is the 0-based index of the local update just made and must be >= 0, got {step}.")
    if step < warmup_steps:
        return True
    return (step - warmup_steps) % period == 0


class LearningRateDrop:
    """Notices a step drop of the learning rate (SMA then resets every replica to the center).

    Crossbow resets the learners at the drops of a step schedule (its MultiStep policy), not whenever the rate
    decreases. A drop is therefore a fall to ``ratio`` × the previous step's rate or below within one step: a
    MultiStep drop (γ = 0.1 or 0.5) is one, while a per-step cosine or linear decay, whose rate changes little
    from one step to the next, is not (it may count once at its very last steps, where the rate reaches zero).
    Resetting on every decrease would reset at every step of such a schedule, leaving the center unmoved.

    Args:
        ratio: the largest fraction of the previous rate that counts as a drop, in (0, 1).

    Example:
        >>> drop = LearningRateDrop()
        >>> [drop.observe(lr) for lr in (0.1, 0.1, 0.01, 0.01, 0.0099)]
        [False, False, True, False, False]
    """

    def __init__(self, ratio: float = 0.5) -> None:
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"A learning-rate drop ratio must lie in (0, 1), got {ratio}. HINT: e.g. 0.5.")
        self.ratio = ratio
        self.last: float | None = None

    def observe(self, lr: float) -> bool:
        """Record this step's learning rate; returns whether it fell to ``ratio`` × the previous step's or below."""
        dropped = self.last is not None and lr <= self.ratio * self.last
        self.last = lr
        return dropped


def report_interval(
    step_seconds: float, shortest: int, longest_factor: int = 8, seconds: float = REPORT_SECONDS
) -> int:
    """Steps until the next report of every replica's period under gradient synchronisation.

    A report is a small collective of its own (about 2 ms on 4 CPU processes, launched, awaited and planned from),
    so steps of a few milliseconds would pay a large share of their time for it every ``shortest`` steps. Reports
    come about every ``seconds`` of training instead, never more often than ``shortest`` (a plan is measured
    ``lag + 1`` steps after it is made) nor less often than ``longest_factor × shortest`` steps:

        interval = clamp(⌈seconds / step_seconds⌉, shortest, longest_factor · shortest)

    ``step_seconds`` is the step time the latest reports measured (every replica computes the same value from the
    same reports, so all agree on when the next one is due); 0 (nothing measured yet) gives ``shortest``.

    >>> report_interval(0.005, shortest=3)   # 5 ms steps: every 24 steps (the cap), 0.12 s
    24
    >>> report_interval(0.05, shortest=3)    # 50 ms steps: every 5 steps
    5
    >>> report_interval(0.5, shortest=3)     # long steps: as often as plans can change
    3
    """
    if step_seconds <= 0 or not math.isfinite(step_seconds):
        return shortest
    longest = longest_factor * shortest
    wanted = seconds / step_seconds  # may overflow to infinity for a vanishing step time
    return longest if wanted >= longest else max(shortest, math.ceil(wanted))
