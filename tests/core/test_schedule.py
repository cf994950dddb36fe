"""Tests for the merge schedule against torch's ``PeriodicModelAverager``."""

import warnings

import pytest
import torch

from lightning_aesgd.core.schedule import merge_due, validate_schedule

PERIODS = [1, 2, 4]
WARMUPS = [0, 3, 4]
NUM_STEPS = 24


def torch_averages_at(step: int, period: int, warmup_steps: int) -> bool:
    """``PeriodicModelAverager.average_parameters``'s predicate, copied from torch's source."""
    return step >= warmup_steps and (step - warmup_steps) % period == 0


@pytest.mark.parametrize("period", PERIODS)
@pytest.mark.parametrize("warmup_steps", WARMUPS)
def test_merge_due_matches_torch_after_warmup(period: int, warmup_steps: int) -> None:
    for step in range(warmup_steps, NUM_STEPS):
        assert merge_due(step, period, warmup_steps) == torch_averages_at(step, period, warmup_steps), step


@pytest.mark.parametrize("period", PERIODS)
@pytest.mark.parametrize("warmup_steps", WARMUPS)
def test_merge_due_merges_after_every_warmup_step(period: int, warmup_steps: int) -> None:
    assert all(merge_due(step, period, warmup_steps) for step in range(warmup_steps))


@pytest.mark.parametrize("period", PERIODS)
@pytest.mark.parametrize("warmup_steps", WARMUPS)
def test_merge_due_matches_a_real_periodic_model_averager(
    period: int, warmup_steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Run torch's own averager, with its collective replaced by a recorder, so that a change of torch's
    # semantics shows up here instead of silently diverging from the copied predicate.
    averagers = pytest.importorskip("torch.distributed.algorithms.model_averaging.averagers")
    averaged_at: list[int] = []
    monkeypatch.setattr(
        averagers.utils, "average_parameters_or_parameter_groups", lambda *_: averaged_at.append(averager.step)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that period 1 makes averaging pointless next to DDP
        averager = averagers.PeriodicModelAverager(period, warmup_steps, process_group=object())
    for _ in range(NUM_STEPS):
        averager.average_parameters([torch.nn.Parameter(torch.zeros(1))])
    ours = [step for step in range(NUM_STEPS) if step >= warmup_steps and merge_due(step, period, warmup_steps)]
    assert ours == averaged_at


@pytest.mark.parametrize(
    ("period", "warmup_steps", "expected"),
    [
        (1, 0, list(range(10))),
        (4, 0, [0, 4, 8]),
        (2, 3, [0, 1, 2, 3, 5, 7, 9]),
        (4, 4, [0, 1, 2, 3, 4, 8]),
    ],
)
def test_merge_due_table(period: int, warmup_steps: int, expected: list[int]) -> None:
    assert [step for step in range(10) if merge_due(step, period, warmup_steps)] == expected


@pytest.mark.parametrize(
    ("period", "warmup_steps", "message"),
    [(0, 0, r"`period` must be >= 1.*use 1"), (-2, 0, "`period`"), (2, -1, r"`warmup_steps` must be >= 0.*use 0")],
)
def test_invalid_schedules_raise_with_a_hint(period: int, warmup_steps: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_schedule(period, warmup_steps)
    with pytest.raises(ValueError, match=message):
        merge_due(0, period, warmup_steps)


def test_merge_due_rejects_a_negative_step() -> None:
    with pytest.raises(ValueError, match="0-based index"):
        merge_due(-1, period=2)


def test_validate_schedule_accepts_the_smallest_valid_settings() -> None:
    validate_schedule(1, 0)
