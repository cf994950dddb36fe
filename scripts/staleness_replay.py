"""Replay a workload's training on one process, each step's gradient applied at once or one step late.

What a one-step-stale gradient (ABS-SGD, ``gradient_delay=1``) does to the optimization, apart from everything
distributed: one replica, the workload's model and optimizer, the same step batch, and the strategy's own
momentum compensation (``GradientSum.compensated``). The method card ``docs/methods/abs_sgd.md``
quotes its figures. Examples::

    python scripts/staleness_replay.py xmc --delay 0            # XMC mini, Adagrad: P@1 every 7 steps
    python scripts/staleness_replay.py xmc --delay 1 --warmup 20 --lr-scale 0.5   # algorithm=abs_sgd's settings
    python scripts/staleness_replay.py fashion --delay 1 --compensate   # Fashion-MNIST CNN: test accuracy per epoch
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from lightning_aesgd.engine.gradients import GradientSum
from lightning_aesgd.engine.pipeline import scaled_learning_rate


def replay(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    loss_of: Callable[[Any], Tensor],
    delay: int,
    warmup: int,
    compensate: bool,
    lr_scale: float = 1.0,
) -> Iterable[int]:
    """Train over ``batches``, yielding each step's count; from step ``warmup`` on, apply gradients ``delay`` late.

    Stale updates run at ``lr_scale`` times the learning rate (the strategy's ``gradient_delay_lr_scale``); the
    first delayed update is fresh (the step that computed it applied nothing) and runs at the full rate.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    reduce = GradientSum(delay=1, compensate_momentum=compensate)
    pending: list[Tensor | None] | None = None
    pending_is_stale = False
    for step, batch in enumerate(batches, start=1):
        optimizer.zero_grad(set_to_none=True)
        loss_of(batch).backward()
        if not delay or step <= warmup:
            optimizer.step()
        else:
            fresh = [None if p.grad is None else p.grad.clone() for p in params]
            if pending is not None:  # the first delayed step applies nothing, as after a flush
                reduce.read_momentum(optimizer)
                sums = {id(p): g for p, g in zip(params, pending, strict=True) if g is not None}
                given = reduce.compensated(sums)
                for param in params:
                    param.grad = given.get(id(param))
                with scaled_learning_rate(optimizer, lr_scale if pending_is_stale else 1.0):
                    optimizer.step()
            # As the strategy: a sum is stale when applied only if its own step moved the parameters.
            pending, pending_is_stale = fresh, pending is not None
        yield step


def xmc(options: argparse.Namespace) -> None:
    """XMC mini with the built-in model (Adagrad, lr 0.1), 2,048 rows per step; P@1 on 1,600 validation rows."""
    from lightning_aesgd.workloads import XMCDataModule, XMCModule
    from lightning_aesgd.workloads.xmc.metrics import precision_at_k

    data = XMCDataModule(preset="mini", batch_size=2048)
    data.setup("fit")
    model = XMCModule(**data.model_dimensions(), sparse_gradients=True)
    num_labels = model.hparams["num_labels"]
    validation = next(iter(data.val_dataloader()))

    def batches() -> Iterable[Any]:
        while True:
            yield from data.train_dataloader()

    def loss_of(batch: Any) -> Tensor:
        return model.loss(model(batch), batch.dense_labels(num_labels))

    for step in replay(model, model.configure_optimizers(), batches(), loss_of, **_modes(options)):
        if step % 7 == 0:
            with torch.no_grad():
                p_at_1 = precision_at_k(model(validation), validation.dense_labels(num_labels), 1).mean().item()
            print(f"step {step}: val P@1 {p_at_1:.3f}", flush=True)
        if step >= options.steps:
            return


def fashion(options: argparse.Namespace) -> None:
    """Fashion-MNIST's CNN (SGD, lr 0.02, momentum 0.9), 256 images per step; test accuracy after each epoch.

    Evaluated without a flush (the model one update behind), where the strategy would apply the sum in flight.
    """
    from lightning_aesgd.workloads import FashionMNISTDataModule
    from lightning_aesgd.workloads.images.models import ImageClassifier

    data = FashionMNISTDataModule(batch_size=256)
    data.setup("fit")
    data.setup("test")
    model = ImageClassifier(network="fashion_cnn", **data.model_dimensions())
    steps_per_epoch = len(data.train_dataloader())

    def batches() -> Iterable[Any]:
        for _ in range(options.epochs):
            yield from data.train_dataloader()

    def loss_of(batch: Any) -> Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(model(inputs), labels)

    model.train()
    for step in replay(model, model.configure_optimizers(), batches(), loss_of, **_modes(options)):
        if step % steps_per_epoch == 0:
            model.eval()
            correct = total = 0
            with torch.no_grad():
                for inputs, labels in data.test_dataloader():
                    correct += int((model(inputs).argmax(dim=1) == labels).sum())
                    total += len(labels)
            print(f"epoch {step // steps_per_epoch - 1}: test accuracy {correct / total:.4f}", flush=True)
            model.train()


def _modes(options: argparse.Namespace) -> dict[str, Any]:
    return {
        "delay": options.delay,
        "warmup": options.warmup,
        "compensate": options.compensate,
        "lr_scale": options.lr_scale,
    }


def main() -> None:
    """Parse the options and replay the chosen workload."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["xmc", "fashion"])
    parser.add_argument("--delay", type=int, choices=[0, 1], default=1, help="steps a gradient waits (default 1)")
    parser.add_argument("--warmup", type=int, default=0, help="synchronous steps before the delay starts")
    parser.add_argument("--compensate", action="store_true", help="spike compensation of SGD momentum")
    parser.add_argument("--lr-scale", type=float, default=1.0, help="factor on the rate of stale updates")
    parser.add_argument("--steps", type=int, default=56, help="xmc: steps to train")
    parser.add_argument("--epochs", type=int, default=3, help="fashion: epochs to train")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(options.seed, verbose=False)
    {"xmc": xmc, "fashion": fashion}[options.workload](options)


if __name__ == "__main__":
    main()
