"""The communication layer on 2 real gloo processes, with closed-form expected results."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import FakeCommunicator

from lightning_aesgd.engine import comm as comm_module
from lightning_aesgd.engine.comm import (
    LocalCommunicator,
    NoMergeWeightError,
    TorchCommunicator,
    WeightedAllReduce,
    completed,
    copy_from_host,
    default_communicator,
)
from lightning_aesgd.engine.stalls import roll_call_key

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

WORLD_SIZE = 2


def _join_gloo(rank: int, world_size: int, init_file: str) -> None:
    """Join a gloo process group of ``world_size`` through ``init_file``."""
    # A forked worker can hang in its first OpenMP kernel if the test process ran one before it forked (as
    # Lightning's forked replicas, one intra-op thread each).
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )


def _run_collectives(rank: int, world_size: int, init_file: str) -> None:
    _join_gloo(rank, world_size, init_file)
    try:
        comm = default_communicator(torch.device("cpu"))
        assert isinstance(comm, TorchCommunicator)
        assert (comm.rank, comm.world_size) == (rank, world_size)
        assert comm._host() is None  # a gloo world carries the host data itself
        assert comm_module._group_timeout(None, torch.device("cpu")) == timedelta(seconds=60)
        # gloo sums sparse tensors, and a plain backend name runs every device's collectives
        assert comm.sums_sparse(torch.device("cpu"))
        assert comm.sums_sparse(torch.device("cuda"))

        summed = torch.full((3,), float(rank + 1))
        comm.all_reduce_sum_(summed)
        torch.testing.assert_close(summed, torch.full((3,), 3.0))  # 1 + 2
        launched = torch.tensor([float(rank), 10.0])
        (result,) = comm.all_reduce_sum_async(launched).wait()
        torch.testing.assert_close(result, torch.tensor([1.0, 20.0]))
        torch.testing.assert_close(launched, torch.tensor([1.0, 20.0]))  # in place
        gathered = comm.all_gather(torch.full((2,), float(rank)))
        torch.testing.assert_close(torch.stack(gathered), torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
        assert comm.broadcast_object({"rank": rank}, src=1) == {"rank": 1}
        # Replica 0 is the default source and destination.
        assert comm.broadcast_object({"rank": rank}) == {"rank": 0}
        assert comm.gather_object(rank) == ([0, 1] if rank == 0 else None)
        tensor = torch.full((2,), float(rank + 7))
        comm.broadcast_(tensor)
        torch.testing.assert_close(tensor, torch.full((2,), 7.0))

        # Replica r holds θ = (r + 1)·1 with weight r + 1: mean = Σ(r+1)² / Σ(r+1).
        weight = float(rank + 1)
        flats = [torch.full((5,), weight), torch.full((3,), -weight), torch.full((2,), weight, dtype=torch.float64)]
        # Each replica's report row rides in the float64 bucket (the widest), in its own slot.
        means, rows = WeightedAllReduce(comm)(flats, weight, row=[rank, 10.0 * rank + 0.125])
        expected = sum((r + 1) ** 2 for r in range(world_size)) / sum(r + 1 for r in range(world_size))
        assert rows == [[float(r), 10.0 * r + 0.125] for r in range(world_size)]
        torch.testing.assert_close(means[0], torch.full((5,), expected))
        torch.testing.assert_close(means[1], torch.full((3,), -expected))
        assert means[2].dtype == torch.float64
        torch.testing.assert_close(means[2], torch.full((2,), expected, dtype=torch.float64))

        tensor = torch.full((4,), float(rank))
        comm.broadcast_(tensor, src=1)
        torch.testing.assert_close(tensor, torch.ones(4))

        assert comm.all_gather_object({"rank": rank}) == [{"rank": r} for r in range(world_size)]
        _check_host_collectives(comm, rank, world_size)
        # As over NCCL: a gloo host group of its own, made at the first host collective, waiting as long as the group.
        comm_module._is_gloo = lambda group: False
        beside = TorchCommunicator(torch.device("cpu"))
        _check_host_collectives(beside, rank, world_size)
        assert beside._host() is not None
        assert beside._host() is beside._host()  # made once
        assert beside._host()._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=60)
        with pytest.raises(ValueError, match="HINT: pass host_group="):  # a subgroup cannot make one alone
            TorchCommunicator(torch.device("cpu"), group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _check_host_collectives(comm: TorchCommunicator, rank: int, world_size: int) -> None:
    gathered = comm.gather_object({"rank": rank}, dst=1)
    assert gathered == ([{"rank": r} for r in range(world_size)] if rank == 1 else None)
    counts = torch.tensor([rank + 1, 10], dtype=torch.int64)
    comm.host_all_reduce_sum_(counts)
    assert counts.tolist() == [sum(range(1, world_size + 1)), 10 * world_size]
    extremes = torch.tensor([rank + 1, -(rank + 1)], dtype=torch.int64)
    comm.host_all_reduce_max_(extremes)
    assert extremes.tolist() == [world_size, -1]


def _use_subgroups(rank: int, world_size: int, init_file: str) -> None:
    _join_gloo(rank, world_size, init_file)
    try:
        world = TorchCommunicator(torch.device("cpu"))
        pair = dist.new_group([0, 1])
        both = TorchCommunicator(torch.device("cpu"), group=pair)  # a gloo subgroup carries its own host data
        assert both._host() is pair
        assert both.gather_object(rank, dst=1) == ([0, 1] if rank == 1 else None)
        # A backend named per device type: gloo on the CPU, none of this group's on CUDA.
        split = dist.new_group([0, 1], backend="cpu:gloo")
        per_device = TorchCommunicator(torch.device("cpu"), group=split, host_group=split)
        assert per_device.sums_sparse(torch.device("cpu"))
        assert not per_device.sums_sparse(torch.device("cuda"))

        world_key = roll_call_key("0")
        _check_subgroup_of_rank_1(world.subgroup([1]), rank, world_size)
        assert roll_call_key("0") == world_key  # a subgroup does not begin a new namespace of the world's roll calls
        # As over NCCL: the subgroup's host data travels on a gloo group of its own, closed with it.
        comm_module._is_gloo = lambda group: False
        _check_subgroup_of_rank_1(world.subgroup([1]), rank, world_size)

        world.close()  # the world's group stays
        total = torch.ones(1)
        world.all_reduce_sum_(total)
        assert total.item() == world_size
    finally:
        dist.destroy_process_group()


def _check_subgroup_of_rank_1(sub: TorchCommunicator | None, rank: int, world_size: int) -> None:
    if rank == 0:
        assert sub is None
        return
    assert sub is not None
    assert (sub.rank, sub.world_size, sub.device) == (0, 1, torch.device("cpu"))
    assert sub._members() == [1]  # the world ranks whose heartbeats its roll calls read
    assert sub._roll_prefix == "group_1/"
    tensor = torch.full((2,), 5.0)
    sub.all_reduce_sum_(tensor)
    torch.testing.assert_close(tensor, torch.full((2,), 5.0))
    # The subgroup's rank 0 is the world's rank 1 (torch takes the world's rank).
    assert sub.gather_object("only", dst=0) == ["only"]
    assert sub.broadcast_object("only", src=0) == "only"
    groups = [sub.group, sub._host()]
    sub.close()
    assert (sub.group, sub._host_group) == (None, None)
    for group in groups:  # destroyed: torch no longer knows its ranks
        with pytest.raises(KeyError):
            dist.get_process_group_ranks(group)
    sub.close()  # closing again does nothing


def test_collectives_on_two_gloo_processes(tmp_path):
    mp.start_processes(
        _run_collectives, args=(WORLD_SIZE, str(tmp_path / "pg")), nprocs=WORLD_SIZE, join=True, start_method="fork"
    )


def test_subgroups_on_two_gloo_processes(tmp_path):
    mp.start_processes(
        _use_subgroups, args=(WORLD_SIZE, str(tmp_path / "pg")), nprocs=WORLD_SIZE, join=True, start_method="fork"
    )


def test_torch_communicator_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        TorchCommunicator(torch.device("cpu"))


def _form_a_gloo_group_beside_a_bound_world(rank: int, world_size: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        # A stand-in for Lightning's binding of an NCCL world to its GPU (torch binds only accelerators itself):
        # bound, every new group would take the binding and, on a rank it leaves out, split the world's backend.
        world = dist.distributed_c10d._get_default_group()
        world.bound_device_id = torch.device("cpu", 0)
        group = comm_module.gloo_group_beside_bound_world([0], timeout=timedelta(seconds=30))
        assert world.bound_device_id == torch.device("cpu", 0)  # restored
        if rank == 0:
            total = torch.ones(1)
            dist.all_reduce(total, group=group)
            assert total.item() == 1.0
            assert group.bound_device_id is None
        else:
            assert group == dist.GroupMember.NON_GROUP_MEMBER
        world.bound_device_id = None
    finally:
        dist.destroy_process_group()


def test_a_gloo_group_leaving_a_rank_out_forms_beside_a_world_bound_to_its_device(tmp_path):
    mp.start_processes(
        _form_a_gloo_group_beside_a_bound_world,
        args=(WORLD_SIZE, str(tmp_path / "pg")),
        nprocs=WORLD_SIZE,
        join=True,
        start_method="fork",
    )


def test_a_lone_replicas_collectives_leave_everything_as_it_is():
    comm = LocalCommunicator()
    assert (comm.world_size, comm.rank) == (1, 0)
    assert comm.sums_sparse(torch.device("cpu"))
    tensor = torch.tensor([1.0, 2.0])
    comm.all_reduce_sum_(tensor)
    comm.broadcast_(tensor)
    comm.host_all_reduce_sum_(tensor)
    comm.host_all_reduce_max_(tensor)
    torch.testing.assert_close(tensor, torch.tensor([1.0, 2.0]))
    future = comm.all_reduce_sum_async(tensor)
    assert future.done()
    assert future.value()[0] is tensor
    (gathered,) = comm.all_gather(tensor)
    assert gathered is tensor
    assert comm.all_gather_object("me") == ["me"]
    assert comm.gather_object("me") == ["me"]
    assert comm.broadcast_object("me") == "me"


def test_without_a_process_group_the_default_communicator_is_a_lone_replicas():
    assert isinstance(default_communicator(torch.device("cpu")), LocalCommunicator)


def test_a_completed_future_holds_its_value_and_a_host_copy_keeps_the_targets_dtype():
    future = completed([1, 2])
    assert future.done()
    assert future.wait() == [1, 2]
    target = torch.zeros(3, dtype=torch.float64)
    copy_from_host(target, [0.5, 1e300, -2.0])
    assert target.tolist() == [0.5, 1e300, -2.0]


def test_a_weighted_mean_of_no_flats_is_empty_and_reads_nothing():
    comm = FakeCommunicator(world_size=2)
    assert WeightedAllReduce(comm)([], 1.0) == ([], [])
    assert comm.calls == []


def test_rows_without_flats_travel_in_an_all_reduce_of_their_own():
    # Replica 1 of 2 reports [5]; its peer reports [7] with weight 2. Without flats no weight need be positive.
    def peers_sum(tail: torch.Tensor) -> torch.Tensor:
        return torch.tensor([2.0, 7.0, 0.0], dtype=tail.dtype)

    comm = FakeCommunicator(world_size=2, rank=1, peers_sum=peers_sum)
    assert WeightedAllReduce(comm)([], 0.0, row=[5.0]) == ([], [[7.0], [5.0]])
    assert comm.calls == ["all_reduce_sum_"]


def test_the_rows_ride_in_the_widest_bucket_whatever_the_order_of_the_dtypes():
    # One replica of one: float64 carries the row though a float16 bucket is reduced after it.
    comm = FakeCommunicator(world_size=1)
    flats = [torch.full((2,), 3.0, dtype=torch.float64), torch.full((3,), 4.0, dtype=torch.float16)]
    means, rows = WeightedAllReduce(comm)(flats, 2.0, row=[70000.0, 1.5])
    assert comm.calls == ["all_reduce_sum_", "all_reduce_sum_"]
    assert rows == [[70000.0, 1.5]]
    torch.testing.assert_close(means[0], flats[0])
    torch.testing.assert_close(means[1], flats[1])


def test_a_replica_with_a_host_weight_of_zero_adds_zeros_even_for_non_finite_tensors():
    # The peer holds 4.0 with weight 3; this replica's NaN and inf count for nothing, nor does the last merge's bucket.
    def peers_sum(bucket: torch.Tensor) -> torch.Tensor:
        other = torch.full_like(bucket, 4.0 * 3.0)
        other[-1] = 3.0
        return other

    merge = WeightedAllReduce(FakeCommunicator(world_size=2, peers_sum=peers_sum))
    (first,), _ = merge([torch.ones(3)], 1.0)
    torch.testing.assert_close(first, torch.full((3,), (1.0 + 4.0 * 3.0) / 4.0))
    (mean,), _ = merge([torch.tensor([float("nan"), float("inf"), 1.0])], 0.0)
    torch.testing.assert_close(mean, torch.full((3,), 4.0))
    assert mean.data_ptr() == first.data_ptr()  # one bucket, kept between merges


def test_a_weight_on_the_device_without_rows_is_summed_as_the_merge_weight():
    merge = WeightedAllReduce(FakeCommunicator(world_size=2))  # an identical peer
    merge([torch.ones(2)], 1.0)
    (mean,), rows = merge([torch.tensor([2.0, -6.0])], torch.tensor(3.0))
    torch.testing.assert_close(mean, torch.tensor([2.0, -6.0]))  # (3·θ + 3·θ) / (3 + 3)
    assert rows == []


def test_zero_total_weight_is_refused_with_every_replicas_row():
    comm = FakeCommunicator(world_size=2, rank=0)  # an identical peer: both rows are this replica's, in slot 0
    with pytest.raises(NoMergeWeightError, match=r"sum to 0\.0;") as raised:
        WeightedAllReduce(comm)([torch.ones(2)], 0.0, row=[3.0])
    assert raised.value.rows == [[6.0], [0.0]]
