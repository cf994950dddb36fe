import pytest

from lightning_aesgd.emulation.profiles import SlowdownChange, SlowdownProfile, as_profile


def test_factors_combine_the_base_and_later_changes():
    profile = SlowdownProfile((1, 2), (SlowdownChange(step=5, replica=0, factor=3),), base=2)
    assert [profile.factor(0, step) for step in (0, 4, 5, 9)] == [2.0, 2.0, 6.0, 6.0]
    assert profile.factor(1, 9) == 4.0


def test_a_mapping_from_a_config_becomes_a_profile():
    profile = as_profile({"factors": [1, 2], "mode": "hook", "seconds_per_sample": 0.001})
    assert profile == SlowdownProfile((1, 2), mode="hook", seconds_per_sample=0.001)
    assert as_profile(None) is None


def test_per_sample_modes_need_seconds_per_sample_and_fixed_modes_no_changes():
    with pytest.raises(ValueError, match="seconds_per_sample"):
        SlowdownProfile((1, 2), mode="hook")
    with pytest.raises(ValueError, match="cannot change"):
        SlowdownProfile((1, 2), (SlowdownChange(5, 0, 2.0),), mode="quota")
    with pytest.raises(ValueError, match="Unknown slowdown mode"):
        SlowdownProfile((1, 2), mode="network")


@pytest.mark.parametrize(
    ("spec", "match"),
    [("fast", "`slowdown` must be"), (2.0, "`slowdown` must be"), ({"mode": "step"}, "needs `factors`")],
)
def test_what_is_not_a_slowdown_spec_is_a_type_error_with_a_hint(spec, match):
    # Found by tests/test_fuzz.py: these failed with a raw TypeError or KeyError (or iterated a string).
    with pytest.raises(TypeError, match=rf"{match}.*HINT"):
        as_profile(spec)


def test_factors_must_be_numbers():
    with pytest.raises(ValueError, match=r"numbers >= 1.*HINT"):
        SlowdownProfile(("2",))
