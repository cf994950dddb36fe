"""The early checks of Trainer and model settings on their own: each refuses only what it names, and lets the rest be.

The refusals themselves are exercised through real fits in tests/test_strategy.py and tests/test_learners.py; here
stand-ins of the Trainer and the engine pin down which settings pass.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_aesgd.checks import (
    UnsupportedSettingError,
    check_delayed_optimizers,
    check_fit_settings,
    check_gradient_settings,
    check_learner_settings,
)


def _trainer(**settings) -> SimpleNamespace:
    defaults = {"gradient_clip_val": None, "gradient_clip_algorithm": "norm", "optimizers": []}
    return SimpleNamespace(**{**defaults, **settings})


def test_a_trainer_that_uses_the_distributed_sampler_is_not_warned_of():
    module = SimpleNamespace(automatic_optimization=True)
    trainer = SimpleNamespace(
        accumulate_grad_batches=1, _accelerator_connector=SimpleNamespace(use_distributed_sampler=True)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_fit_settings(trainer, module)


def test_a_grad_scaler_is_refused_only_with_delayed_sums():
    scaler = SimpleNamespace(scaler=object())
    check_gradient_settings(SimpleNamespace(delay=0), scaler)
    check_gradient_settings(SimpleNamespace(), scaler)  # model merging's engine has no delay
    with pytest.raises(UnsupportedSettingError, match=r"GradScaler.*HINT"):
        check_gradient_settings(SimpleNamespace(delay=1), scaler)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_only_with_delayed_sums():
    params = [nn.Parameter(torch.zeros(2))]
    line_search, first_order = torch.optim.LBFGS(params), torch.optim.SGD(params, lr=0.1)
    check_delayed_optimizers(SimpleNamespace(delay=0), [line_search])
    check_delayed_optimizers(SimpleNamespace(), [line_search])
    check_delayed_optimizers(SimpleNamespace(delay=1), [first_order])
    with pytest.raises(UnsupportedSettingError, match=r"gradient_delay=1 with LBFGS, whose step needs a closure.*HINT"):
        check_delayed_optimizers(SimpleNamespace(delay=1), [first_order, line_search])


@pytest.mark.parametrize(
    "engine",
    [SimpleNamespace(learners=1), SimpleNamespace(learners=1, auto_learners=False), SimpleNamespace()],
    ids=["one-learner", "one-learner-not-auto", "gradient-sync"],
)
def test_one_learner_per_device_is_not_checked_for_what_stacked_learners_cannot_do(engine):
    module = nn.Linear(2, 1)
    trainer = _trainer(gradient_clip_val=1.0, optimizers=[torch.optim.LBFGS(module.parameters())])
    check_learner_settings(engine, trainer, module)


@pytest.mark.parametrize(
    ("engine", "named"),
    [
        (SimpleNamespace(learners=2, auto_learners=False), "learners_per_device=2"),
        (SimpleNamespace(learners=1, auto_learners=True), "learners_per_device='auto'"),  # not chosen yet
    ],
    ids=["two", "auto"],
)
def test_stacked_learners_refuse_clipping_by_norm_naming_their_number(engine, named):
    module = nn.Linear(2, 1)
    with pytest.raises(UnsupportedSettingError, match=rf"{named} with gradient clipping by norm.*HINT"):
        check_learner_settings(engine, _trainer(gradient_clip_val=1.0), module)
    check_learner_settings(engine, _trainer(gradient_clip_val=1.0, gradient_clip_algorithm="value"), module)


def test_stacked_learners_with_an_elementwise_optimizer_are_not_warned_of():
    module = nn.Linear(2, 1)
    trainer = _trainer(optimizers=[torch.optim.SGD(module.parameters(), lr=0.1), torch.optim.Adam(module.parameters())])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_learner_settings(SimpleNamespace(learners=2), trainer, module)
