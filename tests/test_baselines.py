"""The DDP baseline's options beyond Lightning's own."""

from __future__ import annotations

from pathlib import Path

from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_aesgd.baselines import PostLocalSGDStrategy, SharedDeviceDDPStrategy
from lightning_aesgd.settings import NO_BUFFER_SYNC_AT_FORWARD


def test_ddp_skips_its_per_forward_buffer_broadcast_only_when_asked():
    assert SharedDeviceDDPStrategy()._ddp_kwargs == {}  # Lightning's DDP as a user gets it
    fair = SharedDeviceDDPStrategy(sync_buffers_at_forward=False, find_unused_parameters=True)
    assert fair._ddp_kwargs == {**NO_BUFFER_SYNC_AT_FORWARD, "find_unused_parameters": True}


def test_the_ddp_config_takes_the_option_from_an_override():
    config = OmegaConf.load(Path(__file__).parents[1] / "configs" / "algorithm" / "ddp.yaml")
    launch = {"start_method": "fork", "replicas_per_device": 1, "replica_devices": None}
    override = {"algorithm": {"sync_buffers_at_forward": False}}
    config = OmegaConf.merge({"launch": launch}, {"algorithm": config}, override)
    strategy = instantiate(config.algorithm)
    assert NO_BUFFER_SYNC_AT_FORWARD.items() <= strategy._ddp_kwargs.items()


def test_post_local_sgd_skips_the_broadcast_in_its_local_steps_only_when_asked():
    assert PostLocalSGDStrategy()._ddp_kwargs == {}  # the hook and the period are DDPStrategy's own arguments
    fair = PostLocalSGDStrategy(period=4, sync_buffers_at_forward=False)
    assert fair._ddp_kwargs == NO_BUFFER_SYNC_AT_FORWARD
    assert fair._model_averaging_period == 4
