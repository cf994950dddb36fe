"""When merges happen: after every local update during a warm-up, then every ``period`` updates.

The names and the post-warm-up predicate are those of torch's ``PeriodicModelAverager``. Method card:
``docs/methods/local_sgd.md`` (and ``docs/methods/sma.md`` for :class:`LearningRateDrop`).
"""

from __future__ import annotations

__all__ = ["LearningRateDrop", "merge_due", "validate_schedule"]


def validate_schedule(period: int, warmup_steps: int = 0) -> None:
    """Check a merge schedule's settings.

    Args:
        period: Local updates between merges after the warm-up; at least 1.
        warmup_steps: Local updates during which every update is followed by a merge; at least 0.

    Raises:
        ValueError: If ``period < 1`` or ``warmup_steps < 0``.
    """
    if not _is_count(period) or not _is_count(warmup_steps):
        raise ValueError(
            f"`period` and `warmup_steps` count steps: pass whole numbers, got period={period!r}, "
            f"warmup_steps={warmup_steps!r}."
        )
    if period < 1:
        raise ValueError(f"`period` must be >= 1, got {period}; use 1 to merge after every local update.")
    if warmup_steps < 0:
        raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}; use 0 to start periodic merging at once.")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    """Notices when the learning rate falls between two steps (SMA then resets every replica to the center).

    Example:
        >>> drop = LearningRateDrop()
        >>> [drop.observe(lr) for lr in (0.1, 0.1, 0.01, 0.01)]
        [False, False, True, False]
    """

    def __init__(self) -> None:
        self.last: float | None = None

    def observe(self, lr: float) -> bool:
        """Record this step's learning rate; returns whether it is lower than the previous step's."""
        dropped = self.last is not None and lr < self.last
        self.last = lr
        return dropped
