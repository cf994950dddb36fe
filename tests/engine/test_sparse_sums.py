"""Sparse gradients summed without a sparse all-reduce (which NCCL lacks): gathering the rows, or densifying."""

from __future__ import annotations

import math
from contextlib import contextmanager
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import FakeCommunicator
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_aesgd.engine import sparse_sums
from lightning_aesgd.engine.comm import LocalCommunicator
from lightning_aesgd.engine.gradients import GradientSum, gradient_sum_hook
from lightning_aesgd.engine.sparse_sums import sparse_sum_method

WORLD_SIZE = 2
NUM_ROWS, WIDTH, STEPS = 64, 4, 3


# --- the choice between gathering and densifying -------------------------------------------------------------


def _bytes(
    method: str, rows: int, row_width: int, sparse_dim: int, numel: int, element_size: int, world_size: int
) -> int:
    if method == "gather":
        return world_size * rows * (row_width * element_size + 8 * sparse_dim)
    return numel * element_size


@st.composite
def _gradient_sizes(draw: Any) -> dict[str, int]:
    """A sparse gradient's shape and a replica's stored rows, at most all of them."""
    table_rows = draw(st.integers(1, 10**6))
    row_width = draw(st.integers(1, 4096))
    return {
        "rows": draw(st.integers(0, table_rows)),
        "row_width": row_width,
        "sparse_dim": draw(st.integers(1, 3)),
        "numel": table_rows * row_width,
        "element_size": draw(st.sampled_from([1, 2, 4, 8])),
        "world_size": draw(st.integers(1, 1024)),
    }


@given(_gradient_sizes())
def test_the_chosen_way_receives_the_fewest_bytes(sizes):
    costs = {method: _bytes(method, **sizes) for method in ("gather", "densify")}
    assert costs[sparse_sum_method(**sizes)] == min(costs.values())


@given(_gradient_sizes(), st.integers(0, 10**6), st.integers(0, 1024))
def test_more_rows_or_replicas_never_turn_densifying_back_into_gathering(sizes, more_rows, more_replicas):
    more = {**sizes, "rows": sizes["rows"] + more_rows, "world_size": sizes["world_size"] + more_replicas}
    if sparse_sum_method(**sizes) == "densify":
        assert sparse_sum_method(**more) == "densify"


@pytest.mark.parametrize(
    ("sizes", "method"),
    [
        ({"rows": 1, "row_width": 1, "sparse_dim": 1, "numel": 2, "element_size": 8, "world_size": 1}, "gather"),
        ({"rows": 1, "row_width": 1, "sparse_dim": 2, "numel": 3, "element_size": 8, "world_size": 1}, "gather"),
        ({"rows": 1, "row_width": 1, "sparse_dim": 2, "numel": 2, "element_size": 8, "world_size": 1}, "densify"),
        ({"rows": 2, "row_width": 3, "sparse_dim": 1, "numel": 20, "element_size": 4, "world_size": 2}, "gather"),
    ],
    ids=["tie", "tie-two-sparse-dims", "indices-tip-it", "tie-two-replicas"],
)
def test_a_gradient_gathers_where_gathering_is_not_dearer_to_the_byte(sizes, method):
    """At equal bytes received the rows are gathered; 8 bytes more per row of indices make them densify."""
    assert sparse_sum_method(**sizes) == method


@given(_gradient_sizes())
def test_a_gradient_with_every_row_stored_densifies_and_one_with_none_gathers(sizes):
    every_row = sizes["numel"] // sizes["row_width"]
    assert sparse_sum_method(**{**sizes, "rows": every_row}) == "densify"
    assert sparse_sum_method(**{**sizes, "rows": 0}) == "gather"


def test_auto_weighs_the_bytes_at_the_most_rows_any_replica_stores_and_a_named_way_is_kept():
    """Every replica pads its rows to the longest, so one replica storing every row makes every replica densify."""
    # One row of the 64 stored here.
    local = torch.sparse_coo_tensor([[0]], torch.ones(1, WIDTH), (NUM_ROWS, WIDTH), check_invariants=True)
    assert not sparse_sums.densifies(local, [1, 1], "auto")
    assert sparse_sums.densifies(local, [1, NUM_ROWS], "auto")
    assert sparse_sums.densifies(local, [NUM_ROWS, 1], "auto")
    assert sparse_sums.densifies(local, [1, 1], "densify")
    assert not sparse_sums.densifies(local, [NUM_ROWS, NUM_ROWS], "gather")


def test_an_unknown_sparse_reduction_fails_early():
    with pytest.raises(ValueError, match="sparse_reduction"):
        GradientSum(sparse_reduction="reduce_scatter")  # type: ignore[arg-type]


# --- one replica: the sum's form -----------------------------------------------------------------------------


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class SparseBucket:
    """A bucket holding one sparse gradient, as DDP hands it to the hook."""

    def __init__(self, param: nn.Parameter, grad: Tensor) -> None:
        self.param, self.grad = param, grad

    def buffer(self) -> Tensor:
        return self.grad

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[nn.Parameter]:
        return [self.param]


def _sparse(indices: list[list[int]], size: tuple[int, ...], scale: float = 1.0) -> Tensor:
    """A sparse gradient with a stored row per index column (repeats included), row ``k`` worth ``scale·(k + 1)``."""
    rows = len(indices[0])
    values = torch.arange(1.0, rows + 1).reshape(rows, *[1] * (len(size) - len(indices))) * scale
    values = values.expand(rows, *size[len(indices) :]).clone()
    return torch.sparse_coo_tensor(torch.tensor(indices, dtype=torch.long), values, size, check_invariants=False)


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("method", ["gather", "densify"])
@pytest.mark.parametrize(
    ("indices", "size"),
    [([[1, 3, 1]], (5, 2)), ([[0, 2, 0, 1], [4, 1, 4, 0]], (3, 5, 2)), ([[]], (4, 3))],
    ids=["one-sparse-dim", "two-sparse-dims", "no-rows"],
)
def test_a_sparse_sum_by_dense_collectives_is_a_sparse_tensor_of_the_gradients_size(method, indices, size):
    grad = _sparse(indices, size)
    expected = grad.to_dense()
    summed = GradientSum(sparse_reduction=method).reduce(SparseBucket(nn.Parameter(torch.zeros(size)), grad)).wait()
    assert summed.is_sparse
    assert (summed.size(), summed.sparse_dim(), summed.dtype) == (grad.size(), grad.sparse_dim(), grad.dtype)
    torch.testing.assert_close(summed.to_dense(), expected)
    # Gathered: each distinct row once (one replica); densified: every row of the table.
    assert summed._nnz() == (grad.coalesce()._nnz() if method == "gather" else math.prod(size[: len(indices)]))
    torch.testing.assert_close(grad.to_dense(), expected)  # the gradient itself is left as it was


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("method", ["gather", "densify"])
def test_delayed_sparse_sums_get_the_spike_compensation(method):
    """(1 + μ)·Ĝ_{t−1} − μ·Ĝ_{t−2} of sparse sums, gathered ones uncoalesced, and of the flushed one."""
    param = nn.Parameter(torch.zeros(6, 2))
    reduce = GradientSum(delay=1, sparse_reduction=method)
    reduce.read_momentum(torch.optim.SGD([param], lr=0.1, momentum=0.9))
    grads = [_sparse([[1, 4, 1]], (6, 2), 1.0), _sparse([[4, 0]], (6, 2), 3.0), _sparse([[5, 5, 2]], (6, 2), -2.0)]
    dense = [grad.to_dense() for grad in grads]
    returned = []
    for grad in grads:
        reduce.begin_step()
        returned.append(reduce.reduce(SparseBucket(param, grad)).wait())
        reduce.end_step()
    assert returned[0]._nnz() == 0  # nothing to apply yet
    torch.testing.assert_close(returned[1].to_dense(), 1.9 * dense[0])
    torch.testing.assert_close(returned[2].to_dense(), 1.9 * dense[1] - 0.9 * dense[0])
    pending = reduce.take_pending()
    assert pending is not None
    torch.testing.assert_close(reduce.compensated(pending)[id(param)].to_dense(), 1.9 * dense[2] - 0.9 * dense[1])


class RecordingAllReduce:
    """``dist.all_reduce`` as it is, noting whether each tensor was sparse."""

    def __init__(self) -> None:
        self.sparse: list[bool] = []
        self.all_reduce = dist.all_reduce

    def __call__(self, tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        self.sparse.append(tensor.is_sparse)
        return self.all_reduce(tensor, *args, **kwargs)


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize(
    ("backend", "sparse_all_reduce"),
    [("gloo", True), ("cpu:gloo,cuda:nccl", True), ("nccl", False), ("cpu:nccl,cuda:gloo", False)],
)
def test_auto_all_reduces_a_sparse_gradient_only_where_the_devices_backend_can(backend, sparse_all_reduce, monkeypatch):
    all_reduce = RecordingAllReduce()
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    grad = _sparse([[0, 1, 2, 3, 4]], (5, 2))  # every row stored: densifies where not all-reduced as it is
    summed = GradientSum().reduce(SparseBucket(nn.Parameter(torch.zeros(5, 2)), grad)).wait()
    torch.testing.assert_close(summed.to_dense(), grad.to_dense())
    assert any(all_reduce.sparse) == sparse_all_reduce  # beside gloo's sparse sum: its finite flags, dense


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("method", ["gather", "auto", "densify", "all_reduce"])
def test_the_row_count_exchange_is_time_blocked_on_peers(method, monkeypatch):
    """A sparse sum by dense collectives starts with the small exchange of rows and finite flags, which waits for
    every replica; a sparse all-reduce sums its flags beside it and waits for nothing."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    waits = []

    @contextmanager
    def waiting():
        waits.append(True)
        yield

    reduce = GradientSum(waiting=waiting, sparse_reduction=method)
    reduce.reduce(SparseBucket(nn.Parameter(torch.zeros(5, 2)), _sparse([[1, 3, 1]], (5, 2)))).wait()
    assert waits == ([] if method == "all_reduce" else [True])


# --- two replicas through DDP's reducer ----------------------------------------------------------------------


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor, Tensor]:
    """Two bags of embedding rows and the loss's weight of each bag's output, for ``rank`` at ``step``.

    The replicas store different numbers of rows, some of them shared and repeated. At step 1 replica 1 touches
    over half of the table, where its rows cost more to gather than the table to densify, but replica 0's do not.
    """
    if rank == 0:
        ids = torch.tensor([3, step, 3, 7, step + 1])
    elif step == 1:
        ids = torch.cat([torch.arange(0, NUM_ROWS, 2), torch.tensor([3, 7, 3])])
    else:
        ids = torch.tensor([7, 3, 11, 11, step, 20, 21])
    offsets = torch.tensor([0, 2])
    weights = torch.arange(2.0 * WIDTH).reshape(2, WIDTH) * (rank + 1) + step - 0.5
    return ids, offsets, weights


def _expected_sum(step: int) -> Tensor:
    """Σ over replicas of the embedding's gradient: each occurrence of a row adds its bag's weight."""
    total = torch.zeros(NUM_ROWS, WIDTH)
    for rank in range(WORLD_SIZE):
        ids, offsets, weights = _batch(rank, step)
        bag = torch.bucketize(torch.arange(len(ids)), offsets, right=True) - 1
        total.index_add_(0, ids, weights[bag])
    return total


def _handed_to_the_optimizer(method: str, delay: int) -> tuple[Tensor, list[int]]:
    """The dense value and the stored rows of the embedding's gradient after each step's backward, then (delayed)
    of the flushed sum."""
    embedding = nn.EmbeddingBag(NUM_ROWS, WIDTH, mode="sum", sparse=True)
    ddp = DistributedDataParallel(embedding)
    reduce = GradientSum(delay=delay, sparse_reduction=method)
    ddp.register_comm_hook(reduce, gradient_sum_hook)
    handed, rows = [], []
    for step in range(STEPS):
        reduce.begin_step()
        ids, offsets, weights = _batch(dist.get_rank(), step)
        (ddp(ids, offsets) * weights).sum().backward()
        assert embedding.weight.grad is not None
        assert embedding.weight.grad.is_sparse
        handed.append(embedding.weight.grad.to_dense())
        rows.append(embedding.weight.grad._nnz())
        reduce.end_step()
        embedding.weight.grad = None
    if delay:
        pending = reduce.take_pending()
        assert pending is not None
        handed.append(pending[id(embedding.weight)].to_dense())
        rows.append(pending[id(embedding.weight)]._nnz())
    return torch.stack(handed), rows


def _sum_sparse_gradients(rank: int, world_size: int, init_file: str, delay: int) -> None:
    # GNU OpenMP cannot start a thread team in a process forked from one that ran a team (the tests before this
    # one may have): a replica runs its kernels on one thread, as Lightning's forked replicas do on a small machine.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        # Delayed, step t applies step t − 1's sum; the first applies nothing and the flush the last step's.
        expected = torch.stack([_expected_sum(step) for step in range(STEPS)])
        # Gathered: every replica's distinct rows, without the padding.
        gathered_rows = [sum(_batch(r, step)[0].unique().numel() for r in range(world_size)) for step in range(STEPS)]
        if delay:
            expected = torch.cat([torch.zeros(1, NUM_ROWS, WIDTH), expected])
            gathered_rows = [0, *gathered_rows]
        all_reduced, _ = _handed_to_the_optimizer("all_reduce", delay)
        torch.testing.assert_close(all_reduced, expected)
        gathered, rows = _handed_to_the_optimizer("gather", delay)
        torch.testing.assert_close(gathered, all_reduced)
        assert rows == gathered_rows
        densified, rows = _handed_to_the_optimizer("densify", delay)
        torch.testing.assert_close(densified, all_reduced)
        assert rows == [0] * delay + [NUM_ROWS] * STEPS
        # As on NCCL: every replica takes the way chosen from the most rows, although its own rows alone would
        # choose the other at step 1 on replica 0 (a mismatch would pair a gather with an all-reduce).
        chosen: list[str] = []

        def recorded(*args: Any, **kwargs: Any) -> str:
            chosen.append(sparse_sum_method(*args, **kwargs))
            return chosen[-1]

        with (
            mock.patch.object(dist, "get_backend", return_value="nccl"),
            mock.patch.object(sparse_sums, "sparse_sum_method", recorded),
        ):
            torch.testing.assert_close(_handed_to_the_optimizer("auto", delay)[0], all_reduced)
        assert chosen == ["gather", "densify", "gather"]
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0, 1])
def test_gathered_and_densified_sums_are_the_sparse_all_reduces_through_ddp(tmp_path, delay):
    mp.start_processes(
        _sum_sparse_gradients,
        args=(WORLD_SIZE, str(tmp_path / "pg"), delay),
        nprocs=WORLD_SIZE,
        join=True,
        start_method="fork",
    )


@pytest.mark.parametrize("exchange", ["rows", "native"])
def test_an_idle_replica_with_a_finite_gradient_is_not_left_out_and_a_non_finite_one_is(exchange):
    comm = LocalCommunicator()
    sparse = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 3), (4, 3), check_invariants=True).coalesce()

    def left_out(share: float, finite: bool) -> int:
        if exchange == "rows":
            return sparse_sums.exchange_rows(sparse, share, comm, finite)[2]
        future, flags = sparse_sums.native_sparse_sum(sparse, share, comm, finite)
        future.wait()
        return round(flags[1].item())

    assert left_out(0.0, finite=True) == 0  # an idle step: no samples, nothing wrong
    assert left_out(0.5, finite=True) == 0
    assert left_out(0.5, finite=False) == 1


@pytest.mark.parametrize("finite", [True, torch.tensor(True)], ids=["host-flag", "device-flag"])
def test_the_row_exchange_tells_every_replica_the_rows_shares_and_finiteness_of_all(finite):
    """Two replicas alike (scripted): each one's stored rows and share; a left-out one counts no rows, no share."""
    sparse = torch.sparse_coo_tensor([[0, 2, 3]], torch.ones(3, 2), (5, 2), check_invariants=True).coalesce()
    exchange = sparse_sums.exchange_rows(sparse, 0.25, FakeCommunicator(world_size=2), finite)
    assert exchange == sparse_sums.RowExchange([3, 3], 0.5, 0, [True, True])
    left_out = sparse_sums.exchange_rows(sparse, 0.25, FakeCommunicator(world_size=2), torch.tensor(False))
    assert left_out == sparse_sums.RowExchange([0, 0], 0.0, 2, [False, False])


def test_gathered_rows_are_padded_to_the_longest_and_cut_back_to_each_replicas_own():
    """Rank 1 of two stores 3 rows and rank 0 one (the scripted gather hands rank 1's rows back as both)."""
    local = torch.sparse_coo_tensor([[4, 0, 2]], torch.tensor([[1.0], [2.0], [3.0]]), (5, 1), check_invariants=True)
    comm = FakeCommunicator(world_size=2, rank=1)
    summed = sparse_sums.gathered_sum(local, [1, 3], comm).wait()
    assert comm.calls == ["all_gather", "all_gather"]
    assert (summed.size(), summed.sparse_dim(), summed._nnz()) == (local.size(), 1, 4)
    expected = local.to_dense()
    expected[4] += 1.0  # rank 0's one row: the first
    torch.testing.assert_close(summed.to_dense(), expected)
    nothing = FakeCommunicator(world_size=2)
    assert sparse_sums.gathered_sum(sparse_sums.no_rows(local), [0, 0], nothing).wait()._nnz() == 0
    assert nothing.calls == [], "no replica has rows: none launches the gather"


def test_a_native_sparse_sum_is_renormalised_to_the_finite_shares_only_where_a_replica_is_left_out():
    """Gloo's sparse all-reduce: the finite replicas' contributions over their summed share once one is left out
    (it sends no rows), as they are where none is. Three replicas; the peers' sums are scripted."""
    mine = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 3), (4, 3), check_invariants=True).coalesce()
    peers = torch.sparse_coo_tensor([[1]], torch.full((1, 3), 2.0), (4, 3), check_invariants=True).coalesce()

    def native(share: float, finite: bool, peer_flags: list[float]) -> tuple[Tensor, list[float]]:
        comm = FakeCommunicator(
            world_size=3,
            peers_sum=lambda t: peers.clone() if t.is_sparse else torch.tensor(peer_flags, dtype=t.dtype),
        )
        contribution = mine.clone() if finite else sparse_sums.no_rows(mine)
        future, flags = sparse_sums.native_sparse_sum(contribution, share, comm, finite)
        return future.wait().to_dense(), flags.tolist()

    both = (mine + peers).to_dense()
    summed, flags = native(0.25, True, [0.75, 0.0])  # nobody left out: the sum as it is
    torch.testing.assert_close(summed, both)
    assert flags == [1.0, 0.0]
    summed, flags = native(0.25, True, [0.25, 1.0])  # a peer left out: the finite half of the step, doubled
    torch.testing.assert_close(summed, both / 0.5)
    assert flags == [0.5, 1.0]
    summed, flags = native(0.5, False, [0.5, 0.0])  # this replica left out: its share does not count
    torch.testing.assert_close(summed, peers.to_dense() / 0.5)
    assert flags == [0.5, 1.0]


def _leave_one_non_finite_replica_out(rank: int, world_size: int, init_file: str, method: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        # Replica 1's gradient is NaN in one row; each replica holds half of the step.
        values = [[1.0, 2.0], [3.0, 4.0]] if rank == 0 else [[float("nan"), 1.0], [5.0, 6.0]]
        grad = torch.sparse_coo_tensor([[1, 3]] if rank == 0 else [[0, 3]], values, (5, 2))
        with mock.patch.object(dist, "get_backend", return_value="nccl"):  # the exchange of rows, as on NCCL
            reduce = GradientSum(sparse_reduction=method)
            reduce.share = 0.5
            reduce.begin_step()
            summed = reduce.reduce(SparseBucket(nn.Parameter(torch.zeros(5, 2)), grad)).wait()
            reduce.end_step()
        # The mean gradient of the finite replica's samples: its contribution over its share.
        expected = torch.zeros(5, 2)
        expected[1], expected[3] = torch.tensor([1.0, 2.0]) / 0.5, torch.tensor([3.0, 4.0]) / 0.5
        torch.testing.assert_close(summed.to_dense(), expected)
        assert reduce.exclusions.read() == (1, 0)  # one replica left out, in a step that kept a finite one
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["gather", "densify"])
def test_a_replica_whose_rows_are_not_finite_sends_none_and_the_others_are_renormalised(tmp_path, method):
    # Its finiteness reached the others in the exchange of rows, as a device flag that the host read with them.
    mp.start_processes(
        _leave_one_non_finite_replica_out,
        args=(WORLD_SIZE, str(tmp_path / "pg"), method),
        nprocs=WORLD_SIZE,
        join=True,
        start_method="fork",
    )
