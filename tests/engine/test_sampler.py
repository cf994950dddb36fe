"""The plan-driven batch sampler: exact coverage, exact lengths, shared permutations, plan lag, resume."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from lightning_aesgd.engine.sampler import PlanBook, PlanLagError, PlannedBatchSampler, SharedPermutation


def _samplers(size, step_batch, sizes, *, costs=None, drop_last=False, shuffle=True):
    n = len(sizes)
    return [
        PlannedBatchSampler(
            size, step_batch, n, rank, PlanBook(sizes), shuffle=shuffle, seed=3, drop_last=drop_last, costs=costs
        )
        for rank in range(n)
    ]


def _epoch(samplers, epoch=0):
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 200),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    epoch=st.integers(0, 3),
)
def test_every_index_of_an_epoch_is_used_exactly_once_across_replicas(size, sizes, epoch):
    step_batch = sum(sizes)
    batches = _epoch(_samplers(size, step_batch, sizes), epoch)
    seen = sorted(index for rank_batches in batches for batch in rank_batches for index in batch)
    # A tail shorter than the replicas' floors (their plan, up to two samples) is padded by wrapping around (as
    # DistributedSampler pads).
    tail = size % step_batch
    floors = sum(min(size, 2) for size in sizes)
    padding = floors - tail if 0 < tail < floors else 0
    assert len(seen) == size + padding
    assert set(seen) == set(range(size))
    for rank_batches, sampler in zip(batches, _samplers(size, step_batch, sizes), strict=True):
        assert len(rank_batches) == len(sampler)  # every replica takes the same number of steps
        assert all(len(batch) >= 1 for batch in rank_batches)


def test_full_steps_follow_the_plan_and_the_tail_keeps_its_proportions():
    batches = _epoch(_samplers(56, 12, [6, 3, 2, 1]))
    assert [len(b) for b in batches[0]] == [6, 6, 6, 6, 3]
    assert [len(b[0]) for b in batches] == [6, 3, 2, 1]
    # The last 8 indices, split 6:3:2:1 as closely as can be ([4, 2, 1, 1]), but no replica planned two samples or
    # more takes one: BatchNorm cannot train on a batch of one.
    assert [len(b[-1]) for b in batches] == [3, 2, 2, 1]


def test_the_tail_keeps_min_batch_and_pads_to_it_where_it_is_too_short():
    # 400 samples in steps of 32 planned [28, 4]: the tail of 16 split 28:4 would give replica 1 two samples.
    samplers = [PlannedBatchSampler(400, 32, 2, rank, PlanBook([28, 4]), seed=3, min_batch=4) for rank in (0, 1)]
    batches = _epoch(samplers)
    assert [len(b[-1]) for b in batches] == [12, 4]
    assert sorted(i for rank in batches for batch in rank for i in batch) == list(range(400))
    # 390 samples: a tail of 6 for two replicas of min_batch 4 takes 2 more from the epoch's start, as
    # DistributedSampler pads.
    samplers = [PlannedBatchSampler(390, 32, 2, rank, PlanBook([28, 4]), seed=3, min_batch=4) for rank in (0, 1)]
    batches = _epoch(samplers)
    assert [len(b[-1]) for b in batches] == [4, 4]
    seen = sorted(i for rank in batches for batch in rank for i in batch)
    assert len(seen) == 392
    assert set(seen) == set(range(390))


def test_a_cost_aware_split_keeps_each_replicas_min_batch():
    costs = torch.ones(64)
    costs[:8] = 100.0  # expensive samples first: by cost alone, replica 0 would take a few of them only
    samplers = [
        PlannedBatchSampler(64, 16, 2, rank, PlanBook([8, 8]), shuffle=False, costs=costs, min_batch=[6, 1])
        for rank in (0, 1)
    ]
    first_step = [batches[0] for batches in _epoch(samplers)]
    assert len(first_step[0]) == 6, "replica 0 keeps its min_batch however costly its samples"
    assert sorted(first_step[0] + first_step[1]) == list(range(16))


def test_a_tail_shorter_than_the_floors_wraps_around():
    batches = _epoch(_samplers(50, 12, [6, 3, 2, 1]))  # a tail of 2: 5 more, so that no replica planned 2+ gets 1
    assert [len(b[-1]) for b in batches] == [2, 2, 2, 1]
    batches = _epoch(_samplers(35, 32, [16, 16]))  # a tail of 3: one more, as DistributedSampler would pad it
    assert [len(b[-1]) for b in batches] == [2, 2]


def test_a_dataset_smaller_than_the_floors_is_repeated_up_to_them():
    # One sample and a floor of 4: the only step repeats it, as DistributedSampler repeats a dataset smaller than
    # its replicas (the padding once took from the epoch's start only, too short here, and the split failed).
    (sampler,) = [PlannedBatchSampler(1, 16, 1, 0, PlanBook([16]), seed=3, min_batch=4)]
    assert list(sampler) == [[0, 0, 0, 0]]
    batches = _epoch(_samplers(3, 16, [8, 8]))
    assert [len(b[-1]) for b in batches] == [2, 2]
    assert sorted(batches[0][0] + batches[1][0]) in ([0, 0, 1, 2], [0, 1, 1, 2], [0, 1, 2, 2])


def test_drop_last_drops_the_incomplete_step():
    samplers = _samplers(50, 12, [6, 6], drop_last=True)
    assert len(samplers[0]) == 4
    assert sum(len(batch) for batch in _epoch(samplers)[0]) == 24


def test_permutation_equals_torch_distributed_sampler_for_the_same_seed_and_epoch():
    (sampler,) = _samplers(40, 40, [40])
    reference = DistributedSampler(range(40), num_replicas=1, rank=0, shuffle=True, seed=3)
    for epoch in (0, 5):
        sampler.set_epoch(epoch)
        reference.set_epoch(epoch)
        assert next(iter(sampler)) == list(reference)


def test_epochs_draw_different_orders_and_shuffle_false_keeps_dataset_order():
    (sampler,) = _samplers(30, 10, [10])
    first, second = _epoch([sampler], 0)[0], _epoch([sampler], 1)[0]
    assert first != second
    (ordered,) = _samplers(30, 10, [10], shuffle=False)
    assert [i for batch in _epoch([ordered])[0] for i in batch] == list(range(30))


def test_cost_aware_split_balances_cost_not_count():
    costs = torch.tensor([10.0 if i % 2 else 1.0 for i in range(40)])
    batches = _epoch(_samplers(40, 20, [1, 1], costs=costs, shuffle=False))
    for first, second in zip(batches[0], batches[1], strict=True):
        cost_first, cost_second = costs[first].sum(), costs[second].sum()
        assert abs(cost_first - cost_second) <= 10.0
        assert len(first) + len(second) == 20


def test_records_report_each_step_samples_and_cost():
    costs = torch.arange(20, dtype=torch.float64)
    (sampler,) = _samplers(20, 5, [5], costs=costs, shuffle=False)
    batches = list(sampler)
    record = sampler.pop_record(sampler.step_key(0, 2))
    assert record.num_samples == 5
    assert record.cost == pytest.approx(float(costs[batches[2]].sum()))
    with pytest.raises(RuntimeError, match="did not produce"):
        sampler.pop_record(sampler.step_key(0, 1))  # older records were dropped


def test_a_plan_applies_from_its_step_and_a_late_plan_is_refused():
    book = PlanBook([4, 4])
    sampler = PlannedBatchSampler(64, 8, 2, 0, book, shuffle=False)
    iterator = iter(sampler)
    assert [len(next(iterator)) for _ in range(2)] == [4, 4]
    book.schedule(3, [6, 2])
    assert [len(next(iterator)) for _ in range(3)] == [4, 6, 6]
    with pytest.raises(PlanLagError, match="plan_lag"):
        book.schedule(4, [2, 6])


def test_state_dict_resumes_mid_epoch_with_the_same_batches():
    (sampler,) = _samplers(40, 4, [4])
    sampler.set_epoch(2)
    batches = list(sampler)
    sampler.pop_record(sampler.step_key(2, 4))  # training ran step 4 of epoch 2
    state = sampler.state_dict()
    assert state == {"epoch": 2, "steps_done": 5, "step_batch_size": 4}

    (resumed,) = _samplers(40, 4, [4])
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # Lightning sets the epoch again when the restored epoch starts
    assert list(resumed) == batches[5:]
    resumed.set_epoch(3)
    assert len(list(resumed)) == 10  # the next epoch starts from its beginning


def test_resuming_an_epoch_under_way_with_other_step_sizes_fails_with_a_hint():
    (sampler,) = _samplers(40, 8, [4, 4])[:1]
    state = {"epoch": 1, "steps_done": 3, "step_batch_size": 4}
    with pytest.raises(ValueError, match="step_batch_size=4"):
        sampler.load_state_dict(state)
    sampler.load_state_dict({**state, "steps_done": 0})  # at an epoch boundary any size resumes exactly
    sampler.load_state_dict({"epoch": 1, "steps_done": 3})  # older checkpoints did not record the size


def test_a_step_the_sampler_never_produced_fails_with_a_hint():
    (sampler,) = _samplers(40, 4, [4])
    list(sampler)
    with pytest.raises(RuntimeError, match="HINT"):
        sampler.pop_record(sampler.step_key(1, 0))


def test_invalid_configurations_fail_with_a_hint():
    with pytest.raises(ValueError, match="batch_size"):
        PlannedBatchSampler(10, 2, 4, 0, PlanBook([1, 1, 0, 0]))
    with pytest.raises(ValueError, match="costs"):
        PlannedBatchSampler(10, 4, 2, 0, PlanBook([2, 2]), costs=torch.ones(3))


def test_a_plan_scheduled_ahead_leaves_the_steps_before_it_on_the_initial_plan():
    """A plan scheduled before any step is drawn takes effect at its step only; the book counts as revised."""
    book = PlanBook([4, 4])
    assert not book.revised
    book.schedule(2, [6, 2])
    assert book.revised
    assert [book.sizes_at(step) for step in range(4)] == [(4, 4), (4, 4), (6, 2), (6, 2)]
    assert book.latest == (6, 2)


def test_a_new_loader_may_be_given_a_plan_from_step_0_again():
    """After the tuner's rewind (forget_served), plans for the first steps are no longer refused as late."""
    book = PlanBook([4, 4])
    book.sizes_at(5)
    with pytest.raises(PlanLagError):
        book.schedule(0, [2, 6])
    book.forget_served()
    book.schedule(0, [2, 6])
    assert book.sizes_at(0) == (2, 6)


def test_default_seeds_draw_torch_distributed_samplers_order():
    """Without a seed, the shared permutation and the batch sampler draw DistributedSampler's default order."""
    reference = DistributedSampler(range(40), num_replicas=1, rank=0, shuffle=True)
    permutation = SharedPermutation(40)
    assert len(permutation) == 40
    assert list(permutation) == list(reference)
    (batch,) = PlannedBatchSampler(40, 40, 1, 0, PlanBook([40]))
    assert batch == list(reference)


def test_a_trainer_driven_sampler_draws_the_loops_epoch_not_the_one_it_is_handed():
    sampler = PlannedBatchSampler(40, 8, 1, 0, PlanBook([8]), seed=3)
    sampler.sampler.loop_epoch = lambda: 4
    sampler.set_epoch(5)
    assert sampler.epoch == 4
    assert sampler.step_key(sampler.epoch, 0) == 4 * len(sampler)


def test_drop_last_needs_one_full_step_of_samples():
    with pytest.raises(ValueError, match="drop_last"):
        PlannedBatchSampler(11, 12, 2, 0, PlanBook([6, 6]), drop_last=True)
    (sampler,) = _samplers(12, 12, [6, 6], drop_last=True)[:1]
    assert len(sampler) == 1
    assert [len(batch) for batch in sampler] == [6]


def test_a_fresh_sampler_has_completed_no_step():
    (sampler,) = _samplers(40, 4, [4])
    assert sampler.state_dict() == {"epoch": 0, "steps_done": 0, "step_batch_size": 4}


def test_resuming_one_step_into_an_epoch_with_other_step_sizes_fails():
    (sampler,) = _samplers(40, 8, [4, 4])[:1]
    with pytest.raises(ValueError, match="step_batch_size=4"):
        sampler.load_state_dict({"epoch": 1, "steps_done": 1, "step_batch_size": 4})


def test_the_records_of_a_short_last_step_count_its_apportioned_size_as_planned():
    """A full step records the plan's sizes; the tail of 8 split 6:3:2:1 records [3, 2, 2, 1] (its split)."""
    samplers = _samplers(56, 12, [6, 3, 2, 1])
    for rank, sampler in enumerate(samplers):
        list(sampler)
        full = sampler.pop_record(sampler.step_key(0, 3))
        tail = sampler.pop_record(sampler.step_key(0, 4))
        assert (full.planned, full.step_samples) == ([6, 3, 2, 1][rank], 12)
        assert (tail.planned, tail.num_samples, tail.step_samples) == ([3, 2, 2, 1][rank], [3, 2, 2, 1][rank], 8)
