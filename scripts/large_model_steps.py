"""Time per step of a large dense model on equal CPU replicas: the defaults against two DDPs, in turns.

Where a step is mostly communication (a model of tens of millions of parameters on CPU replicas over gloo), any
pass the strategy adds over every gradient shows: the guarded sum's copy of each bucket cost 11% of DDP's step on
a 17-million-parameter MLP until large buckets were summed in place. This races the defaults against DDP without
its per-forward buffer broadcast (the fairer DDP; the model has no buffers anyway), with and without
``gradient_as_bucket_view`` (which the defaults use), on random data, and prints each run's milliseconds per step
(the first 5 steps left out) and the sorted lists.

Usage::

    python scripts/large_model_steps.py --width 2048 --layers 4 --repeats 6
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import Strategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_aesgd import AdaptiveElasticStrategy
from lightning_aesgd.baselines import SharedDeviceDDPStrategy
from lightning_aesgd.bench.race.program import quiet_lightning

START = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
WARM_STEPS = 5
ORDERS = list(itertools.permutations(("ddp", "ddp_bucket_view", "adaptive_elastic")))
"""The contenders' orders, one repeat each in turn."""


class WideNet(pl.LightningModule):
    """An MLP of ``layers`` square layers of ``width`` units, SGD with momentum, on random data."""

    def __init__(self, width: int, layers: int, batch_size: int, steps: int) -> None:
        super().__init__()
        blocks = [module for _ in range(layers) for module in (nn.Linear(width, width), nn.ReLU())]
        self.net = nn.Sequential(*blocks, nn.Linear(width, 10))
        self.width, self.batch_size, self.steps = width, batch_size, steps

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    @override
    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.batch_size * 2 * (self.steps + 1), self.width, generator=generator)
        y = torch.randint(0, 10, (len(x),), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True)


class StepClock(pl.Callback):
    """Rank zero's clock at each step's end, written as JSON at the end of fit."""

    def __init__(self, path: Path) -> None:
        self.path, self.clock = path, []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.clock.append(time.perf_counter())

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.clock))


def ms_per_step(strategy: Strategy, args: argparse.Namespace, path: Path) -> float:
    """One fit: milliseconds per step on rank zero's clock, after the first ``WARM_STEPS``."""
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.replicas,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=[StepClock(path)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(WideNet(args.width, args.layers, args.batch_size, args.steps))
    clock = json.loads(path.read_text())
    warm = min(WARM_STEPS, len(clock) - 1)
    return (clock[-1] - clock[warm]) / (len(clock) - 1 - warm) * 1e3


def main() -> None:
    """Run every contender ``--repeats`` times; print the runs, medians and the defaults' paired differences.

    The order goes through all 6 permutations (each contender as often first, last and right after each other);
    the differences are the defaults' from each DDP, repeat by repeat.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="per replica")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--max-steps", type=int, help="a quick check: this many steps, one repeat")
    args = parser.parse_args()
    if args.max_steps is not None:
        args.steps, args.repeats = max(args.max_steps, 2), 1
    strategies = {
        "ddp": lambda: SharedDeviceDDPStrategy(sync_buffers_at_forward=False, start_method=START),
        # The strongest DDP here: gradients in its buckets (the defaults' own choice), no copies to and from them.
        "ddp_bucket_view": lambda: SharedDeviceDDPStrategy(
            sync_buffers_at_forward=False, start_method=START, gradient_as_bucket_view=True
        ),
        "adaptive_elastic": lambda: AdaptiveElasticStrategy(start_method=START),
    }
    times: dict[str, list[float]] = {name: [] for name in strategies}
    parameters = (args.width + 1) * args.width * args.layers + (args.width + 1) * 10
    print(f"{parameters / 1e6:.1f} million parameters, {args.replicas} replicas, batch {args.batch_size} each")
    with tempfile.TemporaryDirectory() as folder, quiet_lightning():
        for repeat in range(args.repeats):
            order = ORDERS[repeat % len(ORDERS)]
            for name in order:
                times[name].append(ms_per_step(strategies[name](), args, Path(folder) / "clock.json"))
                print(f"repeat {repeat}: {name} {times[name][-1]:.1f} ms per step", flush=True)
    for name, values in times.items():
        listed = sorted(round(value, 1) for value in values)
        print(f"{name}: {listed} ms per step, median {statistics.median(values):.1f}")
    for rival in ("ddp", "ddp_bucket_view"):
        print(paired_difference("adaptive_elastic", times["adaptive_elastic"], rival, times[rival]))


def paired_difference(name: str, values: list[float], rival: str, rival_values: list[float]) -> str:
    """The mean difference of ``values`` from ``rival_values`` repeat by repeat, with its standard error."""
    differences = [value - other for value, other in zip(values, rival_values, strict=True)]
    spread = statistics.stdev(differences) / len(differences) ** 0.5 if len(differences) > 1 else float("nan")
    return (
        f"{name} - {rival}: {statistics.mean(differences):+.1f} ms per step (standard error {spread:.1f}) "
        f"over {len(differences)} repeat{'s' if len(differences) != 1 else ''}"
    )


if __name__ == "__main__":
    main()
