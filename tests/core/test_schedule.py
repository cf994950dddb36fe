"""Tests for the merge schedule against torch's ``PeriodicModelAverager``, and for the report interval."""

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_aesgd.core.schedule import (
    REPORT_SECONDS,
    REPORT_SECONDS_PER_REPLICA,
    REPORT_SHARE,
    LearningRateDrop,
    merge_due,
    report_interval,
    report_seconds,
    validate_schedule,
)

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


@pytest.mark.parametrize(("period", "warmup_steps"), [(4.0, 0), (2, 1.5), (True, 0), (2, "1")])
def test_schedules_that_do_not_count_in_whole_steps_are_refused(period: object, warmup_steps: object) -> None:
    with pytest.raises(ValueError, match="whole numbers"):
        validate_schedule(period, warmup_steps)  # type: ignore[arg-type]


def test_merge_due_without_a_warm_up_merges_every_period_from_step_zero() -> None:
    assert [step for step in range(6) if merge_due(step, period=2)] == [0, 2, 4]


def test_merge_due_rejects_a_negative_step() -> None:
    with pytest.raises(ValueError, match="0-based index"):
        merge_due(-1, period=2)


def test_the_smallest_valid_settings_merge_after_every_step() -> None:
    validate_schedule(1, 0)  # raises if the smallest settings were refused
    assert all(merge_due(step, period=1, warmup_steps=0) for step in range(5))


def _drops(scheduler_factory, steps: int) -> list[int]:
    """The steps at which LearningRateDrop fires under a real torch scheduler stepped once per step."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = scheduler_factory(optimizer)
    drop, fired = LearningRateDrop(), []
    for step in range(steps):
        if drop.observe(optimizer.param_groups[0]["lr"]):
            fired.append(step)
        optimizer.step()
        scheduler.step()
    return fired


def test_a_multistep_schedule_drops_exactly_at_its_milestones() -> None:
    fired = _drops(lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[50, 120], gamma=0.1), 200)
    assert fired == [50, 120]


def test_a_per_step_cosine_schedule_is_no_drop_before_its_last_steps() -> None:
    fired = _drops(lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200), 200)
    assert all(step >= 195 for step in fired), fired


def test_linear_warmup_then_decay_is_no_drop_before_its_last_steps() -> None:
    def warmup_then_decay(opt):
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=20)
        decay = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=180)
        return torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[20])

    fired = _drops(warmup_then_decay, 200)
    assert all(step >= 195 for step in fired), fired


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_drop_ratio_outside_zero_one_is_refused_with_a_hint(ratio: float) -> None:
    with pytest.raises(ValueError, match="HINT"):
        LearningRateDrop(ratio=ratio)


def test_a_fall_to_half_the_rate_is_a_drop_and_a_smaller_fall_is_not() -> None:
    # The default ratio 0.5: a MultiStep drop with γ = 0.5 counts, within one step, the boundary included.
    drop = LearningRateDrop()
    assert [drop.observe(lr) for lr in (1.0, 0.5, 0.3, 0.2)] == [False, True, False, False]


@given(st.floats(min_value=0.0, max_value=100.0), st.integers(min_value=1, max_value=10))
def test_reports_come_about_every_quarter_second_within_their_bounds(step_seconds, shortest):
    interval = report_interval(step_seconds, shortest)
    assert shortest <= interval <= 8 * shortest
    if step_seconds > 0 and shortest < interval < 8 * shortest:
        assert (interval - 1) * step_seconds < REPORT_SECONDS <= interval * step_seconds
    assert report_interval(step_seconds * 2, shortest) <= interval  # longer steps never report less often


def test_nothing_measured_reports_as_often_as_plans_can_change():
    assert report_interval(0.0, 3) == 3
    assert report_interval(float("nan"), 3) == 3


@given(st.integers(min_value=1, max_value=100_000))
def test_reports_of_many_replicas_cost_at_most_their_share_of_the_time(replicas):
    seconds = report_seconds(replicas)
    assert seconds >= REPORT_SECONDS
    assert replicas * REPORT_SECONDS_PER_REPLICA <= REPORT_SHARE * seconds * (1 + 1e-12)
    assert report_seconds(replicas + 1) >= seconds
    if replicas * REPORT_SECONDS_PER_REPLICA <= REPORT_SHARE * REPORT_SECONDS:
        assert seconds == REPORT_SECONDS  # a job of up to 125 replicas reports every quarter second
