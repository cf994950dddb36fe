"""The pytest plugin: a user's own test file gets `aesgd_trainer` and checks a module on mixed CPU replicas."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_aesgd import AdaptiveElasticStrategy
from lightning_aesgd.callbacks import SlowdownCallback
from lightning_aesgd.testing import make_trainer

pytest_plugins = ["pytester"]

# What a user writes: their own module, and a test that trains it on two replicas, the second 3× slower.
USER_TEST = """
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class MyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def test_my_module_trains_on_mixed_devices(aesgd_trainer):
    trainer = aesgd_trainer(devices=2, slowdown=[1, 3], max_steps=6)
    trainer.fit(MyModule())
    assert trainer.state.finished
    assert trainer.world_size == 2
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_a_profile_needs_one_factor_per_device(aesgd_trainer):
    import pytest

    with pytest.raises(ValueError, match="one factor per device"):
        aesgd_trainer(devices=2, slowdown=[1, 2, 4])
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_users_test_file_trains_its_module_through_the_fixture(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user_module=USER_TEST)
    # The entry point registers the plugin once the package is installed; a source checkout loads it by name.
    result = pytester.runpytest_subprocess("-p", "lightning_aesgd.testing", "-p", "no:cacheprovider", timeout=280)
    result.assert_outcomes(passed=2)


def test_the_step_mode_runs_inside_the_strategy_and_other_modes_through_the_callback() -> None:
    trainer = make_trainer(devices=2, slowdown=[1, 3], max_steps=1)
    assert isinstance(trainer.strategy, AdaptiveElasticStrategy)
    assert trainer.num_devices == 2
    assert trainer.strategy.slowdown is not None
    assert trainer.strategy.slowdown.factor(1, 0) == 3.0
    assert not any(isinstance(callback, SlowdownCallback) for callback in trainer.callbacks)
    hooked = make_trainer(devices=2, slowdown={"factors": [1, 2], "mode": "hook", "seconds_per_sample": 1e-4})
    assert hooked.strategy.slowdown is None
    assert [c.mode for c in hooked.callbacks if isinstance(c, SlowdownCallback)] == ["hook"]
    equal = make_trainer(devices=3, slowdown=None, strategy_options={"sync": "models", "period": 2})
    assert equal.strategy.slowdown is None
    assert equal.num_devices == 3


def test_the_plugin_is_registered_as_a_pytest11_entry_point() -> None:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib arrived in Python 3.11")
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {"lightning_aesgd.testing": "lightning_aesgd.testing"}
