"""The communication layer on 2 real gloo processes, with closed-form expected results."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_aesgd.engine import comm as comm_module
from lightning_aesgd.engine.comm import TorchCommunicator, WeightedAllReduce

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

WORLD_SIZE = 2


def _run_collectives(rank: int, world_size: int, init_file: str) -> None:
    # A forked worker can hang in its first OpenMP kernel if the test process ran one before it forked (as
    # Lightning's forked replicas, one intra-op thread each).
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        comm = TorchCommunicator(torch.device("cpu"))
        assert (comm.rank, comm.world_size) == (rank, world_size)

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


def test_collectives_on_two_gloo_processes(tmp_path):
    mp.start_processes(
        _run_collectives, args=(WORLD_SIZE, str(tmp_path / "pg")), nprocs=WORLD_SIZE, join=True, start_method="fork"
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
