"""Small models, data and fakes shared by the tests (importable by spawned test processes)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


class RegressionData(Dataset):
    """A fixed linear-regression problem: y = X·w* + noise, drawn from a seeded generator."""

    def __init__(self, size: int = 64, features: int = 8, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=generator)
        true_weight = torch.randn(features, 1, generator=generator)
        self.y = self.x @ true_weight + 0.1 * torch.randn(size, 1, generator=generator)
        self.sample_costs = torch.arange(size, dtype=torch.float64) % 5 + 1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[index], self.y[index], torch.tensor(index)


class RegressionModel(pl.LightningModule):
    """A two-layer regression net trained with SGD; records which indices each step saw."""

    def __init__(
        self, size: int = 64, batch_size: int = 4, lr: float = 0.05, momentum: float = 0.0, shuffle: bool = True
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.seen: list[list[int]] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, index = batch
        self.seen.append(index.tolist())
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val/loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("test/loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            RegressionData(self.hparams.size), batch_size=self.hparams.batch_size, shuffle=self.hparams.shuffle
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RegressionData(32, seed=1), batch_size=8)


def cpu_trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    """A quiet Trainer on 2 CPU processes, without validation, logger or checkpoints unless ``kwargs`` ask."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


def flat_parameters(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class FakeCommunicator:
    """A communicator for one process that simulates identical or scripted peers and records every call.

    Args:
        world_size: the number of replicas to pretend.
        rank: this replica's index.
        peers_sum: returns what the other replicas add to an all-reduced tensor; by default they are identical
            to this replica, so a SUM multiplies by ``world_size``.
        peers_max: returns the elementwise maximum of the other replicas' host tensors; by default they are
            identical to this replica, so a MAX changes nothing.
        device: the only device whose tensors the pretended backend reduces, as NCCL takes CUDA tensors only;
            any device when ``None``. Host all-reduces take CPU tensors only, as the gloo host group does.
    """

    def __init__(
        self,
        world_size: int = 2,
        rank: int = 0,
        peers_sum: Callable[[Tensor], Tensor] | None = None,
        device: torch.device | str | None = None,
        peers_max: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self.world_size = world_size
        self.rank = rank
        self.peers_sum = peers_sum or (lambda tensor: tensor * (world_size - 1))
        self.peers_max = peers_max or (lambda tensor: tensor)
        self.device = torch.device(device) if device is not None else None
        self.calls: list[str] = []

    def all_reduce_sum_(self, tensor: Tensor) -> None:
        self.calls.append("all_reduce_sum_")
        _check_backend_device(tensor, self.device)
        tensor.add_(self.peers_sum(tensor.clone()))

    def all_reduce_sum_async(self, tensor: Tensor) -> torch.futures.Future:
        self.all_reduce_sum_(tensor)
        self.calls[-1] = "all_reduce_sum_async"
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([tensor])
        return future

    def host_all_reduce_sum_(self, tensor: Tensor) -> None:
        self.calls.append("host_all_reduce_sum_")
        _check_backend_device(tensor, torch.device("cpu"))
        tensor.add_(self.peers_sum(tensor.clone()))

    def host_all_reduce_max_(self, tensor: Tensor) -> None:
        self.calls.append("host_all_reduce_max_")
        _check_backend_device(tensor, torch.device("cpu"))
        torch.maximum(tensor, self.peers_max(tensor.clone()), out=tensor)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        self.calls.append("all_gather")
        _check_backend_device(tensor, self.device)
        return [tensor.clone() for _ in range(self.world_size)]

    def sums_sparse(self, device: torch.device) -> bool:
        return self.device is None or self.device.type == "cpu"

    def broadcast_(self, tensor: Tensor, src: int = 0) -> None:
        self.calls.append("broadcast_")
        _check_backend_device(tensor, self.device)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.calls.append("all_gather_object")
        return [obj] * self.world_size

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        self.calls.append("gather_object")
        return [obj] * self.world_size if self.rank == dst else None

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self.calls.append("broadcast_object")
        return obj


def _check_backend_device(tensor: Tensor, device: torch.device | None) -> None:
    # NCCL's own words for a CPU tensor; a collective is where a tensor on the wrong device first fails.
    if device is not None and tensor.device.type != device.type:
        raise RuntimeError(f"No backend type associated with device type {tensor.device.type}")


def single_process_trainer(epochs: int) -> pl.Trainer:
    """A quiet one-process CPU Trainer for the workloads' learning tests."""
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def no_report_on_its_own(table: Tensor, comm: Any) -> Any:
    """Stands in for a report's own all-reduce (``report_exchange._summed``) where every report must ride in a sum."""
    raise AssertionError("a report table had an all-reduce of its own instead of riding in the last bucket's sum")


def load_script(name: str) -> ModuleType:
    """The module of ``scripts/<name>.py`` (scripts are not a package), loaded afresh."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
