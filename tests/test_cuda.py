"""The strategy on a real GPU: each body runs in a fresh process that sees the GPUs (see conftest.py).

Skipped where no GPU is present; ``scripts/gpu_check.sh`` runs them with the GPU checks of the main job.
"""

from __future__ import annotations

import pytest
from cuda_run import run_on_cuda

pytestmark = [pytest.mark.cuda, pytest.mark.slow, pytest.mark.timeout(900)]


def test_each_sync_mode_fits_a_bufferless_model_on_one_gpu():
    run_on_cuda("cuda_bodies:fit_each_sync_mode")


@pytest.mark.parametrize(("sync", "delay"), [("gradients", 0), ("gradients", 1), ("models", 0)])
def test_sparse_gradients_train_over_nccl(sync, delay):
    run_on_cuda("cuda_bodies:fit_sparse_gradients", sync, delay)


def test_averaged_optimizer_state_stays_on_the_gpu():
    run_on_cuda("cuda_bodies:fit_with_averaged_optimizer_state")


@pytest.mark.parametrize("sync", ["gradients", "models"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_fits(precision, sync):
    run_on_cuda("cuda_bodies:fit_in_precision", precision, sync)


@pytest.mark.parametrize("sync", ["gradients", "models"])
def test_two_replicas_share_one_gpu(sync):
    run_on_cuda("cuda_bodies:fit_replicas_sharing_the_gpu", sync)


def test_a_straggler_sharing_the_gpu_sits_out_of_the_others_sums(tmp_path):
    run_on_cuda("cuda_bodies:fit_a_straggler_among_replicas_sharing_the_gpu", str(tmp_path))


@pytest.mark.parametrize("sync", ["gradients", "models"])
@pytest.mark.parametrize("sparse", [False, True])
def test_a_cpu_replica_trains_beside_the_gpu(sync, sparse):
    run_on_cuda("cuda_bodies:fit_placed_replicas", sync, sparse)


@pytest.mark.parametrize(
    ("learners", "precision"), [(2, "32-true"), (2, "bf16-mixed"), (3, "16-mixed"), ("auto", "32-true")]
)
def test_learners_train_batched_on_the_gpu(learners, precision):
    run_on_cuda("cuda_bodies:fit_learners", learners, precision)


@pytest.mark.parametrize("sync", ["gradients", "models"])
def test_a_lone_replica_synchronises_with_the_host_only_at_reports(sync):
    run_on_cuda("cuda_bodies:count_host_synchronisations", sync)
