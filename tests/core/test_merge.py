"""Tests for the pure merge rules: properties of the weighted mean and closed-form merge sequences.

Replicas are simulated in one process: each keeps its own model and its own copy of the rule's state, every
replica's ``merge_`` receives the same mean, and the copies of the state must stay identical, as they do
across processes in a real run.
"""

import math
import random
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lightning_aesgd.core.merge import (
    EASGD,
    SMA,
    CentralElastic,
    ElasticAverage,
    MergeRule,
    as_merge_rule,
    available_merge_rules,
    elastic_pull_,
    extrapolate_,
    get_merge_rule,
    weighted_mean,
)

# Torch's first calls are slow; hypothesis's default 200 ms deadline would make the suite flaky.
FAST = settings(deadline=None, max_examples=30)

coefficients = st.floats(min_value=0.0, max_value=1.0)
momenta = st.floats(min_value=0.0, max_value=0.99)
weights_elements = st.floats(min_value=0.0, max_value=100.0, allow_subnormal=False)
positive_weights = st.floats(min_value=0.01, max_value=100.0)


@st.composite
def replica_sets(draw: st.DrawFn, dtype: type = np.float32, min_replicas: int = 1) -> list[torch.Tensor]:
    """Between `min_replicas` and 5 flat tensors of one common length, elements in [-1000, 1000]."""
    num_replicas = draw(st.integers(min_value=min_replicas, max_value=5))
    length = draw(st.integers(min_value=1, max_value=8))
    width = 32 if dtype == np.float32 else 64
    elements = st.floats(min_value=-1000.0, max_value=1000.0, width=width, allow_subnormal=False)
    return [torch.from_numpy(draw(arrays(dtype, length, elements=elements))) for _ in range(num_replicas)]


@st.composite
def weighted_replicas(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[float]]:
    """Replicas with one non-negative weight each, at least one positive."""
    replicas = draw(replica_sets())
    weights = draw(st.lists(weights_elements, min_size=len(replicas), max_size=len(replicas)))
    # Zero weights stay possible, but one replica always counts (drawing and filtering wastes examples).
    weights[draw(st.integers(min_value=0, max_value=len(replicas) - 1))] = draw(positive_weights)
    return replicas, weights


@st.composite
def merge_rules(draw: st.DrawFn) -> MergeRule:
    """Any rule of the module, with drawn hyperparameters."""
    kind = draw(st.sampled_from(["elastic_average", "central_elastic", "sma", "easgd"]))
    if kind == "elastic_average":
        return ElasticAverage(alpha=draw(coefficients), momentum=draw(momenta))
    if kind == "central_elastic":
        return CentralElastic(
            alpha=draw(coefficients), central_momentum=draw(momenta), needs_snapshot=draw(st.booleans())
        )
    if kind == "sma":
        return SMA(alpha=draw(coefficients), central_momentum=draw(momenta))
    return EASGD(beta=draw(st.floats(min_value=0.01, max_value=1.0)))


def tensor(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


class Cluster:
    """n simulated replicas of one rule, each with its own model and its own copy of the state."""

    def __init__(self, rule: MergeRule, initial: torch.Tensor, num_replicas: int) -> None:
        self.rule = rule
        self.models = [initial.clone() for _ in range(num_replicas)]
        self.states = [rule.init_state(initial) for _ in range(num_replicas)]

    def step_and_merge(self, updates: Sequence[torch.Tensor], weights: Sequence[float] | None = None) -> torch.Tensor:
        """Apply one local update per replica, then merge; return the (common) global model."""
        snapshots = [model.clone() for model in self.models]
        for model, update in zip(self.models, updates, strict=True):
            model.add_(update)
        contributions = snapshots if self.rule.needs_snapshot else self.models
        mean = weighted_mean(contributions, weights or [1.0] * len(self.models))
        # Each replica gets its own copy of the mean: rules may use it as scratch space.
        merged = [
            self.rule.merge_(model, contributed, mean.clone(), len(self.models), state).clone()
            for model, contributed, state in zip(self.models, contributions, self.states, strict=True)
        ]
        self.assert_states_agree()
        for other in merged[1:]:
            torch.testing.assert_close(other, merged[0], rtol=0, atol=0)
        return merged[0]

    def assert_states_agree(self) -> None:
        for state in self.states[1:]:
            assert state.keys() == self.states[0].keys()
            for key, value in state.items():
                torch.testing.assert_close(value, self.states[0][key], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# weighted_mean


@FAST
@given(weighted_replicas())
def test_weighted_mean_stays_within_elementwise_range(case: tuple[list[torch.Tensor], list[float]]) -> None:
    replicas, weights = case
    mean = weighted_mean(replicas, weights)
    stacked = torch.stack(replicas)
    assert torch.all(mean >= stacked.min(0).values)
    assert torch.all(mean <= stacked.max(0).values)


@FAST
@given(weighted_replicas(), st.randoms(use_true_random=False))
def test_weighted_mean_is_permutation_invariant(
    case: tuple[list[torch.Tensor], list[float]], rng: random.Random
) -> None:
    replicas, weights = case
    order = list(range(len(replicas)))
    rng.shuffle(order)
    permuted = weighted_mean([replicas[i] for i in order], [weights[i] for i in order])
    torch.testing.assert_close(permuted, weighted_mean(replicas, weights), rtol=1e-6, atol=1e-4)


@FAST
@given(replica_sets(), st.floats(min_value=0.01, max_value=100.0))
def test_weighted_mean_with_uniform_weights_is_the_plain_mean(replicas: list[torch.Tensor], weight: float) -> None:
    expected = torch.stack(replicas).mean(0)
    torch.testing.assert_close(weighted_mean(replicas, [weight] * len(replicas)), expected, rtol=1e-5, atol=1e-3)


@FAST
@given(weighted_replicas(), st.integers(min_value=0, max_value=5))
def test_weighted_mean_ignores_a_zero_weight_replica(
    case: tuple[list[torch.Tensor], list[float]], position: int
) -> None:
    replicas, weights = case
    ignored = torch.full_like(replicas[0], 1e6)
    position = min(position, len(replicas))
    with_ignored = weighted_mean(
        [*replicas[:position], ignored, *replicas[position:]], [*weights[:position], 0.0, *weights[position:]]
    )
    assert torch.equal(with_ignored, weighted_mean(replicas, weights))


def test_weighted_mean_weights_each_replica() -> None:
    mean = weighted_mean([tensor(0.0, 10.0), tensor(4.0, 2.0)], [3.0, 1.0])
    torch.testing.assert_close(mean, tensor(1.0, 8.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_weighted_mean_preserves_dtype_and_shape(dtype: torch.dtype) -> None:
    replicas = [torch.ones(3, 2, dtype=dtype), torch.zeros(3, 2, dtype=dtype)]
    mean = weighted_mean(replicas, [1.0, 1.0])
    assert mean.dtype == dtype
    assert mean.shape == (3, 2)


@pytest.mark.parametrize(
    ("tensors", "weights", "message"),
    [
        ([], [], "at least one tensor"),
        ([tensor(1.0)], [1.0, 2.0], "one weight per tensor"),
        ([tensor(1.0), tensor(1.0, 2.0)], [1.0, 1.0], "same shape"),
        ([tensor(1.0), tensor(2.0)], [1.0, -1.0], "non-negative"),
        ([tensor(1.0), tensor(2.0)], [1.0, math.nan], "finite"),
        ([tensor(1.0), tensor(2.0)], [0.0, 0.0], "all zero"),
    ],
)
def test_weighted_mean_rejects_invalid_inputs(tensors: list[torch.Tensor], weights: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        weighted_mean(tensors, weights)


# ---------------------------------------------------------------------------------------------------------
# helpers


@FAST
@given(replica_sets(min_replicas=2), st.floats(min_value=0.0, max_value=1.0))
def test_elastic_pull_is_exact_at_both_ends_and_linear_between(replicas: list[torch.Tensor], alpha: float) -> None:
    x, target = replicas[0], replicas[1]
    untouched, reset, pulled = x.clone(), x.clone(), x.clone()
    elastic_pull_(untouched, target, 0.0)
    elastic_pull_(reset, target, 1.0)
    elastic_pull_(pulled, target, alpha)
    assert torch.equal(untouched, x)
    assert torch.equal(reset, target)
    torch.testing.assert_close(pulled, x - alpha * (x - target), rtol=1e-5, atol=1e-3)


def test_elastic_pull_hard_reset_replaces_even_a_diverged_replica() -> None:
    # α = 1: x becomes exactly the target, whatever x held (a lerp would give NaN for an infinite x).
    x = tensor(math.inf, -math.inf, math.nan)
    elastic_pull_(x, tensor(1.0, 2.0, 3.0), 1.0)
    assert torch.equal(x, tensor(1.0, 2.0, 3.0))


def test_extrapolate_adds_momentum_times_the_last_move_and_shifts_the_history() -> None:
    mean = tensor(1.0, 1.0)
    history = {"previous": tensor(3.0, 2.0), "before_previous": tensor(1.0, 2.0)}
    z = extrapolate_(mean, history, momentum=0.5)
    torch.testing.assert_close(z, tensor(2.0, 1.0))
    assert z is history["previous"]
    torch.testing.assert_close(history["before_previous"], tensor(3.0, 2.0))
    assert torch.equal(mean, tensor(1.0, 1.0))  # only read


def test_extrapolate_with_a_standing_history_gives_the_mean_exactly() -> None:
    mean = tensor(1.0, 2.0)
    z = extrapolate_(mean, {"previous": tensor(9.0, 9.0), "before_previous": tensor(9.0, 9.0)}, momentum=0.7)
    assert torch.equal(z, mean)  # the history stood still: exactly no push


# ---------------------------------------------------------------------------------------------------------
# properties shared by every rule


@FAST
@given(merge_rules(), replica_sets(), st.integers(min_value=1, max_value=4))
def test_replicas_at_the_initial_model_stay_there(rule: MergeRule, initial: list[torch.Tensor], n: int) -> None:
    cluster = Cluster(rule, initial[0], num_replicas=n)
    for _ in range(3):
        merged = cluster.step_and_merge([torch.zeros_like(initial[0])] * n)
        assert torch.equal(merged, initial[0])
        assert all(torch.equal(model, initial[0]) for model in cluster.models)


@FAST
@given(merge_rules(), replica_sets(min_replicas=2), st.integers(min_value=2, max_value=4))
def test_identical_replicas_stay_identical(rule: MergeRule, vectors: list[torch.Tensor], n: int) -> None:
    initial, drift = vectors[0], vectors[1] / 10
    cluster = Cluster(rule, initial, num_replicas=n)
    for _ in range(3):
        cluster.step_and_merge([drift] * n)
        assert all(torch.equal(model, cluster.models[0]) for model in cluster.models[1:])


@FAST
@given(merge_rules(), weighted_replicas())
def test_replica_states_stay_identical_under_uneven_updates(
    rule: MergeRule, case: tuple[list[torch.Tensor], list[float]]
) -> None:
    updates, weights = case
    cluster = Cluster(rule, torch.zeros_like(updates[0]), num_replicas=len(updates))
    for _ in range(3):
        cluster.step_and_merge(updates, weights)  # asserts that states and returned models agree


@FAST
@given(merge_rules(), replica_sets(min_replicas=3))
def test_center_changes_nothing_and_returns_a_new_tensor(rule: MergeRule, vectors: list[torch.Tensor]) -> None:
    initial, update, mean = vectors[0], vectors[1], vectors[2]
    cluster = Cluster(rule, initial, num_replicas=1)
    cluster.step_and_merge([update])
    state = cluster.states[0]
    before = {key: value.clone() for key, value in state.items()}
    mean_before = mean.clone()
    center = rule.center(mean, state)
    center.add_(1.0)  # writing to the result must not reach the state or the mean
    assert state.keys() == before.keys()
    assert all(torch.equal(state[key], before[key]) for key in state)
    assert torch.equal(mean, mean_before)


@pytest.mark.parametrize(
    "rule",
    [
        ElasticAverage(),
        ElasticAverage(alpha=0.5, momentum=0.5),
        SMA(),
        EASGD(),
        CentralElastic(0.5, needs_snapshot=False),
    ],
    ids=repr,
)
def test_merge_never_writes_the_contribution_and_center_returns_fresh_storage(rule: MergeRule) -> None:
    state = rule.init_state(tensor(0.0, 0.0))
    local, mean = tensor(1.0, 2.0), tensor(3.0, 4.0)
    snapshot = tensor(0.5, 0.5)
    contributed = snapshot if rule.needs_snapshot else local
    rule.merge_(local, contributed, mean, 2, state)
    assert torch.equal(snapshot, tensor(0.5, 0.5))
    center = rule.center(tensor(3.0, 4.0), state)
    inputs = [local, mean, *state.values()]
    assert all(center.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in inputs)


@pytest.mark.parametrize("rule", [ElasticAverage(momentum=0.9), SMA(), EASGD()], ids=repr)
def test_merge_allocates_no_model_sized_tensor(rule: MergeRule) -> None:
    # The result lives in the caller's scratch (`mean`) or in the rule's own state, never in fresh storage.
    state = rule.init_state(torch.zeros(1000))
    local, mean = torch.ones(1000), torch.full((1000,), 2.0)
    result = rule.merge_(local, local.clone(), mean, 2, state)
    owners = [mean, *state.values()]
    assert any(result.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in owners)


@pytest.mark.parametrize("rule", [ElasticAverage(momentum=0.9), SMA(), EASGD()], ids=repr)
def test_init_state_does_not_alias_the_initial_model(rule: MergeRule) -> None:
    initial = tensor(1.0, 2.0)
    state = rule.init_state(initial)
    snapshot = {key: value.clone() for key, value in state.items()}
    initial.add_(5.0)
    assert all(torch.equal(state[key], snapshot[key]) for key in state)


@pytest.mark.parametrize("rule", [ElasticAverage(alpha=0.5, momentum=0.9), SMA(alpha=0.5), EASGD(beta=0.5)], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_preserves_dtype_and_shape(rule: MergeRule, dtype: torch.dtype) -> None:
    initial = torch.zeros(6, dtype=dtype)
    cluster = Cluster(rule, initial, num_replicas=2)
    merged = cluster.step_and_merge([torch.ones(6, dtype=dtype), -torch.ones(6, dtype=dtype)])
    for result in [merged, *cluster.models, *cluster.states[0].values(), rule.center(merged, cluster.states[0])]:
        assert result.dtype == dtype
        assert result.shape == (6,)


# ---------------------------------------------------------------------------------------------------------
# ElasticAverage


@FAST
@given(momenta, weighted_replicas())
def test_elastic_average_with_alpha_zero_leaves_replicas_untouched(
    momentum: float, case: tuple[list[torch.Tensor], list[float]]
) -> None:
    updates, weights = case
    cluster = Cluster(ElasticAverage(alpha=0.0, momentum=momentum), torch.zeros_like(updates[0]), len(updates))
    cluster.step_and_merge(updates, weights)
    assert all(torch.equal(model, update) for model, update in zip(cluster.models, updates, strict=True))


@FAST
@given(momenta, weighted_replicas())
def test_elastic_average_with_alpha_one_resets_replicas_to_the_global_model(
    momentum: float, case: tuple[list[torch.Tensor], list[float]]
) -> None:
    updates, weights = case
    cluster = Cluster(ElasticAverage(alpha=1.0, momentum=momentum), torch.zeros_like(updates[0]), len(updates))
    for _ in range(2):
        merged = cluster.step_and_merge(updates, weights)
        assert all(torch.equal(model, merged) for model in cluster.models)


def test_elastic_average_pulls_the_current_model_not_the_contribution() -> None:
    rule = ElasticAverage(alpha=0.5)
    local = tensor(4.0)
    rule.merge_(local, contributed=tensor(100.0), mean=tensor(0.0), num_replicas=2, state=rule.init_state(local))
    torch.testing.assert_close(local, tensor(2.0))


def test_elastic_average_closed_form_with_outer_momentum() -> None:
    # μ = 0.5, α = 0.5, two replicas from z_{-1} = z_{-2} = 0.
    cluster = Cluster(ElasticAverage(alpha=0.5, momentum=0.5), tensor(0.0, 0.0), num_replicas=2)

    # mean = (1·[1, 2] + 3·[3, 6]) / 4 = [2.5, 5]; no history yet, so z_1 = mean; x ← (x + z_1) / 2.
    z1 = cluster.step_and_merge([tensor(1.0, 2.0), tensor(3.0, 6.0)], weights=[1.0, 3.0])
    torch.testing.assert_close(z1, tensor(2.5, 5.0))
    torch.testing.assert_close(cluster.models, [tensor(1.75, 3.5), tensor(2.75, 5.5)])

    # x = [2.75, 3.5], [3, 6]; mean = [2.875, 4.75]; z_2 = mean + 0.5·(z_1 − z_0) = [4.125, 7.25].
    z2 = cluster.step_and_merge([tensor(1.0, 0.0), tensor(0.25, 0.5)])
    torch.testing.assert_close(z2, tensor(4.125, 7.25))
    torch.testing.assert_close(cluster.models, [tensor(3.4375, 5.375), tensor(3.5625, 6.625)])

    # mean = [3.5, 6]; z_3 = mean + 0.5·(z_2 − z_1) = [4.3125, 7.125].
    z3 = cluster.step_and_merge([tensor(0.0, 0.0), tensor(0.0, 0.0)])
    torch.testing.assert_close(z3, tensor(4.3125, 7.125))
    torch.testing.assert_close(cluster.models, [tensor(3.875, 6.25), tensor(3.9375, 6.875)])
    torch.testing.assert_close(cluster.states[0]["previous"], z3)
    torch.testing.assert_close(cluster.states[0]["before_previous"], z2)


@pytest.mark.parametrize(
    ("alpha", "momentum", "expected"), [(1.0, 0.0, True), (0.5, 0.0, False), (1.0, 0.5, False), (0.0, 0.0, False)]
)
def test_only_a_hard_reset_without_momentum_replaces_replicas_with_the_mean(
    alpha: float, momentum: float, expected: bool
) -> None:
    assert ElasticAverage(alpha=alpha, momentum=momentum).replaces_replicas_with_mean is expected


def test_elastic_average_without_momentum_stores_no_history() -> None:
    assert ElasticAverage(momentum=0.0).init_state(tensor(1.0)) == {}


def test_elastic_average_center_is_the_mean() -> None:
    rule = ElasticAverage(momentum=0.9)
    state = {"previous": tensor(9.0), "before_previous": tensor(0.0)}
    assert torch.equal(rule.center(tensor(3.0), state), tensor(3.0))


# ---------------------------------------------------------------------------------------------------------
# CentralElastic, SMA, EASGD


@FAST
@given(momenta, weighted_replicas())
def test_central_elastic_with_alpha_zero_leaves_replicas_and_center_untouched(
    momentum: float, case: tuple[list[torch.Tensor], list[float]]
) -> None:
    updates, weights = case
    initial = torch.zeros_like(updates[0])
    cluster = Cluster(CentralElastic(alpha=0.0, central_momentum=momentum), initial, len(updates))
    cluster.step_and_merge(updates, weights)
    merged = cluster.step_and_merge(updates, weights)
    assert torch.equal(merged, initial)
    assert all(torch.equal(model, 2 * update) for model, update in zip(cluster.models, updates, strict=True))


@FAST
@given(weighted_replicas(), st.floats(min_value=-1000.0, max_value=1000.0, width=32))
def test_central_elastic_with_alpha_one_moves_replicas_onto_the_old_center(
    case: tuple[list[torch.Tensor], list[float]], center: float
) -> None:
    updates, weights = case
    start = torch.full_like(updates[0], center)
    rule = CentralElastic(alpha=1.0, needs_snapshot=False)
    cluster = Cluster(rule, start, len(updates))
    cluster.step_and_merge(updates, weights)
    for model in cluster.models:
        torch.testing.assert_close(model, start, rtol=1e-5, atol=1e-3)


def test_central_elastic_is_right_when_the_contribution_is_local_itself() -> None:
    # One replica, no snapshot: the contribution is `local`; c = Δ = 0.5·(4 − 0).
    rule = CentralElastic(alpha=0.5, needs_snapshot=False)
    local = tensor(4.0)
    state = rule.init_state(tensor(0.0))
    merged = rule.merge_(local, local, tensor(4.0), num_replicas=1, state=state)
    torch.testing.assert_close(local, tensor(2.0))
    torch.testing.assert_close(merged, tensor(2.0))


def test_central_elastic_moves_the_center_by_alpha_n_times_the_weighted_offset() -> None:
    rule = CentralElastic(alpha=0.25)
    state = rule.init_state(tensor(1.0))
    merged = rule.merge_(tensor(0.0), tensor(0.0), mean=tensor(3.0), num_replicas=4, state=state)
    torch.testing.assert_close(merged, tensor(1.0 + 0.25 * 4 * (3.0 - 1.0)))


def test_sma_closed_form_with_central_momentum() -> None:
    # α = 0.5, μ_c = 0.5, two replicas from z = 0; corrections use the snapshot taken before each local step.
    cluster = Cluster(SMA(alpha=0.5, central_momentum=0.5), tensor(0.0), num_replicas=2)

    # Snapshots equal z: no correction; the local steps stand.
    z1 = cluster.step_and_merge([tensor(2.0), tensor(4.0)])
    torch.testing.assert_close(z1, tensor(0.0))
    torch.testing.assert_close(cluster.models, [tensor(2.0), tensor(4.0)])

    # x̂ = [2, 4], after steps x = [3, 3]; c = [1, 2]; x = [2, 1]; Δ = 3 = Σc; v = 3; z = 3.
    z2 = cluster.step_and_merge([tensor(1.0), tensor(-1.0)])
    torch.testing.assert_close(z2, tensor(3.0))
    torch.testing.assert_close(cluster.models, [tensor(2.0), tensor(1.0)])

    # x̂ = [2, 1], after steps x = [2, 3]; c = [−0.5, −1]; x = [2.5, 4]; Δ = −1.5; v = −1.5 + 0.5·3 = 0; z = 3.
    z3 = cluster.step_and_merge([tensor(0.0), tensor(2.0)])
    torch.testing.assert_close(z3, tensor(3.0))
    torch.testing.assert_close(cluster.models, [tensor(2.5), tensor(4.0)])
    torch.testing.assert_close(cluster.states[0]["velocity"], tensor(0.0))

    # x̂ = x = [2.5, 4]; c = [−0.25, 0.5]; x = [2.75, 3.5]; Δ = v = 0.25; z = 3.25.
    z4 = cluster.step_and_merge([tensor(0.0), tensor(0.0)])
    torch.testing.assert_close(z4, tensor(3.25))
    torch.testing.assert_close(cluster.models, [tensor(2.75), tensor(3.5)])
    torch.testing.assert_close(SMA().center(tensor(99.0), cluster.states[0]), tensor(3.25))


def test_easgd_closed_form_with_alpha_beta_over_n() -> None:
    # β = 0.75 and three replicas: α = 0.25.
    cluster = Cluster(EASGD(beta=0.75), tensor(0.0), num_replicas=3)
    z1 = cluster.step_and_merge([tensor(4.0), tensor(8.0), tensor(0.0)])
    torch.testing.assert_close(z1, tensor(0.0))

    # x̂ = [4, 8, 0], after steps x = [5, 9, 1]; c = [1, 2, 0]; x = [4, 7, 1]; z = 0 + 0.75·(4 − 0) = 3.
    z2 = cluster.step_and_merge([tensor(1.0), tensor(1.0), tensor(1.0)])
    torch.testing.assert_close(z2, tensor(3.0))
    torch.testing.assert_close(cluster.models, [tensor(4.0), tensor(7.0), tensor(1.0)])

    # x̂ = [4, 7, 1]; c = [0.25, 1, −0.5]; x = [3.75, 6, 1.5]; z = 3 + 0.75·(4 − 3) = 3.75.
    z3 = cluster.step_and_merge([tensor(0.0), tensor(0.0), tensor(0.0)])
    torch.testing.assert_close(z3, tensor(3.75))
    torch.testing.assert_close(cluster.models, [tensor(3.75), tensor(6.0), tensor(1.5)])


@FAST
@given(st.floats(min_value=0.01, max_value=1.0), replica_sets(dtype=np.float64), st.booleans())
def test_easgd_is_elastically_symmetric(beta: float, updates: list[torch.Tensor], needs_snapshot: bool) -> None:
    # What the replicas give up is exactly what the central model gains (μ_c = 0, uniform weights).
    cluster = Cluster(EASGD(beta=beta, needs_snapshot=needs_snapshot), torch.zeros_like(updates[0]), len(updates))
    for _ in range(2):
        center_before = cluster.states[0]["center"].clone()
        after_steps = [model + update for model, update in zip(cluster.models, updates, strict=True)]
        center_after = cluster.step_and_merge(updates)
        given_up = sum(before - after for before, after in zip(after_steps, cluster.models, strict=True))
        torch.testing.assert_close(center_after - center_before, given_up, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("rule", "num_replicas", "overshoots"),
    [
        (CentralElastic(alpha=0.5), 2, False),  # α·n = 1: the central model lands on the mean
        (CentralElastic(alpha=0.5), 3, True),
        (SMA(), 10, False),
        (SMA(), 11, True),
        (EASGD(beta=1.0), 7, False),  # α = β / n: the pull is β whatever n
    ],
    ids=str,
)
def test_an_overshoot_is_warned_of_when_alpha_times_n_exceeds_one(
    rule: CentralElastic, num_replicas: int, overshoots: bool
) -> None:
    warning = rule.overshoot_warning(num_replicas)
    if not overshoots:
        assert warning is None
    else:
        assert warning is not None
        assert f"on {num_replicas} replicas" in warning
        assert f"alpha <= {1 / num_replicas:g}" in warning


def test_presets_carry_the_papers_defaults() -> None:
    sma = SMA()
    assert (sma.alpha, sma.central_momentum, sma.needs_snapshot, sma.resets_on_lr_drop) == (0.1, 0.9, True, True)
    easgd = EASGD()
    assert (easgd.beta, easgd.central_momentum, easgd.needs_snapshot, easgd.resets_on_lr_drop) == (
        0.9,
        0.0,
        True,
        False,
    )
    assert easgd.alpha_for(1) == pytest.approx(0.9)
    assert easgd.alpha_for(3) == pytest.approx(0.3)
    assert CentralElastic(alpha=0.2).alpha_for(7) == 0.2
    average = ElasticAverage()
    assert (average.alpha, average.momentum, average.needs_snapshot, average.resets_on_lr_drop) == (
        1.0,
        0.0,
        False,
        False,
    )
    assert "velocity" not in EASGD().init_state(tensor(0.0))
    assert "velocity" in SMA().init_state(tensor(0.0))


# ---------------------------------------------------------------------------------------------------------
# registry and validation


@pytest.mark.parametrize(
    ("name", "kwargs", "expected"),
    [
        ("elastic_average", {"alpha": 0.5, "momentum": 0.9}, ElasticAverage),
        ("sma", {"alpha": 0.2}, SMA),
        ("easgd", {"beta": 0.5}, EASGD),
    ],
)
def test_get_merge_rule_builds_the_named_rule(name: str, kwargs: dict[str, float], expected: type) -> None:
    rule = get_merge_rule(name, **kwargs)
    assert type(rule) is expected
    assert isinstance(rule, MergeRule)
    for key, value in kwargs.items():
        assert getattr(rule, key) == value


def test_as_merge_rule_builds_a_named_rule_and_passes_a_rule_object_through() -> None:
    assert type(as_merge_rule("sma")) is SMA
    rule = ElasticAverage(alpha=0.5)
    assert as_merge_rule(rule) is rule


def test_available_merge_rules_lists_every_name() -> None:
    assert available_merge_rules() == ["easgd", "elastic_average", "sma"]


def test_get_merge_rule_lists_valid_names_for_an_unknown_one() -> None:
    with pytest.raises(ValueError, match=r"Unknown merge rule 'smaa'.*'easgd', 'elastic_average', 'sma'"):
        get_merge_rule("smaa")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ElasticAverage(alpha=1.5), r"`alpha` must be in \[0, 1\].*hard reset"),
        (lambda: ElasticAverage(alpha=-0.1), r"`alpha` must be in \[0, 1\]"),
        (lambda: ElasticAverage(alpha=math.nan), r"`alpha` must be in \[0, 1\]"),
        (lambda: ElasticAverage(momentum=1.0), r"`momentum` must be in \[0, 1\).*0 to disable"),
        (lambda: ElasticAverage(momentum=-0.5), r"`momentum` must be in \[0, 1\)"),
        (lambda: CentralElastic(alpha=2.0), r"`alpha` must be in \[0, 1\].*Crossbow"),
        (lambda: CentralElastic(alpha=0.1, central_momentum=1.0), r"`central_momentum` must be in \[0, 1\)"),
        (lambda: SMA(alpha=-1.0), r"`alpha` must be in \[0, 1\]"),
        (lambda: EASGD(beta=0.0), r"`beta` must be in \(0, 1\].*0\.9"),
        (lambda: EASGD(beta=1.5), r"`beta` must be in \(0, 1\]"),
        (lambda: EASGD(beta=-0.5), r"`beta` must be in \(0, 1\]"),
        (lambda: get_merge_rule("sma", alpha=3.0), r"`alpha` must be in \[0, 1\]"),
    ],
)
def test_invalid_hyperparameters_raise_with_a_hint(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("rule", [ElasticAverage(), SMA(), EASGD()], ids=repr)
def test_merge_rejects_an_empty_replica_set(rule: MergeRule) -> None:
    local = tensor(1.0)
    with pytest.raises(ValueError, match="`num_replicas` must be >= 1"):
        rule.merge_(local, local, local, num_replicas=0, state=rule.init_state(local))


def test_easgd_accepts_the_full_coupling():
    rule = EASGD(beta=1.0)  # β in (0, 1]: 1 included
    assert rule.alpha_for(4) == 0.25
