"""Fashion-MNIST with a small CNN, trained by Adaptive SGD on 4 emulated heterogeneous CPU replicas.

Trains :class:`~lightning_aesgd.workloads.FashionCNN` (two convolution–BatchNorm blocks; the strategy merges the
BatchNorm statistics with the weights) for 2 epochs on replicas of relative speeds 1, 1, 1/2 and 1/4, then
tests the merged model in a single process and prints its accuracy (about 0.87).

The data comes from Debian's ``dataset-fashion-mnist`` package (``apt-get install dataset-fashion-mnist``) or
from the folder named by ``$AESGD_FASHION_MNIST_DIR``; nothing is downloaded.

Run it with ``python examples/fashion_mnist.py`` (add ``--max-steps 2`` for a quick check).
"""

import argparse
import multiprocessing
import sys

import pytorch_lightning as pl

from lightning_aesgd import AdaptiveElasticStrategy, ElasticAverage, SlowdownProfile
from lightning_aesgd.workloads import FashionMNISTDataModule, ImageClassifier
from lightning_aesgd.workloads.images import fashion_mnist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: 2 epochs)")
    args = parser.parse_args()
    if not fashion_mnist.is_available():
        sys.exit(
            f"Fashion-MNIST not found in {fashion_mnist.resolve_data_dir()}. Install it with "
            f"`apt-get install dataset-fashion-mnist`, or set {fashion_mnist.ENV_VAR} to a folder holding "
            "its four IDX files."
        )
    pl.seed_everything(0)
    quick = args.max_steps > 0

    datamodule = FashionMNISTDataModule(batch_size=64)  # 64 images per replica and step on average
    datamodule.setup("fit")  # read the files once, before the replicas start
    model = ImageClassifier("fashion_cnn", **datamodule.model_dimensions())
    strategy = AdaptiveElasticStrategy(
        sync="models",  # Adaptive SGD's model merges (the default, "gradients", is DDP's update)
        planner="balanced",
        period=2,
        warmup_steps=10,
        merge_rule=ElasticAverage(momentum=0.3),
        # Replica i is 2·fᵢ times slower than a real core, which keeps 4 replicas on 2 cores out of each
        # other's way while the run stays short.
        slowdown=SlowdownProfile((1, 1, 2, 4), base=2),
        start_method="fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_epochs=2,
        max_steps=args.max_steps,
        limit_val_batches=2 if quick else None,
        log_every_n_steps=50,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=datamodule)

    # After fit the model holds the merged weights: one process tests it, so every test image counts once.
    tester = pl.Trainer(
        accelerator="cpu", devices=1, limit_test_batches=5 if quick else None, logger=False, enable_progress_bar=False
    )
    accuracy = tester.test(model, datamodule=datamodule, verbose=False)[0]["test/acc"]
    print(f"test accuracy of the merged model: {accuracy:.4f}")


if __name__ == "__main__":
    main()
