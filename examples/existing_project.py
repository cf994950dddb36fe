"""An ordinary Lightning project that gains Adaptive SGD with one import and one argument.

The model and data below are what any Lightning user writes: a LightningModule and plain
``DataLoader(..., batch_size=..., shuffle=True)`` loaders over scikit-learn's bundled digits (needs
scikit-learn; nothing is downloaded). The whole change against the DDP version of this script is::

    + import lightning_aesgd  # registers strategy="adaptive_elastic"
    - trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=...)
    + trainer = Trainer(accelerator="cpu", devices=2, strategy="adaptive_elastic", max_epochs=...)

Run it with ``python examples/existing_project.py`` (add ``--max-steps 2`` for a quick check). Like Lightning's
DDP, the strategy starts the second process by running this script again, hence the ``__main__`` guard.
"""

import argparse

import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_aesgd  # noqa: F401  (the one import: registers strategy="adaptive_elastic")


class DigitClassifier(pl.LightningModule):
    """A two-layer perceptron on 8×8 digit images."""

    def __init__(self, hidden: int = 64, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        accuracy = (self(x).argmax(dim=1) == y).float().mean()
        self.log("val_acc", accuracy, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


def digit_loaders(batch_size: int = 32) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders over scikit-learn's 1,797 digits (the last 297 for validation)."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train = TensorDataset(x[:1500], y[:1500])
    val = TensorDataset(x[1500:], y[1500:])
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: 10 epochs)")
    args = parser.parse_args()
    pl.seed_everything(0)
    train_loader, val_loader = digit_loaders()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="adaptive_elastic",  # the one argument; "ddp" is Lightning's data-parallel baseline
        max_epochs=10,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
    )
    model = DigitClassifier()
    trainer.fit(model, train_loader, val_loader)
    # After fit, every process holds the same model (DDP's updates): validate it (each process scores half).
    accuracy = trainer.validate(model, val_loader, verbose=False)[0]["val_acc"]
    if trainer.is_global_zero:
        print(f"validation accuracy of the trained model: {accuracy:.3f}")


if __name__ == "__main__":
    main()
