"""The (delayed) gradient sum of sync="gradients", driven with a one-process gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import FakeCommunicator
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_aesgd.engine import gradients
from lightning_aesgd.engine.comm import LocalCommunicator
from lightning_aesgd.engine.gradients import (
    GradientSum,
    apply_gradients,
    pending_from_list,
    pending_to_list,
    update_skipped,
)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class FakeBucket:
    """DDP's GradBucket as a hook sees it: a flat buffer of its parameters' gradients, in order."""

    def __init__(
        self, params: list[nn.Parameter], grads: list[torch.Tensor], last: bool = True, position: int = 0
    ) -> None:
        self.params = params
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        self.last = last
        self.position = position

    def index(self) -> int:
        return self.position

    def buffer(self) -> torch.Tensor:
        return self.flat

    def is_last(self) -> bool:
        return self.last

    def parameters(self) -> list[nn.Parameter]:
        return self.params


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(3))]


def _grads(value: float) -> list[torch.Tensor]:
    return [torch.full((2, 2), value), torch.full((3,), value)]


@pytest.mark.usefixtures("one_process_group")
def test_the_sum_takes_the_weighted_gradients_as_they_are_and_reports_the_arrival():
    arrivals = []
    reduce = GradientSum(on_last_bucket=lambda: arrivals.append(True))
    reduce.begin_step()
    assert reduce.applies_update
    bucket = FakeBucket(_params(), _grads(4.0))
    summed = reduce.reduce(bucket).wait()
    torch.testing.assert_close(summed, torch.full((7,), 4.0))
    assert arrivals == [True]


@pytest.mark.usefixtures("one_process_group")
def test_alone_the_sum_is_the_bucket_itself_unguarded_as_under_ddp():
    """One replica: no copy, no collective and no finiteness pass; its NaN is its own, as DDP leaves it."""
    reduce = GradientSum()
    reduce.alone = True
    reduce.begin_step()
    bucket = FakeBucket(_params(), [torch.full((2, 2), float("nan")), torch.ones(3)])
    summed = reduce.reduce(bucket).wait()
    reduce.end_step()
    assert summed is bucket.flat
    assert reduce.exclusions.read() == (0, 0)


@pytest.mark.parametrize("delay", [0, 1])
def test_alone_a_sparse_or_delayed_bucket_is_its_own_sum_without_a_collective(delay):
    """Sparse gradients of a lone replica on NCCL (no sparse all-reduce) would gather rows over a group of one."""
    comm = FakeCommunicator(world_size=1, device="meta")  # sums no sparse tensor, as NCCL
    reduce = GradientSum(delay=delay, comm=comm)
    reduce.alone = True
    param = nn.Parameter(torch.zeros(5, 2))
    summed = []
    for value in (1.0, 2.0):
        grad = torch.sparse_coo_tensor(torch.tensor([[1, 3, 1]]), torch.full((3, 2), value), (5, 2))  # row 1 twice
        reduce.begin_step()
        summed.append(reduce.reduce(SparseBucket(param, grad)).wait().to_dense())
        reduce.end_step()

    def rows(value: float) -> torch.Tensor:
        return torch.tensor([[0.0, 0.0], [2 * value] * 2, [0.0, 0.0], [value] * 2, [0.0, 0.0]])

    torch.testing.assert_close(summed[1], rows(1.0 if delay else 2.0))  # a delayed step applies the step before
    if delay:
        torch.testing.assert_close(reduce.take_pending()[id(param)].to_dense(), rows(2.0))
    assert comm.calls == []
    assert reduce.exclusions.read() == (0, 0)


@pytest.mark.usefixtures("one_process_group")
def test_a_group_of_one_present_replica_is_still_guarded_for_those_sitting_out():
    """Replicas sitting out take the present one's model at the handoff: its NaN is zeroed and counted."""
    reduce = GradientSum()  # not alone: a segment's group happens to hold one replica
    reduce.begin_step()
    summed = reduce.reduce(FakeBucket(_params(), [torch.full((2, 2), float("nan")), torch.ones(3)])).wait()
    reduce.end_step()
    torch.testing.assert_close(summed, torch.zeros(7))
    assert reduce.exclusions.read() == (1, 1)


@pytest.mark.parametrize("delay", [0, 1])
def test_a_non_finite_replica_is_left_out_and_the_sum_renormalised_over_the_finite_shares(delay):
    """Three replicas with shares ¼, ¼, ½, whose gradients (already weighted by their shares) are 1, 2 and NaN:
    the update is the mean gradient of the finite samples, (¼·4 + ¼·8) / (¼ + ¼) = 6, and one exclusion counts."""
    weighted = {0: 0.25 * 4.0, 1: 0.25 * 8.0, 2: float("nan")}
    shares = {0: 0.25, 1: 0.25, 2: 0.5}

    def peers_sum(contribution: torch.Tensor) -> torch.Tensor:  # what replicas 1 and 2 add to replica 0's
        flat = contribution[:-2]
        return torch.cat([torch.full_like(flat, weighted[1]), torch.tensor([shares[1], 0.0])]) + torch.cat(
            [torch.zeros_like(flat), torch.tensor([0.0, 1.0])]  # replica 2: zeros, share 0, left out
        )

    reduce = GradientSum(delay=delay, comm=FakeCommunicator(world_size=3, rank=0, peers_sum=peers_sum))
    reduce.share = shares[0]
    params = _params()
    for _ in range(1 + delay):
        reduce.begin_step()
        summed = reduce.reduce(FakeBucket(params, _grads(weighted[0]))).wait()
        reduce.end_step()
    if delay:
        summed = reduce.take_pending()
        summed = torch.cat([summed[id(p)] for p in params])
    torch.testing.assert_close(summed, torch.full((7,), 6.0))
    assert reduce.exclusions.read() == (1 + delay, 0)  # one replica left out of every step's sum
    assert reduce.exclusions.read() == (0, 0)  # read once


@pytest.mark.usefixtures("one_process_group")
def test_a_delayed_sum_is_applied_by_the_next_step_once():
    params = _params()
    reduce = GradientSum(delay=1)
    reduce.begin_step()
    assert not reduce.applies_update  # the first step has nothing to apply yet
    reduce.reduce(FakeBucket(params, _grads(1.0))).wait()
    reduce.end_step()
    reduce.begin_step()
    assert reduce.applies_update
    returned = reduce.reduce(FakeBucket(params, _grads(3.0))).wait()
    torch.testing.assert_close(returned, torch.full((7,), 1.0))  # step 0's sum
    reduce.end_step()
    pending = reduce.take_pending()  # the flush: step 1's sum, once
    assert pending is not None
    torch.testing.assert_close(pending[id(params[1])], torch.full((3,), 3.0))
    assert reduce.take_pending() is None
    reduce.begin_step()
    assert not reduce.applies_update  # after a flush the next step starts afresh


@pytest.mark.usefixtures("one_process_group")
def test_a_checkpoint_peeks_at_the_pending_sum_without_consuming_it():
    params = _params()
    reduce = GradientSum(delay=1)
    reduce.begin_step()
    reduce.reduce(FakeBucket(params, _grads(5.0))).wait()
    reduce.end_step()
    saved = pending_to_list(params, reduce.peek_pending())
    reduce.begin_step()
    assert reduce.applies_update
    returned = reduce.reduce(FakeBucket(params, _grads(0.0))).wait()
    torch.testing.assert_close(returned, torch.full((7,), 5.0))
    restored = GradientSum(delay=1)
    restored.hold(pending_from_list(params, saved))
    restored.begin_step()
    torch.testing.assert_close(restored.reduce(FakeBucket(params, _grads(0.0))).wait(), returned)


def test_apply_gradients_writes_each_parameters_sum():
    params = _params()
    apply_gradients(params, {id(params[0]): torch.ones(4)})
    torch.testing.assert_close(params[0].grad, torch.ones(2, 2))
    assert params[1].grad is None


def test_a_skipped_update_runs_the_closure_and_leaves_a_schedulers_wrapper_in_place():
    param = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)  # wraps optimizer.step on the instance
    wrapped = vars(optimizer).get("step")
    assert wrapped is not None
    calls = []

    def closure() -> torch.Tensor:
        calls.append(True)
        loss = (param * 2).sum()
        loss.backward()
        return loss

    with update_skipped(optimizer):
        optimizer.step(closure=closure)
    assert calls == [True]
    assert float(param.detach()) == 1.0  # no update
    assert vars(optimizer).get("step") is wrapped
    optimizer.step()
    assert float(param.detach()) == -1.0  # the real step again


def test_delay_must_be_zero_or_one():
    with pytest.raises(ValueError, match="0 or 1"):
        GradientSum(delay=2)


def test_a_flushed_gradient_keeps_a_channels_last_parameters_layout():
    """DDP lays a dense parameter's gradient out in the parameter's own strides; a flush must read it so."""
    param = nn.Parameter(torch.zeros(2, 3, 2, 2).contiguous(memory_format=torch.channels_last))
    grad = torch.randn(2, 3, 2, 2)
    in_bucket = grad.permute(0, 2, 3, 1).reshape(-1)  # NHWC: the memory order of a channels_last tensor
    apply_gradients([param], {id(param): in_bucket})
    torch.testing.assert_close(param.grad, grad)


class SparseBucket:
    """A bucket holding one embedding's sparse gradient, a row for every occurrence (uncoalesced)."""

    def __init__(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        self.param, self.grad = param, grad

    def buffer(self) -> torch.Tensor:
        return self.grad

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[nn.Parameter]:
        return [self.param]


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("delay", [0, 1])
def test_a_sparse_gradient_is_summed_with_its_repeated_rows(delay):
    param = nn.Parameter(torch.zeros(5, 2))
    rows = torch.tensor([[1, 3, 1]])  # row 1 occurs twice
    grad = torch.sparse_coo_tensor(rows, torch.ones(3, 2), (5, 2))
    reduce = GradientSum(delay=delay)
    reduce.begin_step()
    summed = reduce.reduce(SparseBucket(param, grad)).wait()
    if delay:  # the first delayed step hands back the local gradient; its sum waits for the next step
        reduce.end_step()
        summed = reduce.take_pending()[id(param)]
    expected = torch.zeros(5, 2)
    expected[1], expected[3] = 2.0, 1.0
    torch.testing.assert_close(summed.to_dense(), expected)


class DeferredSums(LocalCommunicator):
    """A lone replica's communicator whose sums come only when the test says: sums still in flight."""

    def __init__(self) -> None:
        self.launched: list[tuple[torch.Tensor, torch.futures.Future[list[torch.Tensor]]]] = []

    def all_reduce_sum_async(self, tensor: torch.Tensor) -> torch.futures.Future[list[torch.Tensor]]:
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self.launched.append((tensor, future))
        return future

    def complete(self) -> None:
        """The sums arrive: each is the contribution as it is now (one replica)."""
        for tensor, future in self.launched:
            future.set_result([tensor.clone()])


@pytest.mark.parametrize("coalesced", [False, True])
def test_a_held_sparse_contribution_survives_what_happens_to_the_buckets_gradient(coalesced):
    """A delayed sum outlives its backward. While it is in flight DDP gives the sparse gradient tensor the hook's
    result with ``copy_``, a user's code may reuse its input batch (whose indices an embedding's gradient may
    view), and the next backward writes gradients again: none of it reaches the sum."""
    sums = DeferredSums()
    param = nn.Parameter(torch.zeros(5, 2))
    rows = torch.tensor([[1, 3, 1]])
    grad = torch.sparse_coo_tensor(rows, torch.ones(3, 2), (5, 2))
    grad = grad.coalesce() if coalesced else grad
    expected = grad.to_dense().clone()
    # The sum that runs on the gradient's own values.
    reduce = GradientSum(delay=1, sparse_reduction="all_reduce", comm=sums)
    reduce.begin_step()
    handed_back = reduce.reduce(SparseBucket(param, grad)).wait()
    assert handed_back._nnz() == 0  # the first delayed step applies nothing (its update is skipped)
    grad.copy_(handed_back)  # DDP's reducer, writing the result into the bucket's gradient
    grad._indices().fill_(0)  # whatever happens to those tensors now
    grad._values().fill_(7.0)
    rows.fill_(0)  # the user's batch, reused
    reduce.end_step()
    sums.complete()
    torch.testing.assert_close(reduce.take_pending()[id(param)].to_dense(), expected)


def test_a_sparse_copy_rebinds_the_indices_and_values_it_replaces():
    """What the held sparse contribution relies on (torch's semantics, pinned): ``copy_`` into a sparse tensor
    leaves the tensors of its former indices and values as they were, even at an equal number of rows."""
    destination = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 3), (4, 3)).coalesce()
    indices, values = destination._indices(), destination._values()
    source = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.full((2, 3), 5.0), (4, 3)).coalesce()
    destination.copy_(source)
    torch.testing.assert_close(destination.to_dense(), source.to_dense())
    assert indices.tolist() == [[0, 2]]
    torch.testing.assert_close(values, torch.ones(2, 3))


# --- momentum compensation (spike compensation for the one-step-stale sum) -----------------------------------


def _optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    # The first parameter has momentum 0.9, the second none: only the first is compensated.
    return torch.optim.SGD([{"params": [params[0]], "momentum": 0.9}, {"params": [params[1]]}], lr=0.1)


@pytest.mark.usefixtures("one_process_group")
def test_momentum_parameters_get_the_spike_compensated_sum():
    """(1 + μ)·Ĝ_{t−1} − μ·Ĝ_{t−2} for the parameter with momentum (Ĝ before the first is zero), Ĝ_{t−1} else;
    the flush is compensated like a step."""
    params = _params()
    reduce = GradientSum(delay=1)
    reduce.read_momentum(_optimizer(params))
    returned = []
    for value in (2.0, 3.0, 5.0):
        reduce.begin_step()
        returned.append(reduce.reduce(FakeBucket(params, _grads(value))).wait())
        reduce.end_step()
    expected_first = [1.9 * 2.0] * 4 + [2.0] * 3
    expected_second = [1.9 * 3.0 - 0.9 * 2.0] * 4 + [3.0] * 3
    torch.testing.assert_close(returned[1], torch.tensor(expected_first))
    torch.testing.assert_close(returned[2], torch.tensor(expected_second))
    pending = reduce.take_pending()
    assert pending is not None
    flushed = reduce.compensated(pending)
    torch.testing.assert_close(flushed[id(params[0])], torch.full((4,), 1.9 * 5.0 - 0.9 * 3.0))
    torch.testing.assert_close(flushed[id(params[1])], torch.full((3,), 5.0))


@pytest.mark.usefixtures("one_process_group")
def test_without_delay_or_when_switched_off_nothing_is_compensated():
    params = _params()
    for reduce in (GradientSum(delay=0), GradientSum(delay=1, compensate_momentum=False)):
        reduce.read_momentum(_optimizer(params))
        sums = {id(params[0]): torch.ones(4)}
        assert reduce.compensated(sums) is sums


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-10, 10), min_size=1, max_size=12), st.floats(0.05, 0.95))
def test_compensated_heavy_ball_on_delayed_sums_is_nesterov(values, momentum):
    """Spike compensation with delay 1 turns heavy-ball SGD into Nesterov's method on the same (delayed) sums:
    the buffer holds μ·v_t + Ĝ_t where v_t is the plain buffer, so the two trajectories coincide."""
    compensated, nesterov = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    heavy_ball = torch.optim.SGD([compensated], lr=0.1, momentum=momentum)
    reference = torch.optim.SGD([nesterov], lr=0.1, momentum=momentum, nesterov=True)
    reduce = GradientSum(delay=1)
    reduce.read_momentum(heavy_ball)
    for value in values:
        compensated.grad = reduce.compensated({id(compensated): torch.tensor([value])})[id(compensated)]
        nesterov.grad = torch.tensor([value])
        heavy_ball.step()
        reference.step()
    torch.testing.assert_close(compensated.detach(), nesterov.detach(), atol=1e-4, rtol=1e-5)


def test_without_the_guard_a_non_finite_gradient_reaches_the_sum_for_a_grad_scaler_to_see():
    """Under 16-bit mixed precision the GradScaler must find the overflow in the sum, skip the step on every
    replica alike and lower its scale: the guard is off there, and the sum runs in place as DDP's does."""
    reduce = GradientSum(comm=LocalCommunicator())
    reduce.guard = False
    reduce.begin_step()
    bucket = FakeBucket(_params(), [torch.full((2, 2), float("inf")), torch.zeros(3)])
    summed = reduce.reduce(bucket).wait()
    reduce.end_step()
    assert summed.data_ptr() == bucket.flat.data_ptr()  # summed in place: no copy
    assert not bool(torch.isfinite(summed).all())
    assert reduce.exclusions.read() == (0, 0)


@pytest.mark.parametrize("method", ["all_reduce", "gather", "densify"])
def test_a_non_finite_sparse_gradient_is_left_out_of_its_sum(method):
    """Two replicas (the fake's peer sends what this one does) whose embedding gradients are NaN: no finite rows
    remain, the sum has none, and the step counts as one without a finite replica."""
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.tensor([[float("nan"), 1.0], [2.0, 3.0]]), (5, 2))
    reduce = GradientSum(comm=FakeCommunicator(world_size=2), sparse_reduction=method)
    reduce.begin_step()
    summed = reduce.reduce(SparseBucket(nn.Parameter(torch.zeros(5, 2)), grad)).wait()
    reduce.end_step()
    torch.testing.assert_close(summed.to_dense(), torch.zeros(5, 2))
    assert reduce.exclusions.read() == (2, 1)


def _carrying(reduce: GradientSum, table: torch.Tensor, carried: list) -> None:
    """An ``on_last_bucket`` that hands ``reduce`` a report table, as the strategy's arrival does."""
    reduce.on_last_bucket = lambda: carried.append(reduce.carry(table))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("delay", [0, 1])
def test_the_last_bucket_carries_a_report_table_in_its_own_all_reduce(dtype, delay):
    """Two replicas (the fake's peer sends what this one does): one collective returns the bucket's sum and the
    table's, in float64 to far more than float32's 7 digits."""
    comm = FakeCommunicator(world_size=2)
    reduce, carried = GradientSum(delay=delay, comm=comm), []
    table = torch.tensor([[1.0 / 3.0, 12345.678901234], [0.0, 0.0]], dtype=torch.float64)
    _carrying(reduce, table, carried)
    params = _params()
    grads = [g.to(dtype) for g in _grads(0.5)]
    reduce.begin_step()
    summed = reduce.reduce(FakeBucket(params, grads)).wait()
    reduce.end_step()
    assert comm.calls == ["all_reduce_sum_async"]
    (future,) = carried
    torch.testing.assert_close(future.wait(), 2 * table, rtol=1e-13, atol=0)
    if delay:  # the first delayed step applies nothing; its sum is the pending one
        pending = reduce.take_pending()
        summed = torch.cat([pending[id(p)] for p in params])
    torch.testing.assert_close(summed, torch.full((7,), 1.0, dtype=dtype))
    assert reduce.exclusions.read() == (0, 0)


def test_a_non_finite_bucket_still_carries_the_table():
    """The guard zeroes a NaN replica's gradients, never the report that rides with them."""
    reduce, carried = GradientSum(comm=FakeCommunicator(world_size=2)), []
    _carrying(reduce, torch.ones(2, 3, dtype=torch.float64), carried)
    reduce.begin_step()
    summed = reduce.reduce(FakeBucket(_params(), [torch.full((2, 2), float("nan")), torch.ones(3)])).wait()
    reduce.end_step()
    torch.testing.assert_close(summed, torch.zeros(7))
    torch.testing.assert_close(carried[0].wait(), torch.full((2, 3), 2.0, dtype=torch.float64))
    assert reduce.exclusions.read() == (2, 1)


def _bucket_that_cannot_carry(case: str) -> tuple[GradientSum, FakeBucket | SparseBucket]:
    reduce = GradientSum(comm=FakeCommunicator(world_size=2))
    if case == "sparse":
        grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 2), (5, 2))
        return reduce, SparseBucket(nn.Parameter(torch.zeros(5, 2)), grad)
    grads = _grads(1.0)
    if case == "bfloat16":
        grads = [g.to(torch.bfloat16) for g in grads]
    reduce.guard = case != "grad_scaler"
    reduce.alone = case == "alone"
    return reduce, FakeBucket(_params(), grads)


@pytest.mark.parametrize("case", ["sparse", "bfloat16", "grad_scaler", "alone"])
def test_a_bucket_that_cannot_carry_the_table_declines_it(case):
    """Sparse and half-precision buckets, DDP's own in-place sum under a grad scaler, and a lone replica's bucket
    (no sum at all): the report then has an all-reduce of its own, decided alike on every replica."""
    reduce, bucket = _bucket_that_cannot_carry(case)
    carried: list = []
    _carrying(reduce, torch.ones(2, 3, dtype=torch.float64), carried)
    reduce.begin_step()
    reduce.reduce(bucket).wait()
    assert carried == [None]


def test_carrying_is_only_offered_during_the_last_buckets_arrival():
    reduce = GradientSum(comm=FakeCommunicator(world_size=2))
    assert reduce.carry(torch.ones(2, 3, dtype=torch.float64)) is None
    reduce.begin_step()
    reduce.reduce(FakeBucket(_params(), _grads(1.0), last=False)).wait()
    assert reduce.carry(torch.ones(2, 3, dtype=torch.float64)) is None


def test_a_table_handed_over_by_an_arrival_that_then_fails_rides_in_no_later_sum():
    """An exception after ``carry`` (an interrupt in the arrival) leaves nothing behind for another bucket: a sum
    longer than the peers' would hang them."""
    sizes: list[int] = []

    class Sized(FakeCommunicator):
        def all_reduce_sum_async(self, tensor: torch.Tensor) -> torch.futures.Future:
            sizes.append(tensor.numel())
            return super().all_reduce_sum_async(tensor)

    reduce = GradientSum(comm=Sized(world_size=2))

    def failing_arrival() -> None:
        reduce.carry(torch.ones(2, 3, dtype=torch.float64))
        raise KeyboardInterrupt

    reduce.on_last_bucket = failing_arrival
    reduce.begin_step()
    with pytest.raises(KeyboardInterrupt):
        reduce.reduce(FakeBucket(_params(), _grads(1.0)))
    reduce.on_last_bucket = None
    reduce.begin_step()
    reduce.reduce(FakeBucket(_params(), _grads(1.0), last=False)).wait()
    assert sizes == [7 + 2]  # the bucket and its flags: no table
    assert reduce.carry(torch.ones(2, 3, dtype=torch.float64)) is None


def test_a_sum_that_cannot_be_launched_fails_the_carried_table_too():
    class Unlaunchable(FakeCommunicator):
        def all_reduce_sum_async(self, tensor: torch.Tensor) -> torch.futures.Future:
            raise RuntimeError("the communicator was aborted")

    reduce, carried = GradientSum(comm=Unlaunchable(world_size=2)), []
    _carrying(reduce, torch.ones(2, 3, dtype=torch.float64), carried)
    reduce.begin_step()
    with pytest.raises(RuntimeError, match="aborted"):
        reduce.reduce(FakeBucket(_params(), _grads(1.0)))
    assert carried[0].done()  # failed, not left for a waiter to hang on
    with pytest.raises(RuntimeError, match="aborted"):
        carried[0].wait()


def test_only_the_last_bucket_reports_the_arrival():
    arrivals: list[bool] = []
    reduce = GradientSum(comm=FakeCommunicator(world_size=2), on_last_bucket=lambda: arrivals.append(True))
    params = _params()
    reduce.begin_step()
    reduce.reduce(FakeBucket([params[1]], [torch.ones(3)], last=False)).wait()
    assert arrivals == []
    reduce.reduce(FakeBucket([params[0]], [torch.ones(2, 2)], position=1)).wait()
    assert arrivals == [True]


def test_until_a_share_is_set_the_replicas_gradient_counts_whole():
    """The default share is 1: with its peer left out, the sum is renormalised by 1/1 and stays this gradient."""

    def peers_sum(contribution: torch.Tensor) -> torch.Tensor:  # a peer left out: zeros, share 0, one flag
        return torch.cat([torch.zeros_like(contribution[:-2]), torch.tensor([0.0, 1.0])])

    reduce = GradientSum(comm=FakeCommunicator(world_size=2, peers_sum=peers_sum))
    reduce.begin_step()
    summed = reduce.reduce(FakeBucket(_params(), _grads(3.0))).wait()
    reduce.end_step()
    torch.testing.assert_close(summed, torch.full((7,), 3.0))
    assert reduce.exclusions.read() == (1, 0)


def _delayed_sum_of_a_refilled_bucket(reduce: GradientSum, settle=lambda: None) -> torch.Tensor:
    """One delayed step's sum of a bucket of 2s, taken after the next backward refilled the bucket with 9s."""
    params = _params()
    bucket = FakeBucket(params, _grads(2.0))
    reduce.begin_step()
    reduce.reduce(bucket).wait()
    reduce.end_step()
    bucket.flat.fill_(9.0)  # the next backward
    settle()
    pending = reduce.take_pending()
    return torch.cat([pending[id(p)] for p in params])


def test_a_delayed_unguarded_sum_runs_on_a_copy_that_the_next_backward_leaves_alone():
    """Under a GradScaler the sum is DDP's own, but a delayed one outlives the bucket that DDP refills."""
    sums = DeferredSums()
    reduce = GradientSum(delay=1, comm=sums)
    reduce.guard = False
    torch.testing.assert_close(_delayed_sum_of_a_refilled_bucket(reduce, sums.complete), torch.full((7,), 2.0))


def test_alone_a_delayed_dense_sum_keeps_the_bucket_as_it_was_without_a_communicator():
    """A lone replica's delayed sum is a copy of its bucket (no collective, none made) that the next backward,
    refilling the bucket, leaves alone."""
    reduce = GradientSum(delay=1)
    reduce.alone = True
    torch.testing.assert_close(_delayed_sum_of_a_refilled_bucket(reduce), torch.full((7,), 2.0))
    assert reduce.comm is None
    assert reduce.exclusions.read() == (0, 0)
    assert reduce.comm is None
    assert reduce.exclusions.read() == (0, 0)


@pytest.mark.parametrize("method", ["gather", "densify"])
def test_a_sparse_sum_without_the_guard_lets_a_non_finite_gradient_through(method):
    """Under a GradScaler a NaN embedding gradient must reach the gathered or densified sum, as a dense one does."""
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.tensor([[float("nan"), 1.0], [2.0, 3.0]]), (5, 2))
    reduce = GradientSum(comm=FakeCommunicator(world_size=2), sparse_reduction=method)
    reduce.guard = False
    reduce.begin_step()
    summed = reduce.reduce(SparseBucket(nn.Parameter(torch.zeros(5, 2)), grad)).wait().to_dense()
    reduce.end_step()
    assert torch.isnan(summed[1, 0])
    torch.testing.assert_close(summed[3], torch.tensor([4.0, 6.0]))
    assert reduce.exclusions.read() == (0, 0)


def test_a_delayed_steps_sums_are_compensated_once_whatever_the_number_of_buckets():
    """The momentum parameter in the second of two buckets gets (1 + μ)·Ĝ_{t−1}, not that compensated again."""
    params = _params()
    reduce = GradientSum(delay=1, comm=FakeCommunicator(world_size=1))
    reduce.read_momentum(_optimizer(params))  # μ = 0.9 for params[0]
    returned = []
    for value in (2.0, 3.0):
        reduce.begin_step()
        reduce.reduce(FakeBucket([params[1]], [torch.full((3,), value)], last=False)).wait()
        returned.append(reduce.reduce(FakeBucket([params[0]], [torch.full((2, 2), value)], position=1)).wait())
        reduce.end_step()
    torch.testing.assert_close(returned[1], torch.full((4,), 1.9 * 2.0))


# --- large host buckets summed in place (IN_PLACE_MIN_ELEMENTS) -----------------------------------------------


def _in_place_sum(monkeypatch, comm, delay: int = 0) -> GradientSum:
    """A sum that takes the 7 elements of ``_params()`` for a large bucket (exactly the threshold)."""
    monkeypatch.setattr(gradients, "IN_PLACE_MIN_ELEMENTS", 7)
    reduce = GradientSum(delay=delay, comm=comm)
    reduce.sums_in_place = True
    return reduce


def test_a_large_synchronous_host_bucket_is_summed_in_place_with_its_flags_beside_it(monkeypatch):
    comm = FakeCommunicator(world_size=2)
    reduce = _in_place_sum(monkeypatch, comm)
    reduce.share = 0.5
    bucket = FakeBucket(_params(), _grads(1.5))
    reduce.begin_step()
    summed = reduce.reduce(bucket).wait()
    reduce.end_step()
    assert summed.data_ptr() == bucket.flat.data_ptr()  # no copy
    torch.testing.assert_close(summed, torch.full((7,), 3.0))
    assert comm.calls == ["all_reduce_sum_async"] * 2  # the bucket, then its flags
    assert reduce.exclusions.read() == (0, 0)


def test_a_large_delayed_bucket_is_summed_on_a_copy_with_its_flags(monkeypatch):
    """A delayed sum outlives the bucket: never in place, whatever its size."""
    comm = FakeCommunicator(world_size=2)
    reduce = _in_place_sum(monkeypatch, comm, delay=1)
    params = _params()
    bucket = FakeBucket(params, _grads(1.5))
    reduce.begin_step()
    reduce.reduce(bucket).wait()
    reduce.end_step()
    torch.testing.assert_close(bucket.flat, torch.full((7,), 1.5))
    assert comm.calls == ["all_reduce_sum_async"]
    pending = reduce.take_pending()
    torch.testing.assert_close(torch.cat([pending[id(p)] for p in params]), torch.full((7,), 3.0))


def test_a_large_bucket_summed_in_place_is_renormalised_by_the_flags_summed_beside_it(monkeypatch):
    """Replica 0 (share ¼, weighted gradient 1) and a peer (share ¼, weighted gradient 2) with a third left out:
    (1 + 2) / (¼ + ¼) = 6, one exclusion."""

    def peers_sum(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 2:  # the flags
            return torch.tensor([0.25, 1.0])
        return torch.full_like(tensor, 2.0)

    reduce = _in_place_sum(monkeypatch, FakeCommunicator(world_size=3, peers_sum=peers_sum))
    reduce.share = 0.25
    reduce.begin_step()
    summed = reduce.reduce(FakeBucket(_params(), _grads(1.0))).wait()
    reduce.end_step()
    torch.testing.assert_close(summed, torch.full((7,), 6.0))
    assert reduce.exclusions.read() == (1, 0)


def test_a_large_bucket_summed_in_place_carries_the_table_with_its_flags(monkeypatch):
    comm = FakeCommunicator(world_size=2)
    reduce, carried = _in_place_sum(monkeypatch, comm), []
    table = torch.tensor([[1.0 / 3.0, 12345.678901234]], dtype=torch.float64)
    _carrying(reduce, table, carried)
    reduce.begin_step()
    summed = reduce.reduce(FakeBucket(_params(), _grads(0.5))).wait()
    reduce.end_step()
    torch.testing.assert_close(summed, torch.full((7,), 1.0))
    (future,) = carried
    assert future.done()  # set by the sum itself: a waiter never hangs
    torch.testing.assert_close(future.wait(), 2 * table, rtol=1e-13, atol=0)
    assert comm.calls == ["all_reduce_sum_async"] * 2


@pytest.mark.parametrize("carrying", [True, False])
def test_a_large_bucket_that_cannot_be_launched_in_place_fails_the_carried_table_too(monkeypatch, carrying):
    """The communicator's error reaches the caller, and any table's waiter, rather than leaving it to hang."""

    class Unlaunchable(FakeCommunicator):
        def all_reduce_sum_async(self, tensor: torch.Tensor) -> torch.futures.Future:
            raise RuntimeError("the communicator was aborted")

    reduce, carried = _in_place_sum(monkeypatch, Unlaunchable(world_size=2)), []
    if carrying:
        _carrying(reduce, torch.ones(2, 3, dtype=torch.float64), carried)
    reduce.begin_step()
    with pytest.raises(RuntimeError, match="aborted"):
        reduce.reduce(FakeBucket(_params(), _grads(1.0)))
    if carrying:
        assert carried[0].done()
        with pytest.raises(RuntimeError, match="aborted"):
            carried[0].wait()


@pytest.mark.parametrize("carrying", [True, False])
def test_a_peer_failing_a_sum_in_place_fails_the_carried_table_too(monkeypatch, carrying):
    class Failing(FakeCommunicator):
        def all_reduce_sum_async(self, tensor: torch.Tensor) -> torch.futures.Future:
            future: torch.futures.Future = torch.futures.Future()
            future.set_exception(RuntimeError("a peer is gone"))
            return future

    reduce, carried = _in_place_sum(monkeypatch, Failing(world_size=2)), []
    if carrying:
        _carrying(reduce, torch.ones(2, 3, dtype=torch.float64), carried)
    reduce.begin_step()
    with pytest.raises(RuntimeError, match="gone"):
        reduce.reduce(FakeBucket(_params(), _grads(1.0))).wait()
    if carrying:
        assert carried[0].done()
        with pytest.raises(RuntimeError, match="gone"):
            carried[0].wait()


# --- gradients into the parameters, and checkpoints of the pending ones --------------------------------------


def test_apply_gradients_gives_a_sparse_sum_as_it_is():
    param = nn.Parameter(torch.zeros(5, 2))
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 2), (5, 2))
    apply_gradients([param], {id(param): grad})
    assert param.grad is grad


def test_apply_gradients_reads_a_complex_parameters_real_pairs():
    """A complex gradient lies in the bucket as its real pairs (torch.view_as_real), interleaved."""
    param = nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))
    grad = torch.tensor([[1 + 2j, 3 + 4j], [5 + 6j, 7 + 8j]], dtype=torch.complex64)
    apply_gradients([param], {id(param): torch.view_as_real(grad).reshape(-1)})
    torch.testing.assert_close(param.grad, grad)


def test_apply_gradients_lays_a_strided_parameters_sum_out_contiguously():
    """A parameter with gaps between its elements (a view) has its gradient in the bucket in row-major order."""
    param = nn.Parameter(torch.zeros(3, 4)[:, :2])
    grad = torch.arange(6.0).reshape(3, 2)
    apply_gradients([param], {id(param): grad.reshape(-1)})
    torch.testing.assert_close(param.grad, grad)


def test_apply_gradients_keeps_a_permuted_layout_whatever_the_stride_of_a_dimension_of_size_one():
    """A size-one dimension's stride says nothing about the layout: a transposed parameter stays transposed."""
    param = nn.Parameter(torch.empty_strided((2, 1, 3), (1, 100, 2)))
    grad = torch.arange(6.0).reshape(2, 1, 3)
    in_bucket = grad.permute(2, 1, 0).reshape(-1)  # the parameter's memory order: the first dimension fastest
    apply_gradients([param], {id(param): in_bucket})
    torch.testing.assert_close(param.grad, grad)


def test_a_delayed_sum_splits_a_complex_parameters_real_pairs_from_its_neighbours():
    complex_param, real_param = nn.Parameter(torch.zeros(2, dtype=torch.complex64)), nn.Parameter(torch.zeros(3))
    grad = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64)
    reduce = GradientSum(delay=1, comm=FakeCommunicator(world_size=1))
    reduce.begin_step()
    bucket = FakeBucket([complex_param, real_param], [torch.view_as_real(grad), torch.full((3,), 5.0)])
    reduce.reduce(bucket).wait()
    reduce.end_step()
    pending = reduce.take_pending()
    apply_gradients([complex_param, real_param], pending)
    torch.testing.assert_close(complex_param.grad, grad)
    torch.testing.assert_close(real_param.grad, torch.full((3,), 5.0))


def test_pending_to_list_stores_none_for_parameters_without_a_sum_and_nothing_without_pending():
    params = _params()
    assert pending_to_list(params, None) is None
    saved = pending_to_list(params, {id(params[1]): torch.ones(3)})
    assert saved[0] is None
    torch.testing.assert_close(saved[1], torch.ones(3))
    restored = pending_from_list(params, saved)
    assert list(restored) == [id(params[1])]


def test_pending_from_list_refuses_a_checkpoint_of_another_number_of_parameters():
    with pytest.raises(ValueError, match="1 parameters, the model has 2"):
        pending_from_list(_params(), [torch.ones(4)])


def test_a_skipped_update_without_a_closure_or_a_scheduler_leaves_the_class_step_in_place():
    param = nn.Parameter(torch.ones(1))
    param.grad = torch.ones(1)
    optimizer = torch.optim.SGD([param], lr=1.0)
    with update_skipped(optimizer):
        assert optimizer.step() is None
    assert "step" not in vars(optimizer)
    torch.testing.assert_close(param.detach(), torch.ones(1))
    optimizer.step()
    torch.testing.assert_close(param.detach(), torch.zeros(1))
