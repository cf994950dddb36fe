"""When merges happen: torch's periodic model-averaging schedule, with post-local SGD's warm-up.

The names and the post-warm-up predicate are those of
``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager`` so that reviewers recognise
them; the warm-up differs on purpose (see :func:`merge_due`).
"""

from __future__ import annotations

__all__ = ["merge_due", "validate_schedule"]


def validate_schedule(period: int, warmup_steps: int = 0) -> None:
    """Check a merge schedule's settings.

    Args:
        period: Local updates between merges after the warm-up; at least 1.
        warmup_steps: Local updates during which every update is followed by a merge; at least 0.

    Raises:
        ValueError: If ``period < 1`` or ``warmup_steps < 0``.
    """
    if period < 1:
        raise ValueError(f"`period` must be >= 1, got {period}; use 1 to merge after every local update.")
    if warmup_steps < 0:
        raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}; use 0 to start periodic merging at once.")


def merge_due(step: int, period: int, warmup_steps: int = 0) -> bool:
    """Whether a merge follows the local update with 0-based index ``step``.

    After the warm-up (``step >= warmup_steps``) this is exactly the predicate of torch's
    ``PeriodicModelAverager``::

        (step − warmup_steps) mod period == 0

    so the first merge after the warm-up follows update ``warmup_steps`` itself, and then every ``period``
    updates. *During* the warm-up (``step < warmup_steps``) a merge follows *every* update, which is what
    post-local SGD's warm phase means (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020):
    there, torch's ``PeriodicModelAverager`` skips averaging only because DDP (with the post-local-SGD
    communication hook) is already all-reducing gradients at every step, keeping the replicas identical.
    Without DDP underneath, merging after every update keeps them in that fully synchronous regime (for plain
    SGD from identical replicas, averaging the models after each update equals averaging the gradients).

    Args:
        step: 0-based index of the local update just made; non-negative.
        period: Local updates between merges after the warm-up; at least 1.
        warmup_steps: Number of initial updates each followed by a merge; at least 0.

    Returns:
        Whether to merge now.

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
