"""Plan settings validate themselves when built: a wrong value fails at construction, named, with the fix."""

from __future__ import annotations

import pytest

from lightning_aesgd.core.planners import StaticPlanner
from lightning_aesgd.engine.plan_settings import PlanSettings


def test_the_defaults_are_adaptive_and_build_the_proportional_planner():
    settings = PlanSettings()
    assert settings.adaptive
    assert type(settings.build_planner(floor=4, cap=None)).__name__ == "ProportionalPlanner"
    assert not PlanSettings(planner="static").adaptive


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"min_share": 1.5}, "min_share"), ({"plan_gain": 0.0}, "plan_gain"), ({"plan_dead_band": -0.1}, "dead_band")],
)
def test_bad_damping_options_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanSettings(**kwargs)


# Each of these used to pass construction and fail later, without naming the option (a comparison's TypeError,
# the speed estimator's "`smoothing`", the first plan's error after a training step).
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_batch": "1"}, TypeError, "`min_batch` is a batch size"),
        ({"min_batch": 1.5}, TypeError, "`min_batch` is a batch size"),
        ({"max_batch": 2.5}, TypeError, "`max_batch` is a batch size"),
        ({"min_share": "0.1"}, TypeError, "`min_share` must be a number"),
        ({"hold_steps": -1}, ValueError, "`hold_steps` counts steps"),
        ({"hold_steps": 2.5}, ValueError, "`hold_steps` counts steps"),
        ({"speed_smoothing": 1.0}, ValueError, "`speed_smoothing`"),
        ({"speed_smoothing": float("nan")}, ValueError, "`speed_smoothing`"),
        ({"planner": None}, TypeError, "`planner` must be a name or a Planner"),
        ({"planner": "static", "shares": "12"}, TypeError, "`shares` must be a list"),
        ({"planner": "static", "shares": ["a"]}, TypeError, "`shares` must all be numbers"),
        ({"planner": "static", "shares": [0.0]}, ValueError, "one finite share > 0"),
        ({"planner": "static", "shares": []}, ValueError, "one finite share > 0"),
        ({"shares": [1.0]}, ValueError, "fix the plan of the 'static' planner"),
        ({"planner": "static", "shares": [1.0, float("inf")]}, ValueError, "one finite share > 0"),
        ({"leave_out_stragglers": "yes"}, TypeError, "`leave_out_stragglers` is a switch"),
        ({"plan_gain": "0.5"}, TypeError, "`plan_gain` must be a number"),
    ],
)
def test_bad_plan_options_fail_at_construction_with_a_hint(kwargs, error, match):
    with pytest.raises(error, match=rf"{match}.*HINT"):
        PlanSettings(**kwargs)


def test_a_smoothing_of_zero_keeps_only_the_latest_period_and_is_allowed():
    assert PlanSettings(speed_smoothing=0.0).speed_smoothing == 0.0


def test_the_static_planner_is_built_from_the_shares_and_keeps_no_floor_of_its_own():
    settings = PlanSettings(planner="static", shares=[2.0, 1.0, 1.0])
    assert settings.build_planner(floor=1, cap=None) == StaticPlanner((2.0, 1.0, 1.0))
    # Adaptive plans keep a tenth of the equal share (4 of 40); a static plan only min_batch.
    assert PlanSettings().floors(120, 3) == [4, 4, 4]
    assert settings.floors(120, 3) == [1, 1, 1]


def test_a_replica_whose_max_batch_is_below_its_min_batch_fails_once_the_replicas_are_known():
    # A static plan builds without the per-replica bounds: they are checked against each other here.
    with pytest.raises(ValueError, match=r"Replica 1's max_batch=4 is below its min_batch=5.*HINT"):
        PlanSettings(planner="static", min_batch=5, max_batch=[8, 4]).check_replicas(2)
    PlanSettings(planner="static", min_batch=5, max_batch=[8, 5]).check_replicas(2)  # equal bounds fit


def test_steps_that_fit_the_bounds_exactly_pass():
    PlanSettings().check_step(3, 3)  # one sample per replica
    PlanSettings(min_batch=4).check_step(12, 3)  # every replica at its min_batch
    PlanSettings(max_batch=4).check_step(12, 3)  # every replica at its max_batch


class _Fixed:
    """A user's planner that returns the same plan whatever it is asked."""

    def __init__(self, sizes):
        self.sizes = sizes

    def plan(self, current, step_times, total):
        return list(self.sizes)


def test_a_planner_object_passes_its_trial_plan_only_with_one_sample_or_more_per_replica():
    PlanSettings(planner=_Fixed([1, 11])).check_step(12, 2)
    with pytest.raises(ValueError, match=r"returned \[0, 12\] for a trial plan of \[6, 6\].*HINT"):
        PlanSettings(planner=_Fixed([0, 12])).check_step(12, 2)


def test_a_named_planner_given_as_an_object_passes_its_trial_plan():
    """The trial plan's replicas measure a valid step time: a real planner divides by it."""
    planner = PlanSettings(planner="balanced").build_planner(floor=1, cap=None)
    PlanSettings(planner=planner).check_step(12, 3)
