"""The merge machinery of one replica against a fake communicator with scripted peers (no process group)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import FakeCommunicator
from torch import nn

from lightning_aesgd.core.merge import EASGD, SMA, ElasticAverage
from lightning_aesgd.engine.averager import (
    ElasticAverager,
    MergeSettings,
    MomentLayoutError,
    _check_same_moment_count,
)
from lightning_aesgd.engine.comm import LocalCommunicator, WeightedAllReduce


def _model(value: float) -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        for tensor in [*model.parameters(), *[b for b in model.buffers() if b.is_floating_point()]]:
            tensor.fill_(value)
    return model


def _peer(value: float, weight: float):
    """Peers that together contribute one replica holding `value` everywhere with merge weight `weight`."""

    def peers_sum(bucket: torch.Tensor) -> torch.Tensor:
        other = torch.full_like(bucket, value * weight)
        other[-1] = weight
        return other

    return FakeCommunicator(world_size=2, peers_sum=peers_sum)


def test_weighted_mean_uses_one_all_reduce_per_dtype_and_closed_form_weights():
    comm = _peer(value=4.0, weight=3.0)
    means, rows = WeightedAllReduce(comm)([torch.full((3,), 1.0), torch.full((2,), 1.0)], 1.0)
    assert comm.calls == ["all_reduce_sum_"]
    assert rows == []
    for mean in means:
        torch.testing.assert_close(mean, torch.full_like(mean, (1.0 * 1 + 4.0 * 3) / 4))


def test_report_rows_travel_in_the_same_all_reduce_as_the_model():
    # Replica 1 of 3; the peers hold 4.0 with weight 3 in all and report rows [7, 8] and [9, 10] in slots 0 and 2.
    def peers_sum(bucket: torch.Tensor) -> torch.Tensor:
        other = torch.zeros_like(bucket)
        other[:5] = 4.0 * 3.0
        other[5] = 3.0
        other[6:8] = torch.tensor([7.0, 8.0])
        other[10:12] = torch.tensor([9.0, 10.0])
        return other

    comm = FakeCommunicator(world_size=3, rank=1, peers_sum=peers_sum)
    means, rows = WeightedAllReduce(comm)([torch.full((3,), 1.0), torch.full((2,), 1.0)], 1.0, row=[5.0, 6.0])
    assert comm.calls == ["all_reduce_sum_"]
    assert rows == [[7.0, 8.0], [5.0, 6.0], [9.0, 10.0]]
    for mean in means:
        torch.testing.assert_close(mean, torch.full_like(mean, (1.0 + 4.0 * 3) / 4))


def test_hard_average_resets_parameters_and_buffers_to_the_weighted_mean():
    model = _model(1.0)
    averager = ElasticAverager(
        model, _peer(value=3.0, weight=1.0), MergeSettings(ElasticAverage(alpha=1.0), merge_buffers=True)
    )
    averager.merge(weight=1.0)
    for tensor in [*model.parameters(), model[1].running_mean, model[1].running_var]:
        torch.testing.assert_close(tensor, torch.full_like(tensor, 2.0))
    assert model[1].num_batches_tracked.item() == 0  # integer counters stay local, out of the bucket
    assert averager.merges == 1


def test_local_buffers_are_left_alone_when_not_merged():
    model = _model(1.0)
    ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage(), merge_buffers=False)).merge(weight=1.0)
    torch.testing.assert_close(model[1].running_mean, torch.ones(2))
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), 2.0))


def test_a_buffer_assigned_anew_is_merged_in_its_new_tensor():
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage(alpha=1.0), merge_buffers=True))
    model[1].running_mean = torch.full((2,), 5.0)  # `self.ema = ...`: a new tensor; the old one keeps 1.0
    averager.merge(weight=1.0)
    torch.testing.assert_close(model[1].running_mean, torch.full((2,), 4.0))  # (5 + 3) / 2, not the old tensor's


def test_buffers_that_change_shape_are_named_in_a_warning_and_merges_go_on_without_them():
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage(), merge_buffers=True))
    model[1].running_mean = torch.zeros(3)  # a replica raising here would leave its peers waiting in the merge
    with pytest.warns(UserWarning, match="HINT: register every buffer before the fit"):
        averager.merge(weight=1.0)
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), 2.0))  # the parameters still merge


@pytest.mark.parametrize("change", ["deleted", "set to None"])
def test_a_buffer_deleted_or_set_to_none_is_named_in_a_warning_and_merges_go_on_without_it(change):
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage(), merge_buffers=True))
    if change == "deleted":
        del model[1].running_var  # a KeyError here would leave the peers waiting in the merge's collective
    else:
        model[1].running_var = None
    with pytest.warns(UserWarning, match="HINT: register every buffer before the fit"):
        averager.merge(weight=1.0)
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), 2.0))  # the parameters still merge


def test_evaluation_and_the_end_of_fit_see_a_buffer_assigned_anew_after_the_last_merge():
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage(alpha=1.0), merge_buffers=True))
    model[1].running_mean = torch.full((2,), 5.0)
    averager.swap_in_global_model()
    torch.testing.assert_close(model[1].running_mean, torch.full((2,), 4.0))
    averager.swap_out()
    torch.testing.assert_close(model[1].running_mean, torch.full((2,), 5.0))
    averager.adopt_global_model()
    torch.testing.assert_close(model[1].running_mean, torch.full((2,), 4.0))


def test_parameters_unfrozen_after_the_start_are_named_in_a_warning_once():
    model = _model(1.0)
    model[0].bias.requires_grad_(False)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage()))
    model[0].bias.requires_grad_(True)  # BackboneFinetuning's unfreezing
    with pytest.warns(UserWarning, match=r"became trainable.*HINT: make them trainable from the start"):
        averager.merge(weight=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        averager.merge(weight=1.0)


def test_elastic_pull_moves_a_fraction_alpha_towards_the_mean():
    model = _model(1.0)
    ElasticAverager(model, _peer(5.0, 1.0), MergeSettings(ElasticAverage(alpha=0.25))).merge(weight=1.0)
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), 1.0 + 0.25 * (3.0 - 1.0)))


def test_schedule_merges_every_step_in_warmup_then_every_period():
    averager = ElasticAverager(
        _model(0.0), LocalCommunicator(), MergeSettings(ElasticAverage(), period=3, warmup_steps=2)
    )
    due = [averager.after_local_step(num_samples=4) for _ in range(9)]
    assert due == [True, True, True, False, False, True, False, False, True]


def test_merge_weight_follows_the_merge_weights_and_resets_after_a_merge():
    averager = ElasticAverager(
        _model(0.0), LocalCommunicator(), MergeSettings(ElasticAverage(), weights="samples", period=5)
    )
    for samples in (3, 5):
        averager.after_local_step(num_samples=samples)
    assert averager.own_weight() == 8
    averager.merge(averager.own_weight())
    assert averager.samples_since_merge == 0
    assert averager.own_weight() == 8  # no work since: the last weight stands, e.g. for evaluation


@pytest.mark.parametrize("weights", ["samples", "updates", "uniform"])
@pytest.mark.parametrize("skipped", [(), (1,), (0, 2), (0, 1, 2)], ids=["none", "one", "two", "all"])
def test_the_weight_less_the_devices_skipped_steps_is_the_weight_after_taking_them_back(weights, skipped):
    samples = [4.0, 6.0, 8.0]  # three steps since the last merge; `skipped` the GradScaler skipped

    def averager() -> ElasticAverager:
        made = ElasticAverager(_model(1.0), LocalCommunicator(), MergeSettings(ElasticAverage(), weights=weights))
        for num_samples in samples:
            made.after_local_step(num_samples)
        return made

    on_device = averager()
    flags = torch.tensor([float(step in skipped) for step in range(3)], dtype=torch.float64)
    weight = on_device.own_weight_less((flags * torch.tensor(samples, dtype=torch.float64)).sum(), flags.sum())
    on_host = averager()
    for step in skipped:
        on_host.take_back_step(samples[step])
    assert float(weight) == on_host.own_weight()


def test_swap_in_global_model_and_back_restores_the_replica_exactly():
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage(alpha=0.5)))
    before = [t.clone() for t in model.state_dict().values()]
    averager.swap_in_global_model()
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), 2.0))
    params, _ = averager.local_model()
    torch.testing.assert_close(params, torch.ones_like(params))
    averager.swap_out()
    for tensor, saved in zip(model.state_dict().values(), before, strict=True):
        torch.testing.assert_close(tensor, saved)


def test_sma_corrections_use_the_pre_step_snapshot():
    model = _model(0.0)
    rule = SMA(alpha=0.1, central_momentum=0.0)
    averager = ElasticAverager(model, _peer(1.0, 1.0), MergeSettings(rule, weights="uniform"))
    averager.before_local_step()  # snapshot x̂ = 0
    with torch.no_grad():
        model[0].weight.fill_(-1.0)  # the local step moves the replica
    assert averager.after_local_step(num_samples=1)
    averager.merge(weight=1.0)
    # x ← x − α(x̂ − z) = −1 − 0.1·(0 − 0); z ← z + α·n·(mean(x̂) − z) = 0 + 0.1·2·0.5
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), -1.0))
    torch.testing.assert_close(averager.global_model()[0][:4], torch.full((4,), 0.1))


@pytest.mark.parametrize("mode", ["keep", "reset", "average"])
def test_optimizer_state_modes(mode):
    model = _model(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
    momentum = optimizer.state[model[0].weight]["momentum_buffer"].clone()
    # The peer contributes 0 with weight 0; it holds as many moments as this replica (the int64 count check).
    comm = FakeCommunicator(world_size=2, peers_sum=lambda t: t.clone() if t.dtype == torch.int64 else 0 * t)
    averager = ElasticAverager(model, comm, MergeSettings(ElasticAverage(), optimizer_state=mode))
    averager.merge(weight=1.0, optimizer=optimizer)
    if mode == "reset":
        assert not optimizer.state
    else:
        torch.testing.assert_close(optimizer.state[model[0].weight]["momentum_buffer"], momentum)


def test_optimizer_moments_are_averaged_with_the_merge_weights():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    averager = ElasticAverager(
        model, FakeCommunicator(world_size=2), MergeSettings(ElasticAverage(), optimizer_state="average")
    )
    buffer = optimizer.state[model.weight]["momentum_buffer"]
    expected = buffer.clone()  # an identical peer: the average is unchanged, and it went through the bucket
    averager.merge(weight=1.0, optimizer=optimizer)
    torch.testing.assert_close(optimizer.state[model.weight]["momentum_buffer"], expected)


def test_a_total_weight_of_zero_is_an_error():
    averager = ElasticAverager(
        _model(1.0), FakeCommunicator(world_size=2, peers_sum=torch.zeros_like), MergeSettings(ElasticAverage())
    )
    with pytest.raises(ValueError, match="at least one must be positive"):
        averager.merge(weight=0.0)


def test_shared_and_local_state_round_trip():
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage(momentum=0.5), period=2))
    averager.after_local_step(num_samples=4)
    averager.merge(weight=4.0)
    averager.after_local_step(num_samples=2)
    shared, local = averager.shared_state(), averager.local_state()
    fresh = ElasticAverager(_model(0.0), _peer(3.0, 1.0), MergeSettings(ElasticAverage(momentum=0.5), period=2))
    fresh.load_shared_state(shared)
    fresh.load_local_state(local)
    assert fresh.shared_state()["local_steps"] == 2
    assert fresh.own_weight() == 2
    for name, tensor in shared["rule_state"].items():
        torch.testing.assert_close(fresh.rule_state[name], tensor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_report_rows_of_a_half_precision_model_keep_large_counts(dtype):
    comm = FakeCommunicator(world_size=1, peers_sum=lambda bucket: torch.zeros_like(bucket))
    means, rows = WeightedAllReduce(comm)([torch.ones(3, dtype=dtype)], 1.0, row=[70000.0, 257.0])
    assert rows == [[70000.0, 257.0]]  # float64, not the model's half precision
    assert comm.calls == ["all_reduce_sum_", "all_reduce_sum_"]
    assert means[0].dtype == dtype


@pytest.mark.parametrize("rule", [None, 1, object(), ElasticAverage], ids=["None", "int", "object", "class"])
def test_something_that_is_not_a_merge_rule_fails_when_the_settings_are_built(rule):
    # Found by tests/test_fuzz.py: these used to pass construction and fail with AttributeError when fit started.
    with pytest.raises(TypeError, match=r"`merge_rule` must be a MergeRule object.*HINT"):
        MergeSettings(rule)


def test_merge_buffers_must_be_a_switch():
    with pytest.raises(TypeError, match=r"`merge_buffers` is a switch.*HINT"):
        MergeSettings(ElasticAverage(), merge_buffers=None)


def test_sma_whose_pull_overshoots_the_mean_is_named_in_a_warning():
    with pytest.warns(UserWarning, match=r"α·n > 1.*alpha <= 0.25"):
        ElasticAverager(nn.Linear(2, 1), FakeCommunicator(world_size=4), MergeSettings(SMA(alpha=0.3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ElasticAverager(nn.Linear(2, 1), FakeCommunicator(world_size=4), MergeSettings(SMA(alpha=0.25)))


def test_averaging_moments_that_replicas_hold_for_different_parameters_fails_alike_on_every_rank():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # momentum for weight (2) and bias (1): 3 values here
    settings = MergeSettings(ElasticAverage(), optimizer_state="average")
    # The peer holds momentum for the weight only (its bias got no gradient): 2 values, sent as (2, −2).
    peer = FakeCommunicator(world_size=2, peers_max=lambda t: torch.tensor([2, -2]))
    with pytest.raises(MomentLayoutError, match=r"between 2 and 3.*HINT: use optimizer_state='keep'"):
        ElasticAverager(model, peer, settings).merge(weight=1.0, optimizer=optimizer)
    ElasticAverager(model, FakeCommunicator(world_size=2), settings).merge(weight=1.0, optimizer=optimizer)


def test_the_moment_count_check_is_exact_at_counts_whose_squares_overflow_64_bits():
    eight_replicas = FakeCommunicator(world_size=8)
    _check_same_moment_count(eight_replicas, 4_000_000_000)  # (4e9)² > 2⁶³: a sum of squares overflowed here
    one_fewer = FakeCommunicator(world_size=8, peers_max=lambda t: torch.tensor([4_000_000_000, -3_999_999_999]))
    with pytest.raises(MomentLayoutError, match="between 3999999999 and 4000000000"):
        _check_same_moment_count(one_fewer, 3_999_999_999)


def test_a_rule_that_never_pulls_is_named_in_a_warning_at_the_line_that_built_the_settings():
    with pytest.warns(UserWarning, match="never pulls the replicas together") as record:
        MergeSettings(ElasticAverage(alpha=0.0))
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MergeSettings(ElasticAverage(alpha=1.0))
        MergeSettings(EASGD(beta=1.0))


def test_an_unknown_optimizer_state_mode_fails_when_the_settings_are_built():
    with pytest.raises(ValueError, match=r"Unknown optimizer_state 'average_all'.*HINT"):
        MergeSettings(ElasticAverage(), optimizer_state="average_all")


def test_the_overshoot_warning_points_at_the_line_that_built_the_averager():
    with pytest.warns(UserWarning, match=r"α·n > 1") as record:
        ElasticAverager(nn.Linear(2, 1), FakeCommunicator(world_size=4), MergeSettings(SMA(alpha=0.3)))
    assert record[0].filename == __file__


def test_merges_warn_of_nothing_while_the_trainable_parameters_stay_as_they_were():
    model = _model(1.0)
    model[0].bias.requires_grad_(False)  # frozen from the start and still frozen: nothing changed
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        averager.merge(weight=1.0)
        averager.global_model()


def test_only_rank_zero_warns_of_parameters_that_became_trainable():
    model = _model(1.0)
    model[0].bias.requires_grad_(False)
    averager = ElasticAverager(model, FakeCommunicator(world_size=2, rank=1), MergeSettings(ElasticAverage()))
    model[0].bias.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        averager.merge(weight=1.0)


def test_an_elastic_average_merges_the_models_after_the_local_step():
    """The rule needs no snapshot: a `before_local_step` call keeps none, and the post-step models merge."""
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage(alpha=1.0)))
    averager.before_local_step()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(5.0)  # the local step moves the replica
    assert averager.after_local_step(num_samples=1)
    averager.merge(weight=1.0)
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), (5.0 + 3.0) / 2))


def test_the_updates_weight_counts_each_local_step_once():
    averager = ElasticAverager(
        _model(1.0), LocalCommunicator(), MergeSettings(ElasticAverage(), weights="updates", period=5)
    )
    for samples in (3, 5, 7):
        averager.after_local_step(num_samples=samples)
    assert averager.own_weight() == 3
    averager.take_back_step(num_samples=7)
    assert averager.own_weight() == 2


def test_a_skipped_merge_leaves_the_last_weight_until_new_work_is_done():
    averager = ElasticAverager(_model(1.0), LocalCommunicator(), MergeSettings(ElasticAverage(), period=5))
    averager.merge(weight=6.0)
    for _ in range(2):
        averager.after_local_step(num_samples=4)
        averager.take_back_step(num_samples=4)  # the GradScaler skipped the step
    assert averager.own_weight() == 0.0
    averager.skip_merge()
    assert averager.own_weight() == 6.0
    averager.after_local_step(num_samples=5)
    assert averager.own_weight() == 5


def test_the_weight_less_skipped_steps_is_the_last_weight_without_an_update_since_the_merge():
    averager = ElasticAverager(_model(1.0), LocalCommunicator(), MergeSettings(ElasticAverage()))
    averager.merge(weight=6.0)
    none_skipped = torch.zeros((), dtype=torch.float64)
    assert float(averager.own_weight_less(none_skipped, none_skipped)) == 6.0


def test_kept_optimizer_moments_stay_local_and_add_no_collective():
    model = _model(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
    momentum = optimizer.state[model[0].weight]["momentum_buffer"].clone()
    comm = _peer(value=3.0, weight=1.0)  # a peer whose moments differ
    ElasticAverager(model, comm, MergeSettings(ElasticAverage(), optimizer_state="keep")).merge(1.0, optimizer)
    torch.testing.assert_close(optimizer.state[model[0].weight]["momentum_buffer"], momentum)
    assert comm.calls == ["all_reduce_sum_"]


def test_averaged_optimizer_moments_take_the_weighted_mean_with_the_peers():
    model = _model(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
    momentum = optimizer.state[model[0].weight]["momentum_buffer"].clone()
    comm = _peer(value=3.0, weight=1.0)  # a peer holding 3.0 in every moment, as many as here
    ElasticAverager(model, comm, MergeSettings(ElasticAverage(), optimizer_state="average")).merge(1.0, optimizer)
    torch.testing.assert_close(optimizer.state[model[0].weight]["momentum_buffer"], (momentum + 3.0) / 2)


def test_swapped_in_tells_whether_the_module_holds_the_global_model():
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage()))
    assert not averager.swapped_in
    averager.swap_out()  # nothing swapped in: nothing to restore
    torch.testing.assert_close(model[0].weight, torch.ones(2, 2))
    averager.swap_in_global_model()
    assert averager.swapped_in
    averager.swap_out()
    assert not averager.swapped_in


def test_a_second_swap_in_keeps_the_replica_to_restore_and_makes_no_collective():
    model = _model(1.0)
    comm = _peer(3.0, 1.0)
    averager = ElasticAverager(model, comm, MergeSettings(ElasticAverage()))
    averager.swap_in_global_model()
    averager.swap_in_global_model()
    assert comm.calls == ["all_reduce_sum_"]
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), 2.0))
    averager.swap_out()
    torch.testing.assert_close(model[0].weight, torch.ones(2, 2))


def test_adopting_while_swapped_in_keeps_the_shown_global_model_without_another_collective():
    model = _model(1.0)
    comm = _peer(3.0, 1.0)
    averager = ElasticAverager(model, comm, MergeSettings(ElasticAverage()))
    averager.swap_in_global_model()
    averager.adopt_global_model()
    assert comm.calls == ["all_reduce_sum_"]
    assert not averager.swapped_in
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), 2.0))


def test_swap_out_gives_every_learner_its_buffers_back():
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage()), learners=2)
    averager.swap_in_global_model()
    torch.testing.assert_close(model[1].running_mean, torch.full((2,), 2.0))
    averager.swap_out()
    torch.testing.assert_close(model[1].running_mean, torch.ones(2, 2))  # a row per learner


def test_restore_from_writes_the_center_and_clears_the_optimizer_state():
    model = _model(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
    averager = ElasticAverager(model, LocalCommunicator(), MergeSettings(ElasticAverage()))
    center = torch.full((averager.params.numel,), 7.0)
    averager.restore_from(center, optimizer)
    assert not optimizer.state
    torch.testing.assert_close(averager.params.read(), center)
    averager.restore_from(center - 1.0, None)  # no optimizer: the parameters alone
    torch.testing.assert_close(averager.params.read(), center - 1.0)


@pytest.mark.parametrize("learners", [1, 2])
def test_adopting_the_global_model_drops_gradients_only_of_stacked_learners(learners):
    model = _model(1.0)
    averager = ElasticAverager(model, FakeCommunicator(world_size=1), MergeSettings(ElasticAverage()), learners)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    averager.adopt_global_model()
    assert (model[0].weight.grad is None) == (learners > 1)


@pytest.mark.parametrize("learners", [1, 2])
def test_one_model_shapes_name_the_stacked_parameters_only_with_several_learners(learners):
    model = _model(1.0)
    averager = ElasticAverager(model, FakeCommunicator(world_size=1), MergeSettings(ElasticAverage()), learners)
    one_model = [(2, 2), (2,), (2,), (2,)]  # the linear layer's weight and bias, the batch norm's
    expected = dict(zip(map(id, model.parameters()), one_model, strict=True)) if learners > 1 else {}
    assert averager.one_model_shapes() == expected


def test_unstack_leaves_one_model_the_mean_of_the_learners():
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage()), learners=2)
    with torch.no_grad():
        averager.params.live[0].add_(2.0)  # learner 0 holds 3.0, learner 1 holds 1.0
    averager.unstack()
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), 2.0))  # local: the peer is not asked
    torch.testing.assert_close(model[1].running_mean, torch.ones(2))


def test_unstack_keeps_a_global_model_shown_already():
    model = _model(1.0)
    averager = ElasticAverager(model, _peer(3.0, 1.0), MergeSettings(ElasticAverage()), learners=2)
    with torch.no_grad():
        averager.params.live[0].add_(2.0)  # the learners' mean is 2.0; with the peer's 3.0 the global model 2.5
    averager.swap_in_global_model()
    averager.unstack()
    torch.testing.assert_close(model[0].weight, torch.full((2, 2), 2.5))
