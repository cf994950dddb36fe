"""The finite guard's arithmetic, pure: what a replica sends, and what the sum becomes."""

from __future__ import annotations

import math
import os
from datetime import timedelta
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel

from lightning_aesgd.engine import finite_guard
from lightning_aesgd.engine.finite_guard import Exclusions, flags_of, guarded, guarded_in_place, renormalised
from lightning_aesgd.engine.gradients import GradientSum, gradient_sum_hook


def _sum(contributions: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(contributions).sum(dim=0)


@settings(max_examples=60, deadline=None)
@given(
    shares=st.lists(st.integers(1, 64), min_size=1, max_size=6),
    values=st.lists(st.floats(-10, 10), min_size=6, max_size=6),
    bad=st.lists(st.booleans(), min_size=6, max_size=6),
    on_host=st.booleans(),
)
def test_the_sum_is_the_mean_gradient_of_the_finite_samples(shares, values, bad, on_host):
    """Both paths: read on the host (CPU tensors), and decided on the device without reading (as on CUDA)."""
    with patch.object(finite_guard, "_on_host", lambda tensor: on_host):
        _check_the_mean_gradient_of_the_finite_samples(shares, values, bad)


def _check_the_mean_gradient_of_the_finite_samples(shares, values, bad):
    total = sum(shares)
    fractions = [size / total for size in shares]
    contributions, expected_num, expected_den = [], 0.0, 0.0
    for index, fraction in enumerate(fractions):
        mean_gradient = torch.full((5,), values[index])
        weighted = fraction * mean_gradient
        if bad[index]:
            weighted[2] = math.nan
        else:
            expected_num += fraction * values[index]
            expected_den += fraction
        contributions.append(guarded(weighted, fraction))
    summed = _sum(contributions)
    result = renormalised(summed)
    if expected_den == 0:
        torch.testing.assert_close(result, torch.zeros(5))  # nothing finite: no update
    elif not any(bad[: len(shares)]):
        # Every replica finite: the plain sum, untouched (DDP's update).
        torch.testing.assert_close(result, _sum([c[:-2] for c in contributions]))
    else:
        torch.testing.assert_close(result, torch.full((5,), expected_num / expected_den), rtol=1e-5, atol=1e-5)
    assert flags_of(summed)[1].item() == sum(bad[: len(shares)])


def test_a_contribution_carries_its_share_and_zeros_when_not_finite():
    finite = guarded(torch.tensor([1.0, 2.0]), 0.25)
    assert finite.tolist() == [1.0, 2.0, 0.25, 0.0]
    infinite = guarded(torch.tensor([1.0, math.inf]), 0.25)
    assert infinite.tolist() == [0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_values_whose_sum_passes_their_range_are_finite(dtype, on_host, monkeypatch):
    monkeypatch.setattr(finite_guard, "_on_host", lambda tensor: on_host)
    buffer = torch.ones(100_000, dtype=dtype)  # a sum of 100,000: past float16's 65,504
    assert flags_of(guarded(buffer, 0.5)).tolist() == [0.5, 0.0]
    assert flags_of(guarded(torch.tensor([1.0, math.nan], dtype=dtype), 0.5)).tolist() == [0.0, 1.0]


@pytest.mark.parametrize("on_host", [True, False])
def test_exclusions_count_the_most_left_out_of_any_bucket_and_the_longest_run_without_a_finite_replica(
    on_host, monkeypatch
):
    monkeypatch.setattr(finite_guard, "_on_host", lambda tensor: on_host)
    exclusions, one, every, none = Exclusions(), torch.tensor([0.5, 1.0]), torch.tensor([0.0, 2.0]), torch.zeros(2)
    exclusions.add_step([one, one], world_size=2)  # one replica, in two buckets of the step
    for flags in ([every], [every], [none], [every]):
        exclusions.add_step(flags, world_size=2)
    assert exclusions.read() == (1 + 2 + 2 + 0 + 2, 2)
    exclusions.add_step([every], world_size=2)  # the run in progress goes on across reads
    assert exclusions.read() == (2, 2)
    exclusions.add_step([none], world_size=2)
    assert exclusions.read() == (0, 2)  # the run ended at this read's first step
    assert exclusions.read() == (0, 0)


def test_ten_steps_in_a_row_without_a_finite_replica_stop_training_with_a_hint():
    from lightning_aesgd.engine.gradient_sync import NON_FINITE_STEPS_LIMIT, _judge_exclusions
    from lightning_aesgd.engine.pipeline import NonFiniteReplicasError

    _judge_exclusions(excluded=3, run=NON_FINITE_STEPS_LIMIT - 1, global_step=42, logs=False)  # goes on
    with pytest.raises(NonFiniteReplicasError, match=r"in 10 consecutive steps before global step 42.*HINT"):
        _judge_exclusions(excluded=20, run=NON_FINITE_STEPS_LIMIT, global_step=42, logs=False)


# --- two replicas through DDP's reducer ----------------------------------------------------------------------

SHARES = (0.25, 0.75)  # the replicas' shares of every step's samples
NAN_STEP = 1  # replica 1's loss is NaN at this step


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 3, generator=generator), torch.randn(6, 1, generator=generator)


def _mean_gradient(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    """The mean gradient of replica ``rank``'s samples at ``step``, at ``model``'s weights (no communication)."""
    x, y = _data(rank, step)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _guarded_sums(rank: int, world_size: int, init_file: str, delay: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        reference = torch.nn.Linear(3, 1)
        reference.load_state_dict(model.state_dict())
        ddp = DistributedDataParallel(model)
        reduce = GradientSum(delay=delay)
        ddp.register_comm_hook(reduce, gradient_sum_hook)
        reduce.share = SHARES[rank]
        handed = []
        for step in range(3):
            reduce.begin_step()
            x, y = _data(rank, step)
            loss = torch.nn.functional.mse_loss(ddp(x), y) * SHARES[rank]
            if rank == 1 and step == NAN_STEP:
                loss = loss * math.nan
            loss.backward()
            handed.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            reduce.end_step()
            model.zero_grad()
        if delay:
            pending = reduce.take_pending()
            handed = [*handed[1:], torch.cat([pending[id(p)].reshape(-1) for p in model.parameters()])]
        # The weights never move here: every step's sum is taken at the same weights.
        expected = [
            SHARES[0] * _mean_gradient(reference, 0, step) + SHARES[1] * _mean_gradient(reference, 1, step)
            for step in range(3)
        ]
        expected[NAN_STEP] = _mean_gradient(reference, 0, NAN_STEP)  # replica 0's samples alone
        for got, want in zip(handed, expected, strict=True):
            torch.testing.assert_close(got, want)
        assert reduce.exclusions.read() == (1, 0)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Gloo's worker thread releases each completed sum's Python callback (`.then`) under the GIL, just after the
    # future completes. Destroying the group right after the last sums were awaited (its last reference is DDP's
    # reducer, freed on return with the GIL held, and its destructor joins that thread) deadlocked the delayed
    # case now and then, even after a barrier. A worker that passed its checks leaves without destructors.
    os._exit(0)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0, 1])  # both: the delayed one once deadlocked at teardown (see above)
def test_through_ddp_a_nan_replica_leaves_the_mean_gradient_of_the_others_samples(tmp_path, delay):
    mp.start_processes(_guarded_sums, args=(2, str(tmp_path / "pg"), delay), nprocs=2, join=True, start_method="fork")


@pytest.mark.parametrize("on_host", [True, False])
def test_a_rider_travels_after_the_flags_whether_or_not_the_buffer_is_finite(on_host, monkeypatch):
    monkeypatch.setattr(finite_guard, "_on_host", lambda tensor: on_host)
    rider = torch.tensor([7.0, 8.0, 9.0])
    assert guarded(torch.tensor([1.0, 2.0]), 0.25, rider).tolist() == [1.0, 2.0, 0.25, 0.0, 7.0, 8.0, 9.0]
    assert guarded(torch.tensor([math.nan, 2.0]), 0.25, rider).tolist() == [0.0, 0.0, 0.0, 1.0, 7.0, 8.0, 9.0]


def test_a_bucket_guarded_in_place_keeps_its_values_when_finite_and_is_zeroed_otherwise():
    finite = torch.tensor([1.0, 2.0])
    assert guarded_in_place(finite, 0.25).tolist() == [0.25, 0.0]
    assert finite.tolist() == [1.0, 2.0]
    infinite = torch.tensor([1.0, -math.inf])
    assert guarded_in_place(infinite, 0.25).tolist() == [0.0, 1.0]
    assert infinite.tolist() == [0.0, 0.0]


def test_a_sum_of_in_place_guarded_buckets_is_renormalised_by_its_flags_summed_apart():
    buffers = [torch.tensor([0.25, 0.25]), torch.tensor([math.nan, 1.0]), torch.tensor([1.5, 1.5])]
    flags = [guarded_in_place(buffer, share) for buffer, share in zip(buffers, (0.25, 0.25, 0.5), strict=True)]
    result = renormalised(_sum(buffers), _sum(flags))
    torch.testing.assert_close(result, torch.tensor([(0.25 + 1.5) / 0.75] * 2))


@pytest.mark.parametrize("on_host", [True, False])
def test_with_no_replica_left_out_the_sum_is_not_rescaled_whatever_the_shares_add_up_to(on_host, monkeypatch):
    """Rounded shares need not add up to exactly 1: the sum is DDP's, bit for bit, not divided by them."""
    monkeypatch.setattr(finite_guard, "_on_host", lambda tensor: on_host)
    summed = guarded(torch.tensor([1.0, 3.0]), 0.5)  # a lone replica's share, as if half the step were missing
    assert renormalised(summed).tolist() == [1.0, 3.0]


def test_the_first_step_without_a_finite_replica_starts_a_run_of_one():
    exclusions = Exclusions()
    exclusions.add_step([torch.tensor([0.0, 2.0])], world_size=2)
    assert exclusions.read() == (2, 1)


def test_a_step_without_buckets_counts_nothing():
    exclusions = Exclusions()
    exclusions.add_step([], world_size=2)
    assert exclusions.read() == (0, 0)


def test_the_most_left_out_of_any_bucket_counts_on_the_host():
    exclusions = Exclusions()
    exclusions.add_step([torch.tensor([0.5, 1.0]), torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0])], world_size=3)
    assert exclusions.read() == (2, 0)


@pytest.mark.parametrize("on_host", [True, False])
def test_exclusion_counts_survive_a_state_dict_round_trip(on_host, monkeypatch):
    """A replica that missed some sums takes its peers' counts, and then counts alike again."""
    monkeypatch.setattr(finite_guard, "_on_host", lambda tensor: on_host)
    exclusions, every = Exclusions(), torch.tensor([0.0, 2.0])
    for _ in range(3):
        exclusions.add_step([every], world_size=2)
    state = exclusions.state_dict()
    assert (state["counts"] is None) == on_host
    copy = Exclusions()
    copy.load_state_dict(state, torch.device("cpu"))
    for counts in (exclusions, copy):
        counts.add_step([every], world_size=2)
        assert counts.read() == (8, 4)
