"""Adaptive SGD against Lightning's DDP on the same emulated heterogeneous devices.

Both runs train the ``mini`` sparse XMC workload on 4 CPU replicas under one slowdown profile (one replica 2×
and one 4× slower): ``adaptive_elastic`` applies the profile itself, Lightning's unmodified ``DDPStrategy``
gets it through ``lightning_aesgd.SlowdownCallback``. Each fit is timed by the wall clock and the script prints
both throughputs and their ratio. The devices are emulated (replicas sleep to look slower), so only the ratio
is meaningful, never the absolute samples per second; start-up costs are included in both times and dilute
the ratio of short runs.

Run it with ``python examples/compare_with_ddp.py`` (add ``--max-steps 2`` for a quick check).
"""

import argparse
import multiprocessing
import time
from typing import Literal

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy, Strategy

from lightning_aesgd import AdaptiveElasticStrategy, ElasticAverage, SlowdownCallback, SlowdownProfile
from lightning_aesgd.workloads import XMCDataModule, XMCModule

REPLICAS, BATCH_SIZE, EPOCHS = 4, 512, 5
PROFILE = SlowdownProfile((1, 1, 2, 4), base=6)  # replica i is 6·fᵢ times slower than a real core
# fork starts CPU replicas fastest; spawn where fork is unavailable (macOS, Windows) or with CUDA.
START: Literal["fork", "spawn"] = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def timed_fit(strategy: Strategy, callbacks: list[pl.Callback], datamodule: XMCDataModule, max_steps: int) -> float:
    """Train a fresh model and return the wall-clock seconds of ``fit``."""
    pl.seed_everything(0)
    model = XMCModule(**datamodule.model_dimensions(), optimizer="adagrad", lr=0.1, sparse_gradients=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=REPLICAS,
        strategy=strategy,
        callbacks=callbacks,
        max_epochs=EPOCHS,
        max_steps=max_steps,
        limit_val_batches=0,  # time training only
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=-1, help=f"stop after this many steps (-1: {EPOCHS} epochs)")
    args = parser.parse_args()
    datamodule = XMCDataModule(preset="mini", batch_size=BATCH_SIZE)
    datamodule.setup("fit")  # generate the data once, before the replicas start
    # Both strategies consume REPLICAS × BATCH_SIZE samples per step, and drop an epoch's incomplete last step.
    steps_per_epoch = len(datamodule.train_set) // (REPLICAS * BATCH_SIZE)
    steps = args.max_steps if args.max_steps > 0 else EPOCHS * steps_per_epoch
    samples = steps * REPLICAS * BATCH_SIZE

    adaptive = AdaptiveElasticStrategy(
        sync="models",  # Adaptive SGD's model merges (the default, "gradients", is DDP's update)
        planner="balanced",
        period=2,
        merge_rule=ElasticAverage(momentum=0.3),
        sample_costs="auto",
        slowdown=PROFILE,
        start_method=START,
    )
    seconds = {
        "adaptive_elastic": timed_fit(adaptive, [], datamodule, args.max_steps),
        "ddp": timed_fit(DDPStrategy(start_method=START), [SlowdownCallback(PROFILE)], datamodule, args.max_steps),
    }
    for name, elapsed in seconds.items():
        print(f"{name:>16}: {steps} steps in {elapsed:6.1f} s, {samples / elapsed:8.0f} samples/s (emulated)")
    ratio = seconds["ddp"] / seconds["adaptive_elastic"]
    print(f"throughput ratio adaptive_elastic / ddp: {ratio:.2f}x (emulated devices: only the ratio is meaningful)")


if __name__ == "__main__":
    main()
