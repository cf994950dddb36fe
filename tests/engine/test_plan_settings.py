"""Plan settings validate themselves when built: a wrong value fails at construction, named, with the fix."""

from __future__ import annotations

import pytest

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
    ],
)
def test_bad_plan_options_fail_at_construction_with_a_hint(kwargs, error, match):
    with pytest.raises(error, match=rf"{match}.*HINT"):
        PlanSettings(**kwargs)
