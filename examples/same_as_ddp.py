"""DDP's result at speed-proportional batches: ``sync="gradients"`` against Lightning's DDP, with Adam.

Four CPU processes train the same small network with Adam from the same seed on the same data. The user's own
``training_step`` is slower on some replicas (costs 1, 1, 2 and 4 per sample: a sleep proportional to the batch,
as a slower device would take), which neither strategy is told about. Three runs:

- Lightning's ``DDPStrategy``: equal batches, every step waits for the slowest replica;
- ``adaptive_elastic`` with its default ``sync="gradients"``: batches follow the measured speeds, and each
  replica's gradient counts with its share of the step (``Σ bᵢ/M · gᵢ``), so every update is DDP's update;
- ``adaptive_elastic`` with ``sync="models"`` (model merges after every step), for contrast: with Adam, averaging
  models is not averaging gradients.

It prints the largest difference of each run's final weights from DDP's and each run's training time over DDP's
(measured from the first to the last training step on rank zero, so process start-up is left out). The devices
are emulated, so only the ratios mean something.

Run it with ``python examples/same_as_ddp.py`` (``--max-steps 4`` for a quick check).
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy, Strategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_aesgd import AdaptiveElasticStrategy

REPLICAS, BATCH_SIZE, STEPS = 4, 16, 60
COSTS = (1, 1, 2, 4)  # per-sample cost of each replica's training_step, in units of SECONDS_PER_SAMPLE
SECONDS_PER_SAMPLE = 0.002
START: Literal["fork", "spawn"] = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


class SlowOnSomeReplicas(pl.LightningModule):
    """An MLP classifier under Adam whose training_step takes longer per sample on the slower replicas."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        time.sleep(COSTS[self.global_rank] * SECONDS_PER_SAMPLE * len(x))  # a slower device, in user code
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(REPLICAS * BATCH_SIZE * 32, 32, generator=generator)
        y = (x[:, :10] + 0.5 * torch.randn(len(x), 10, generator=generator)).argmax(dim=1)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=True)


class TrainingClock(pl.Callback):
    """Seconds from the first training batch to the end of fit, on rank zero, as the metric ``train_seconds``.

    Lightning hands rank zero's ``callback_metrics`` back to the launching process.
    """

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 0:
            self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.callback_metrics["train_seconds"] = torch.tensor(time.perf_counter() - self.start)


def fit(strategy: Strategy, steps: int) -> tuple[Tensor, float]:
    """Train a fresh model; return its final weights and the seconds of training."""
    pl.seed_everything(0, verbose=False)
    model = SlowOnSomeReplicas()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=REPLICAS,
        strategy=strategy,
        max_steps=steps,
        callbacks=[TrainingClock()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    weights = torch.cat([p.detach().reshape(-1) for p in model.net.parameters()])
    return weights, float(trainer.callback_metrics["train_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    steps = parser.parse_args().max_steps
    ddp, ddp_seconds = fit(DDPStrategy(start_method=START), steps)
    runs = {
        'sync="gradients"': AdaptiveElasticStrategy(sync="gradients", start_method=START),
        'sync="models"': AdaptiveElasticStrategy(sync="models", start_method=START),
    }
    print(f"{REPLICAS} replicas, costs {COSTS}, Adam, {steps} steps of {REPLICAS * BATCH_SIZE} samples")
    for name, strategy in runs.items():
        weights, seconds = fit(strategy, steps)
        difference = float((weights - ddp).abs().max())
        print(f"{name}: largest weight difference from DDP {difference:.2e}; time / DDP's {seconds / ddp_seconds:.2f}")


if __name__ == "__main__":
    main()
