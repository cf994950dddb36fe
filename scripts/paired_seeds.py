"""Accuracy and step time at small batches with BatchNorm: the defaults against DDP, seed by seed.

At a small per-replica batch, a BatchNorm layer normalises each replica's few samples by their own statistics, so
which samples share a replica's batch changes the update. The strategy deals the samples with its own sampler, not
Lightning's ``DistributedSampler``, so its runs cannot match DDP's weights; only their accuracy can be compared,
and the difference between two runs of one seed is mostly noise. This script measures it over paired seeds: for
each seed, the same network, initial weights and data under each strategy, in alternating order, on equal CPU
replicas (no emulation) whose ``training_step`` also spins a fixed time (a launch-bound step).

The network is the user's own (an MLP with two BatchNorm layers on Fashion-MNIST, SGD), as a user would write
it. Each run validates every ``--val-every`` steps on ``--val-samples`` test images; its score is the mean
accuracy of its last ``--last`` validations, which averages out the step-to-step wobble of one validation. The
rivals are Lightning's DDP (its per-forward broadcast of the BatchNorm statistics) and DDP without that broadcast
(the strategy does without it too, see ``SharedDeviceDDPStrategy``): the faster DDP is the fairer rival on the
clock.

It prints each seed's scores and milliseconds per step, then for each rival the mean paired difference of the
defaults' score from the rival's, its standard error over the seeds, and the median milliseconds per step of
each. Needs Fashion-MNIST (``scripts/setup_env.sh --with-data``); nothing is downloaded.

Usage::

    python scripts/paired_seeds.py --seeds 10-25 --out bench_results/paired_seeds.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy, Strategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_aesgd import AdaptiveElasticStrategy
from lightning_aesgd.baselines import SharedDeviceDDPStrategy
from lightning_aesgd.bench.race.program import quiet_lightning
from lightning_aesgd.workloads.images import fashion_mnist

START = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
STRATEGIES = ("ddp_lightning", "ddp", "adaptive_elastic")
WARM_STEPS = 10  # left out of the step time: the first plan and the loaders' start


def make_strategy(name: str) -> Strategy:
    """The strategy raced under ``name``: the defaults, or Lightning's DDP as it comes or as the strategy sets it.

    As the strategy sets it: no per-forward broadcast, the gradients in the buckets.
    """
    if name == "adaptive_elastic":
        return AdaptiveElasticStrategy(start_method=START)
    if name == "ddp":
        return SharedDeviceDDPStrategy(sync_buffers_at_forward=False, start_method=START, gradient_as_bucket_view=True)
    return DDPStrategy(start_method=START)


class BatchNormNet(pl.LightningModule):
    """An MLP with two BatchNorm layers; each ``training_step`` also spins ``step_ms`` (a launch-bound step)."""

    def __init__(self, batch_size: int, step_ms: float, lr: float, val_samples: int) -> None:
        super().__init__()
        self.batch_size, self.step_ms, self.lr, self.val_samples = batch_size, step_ms, lr, val_samples
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 128),
            nn.BatchNorm1d(128),
            nn.ReLU(),
            nn.Linear(128, 64),
            nn.BatchNorm1d(64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        end = time.perf_counter() + self.step_ms / 1e3
        while time.perf_counter() < end:  # busy, as a device's launch overhead keeps its host busy
            pass
        return nn.functional.cross_entropy(self.net(x), y)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        accuracy = (self.net(x).argmax(dim=1) == y).float().mean()
        self.log("val_acc", accuracy, sync_dist=True, batch_size=len(x))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_images("train"), batch_size=self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        images = _images("test")
        return DataLoader(TensorDataset(*(t[: self.val_samples] for t in images.tensors)), batch_size=250)


def _images(split: fashion_mnist.Split) -> TensorDataset:
    x, y = fashion_mnist.load_split(split)
    return TensorDataset(x.reshape(-1, 1, 28, 28).float() / 255, y.long())


class Record(pl.Callback):
    """Rank zero's clock at each step's end and each validation's accuracy, written as JSON at the end of fit."""

    def __init__(self, path: Path) -> None:
        self.path, self.clock, self.accuracies = path, [], []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.clock.append(time.perf_counter())

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.accuracies.append(float(trainer.callback_metrics["val_acc"]))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({"clock": self.clock, "accuracies": self.accuracies}))


def run(name: str, seed: int, args: argparse.Namespace, path: Path) -> dict[str, float]:
    """One fit of ``name`` from ``seed``: its score (mean of the last validations) and milliseconds per step."""
    pl.seed_everything(seed, verbose=False)
    model = BatchNormNet(args.batch_size, args.step_ms, args.lr, args.val_samples)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.replicas,
        strategy=make_strategy(name),
        max_steps=args.steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[Record(path)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    record = json.loads(path.read_text())
    clock = record["clock"]
    warm = max(1, min(WARM_STEPS, len(clock) // 2))  # a quick check keeps half its steps
    return {
        "score": statistics.fmean(record["accuracies"][-args.last :]),
        "ms_per_step": (clock[-1] - clock[warm - 1]) / max(1, len(clock) - warm) * 1e3,
    }


def seeds_of(text: str) -> list[int]:
    """``"10-25"`` or ``"1,4,9"``: the seeds to run."""
    if "-" in text:
        first, last = (int(part) for part in text.split("-"))
        return list(range(first, last + 1))
    return [int(part) for part in text.split(",")]


def summary(results: dict[int, dict[str, dict[str, float]]], rivals: list[str]) -> list[str]:
    """Each rival's mean paired difference of the defaults' score (± its standard error), and step times."""
    lines = []
    for rival in rivals:
        differences = [r["adaptive_elastic"]["score"] - r[rival]["score"] for r in results.values()]
        error = statistics.stdev(differences) / math.sqrt(len(differences)) if len(differences) > 1 else math.nan
        ms = {
            name: statistics.median(r[name]["ms_per_step"] for r in results.values())
            for name in (rival, "adaptive_elastic")
        }
        lines.append(
            f"adaptive_elastic - {rival}: score {statistics.fmean(differences):+.4f} ± {error:.4f} (standard error, "
            f"{len(differences)} seeds); ms per step {ms['adaptive_elastic']:.2f} against {ms[rival]:.2f} "
            f"(time per step ÷ {rival}'s: {ms['adaptive_elastic'] / ms[rival]:.2f})"
        )
    return lines


def main() -> None:
    """Race the strategies seed by seed, printing each seed's scores as it ends and the paired summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="10-25", help="a range a-b or a comma list (default 10-25)")
    parser.add_argument("--rivals", default="ddp_lightning,ddp", help="comma list of ddp_lightning, ddp")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per replica (default 8)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--last", type=int, default=6, help="validations averaged into a run's score")
    parser.add_argument("--val-samples", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=3.0, help="fixed busy time of each training_step")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--out", type=Path, default=Path("bench_results/paired_seeds.json"))
    parser.add_argument("--max-steps", type=int, help="a quick check: train this many steps (and validate at the end)")
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's and the strategy's messages")
    args = parser.parse_args()
    if args.max_steps is not None:
        args.steps, args.val_every, args.last = args.max_steps, args.max_steps, 1
    rivals = args.rivals.split(",")
    unknown = set(rivals) - set(STRATEGIES[:2])
    if unknown:
        parser.error(f"unknown rival(s) {sorted(unknown)}: choose from ddp_lightning, ddp")
    if not fashion_mnist.is_available():
        parser.error("Fashion-MNIST is not installed. HINT: run scripts/setup_env.sh --with-data")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    names = [*rivals, "adaptive_elastic"]
    results: dict[int, dict[str, dict[str, float]]] = {}
    for index, seed in enumerate(seeds_of(args.seeds)):
        order = names if index % 2 == 0 else names[::-1]  # alternate, so a drift of the machine favours neither
        with nullcontext() if args.verbose else quiet_lightning():
            results[seed] = {name: run(name, seed, args, args.out.with_suffix(f".{name}.json")) for name in order}
        scores = "  ".join(f"{name} {r['score']:.4f} ({r['ms_per_step']:.2f} ms)" for name, r in results[seed].items())
        print(f"seed {seed}: {scores}", flush=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))
    print("\n".join(summary(results, rivals)))


if __name__ == "__main__":
    main()
