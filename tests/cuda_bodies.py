"""Bodies of the ``cuda`` tests, run in a fresh process that sees the GPUs (``tests/cuda_run.py``).

Each function fits on the first GPU and raises if anything is off; the replicas start by spawn, as on any
machine where CUDA may already be in use.
"""

from __future__ import annotations

import math
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from helpers import RegressionModel, flat_parameters
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_aesgd import AdaptiveElasticStrategy, SlowdownCallback

TIMEOUT = timedelta(seconds=120)


class SparseBags(Dataset):
    """Bags of feature ids with a target per bag: the shape of sparse extreme classification, small."""

    def __init__(self, size: int = 256, features: int = 500, per_bag: int = 6) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(features, (size, per_bag), generator=generator)
        self.targets = (self.ids % 7 == 0).float().mean(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.ids[index], self.targets[index]


class SparseModel(pl.LightningModule):
    """An ``EmbeddingBag(sparse=True)`` under a linear head: every step has a sparse gradient bucket."""

    def __init__(self, features: int = 500) -> None:
        super().__init__()
        self.bags = nn.EmbeddingBag(features, 16, mode="sum", sparse=True)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, targets = batch
        return nn.functional.mse_loss(self.head(self.bags(ids)), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SparseBags(), batch_size=16, shuffle=True)


class BatchableRegression(RegressionModel):
    """The regression model without its host read of the indices (``.tolist()``), which no batched step can do."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, _ = batch
        return nn.functional.mse_loss(self(x), y)


def _trainer(strategy: AdaptiveElasticStrategy, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "gpu",
        "devices": 1,
        "max_steps": 12,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


def _fit_and_check(model: pl.LightningModule, strategy: AdaptiveElasticStrategy, **kwargs: Any) -> None:
    pl.seed_everything(3)
    before = flat_parameters(model).clone()
    trainer = _trainer(strategy, **kwargs)
    trainer.fit(model)
    after = flat_parameters(model)
    assert trainer.state.finished, trainer.state
    assert torch.isfinite(after).all(), "the fitted model is not finite"
    assert not torch.equal(after.cpu(), before.cpu()), "training did not move the parameters"


def _strategy(sync: str, **options: Any) -> AdaptiveElasticStrategy:
    return AdaptiveElasticStrategy(sync=sync, start_method="spawn", timeout=TIMEOUT, **options)  # type: ignore[arg-type]


def fit_each_sync_mode(accelerator: str = "gpu", devices: int = 1) -> None:
    """A spawn-launched fit of a bufferless model under each sync mode (the first merge included)."""
    for sync in ("gradients", "models"):
        _fit_and_check(RegressionModel(), _strategy(sync), accelerator=accelerator, devices=devices)


def fit_sparse_gradients(sync: str, delay: int, accelerator: str = "gpu", devices: int = 1) -> None:
    """A sparse gradient bucket (over NCCL on a GPU) under ``sync``, with ABS-SGD's delay where ``delay``."""
    options = {"gradient_delay": delay} if delay else {}
    _fit_and_check(SparseModel(), _strategy(sync, **options), accelerator=accelerator, devices=devices)


def fit_with_averaged_optimizer_state() -> None:
    """``optimizer_state="average"`` all-reduces the optimizer's moments on the GPU."""
    _fit_and_check(RegressionModel(momentum=0.9), _strategy("models", optimizer_state="average"))


def fit_in_precision(precision: str, sync: str) -> None:
    """A fit under a mixed precision (bf16-mixed, 16-mixed)."""
    _fit_and_check(RegressionModel(), _strategy(sync), precision=precision)


def fit_replicas_sharing_the_gpu(sync: str) -> None:
    """Two replica processes on the first GPU, over gloo: plans, merges and the sampler on CUDA."""
    _fit_and_check(RegressionModel(), _strategy(sync, replicas_per_device=2, slowdown=[1, 3]))


class _SatOut(pl.Callback):
    """Writes the steps each rank sat out into ``directory`` when its training ends."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = trainer.strategy.engine.sat_out_steps  # type: ignore[attr-defined]
        (self.directory / f"sat_out{trainer.global_rank}").write_text(str(steps))


def fit_a_straggler_among_replicas_sharing_the_gpu(directory: str, accelerator: str = "gpu") -> None:
    """Three replicas on the first GPU over gloo, the third 50 times slower: the other two sum their gradients in a
    subgroup that leaves it out (which a gloo group bound to the GPU failed to form), and it sits out."""
    slow = SlowdownCallback({"factors": [1, 1, 50], "mode": "user", "seconds_per_sample": 0.001})
    model = RegressionModel(size=480, batch_size=8)  # 20 steps an epoch of 24 samples among 3 replicas
    strategy = _strategy("gradients", replicas_per_device=3)
    options = {"accelerator": accelerator, "max_steps": -1, "max_epochs": 2, "callbacks": [slow, _SatOut(directory)]}
    _fit_and_check(model, strategy, **options)
    sat_out = [int((Path(directory) / f"sat_out{rank}").read_text()) for rank in range(3)]
    assert sat_out[2] > 0, f"steps each replica sat out: {sat_out}"
    assert sat_out[0] == sat_out[1] == 0, f"steps each replica sat out: {sat_out}"


def fit_placed_replicas(sync: str, sparse: bool, devices: tuple[str, ...] = ("cuda:0", "cpu")) -> None:
    """Replicas placed by ``replica_devices`` (by default a GPU replica and a CPU replica, over gloo), dense or sparse
    gradients: each rank on its own accelerator, a CPU replica in 32-bit under a GPU replica's bf16 autocast."""
    model = SparseModel() if sparse else RegressionModel()
    strategy = _strategy(sync, replica_devices=list(devices))
    precision = "bf16-mixed" if "cuda:0" in devices else "32-true"
    _fit_and_check(model, strategy, accelerator="auto", precision=precision)


def fit_learners(learners: int | str, precision: str = "32-true", accelerator: str = "gpu", devices: int = 1) -> None:
    """Several learners per replica (Crossbow) in one batched step: stacked models, optimizer and merges on the
    device, under ``precision``; ``"auto"`` measures them there first."""
    options = {"learners_per_device": learners, "merge_rule": "sma", "planner": "static", "max_learners": 2}
    _fit_and_check(
        BatchableRegression(momentum=0.9),
        _strategy("models", **options),
        accelerator=accelerator,
        devices=devices,
        precision=precision,
    )


class HostSyncs(pl.Callback):
    """Counts each training step's host synchronisations from step ``start`` on.

    Counted: what torch.cuda's sync debug mode flags (``.item()``, ``.cpu()``, ``.tolist()``, blocking copies,
    stream synchronisations) and every wait for an event or for the whole device, which it does not flag. A
    step's window runs from its ``on_train_batch_start`` to the next step's (the last one's to the end of fit),
    so it holds everything the loop, the strategy and the model do for that step.

    Given ``allowed`` (a plain single-device Trainer's counts over the same steps), the fit fails at its end where
    the strategy adds more than ``per_report`` synchronisations to a step, or adds any to more steps than it can
    report at (one every ``every`` steps).
    """

    def __init__(self, start: int, allowed: list[int] | None = None, per_report: int = 1, every: int = 3) -> None:
        self.start, self.allowed, self.per_report, self.every = start, allowed, per_report, every
        self.counts: list[int] = []
        self._catcher: Any = None
        self._caught: list[warnings.WarningMessage] = []
        self._waits = 0
        self._originals: list[tuple[Any, str, Any]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Set up here, in the process that trains (a spawned replica's): the waits the debug mode does not flag.
        for owner, name in ((torch.cuda.Event, "synchronize"), (torch.cuda, "synchronize")):
            original = getattr(owner, name)
            self._originals.append((owner, name, original))
            setattr(owner, name, self._counted(original))

    def _counted(self, wait: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._catcher is not None:
                self._waits += 1
            return wait(*args, **kwargs)

        return counted

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self._close()
        if trainer.global_step >= self.start:
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()
        for owner, name, original in self._originals:
            setattr(owner, name, original)
        if self.allowed is None:
            return
        seen = f"the strategy's {self.counts}, the plain Trainer's {self.allowed}"
        assert len(self.counts) == len(self.allowed), f"the runs counted different steps: {seen}"
        extra = [count - allowed for count, allowed in zip(self.counts, self.allowed, strict=True)]
        most = max(extra)
        assert most <= self.per_report, f"a step synchronised {most} times beyond a plain Trainer's: {seen}"
        synchronised, reports = sum(e > 0 for e in extra), math.ceil(len(extra) / self.every)
        assert synchronised <= reports, f"{synchronised} steps synchronised, reports come at most {reports}: {seen}"

    def _close(self) -> None:
        if self._catcher is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        flagged = sum("synchroniz" in str(caught.message) for caught in self._caught)
        self.counts.append(flagged + self._waits)
        self._catcher.__exit__(None, None, None)
        self._catcher, self._waits = None, 0


def count_host_synchronisations(sync: str) -> None:
    """A lone GPU replica synchronises with the host no more than a plain Trainer, but at its reports.

    Under gradient sums a report comes at most every ``lag + 1`` steps (3 here) and reads the device once; under
    model merges every merge reports (here every 3 steps), and reads the device once too: the finite flag and the
    weight travel in the merge's collective, and come back with the merged rows. The plain Trainer's counts,
    measured first in this process, bound the strategy's over the same steps (its replica is spawned, so it checks
    them there). A step that waits for the host leaves a host-bound GPU idle.
    """
    steps, start, every = 80, 20, 3
    options = {"plan_lag": every - 1} if sync == "gradients" else {"period": every}

    def trainer(strategy: Any, callback: HostSyncs) -> pl.Trainer:
        return _trainer(strategy, max_steps=steps, callbacks=[callback])

    plain = HostSyncs(start)
    pl.seed_everything(3)
    trainer("auto", plain).fit(BatchableRegression(size=2048, batch_size=16))
    assert len(plain.counts) == steps - start, plain.counts
    checked = HostSyncs(start, allowed=plain.counts, per_report=1, every=every)
    pl.seed_everything(3)
    trainer(_strategy(sync, **options), checked).fit(BatchableRegression(size=2048, batch_size=16))
