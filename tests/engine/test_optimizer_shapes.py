"""Optimizer state moved between one model and stacked learners: the mean of the rows, a copy per row, or afresh."""

from __future__ import annotations

import logging

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from lightning_aesgd.engine.optimizer_shapes import fit_optimizer_state, fitted_state, one_model_state

shapes = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(torch.Size)


@given(shape=shapes, learners=st.integers(2, 4))
def test_one_models_state_becomes_every_learners_and_their_mean_is_it_again(shape, learners):
    moment = torch.randn(shape)
    step = torch.tensor(5.0)
    stacked = fitted_state({"step": step, "exp_avg": moment}, torch.Size([learners, *shape]))
    assert stacked is not None
    assert stacked["step"] is step, "a step counter is one number, whatever the learners"
    assert stacked["exp_avg"].shape == (learners, *shape)
    assert all(torch.equal(row, moment) for row in stacked["exp_avg"])
    original = moment.clone()
    stacked["exp_avg"][0].add_(1.0)
    assert torch.equal(moment, original), "each row a copy"
    assert torch.equal(stacked["exp_avg"][1], original)
    back = fitted_state(stacked, shape)
    assert back is not None
    torch.testing.assert_close(back["exp_avg"], original + 1 / learners)


def test_a_state_of_another_model_fits_no_parameter():
    assert fitted_state({"momentum_buffer": torch.zeros(3, 4)}, torch.Size([4, 3])) is None
    state = {"momentum_buffer": torch.zeros(3), "step": torch.tensor(1.0), "flag": True}
    assert fitted_state(state, torch.Size([3])) == state


def _stacked_adam(learners: int) -> tuple[nn.Linear, torch.optim.Adam]:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    for param in layer.parameters():
        param.data = param.data.unsqueeze(0).repeat(learners, *[1] * param.dim())
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    sum(param.square().sum() * (row + 1) for row, param in enumerate(layer.parameters())).backward()
    optimizer.step()
    return layer, optimizer


def test_a_checkpoint_holds_the_learners_mean_state_and_leaves_theirs_untouched():
    layer, optimizer = _stacked_adam(learners=3)
    shapes = {id(layer.weight): torch.Size([2, 3]), id(layer.bias): torch.Size([2])}
    live = optimizer.state_dict()
    saved = one_model_state(live, optimizer, shapes)
    assert [tuple(s["exp_avg"].shape) for s in saved["state"].values()] == [(2, 3), (2,)]
    torch.testing.assert_close(saved["state"][0]["exp_avg"], optimizer.state[layer.weight]["exp_avg"].mean(0))
    assert saved["param_groups"] == live["param_groups"]
    assert optimizer.state[layer.weight]["exp_avg"].shape == (3, 2, 3), "the learners train on"


def test_a_resumed_state_is_fitted_to_the_parameters_or_dropped_with_a_warning(caplog):
    layer, optimizer = _stacked_adam(learners=3)
    one = one_model_state(optimizer.state_dict(), optimizer, {id(p): p.shape[1:] for p in layer.parameters()})
    plain = nn.Linear(3, 2)
    resumed = torch.optim.Adam(plain.parameters(), lr=0.1)
    resumed.load_state_dict(optimizer.state_dict())  # stacked moments, as an older checkpoint held them
    fit_optimizer_state(resumed)
    assert resumed.state[plain.weight]["exp_avg"].shape == (2, 3)
    torch.testing.assert_close(resumed.state[plain.weight]["exp_avg"], one["state"][0]["exp_avg"])
    resumed.step()  # no shape error

    other = torch.optim.Adam(nn.Linear(2, 3).parameters(), lr=0.1)
    other.load_state_dict(optimizer.state_dict())
    with caplog.at_level(logging.WARNING, logger="lightning_aesgd"):
        fit_optimizer_state(other)
    assert not other.state
    assert "does not fit a parameter of shape (3, 2): the optimizer starts afresh" in caplog.text


def test_a_state_one_dimension_short_of_another_shape_fits_no_parameter():
    assert fitted_state({"exp_avg": torch.zeros(3)}, torch.Size([2, 4])) is None


def test_a_checkpoint_keeps_the_state_of_a_parameter_it_cannot_fit_as_it_is():
    layer, optimizer = _stacked_adam(learners=3)
    shapes = {id(layer.weight): torch.Size([5, 7]), id(layer.bias): torch.Size([2])}  # the weight fits no way
    live = optimizer.state_dict()
    saved = one_model_state(live, optimizer, shapes)
    assert saved["state"][0] is live["state"][0]
    assert saved["state"][1]["exp_avg"].shape == (2,)


def test_fitting_skips_parameters_without_state():
    frozen, trained = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([frozen, trained], lr=0.1, momentum=0.9)
    trained.grad = torch.ones(3)
    optimizer.step()
    fit_optimizer_state(optimizer)
    assert frozen not in optimizer.state
    assert optimizer.state[trained]["momentum_buffer"].shape == (3,)
