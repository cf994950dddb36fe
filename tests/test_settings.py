"""StrategySettings on their own: defaults, early errors with a hint, and the engine and DDP options they give."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_aesgd import SMA, AdaptiveElasticStrategy, ElasticAverage, InverseTimeDecay
from lightning_aesgd.core.planners import ProportionalPlanner
from lightning_aesgd.emulation import SlowdownProfile
from lightning_aesgd.engine.gradient_sync import GradientSync
from lightning_aesgd.engine.model_merge import ModelMerge
from lightning_aesgd.settings import MERGE_OPTIONS, StrategySettings, check_launch
from lightning_aesgd.strategy import AdaptiveElasticMixin

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_aesgd"
LIGHTNING = ("pytorch_lightning", "lightning", "lightning_fabric")

# The strategy's arguments that are not training options: they launch the replicas, or Lightning's connector
# sets them.
LAUNCH_OPTIONS = {
    "replicas_per_device",
    "replica_devices",
    "process_group_backend",
    "timeout",
    "start_method",
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
}

# A valid value other than the default for every merge option, each accepted with sync="models".
MERGE_VALUES = {
    "period": 2,
    "merge_rule": ElasticAverage(alpha=0.5),
    "merge_weights": "updates",
    "l2_nudge": True,
    "merge_buffers": False,
    "optimizer_state": "reset",
    "lr_scaling": True,
    "learners_per_device": 2,
    "max_learners": 4,
    "learner_min_gain": 0.2,
}


def test_the_defaults_are_valid():
    settings = StrategySettings()
    assert settings.sync == "gradients"
    assert settings.merging.period == 1
    assert settings.planning.planner == "proportional"
    assert settings.planning.hold_steps == 0
    assert settings.step_slowdown is None
    assert settings.merge_options_given() == []


def test_settings_are_frozen_and_compare_by_their_options():
    settings = StrategySettings(sync="models", period=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.period = 2  # type: ignore[misc]
    assert settings == StrategySettings(sync="models", period=4)
    assert settings != StrategySettings(sync="models", period=3)


# --- early errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        # switches: a string from a config file is truthy (found by tests/test_fuzz.py: "no" switched lr_scaling on)
        ({"lr_scaling": "no"}, TypeError, "`lr_scaling` is a switch"),
        ({"telemetry": None}, TypeError, "`telemetry` is a switch"),
        ({"sync": "models", "merge_buffers": None}, TypeError, "`merge_buffers` is a switch"),
        # model merging's options, checked in either sync mode
        ({"sync": "models", "period": 0}, ValueError, "period"),
        ({"sync": "models", "period": 2.5}, ValueError, "whole numbers"),
        ({"warmup_steps": -1}, ValueError, "warmup"),
        ({"merge_weights": "loss"}, ValueError, "samples"),
        ({"merge_rule": "gossip"}, ValueError, "elastic_average"),
        ({"merge_rule": None}, TypeError, "`merge_rule` must be a MergeRule object"),
        ({"merge_rule": ElasticAverage}, TypeError, "not the class"),
        ({"optimizer_state": "drop"}, ValueError, "keep"),
        # several learners per replica
        ({"sync": "models", "learners_per_device": 0}, ValueError, "counts models per replica"),
        ({"sync": "models", "learners_per_device": 2.0}, ValueError, "whole number"),
        ({"sync": "models", "learners_per_device": 2, "sample_costs": "auto"}, ValueError, "sample_costs"),
        ({"sync": "models", "learners_per_device": 2, "optimizer_state": "average"}, ValueError, "'keep' or 'reset'"),
        ({"sync": "models", "learners_per_device": 2, "merge_buffers": False}, ValueError, "buffers are merged"),
        ({"sync": "models", "learners_per_device": "auto", "max_learners": 0}, ValueError, "`max_learners`"),
        ({"sync": "models", "learners_per_device": "auto", "learner_min_gain": -0.1}, ValueError, "learner_min_gain"),
        # plans
        ({"planner": "greedy"}, ValueError, "proportional"),
        ({"planner": 3}, TypeError, "`planner` must be a name or a Planner"),
        ({"planner": "proportional", "shares": [1, 2]}, ValueError, "static"),
        ({"planner": "static", "shares": [0.0]}, ValueError, "`shares` must be one finite share"),
        ({"min_batch": "2"}, TypeError, "`min_batch` is a batch size"),
        ({"min_share": 1.5}, ValueError, "min_share"),
        ({"min_batch": [4, "2"]}, TypeError, r"a list of one per replica; got \[4, '2'\]"),
        ({"max_batch": [8, 2.5]}, TypeError, "`max_batch` is a batch size, or a list"),
        ({"min_share": [0.1, "x"]}, TypeError, "`min_share` must be a number or a list"),
        ({"min_share": [0.1, 1.5]}, ValueError, "min_share"),
        ({"min_batch": [1, 2], "max_batch": [4, 4, 4]}, ValueError, r"hold values for \[2, 3\] replicas"),
        ({"speed_smoothing": 1.0}, ValueError, "`speed_smoothing` is the weight"),
        ({"plan_gain": 0.0}, ValueError, "plan_gain"),
        # the loader and the learning rate
        ({"step_batch_size": 0}, ValueError, "step_batch_size"),
        ({"plan_lag": 0}, ValueError, "plan_lag"),
        ({"sample_costs": "bogus"}, ValueError, "Unknown sample_costs"),
        ({"lr_schedule": 0.05}, TypeError, "`lr_schedule` is a function of the global step"),
        # the sync mode and its gradient options
        ({"sync": "weights"}, ValueError, "not one of"),
        ({"gradient_delay": 2}, ValueError, r"0 \(synchronous\) or 1"),
        ({"sync": "models", "gradient_delay": 1}, ValueError, "sync='gradients'"),
        ({"gradient_delay": 1, "gradient_delay_warmup": -1}, ValueError, "counts steps"),
        ({"gradient_delay_warmup": 5}, ValueError, "gradient_delay=1"),
        ({"gradient_delay": 1, "gradient_delay_lr_scale": "half"}, ValueError, "is a factor"),
        ({"gradient_delay": 1, "gradient_delay_lr_scale": float("nan")}, ValueError, "not a finite number"),
        ({"gradient_delay": 1, "gradient_delay_lr_scale": 0}, ValueError, "stop or reverse"),
        ({"gradient_delay_lr_scale": 0.5}, ValueError, "gradient_delay=1"),
        ({"sync": "models", "find_unused_parameters": True}, ValueError, "DistributedDataParallel's option"),
        ({"gradient_delay": 1, "find_unused_parameters": True}, ValueError, "unused in a step"),
        # emulated slower devices
        ({"slowdown": [1.0, 0.5]}, ValueError, ">= 1"),
        ({"slowdown": "fast"}, TypeError, "`slowdown` must be a SlowdownProfile"),
    ],
)
def test_a_bad_value_fails_when_the_settings_are_built_with_a_hint(options, error, match):
    with pytest.raises(error, match=match) as raised:
        StrategySettings(**options)
    assert type(raised.value) is error
    assert "HINT:" in str(raised.value)


def test_a_rule_that_never_pulls_the_replicas_together_is_named():
    with pytest.warns(UserWarning, match="never pulls the replicas together"):
        StrategySettings(sync="models", merge_rule=ElasticAverage(alpha=0.0))


@pytest.mark.parametrize("name", MERGE_OPTIONS)
def test_a_merge_option_with_gradient_sync_is_refused_by_name(name):
    StrategySettings(sync="models", **{name: MERGE_VALUES[name]})  # a valid value for model merging
    with pytest.raises(ValueError, match=rf"\['{name}'\] configure model merging.*HINT: remove them, or use sync="):
        StrategySettings(sync="gradients", **{name: MERGE_VALUES[name]})


def test_every_merge_option_given_with_gradient_sync_is_named_at_once():
    with pytest.raises(ValueError, match=r"\['lr_scaling', 'merge_rule', 'period'\] configure model merging"):
        StrategySettings(period=4, merge_rule=SMA(alpha=0.1), lr_scaling=True)


class _Incomparable(ElasticAverage):
    """A merge rule whose comparison raises (as one holding an array would)."""

    def __eq__(self, other):
        raise TypeError("no equality")

    __ne__ = __eq__
    __hash__ = ElasticAverage.__hash__


def test_a_merge_rule_that_cannot_be_compared_with_the_default_is_given():
    settings = StrategySettings(sync="models", merge_rule=_Incomparable())
    assert settings.merge_options_given() == ["merge_rule"]
    with pytest.raises(ValueError, match=r"\['merge_rule'\] configure model merging"):
        StrategySettings(sync="gradients", merge_rule=_Incomparable())


def test_merge_options_at_their_defaults_are_not_given():
    # Compared with the dataclass's own defaults: stating one explicitly is not configuring model merging.
    defaults = {field.name: field.default for field in dataclasses.fields(StrategySettings) if field.init}
    settings = StrategySettings(sync="gradients", **{name: defaults[name] for name in MERGE_OPTIONS})
    assert settings.merge_options_given() == []
    assert set(MERGE_OPTIONS) <= set(defaults)


# --- what the settings give -----------------------------------------------------------------------------------


def test_plans_hold_through_the_warmup_only_when_asked():
    assert StrategySettings(sync="models", warmup_steps=5, plan_after_warmup=True).planning.hold_steps == 5
    assert StrategySettings(sync="models", warmup_steps=5).planning.hold_steps == 0


def test_only_a_step_mode_slowdown_is_the_strategys_own():
    assert StrategySettings(slowdown=[1.0, 2.0]).step_slowdown == SlowdownProfile((1.0, 2.0))
    hook = {"factors": [2.0], "mode": "hook", "seconds_per_sample": 0.001}
    assert StrategySettings(slowdown=hook).step_slowdown is None


def test_ddp_options_are_those_of_gradient_sync_only():
    options = StrategySettings(find_unused_parameters=True).ddp_options()
    assert options.pop("find_unused_parameters") is True
    assert options.pop("gradient_as_bucket_view") is True  # no copy of a summed bucket back into the gradients
    # DDP's per-forward buffer broadcast is off, under the name this torch gives it.
    assert options in ({"forward_sync_buffers": False}, {"broadcast_buffers": False})
    assert StrategySettings(sync="models").ddp_options() == {}
    assert (
        StrategySettings(sync="gradients", gradient_as_bucket_view=False).ddp_options()["gradient_as_bucket_view"]
        is False
    )


def test_ddp_takes_the_options_of_gradient_sync_under_this_torchs_current_names():
    """The test above takes either name of the per-forward broadcast; DDP itself takes this torch's own without a
    deprecation (torch 2.13's old ``broadcast_buffers=False`` would warn, and skip the broadcast at wrapping too)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ddp = DistributedDataParallel(nn.Linear(2, 2), **StrategySettings().ddp_options())
    finally:
        dist.destroy_process_group()
    assert getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)) is False
    assert (ddp.find_unused_parameters, ddp.gradient_as_bucket_view) == (False, True)


def test_the_merge_rules_own_options_given_to_the_strategy_are_named_as_the_rules():
    with pytest.raises(
        TypeError, match=r"takes no \['alpha', 'momentum'\]: they belong to the merge rule\. HINT: pass "
    ):
        AdaptiveElasticStrategy(sync="models", alpha=0.5, momentum=0.9, perod=2)


def test_a_timeout_of_zero_is_refused_as_one_below_zero_and_any_positive_one_is_taken():
    with pytest.raises(ValueError, match=r"every collective would fail at once.*HINT"):
        check_launch(timedelta(0), "popen")
    check_launch(timedelta(microseconds=1), "popen")
    check_launch(None, "spawn")


def test_gradient_as_bucket_view_is_the_strategys_own_switch():
    strategy = AdaptiveElasticStrategy(sync="gradients", gradient_as_bucket_view=False)
    assert strategy._ddp_kwargs["gradient_as_bucket_view"] is False
    with pytest.raises(TypeError, match="gradient_as_bucket_view=True or gradient_as_bucket_view=False"):
        StrategySettings(sync="gradients", gradient_as_bucket_view="no")


class _Recorded:
    """Stands in for an engine class: records what it was built with."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def test_gradient_sync_is_built_with_every_option_passed_through(monkeypatch):
    schedule = InverseTimeDecay(decay=0.1, warmup_steps=2)
    settings = StrategySettings(
        gradient_delay=1,
        compensate_momentum=False,
        gradient_delay_warmup=3,
        gradient_delay_lr_scale=np.float32(0.5),
        lr_schedule=schedule,
        step_batch_size=8,
        plan_lag=3,
        sample_costs="auto",
        planner=ProportionalPlanner(),
    )
    engine = settings.build_engine()
    assert isinstance(engine, GradientSync)
    assert (engine.delay, engine.lr_schedule, engine.step_batch_size, engine.plan_lag) == (1, schedule, 8, 3)
    assert type(engine.delay_lr_scale) is float
    assert settings.build_engine() is not engine  # a new engine per strategy
    monkeypatch.setattr("lightning_aesgd.settings.GradientSync", _Recorded)
    recorded = settings.build_engine()
    assert recorded.args == (settings.planning,)
    assert recorded.kwargs == {
        "delay": 1,
        "compensate_momentum": False,
        "delay_warmup": 3,
        "delay_lr_scale": 0.5,
        "lr_schedule": schedule,
        "step_batch_size": 8,
        "plan_lag": 3,
        "sample_costs": "auto",
    }


def test_model_merge_is_built_with_every_option_passed_through(monkeypatch):
    schedule = InverseTimeDecay(decay=0.1, warmup_steps=2)
    settings = StrategySettings(
        sync="models",
        period=2,
        merge_weights="updates",
        l2_nudge=True,
        lr_scaling=True,
        lr_schedule=schedule,
        step_batch_size=8,
        plan_lag=4,
        sample_costs="dataset",
        checkpoint_replicas=False,
    )
    engine = settings.build_engine()
    assert isinstance(engine, ModelMerge)
    assert engine.merging is settings.merging
    assert (engine.lr_scaling, engine.checkpoint_replicas, engine.normalization.enabled) == (True, False, True)
    monkeypatch.setattr("lightning_aesgd.settings.ModelMerge", _Recorded)
    recorded = settings.build_engine()
    assert recorded.args == (settings.merging, settings.planning)
    assert recorded.kwargs == {
        "l2_nudge": True,
        "lr_scaling": True,
        "lr_schedule": schedule,
        "step_batch_size": 8,
        "plan_lag": 4,
        "sample_costs": "dataset",
        "checkpoint_replicas": False,
        "learners": 1,
        "learner_tuning": settings.learner_tuning,
    }


def test_model_merge_is_built_with_the_learners_per_device():
    assert StrategySettings(sync="models", learners_per_device=3).build_engine().learners == 3


# --- the strategy's signature -----------------------------------------------------------------------------------


def _strategy_parameters() -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(AdaptiveElasticMixin.__init__).parameters)


def test_every_option_is_a_keyword_of_the_strategy_and_every_keyword_an_option_or_a_launch_argument():
    parameters = _strategy_parameters()
    options = set(StrategySettings.option_names())
    assert options <= set(parameters)
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in options)
    assert set(parameters) - options == LAUNCH_OPTIONS | {"self", "unexpected"}


@pytest.mark.parametrize("name", StrategySettings.option_names())
def test_the_strategys_default_is_the_settings_default(name):
    # The strategy's signature is what LightningCLI reads: its defaults must be the settings' own.
    default = {field.name: field.default for field in dataclasses.fields(StrategySettings)}[name]
    assert _strategy_parameters()[name].default == default


def test_the_strategy_forwards_every_option_to_its_settings():
    given = {"sync": "models", "period": 3, "merge_weights": "updates", "lr_scaling": True, "plan_lag": 5}
    strategy = AdaptiveElasticStrategy(**given)
    assert strategy.settings == StrategySettings(**given)
    assert (strategy.sync, strategy.merging, strategy.telemetry) == ("models", strategy.settings.merging, True)


def test_the_settings_load_no_lightning_module():
    # As the engine's layer: a program that builds settings (or a test like this file's first half) needs no
    # Lightning. The package's own __init__ registers the strategy, so the module is loaded without it.
    script = f"""
import importlib, sys, types
package = types.ModuleType("lightning_aesgd")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["lightning_aesgd"] = package
importlib.import_module("lightning_aesgd.settings")
print(sorted(name for name in sys.modules if name.split(".")[0] in {LIGHTNING!r}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_numpy_numbers_in_options_are_kept_as_pythons_so_checkpoints_load_with_weights_only():
    settings = StrategySettings(
        sync="models", step_batch_size=np.int64(8), plan_lag=np.int64(2), period=np.int64(2), min_share=np.float32(0.2)
    )
    for name in ("step_batch_size", "plan_lag", "period", "min_share"):
        assert type(getattr(settings, name)) in (int, float), name
    assert type(settings.merging.period) is int
