"""Several replica processes per device: the placement rules, and fits with 2 replicas on one device."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from helpers import RegressionModel, cpu_trainer
from hypothesis import given
from hypothesis import strategies as st

from lightning_aesgd import AdaptiveElasticStrategy
from lightning_aesgd.baselines import PostLocalSGDStrategy, SharedDeviceDDPStrategy
from lightning_aesgd.placement import (
    check_replicas_per_device,
    process_group_backend,
    repeat_devices,
    shares_a_device,
)

CUDA = [torch.device("cuda", 0), torch.device("cuda", 1)]


@given(st.integers(1, 3), st.integers(1, 5))
def test_each_device_gets_its_replicas_side_by_side(num_devices, replicas_per_device):
    devices = [torch.device("cuda", i) for i in range(num_devices)]
    repeated = repeat_devices(devices, replicas_per_device)
    assert len(repeated) == num_devices * replicas_per_device
    assert repeated[::replicas_per_device] == devices
    assert shares_a_device(repeated) == (replicas_per_device > 1)


def test_replicas_that_share_a_gpu_use_gloo():
    assert process_group_backend(repeat_devices(CUDA, 2), None) == "gloo"
    assert process_group_backend(CUDA, None) is None  # Lightning's own choice (nccl) stands
    assert process_group_backend([torch.device("cpu")] * 2, None) is None
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank"):
        process_group_backend(repeat_devices(CUDA, 2), "nccl")


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_replicas_per_device_must_be_a_whole_number(value):
    with pytest.raises(ValueError, match="replicas_per_device"):
        check_replicas_per_device(value)


@pytest.mark.parametrize("strategy_class", [AdaptiveElasticStrategy, SharedDeviceDDPStrategy, PostLocalSGDStrategy])
def test_strategies_start_replicas_per_device_processes(strategy_class):
    strategy = strategy_class(replicas_per_device=3)
    strategy.parallel_devices = CUDA
    assert strategy.num_processes == 6
    assert strategy.parallel_devices == repeat_devices(CUDA, 3)
    strategy.set_world_ranks()
    assert strategy._get_process_group_backend() == "gloo"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sync", ["gradients", "models"])
def test_two_replicas_train_on_one_device(sync):
    pl.seed_everything(0)
    model = RegressionModel()
    trainer = cpu_trainer(
        AdaptiveElasticStrategy(sync=sync, replicas_per_device=2, start_method="fork"), devices=1, max_steps=6
    )
    trainer.fit(model)
    assert trainer.world_size == 2
    assert trainer.state.finished
