"""Rebuilding the user's DataLoader: every option kept, unsupported loaders refused with the fix."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import RegressionData
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
)

from lightning_aesgd.engine import loading
from lightning_aesgd.engine.loading import (
    IdleBatch,
    LoaderClock,
    PlannedDataLoader,
    TimedLoading,
    TrainLoaderFacts,
    build_planned_loader,
    check_sample_costs,
    check_step_fits,
    check_step_options,
    inspect_train_loader,
    is_idle,
    prefetch_depth,
    resolve_sample_costs,
)
from lightning_aesgd.engine.sampler import PlanBook, StepIndices


def _collate(samples):
    return torch.stack([s[0] for s in samples])


def _init_worker(worker_id: int) -> None:
    return None


def _build(loader: DataLoader, **kwargs) -> PlannedDataLoader:
    facts = inspect_train_loader(loader)
    options = {"step_batch_size": facts.batch_size * 2, **kwargs}
    return build_planned_loader(loader, facts, num_replicas=2, rank=1, plan_book=PlanBook([5, 3]), **options)


def test_options_of_the_original_loader_are_kept():
    generator = torch.Generator()
    loader = DataLoader(
        RegressionData(40),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        collate_fn=_collate,
        pin_memory=False,
        timeout=30,
        worker_init_fn=_init_worker,
        generator=generator,
        prefetch_factor=3,
        persistent_workers=True,
    )
    rebuilt = _build(loader)
    for name in ("num_workers", "timeout", "worker_init_fn", "generator", "prefetch_factor", "persistent_workers"):
        assert getattr(rebuilt, name) is getattr(loader, name)
    # The user's dataset and collate function run together, timed, in the loader's workers.
    assert rebuilt.dataset.dataset is loader.dataset
    assert rebuilt.dataset.collate is loader.collate_fn
    assert rebuilt.batch_sampler.step_batch_size == 8  # batch_size × replicas by default
    assert rebuilt.batch_sampler.sampler.shuffle
    batches = list(rebuilt)
    assert [len(b) for b in batches] == [3] * 5  # rank 1 takes 3 of every 8 indices
    assert prefetch_depth(rebuilt) == 2 * 3 + 1
    # Every batch's production time reached the main process, keyed by its step.
    assert all(rebuilt.loader_clock.read(step) > 0 for step in range(5))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_loader_out_of_order_is_put_in_order_with_a_warning_on_rank_zero(rank, recwarn):
    # Out of order, a replica trained the next step's samples with this step's loss weight (the step's record).
    loader = DataLoader(RegressionData(40), batch_size=4, num_workers=1, in_order=False)
    facts = inspect_train_loader(loader)
    rebuilt = build_planned_loader(
        loader, facts, num_replicas=2, rank=rank, plan_book=PlanBook([5, 3]), step_batch_size=8
    )
    assert rebuilt.in_order is True
    said = [str(warning.message) for warning in recwarn if "in_order=False" in str(warning.message)]
    assert said == ([loading.IN_ORDER_WARNING] if rank == 0 else [])


@pytest.mark.timeout(120)
def test_loader_times_reach_the_replica_from_spawned_workers():
    # A spawned worker gets the clock by pickling: its ring must still be the replica's shared memory.
    loader = DataLoader(RegressionData(16), batch_size=4, num_workers=1, multiprocessing_context="spawn")
    rebuilt = _build(loader)
    assert len(list(rebuilt)) == 2  # steps of 8 samples, this replica's 3 of each
    assert all(rebuilt.loader_clock.read(step) > 0 for step in range(2))


def test_rebuilt_loader_state_round_trips():
    rebuilt = _build(DataLoader(RegressionData(40), batch_size=4))
    assert not rebuilt.batch_sampler.sampler.shuffle
    rebuilt.load_state_dict({"epoch": 3, "steps_done": 2})
    assert rebuilt.batch_sampler.epoch == 3
    assert len(list(rebuilt)) == 3  # 5 steps per epoch, 2 already done


def test_explicit_step_batch_size_overrides_the_default():
    rebuilt = _build(DataLoader(RegressionData(40), batch_size=4), step_batch_size=16)
    assert len(rebuilt) == 3


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


class _NoLength(torch.utils.data.Dataset):
    def __getitem__(self, index):
        return index


@pytest.mark.parametrize(
    ("loader", "hint"),
    [
        (DataLoader(_Stream(), batch_size=2), "map-style"),
        (DataLoader(_NoLength(), batch_size=2, sampler=range(4)), "__len__"),
        (DataLoader(RegressionData(8), batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8)), "shuffle=True"),
        (DataLoader(RegressionData(8), batch_size=None), "batch_size"),
    ],
)
def test_unsupported_loaders_are_refused_with_the_fix(loader, hint):
    with pytest.raises(TypeError, match=hint):
        _build(loader)


def test_loader_time_is_divided_among_parallel_workers_and_read_once(monkeypatch):
    ticks = iter(range(0, 100, 2))  # every clock reading is 2 s after the previous: each batch takes 2 s
    monkeypatch.setattr(loading.time, "perf_counter", lambda: float(next(ticks)))
    clock, single = LoaderClock(), LoaderClock()
    TimedLoading(list(range(8)), lambda samples: samples, clock, workers=4).__getitems__(StepIndices([0, 1], 3))
    TimedLoading(list(range(8)), lambda samples: samples, single, workers=0).__getitems__(StepIndices([0, 1], 3))
    assert (clock.read(3), single.read(3)) == (0.5, 2.0)
    assert clock.read(3) == 0.0  # read once: a later step with the same slot never sees a stale time


def test_state_set_on_the_worker_dataset_reaches_the_users_dataset():
    class Data:
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return self.handle + index

    data = Data()
    timed = TimedLoading(data, list, LoaderClock())
    timed.handle = 10  # what a worker_init_fn does with get_worker_info().dataset
    assert data.handle == 10
    assert timed[1] == 11


def test_a_users_sampler_inside_lightnings_wrapper_is_refused_not_replaced():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import WeightedRandomSampler

    weighted = WeightedRandomSampler([0.0] * 20 + [1.0] * 20, num_samples=40)
    loader = DataLoader(RegressionData(40), batch_size=4, sampler=DistributedSamplerWrapper(weighted, 2, 0))
    with pytest.raises(TypeError, match=r"cannot follow the sampler WeightedRandomSampler.*HINT"):
        inspect_train_loader(loader)


@pytest.mark.parametrize(("name", "value"), [("step_batch_size", 0), ("step_batch_size", 2.0), ("plan_lag", True)])
def test_step_options_must_be_whole_numbers(name, value):
    options = {"step_batch_size": None, "plan_lag": None, name: value}
    with pytest.raises(ValueError, match=rf"`{name}` must be a whole number.*HINT"):
        check_step_options(**options)


def test_a_drop_last_loader_too_small_for_one_step_names_the_options_to_change():
    # Found by tests/test_fuzz.py: the sampler's error named neither drop_last nor the batch sizes.
    check_step_fits(8, 8, drop_last=True)
    check_step_fits(3, 8, drop_last=False)
    with pytest.raises(ValueError, match=r"drop_last=True.*3 samples.*one step of 8.*HINT: set drop_last=False"):
        check_step_fits(3, 8, drop_last=True)
    loader = DataLoader(RegressionData(3), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="HINT"):
        _build(loader)


def test_sample_costs_come_from_the_dataset_or_a_function():
    data = RegressionData(10)
    torch.testing.assert_close(resolve_sample_costs("dataset", data), data.sample_costs)
    torch.testing.assert_close(
        resolve_sample_costs(lambda d: [2.0] * len(d), data), torch.full((10,), 2.0, dtype=torch.float64)
    )
    assert resolve_sample_costs(None, data) is None
    with pytest.raises(TypeError, match="sample_costs"):
        resolve_sample_costs("dataset", list(range(3)))
    with pytest.raises(ValueError, match="non-negative"):
        resolve_sample_costs(lambda d: [-1.0] * len(d), data)


def test_auto_sample_costs_use_the_dataset_costs_where_present():
    data = RegressionData(10)
    torch.testing.assert_close(resolve_sample_costs("auto", data), data.sample_costs)
    assert resolve_sample_costs("auto", list(range(3))) is None


def test_sample_costs_are_checked_at_construction_and_against_the_dataset():
    for spec in ("bogus", 1.0):
        with pytest.raises(ValueError, match=r"Unknown sample_costs.*HINT"):
            check_sample_costs(spec)
    with pytest.raises(ValueError, match=r"shape \(1,\) for a dataset of 10 samples.*HINT"):
        resolve_sample_costs(lambda dataset: [1.0], RegressionData(10))


def test_the_loader_clock_remembers_1024_steps_and_then_reuses_their_slots():
    clock = LoaderClock()
    clock.record(1024 + 3, 2.0)  # a ring of 1024: step 1027 takes step 3's slot
    assert clock.read(3) == 2.0
    small = LoaderClock(slots=4)
    small.record(5, 1.5)
    assert (small.read(5), small.read(1)) == (1.5, 0.0)  # the slot is shared and cleared by the first read


def test_an_idle_batch_is_empty_and_shows_its_name():
    assert len(IdleBatch()) == 0
    assert repr(IdleBatch()) == "IdleBatch()"


def test_only_a_lone_idle_batch_one_level_deep_in_a_dict_list_or_tuple_is_idle():
    assert is_idle([IdleBatch()])
    assert is_idle((IdleBatch(),))
    assert not is_idle([IdleBatch(), IdleBatch()])
    assert not is_idle({"main": IdleBatch(), "extra": torch.zeros(1)})
    assert not is_idle([[IdleBatch()]])  # deeper than Lightning puts a loader's batch
    assert not is_idle({IdleBatch()})  # a set is not a container of loaders' batches
    assert not is_idle(None)
    assert not is_idle(torch.zeros(1))


def test_a_replica_left_out_of_a_step_gets_an_idle_batch_without_fetching_or_collating():
    fetched = []

    class Data:
        def __len__(self):
            return 4

        def __getitem__(self, index):
            fetched.append(index)
            return index

    def collate(samples):
        raise AssertionError("collated an empty batch")

    clock = LoaderClock()
    clock.record(2, 1.0)
    got = TimedLoading(Data(), collate, clock).__getitems__(StepIndices([], 2))
    assert len(got) == 1
    assert isinstance(got[0], IdleBatch)
    assert fetched == []
    assert clock.read(2) == 1.0  # no time recorded over the step's earlier one


def test_a_dataset_that_fetches_whole_batches_is_asked_once_per_batch():
    asked = []

    class Data:
        def __len__(self):
            return 8

        def __getitem__(self, index):
            raise AssertionError("fetched one sample at a time")

        def __getitems__(self, indices):
            asked.append(list(indices))
            return [10 * i for i in indices]

    timed = TimedLoading(Data(), sum, LoaderClock())
    assert timed.__getitems__(StepIndices([1, 2, 5], 0)) == [80]
    assert asked == [[1, 2, 5]]


def test_the_timed_wrapper_reads_the_users_dataset_and_keeps_its_own_fields():
    data = RegressionData(6)
    timed = TimedLoading(data, list, LoaderClock(), workers=2)
    assert len(timed) == 6
    assert timed.sample_costs is data.sample_costs
    timed.workers = 3  # the wrapper's own field stays on the wrapper
    assert timed.workers == 3
    assert not hasattr(data, "workers")
    copy = pickle.loads(pickle.dumps(timed))  # how a spawned worker gets it
    assert (len(copy), copy.workers) == (6, 3)
    torch.testing.assert_close(copy[2][0], data[2][0])


def test_the_rebuilt_loaders_state_is_its_samplers_position():
    rebuilt = _build(DataLoader(RegressionData(40), batch_size=4))
    assert rebuilt.state_dict() == {"epoch": 0, "steps_done": 0, "step_batch_size": 8}
    rebuilt.load_state_dict({"epoch": 3, "steps_done": 2})
    list(rebuilt)
    assert rebuilt.state_dict() == rebuilt.batch_sampler.state_dict()
    assert rebuilt.state_dict()["epoch"] == 3


def test_step_options_of_one_or_more_or_none_pass():
    check_step_options(None, None)
    check_step_options(1, 1)
    check_step_options(4, 2)


def test_one_worker_keeps_its_prefetch_factor_and_the_depth_counts_the_fetchers_batch():
    rebuilt = _build(DataLoader(RegressionData(40), batch_size=4, num_workers=1, prefetch_factor=4))
    assert rebuilt.prefetch_factor == 4
    assert prefetch_depth(rebuilt) == 1 * 4 + 1
    assert prefetch_depth(_build(DataLoader(RegressionData(40), batch_size=4))) == 1  # only the fetcher's batch


def test_a_loader_already_in_order_is_rebuilt_without_a_warning(recwarn):
    loader = DataLoader(RegressionData(40), batch_size=4, num_workers=1)
    facts = inspect_train_loader(loader)
    rebuilt = build_planned_loader(loader, facts, num_replicas=2, rank=0, plan_book=PlanBook([5, 3]), step_batch_size=8)
    assert rebuilt.in_order is True
    assert [str(warning.message) for warning in recwarn if "in_order" in str(warning.message)] == []


def test_the_out_of_order_warning_points_at_the_line_that_built_the_loader():
    loader = DataLoader(RegressionData(40), batch_size=4, num_workers=1, in_order=False)
    facts = inspect_train_loader(loader)
    with pytest.warns(UserWarning, match="in_order=False") as record:
        build_planned_loader(loader, facts, num_replicas=2, rank=0, plan_book=PlanBook([5, 3]), step_batch_size=8)
    assert [warning.filename for warning in record] == [__file__]


@pytest.mark.parametrize(("shuffle", "seed"), [(True, 7), (False, 0)])
def test_lightnings_distributed_sampler_is_read_as_its_shuffle_and_seed(shuffle, seed):
    data = RegressionData(40)
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=shuffle, seed=seed)
    facts = inspect_train_loader(DataLoader(data, batch_size=1, sampler=sampler))
    assert facts == TrainLoaderFacts(40, 1, shuffle, seed)


def test_a_shuffled_loader_takes_lightnings_global_seed_and_a_sequential_one_seed_zero(monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert inspect_train_loader(DataLoader(RegressionData(40), batch_size=4, shuffle=True)).seed == 0
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert inspect_train_loader(DataLoader(RegressionData(40), batch_size=4, shuffle=True)).seed == 7
    facts = inspect_train_loader(DataLoader(RegressionData(40), batch_size=4))
    assert facts == TrainLoaderFacts(40, 4, False, 0)


def test_a_random_sampler_of_another_length_than_the_dataset_is_refused():
    loader = DataLoader(RegressionData(16), batch_size=2, sampler=RandomSampler(range(8)))
    with pytest.raises(TypeError, match=r"RandomSampler draws 8 indices of a dataset of 16 samples.*HINT"):
        inspect_train_loader(loader)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_users_plain_batch_sampler_is_read_as_its_batch_size_and_order(shuffle):
    data = RegressionData(10)
    order = RandomSampler(data) if shuffle else SequentialSampler(data)
    facts = inspect_train_loader(DataLoader(data, batch_sampler=BatchSampler(order, batch_size=3, drop_last=False)))
    assert (facts.dataset_size, facts.batch_size, facts.shuffle) == (10, 3, shuffle)
    dropping = DataLoader(data, batch_sampler=BatchSampler(order, batch_size=3, drop_last=True))
    with pytest.raises(TypeError, match=r"drop_last=True.*HINT: pass batch_size=3"):
        inspect_train_loader(dropping)


def test_zero_sample_costs_are_allowed_and_infinite_ones_refused():
    data = RegressionData(4)
    torch.testing.assert_close(
        resolve_sample_costs(lambda d: [0.0, 0.5, 0.0, 2.0], data),
        torch.tensor([0.0, 0.5, 0.0, 2.0], dtype=torch.float64),
    )
    with pytest.raises(ValueError, match="finite"):
        resolve_sample_costs(lambda d: [1.0, float("inf"), 1.0, 1.0], data)


def test_an_unknown_sample_costs_option_is_refused_when_resolved_too():
    with pytest.raises(ValueError, match=r"Unknown sample_costs 'bogus'.*HINT"):
        resolve_sample_costs("bogus", RegressionData(4))


def test_indices_without_a_step_are_fetched_and_collated_but_not_timed():
    clock = LoaderClock()
    assert TimedLoading(list(range(10, 20)), sum, clock).__getitems__([1, 2]) == [23]
    assert clock.seconds.count_nonzero() == 0
