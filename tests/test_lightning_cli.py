"""LightningCLI sets the strategy's options from flags and from YAML, in both Lightning namespaces."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from helpers import RegressionModel

from lightning_aesgd.strategy import AdaptiveElasticMixin

pytest.importorskip("jsonargparse")

NAMESPACES = [
    ("pytorch_lightning.cli", "lightning_aesgd.AdaptiveElasticStrategy"),
    ("lightning.pytorch.cli", "lightning_aesgd.unified.AdaptiveElasticStrategy"),
]


def _cli(module: str, args: list[str]):
    cli_class = pytest.importorskip(module).LightningCLI
    model = RegressionModel if module.startswith("pytorch_lightning") else _UnifiedModel
    return cli_class(model, run=False, args=["--trainer.accelerator=cpu", "--trainer.devices=1", *args])


class _UnifiedModel(L.LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, 1)


@pytest.mark.parametrize(("module", "class_path"), NAMESPACES)
def test_flags_set_the_strategy_options(module, class_path):
    cli = _cli(
        module,
        [
            f"--trainer.strategy={class_path}",
            "--trainer.strategy.sync=models",
            "--trainer.strategy.period=2",
            "--trainer.strategy.planner=static",
        ],
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, AdaptiveElasticMixin)
    assert (strategy.period, strategy.plans.settings.planner) == (2, "static")


@pytest.mark.parametrize(("module", "class_path"), NAMESPACES)
def test_a_yaml_config_sets_the_strategy_options(module, class_path, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  strategy:\n"
        f"    class_path: {class_path}\n"
        "    init_args:\n"
        "      sync: models\n"
        "      period: 3\n"
        "      warmup_steps: 2\n"
        "      merge_rule:\n"
        "        class_path: lightning_aesgd.ElasticAverage\n"
        "        init_args: {alpha: 0.5, momentum: 0.3}\n"
    )
    strategy = _cli(module, [f"--config={config}"]).trainer.strategy
    assert (strategy.period, strategy.warmup_steps) == (3, 2)
    assert (strategy.merge_rule.alpha, strategy.merge_rule.momentum) == (0.5, 0.3)


def test_the_help_lists_the_strategys_options_not_ddps(capsys):
    with pytest.raises(SystemExit):
        _cli(
            "pytorch_lightning.cli",
            [
                "--trainer.strategy=lightning_aesgd.AdaptiveElasticStrategy",
                "--trainer.strategy.help=lightning_aesgd.AdaptiveElasticStrategy",
            ],
        )
    text = capsys.readouterr().out
    assert "--trainer.strategy.period" in text
    assert "bucket_cap_mb" not in text
    assert "static_graph" not in text
    assert "--trainer.strategy.sync" in text
    # find_unused_parameters and gradient_as_bucket_view are ours too, for sync="gradients"
    assert "--trainer.strategy.gradient_as_bucket_view" in text
