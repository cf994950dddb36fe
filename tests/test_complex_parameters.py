"""Complex parameters train as their real and imaginary parts would, in every mode, on 2 forked gloo replicas.

A complex weight ``w`` and the pair of real weights ``(Re w, Im w)`` computing the same function get the same
gradients (torch's convention for a real loss, ``∂L/∂Re w + i·∂L/∂Im w``), so every mode must leave them equal.
A merge or a delayed sum that cast ``w`` to a real dtype lost its imaginary part, silently.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import pytorch_lightning as pl
import torch
from helpers import cpu_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_aesgd import AdaptiveElasticStrategy

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(240)]


class _Filter(pl.LightningModule):
    """``|x · w|`` fitted to targets, with ``w`` complex or held as its real and imaginary parts."""

    def __init__(self, complex_weights: bool) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        weights = torch.randn(4, 3, dtype=torch.cfloat, generator=generator) / 2
        self.complex_weights = complex_weights
        if complex_weights:
            self.w = nn.Parameter(weights)
        else:
            self.re, self.im = nn.Parameter(weights.real.clone()), nn.Parameter(weights.imag.clone())

    def weights(self) -> Tensor:
        return self.w if self.complex_weights else torch.complex(self.re, self.im)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss((x.to(torch.cfloat) @ self.weights()).abs(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(96, 4, generator=generator)
        return DataLoader(TensorDataset(x, x[:, :3].abs() + 0.5), batch_size=12)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"gradient_delay": 1},
        {"sync": "models", "period": 2},
        {"sync": "models", "period": 2, "optimizer_state": "average"},
    ],
    ids=["gradients", "delayed", "models", "models-average-state"],
)
def test_complex_weights_end_where_their_real_and_imaginary_parts_do(options):
    fitted = []
    for complex_weights in (True, False):
        model = _Filter(complex_weights)
        strategy = AdaptiveElasticStrategy(
            planner="static", start_method="fork", timeout=timedelta(seconds=90), **options
        )
        cpu_trainer(strategy, max_steps=12).fit(model)
        fitted.append(model.weights().detach())
    initial = _Filter(complex_weights=True).w.detach()
    moved = fitted[0] - initial
    assert moved.real.abs().min() > 0  # every weight trained, its real part ...
    assert moved.imag.abs().min() > 0  # ... and its imaginary part
    torch.testing.assert_close(fitted[0], fitted[1], rtol=0, atol=1e-6)
