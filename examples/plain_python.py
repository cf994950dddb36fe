"""Adaptive SGD from plain Python (no Hydra): sparse XMC on 4 emulated heterogeneous CPU replicas.

Trains the ``mini`` synthetic XMC data set with the strategy configured as the ``adaptive_sgd`` config does,
on 4 CPU replicas of which one is 2× and one 4× slower (emulated), logs to CSV, then tests the merged model
in a single process and prints P@1 and P@5. The CSV also holds the strategy's own metrics, ``aesgd/...``: per
replica ``samples_per_sec``, ``batch_size``, ``share``, ``merge_weight``, ``step_seconds``, ``wait_fraction``,
and ``aesgd/step_time_balance`` (1.0 when all replicas finish their step together).

Run it with ``python examples/plain_python.py`` (add ``--max-steps 2`` for a quick check).
"""

import argparse
import csv
import multiprocessing
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger

from lightning_aesgd import AdaptiveElasticStrategy, ElasticAverage, SlowdownProfile
from lightning_aesgd.workloads import XMCDataModule, XMCModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: 5 epochs)")
    parser.add_argument("--log-dir", default="lightning_logs", help="where the CSV logger writes")
    args = parser.parse_args()
    pl.seed_everything(0)

    datamodule = XMCDataModule(preset="mini", batch_size=512)  # 512 rows per replica and step
    model = XMCModule(**datamodule.model_dimensions(), optimizer="adagrad", lr=0.1, sparse_gradients=True)
    strategy = AdaptiveElasticStrategy(
        sync="models",  # Adaptive SGD's model merges (the default, "gradients", is DDP's update)
        planner="balanced",  # batch sizes that give every replica the same predicted step time
        period=2,  # merge every 2 local steps
        merge_rule=ElasticAverage(momentum=0.3),  # outer momentum of the merged model
        sample_costs="auto",  # a sparse row costs its non-zeros
        # Replica i is 6·fᵢ times slower than a real core: devices of relative speeds 1, 1, 1/2, 1/4.
        slowdown=SlowdownProfile((1, 1, 2, 4), base=6),
        # fork starts CPU replicas fastest; spawn where fork is unavailable (macOS, Windows) or with CUDA.
        start_method="fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn",
    )
    # A fixed version: after a fork or spawn launch the main process would otherwise count one version past the
    # folder rank zero wrote.
    logger = CSVLogger(args.log_dir, name="plain_python", version="")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_epochs=5,
        max_steps=args.max_steps,
        log_every_n_steps=1,  # the strategy logs its aesgd/ metrics at merges that fall on logging steps
        num_sanity_val_steps=0,
        logger=logger,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=datamodule)

    # After fit the model holds the merged weights: one process tests it, so every test row counts once.
    tester = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    results = tester.test(model, datamodule=datamodule, verbose=False)[0]
    print(f"test P@1 = {results['test/p@1']:.4f}, P@5 = {results['test/p@5']:.4f}")

    # Rank zero wrote the CSV; the strategy's own columns are named aesgd/... (see the module docstring).
    metrics_csv = Path(logger.log_dir) / "metrics.csv"
    with metrics_csv.open() as handle:
        rows = list(csv.DictReader(handle))
    balance = [float(row["aesgd/step_time_balance"]) for row in rows if row.get("aesgd/step_time_balance")]
    if balance:  # slowest over fastest replica's busy time per step, first and last logged
        print(f"{metrics_csv}: aesgd/step_time_balance {balance[0]:.2f} -> {balance[-1]:.2f} (1.0: balanced)")


if __name__ == "__main__":
    main()
