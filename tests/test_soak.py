"""A long run of the default mode: 2,000 steps of 4 replicas under gradient sync, with plans changing.

Validation every 100 steps and a checkpoint every 500. Every replica's resident memory stays flat, every epoch
uses every sample exactly once, the plan history stays bounded, and a run resumed from the middle checkpoint ends
with the uninterrupted run's parameters (the gradient sum is the step batch's mean gradient whatever the plans).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
from helpers import RegressionModel, cpu_trainer, flat_parameters
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_aesgd import AdaptiveElasticStrategy
from lightning_aesgd.engine.plan_loop import HISTORY_LENGTH

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS, REPLICAS, BATCH, SIZE = 2000, 4, 8, 3200  # 32 samples a step: 100 steps an epoch, 20 epochs
PHASE = 500  # replica 1 is slower in every other phase of this many steps: the plans follow it back and forth


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class SoakModel(RegressionModel):
    """The regression net; records each step's epoch and indices, and its memory after warm-up and at the end."""

    def __init__(self) -> None:
        super().__init__(size=SIZE, batch_size=BATCH)
        self.by_epoch: list[tuple[int, list[int]]] = []
        self.memory: dict[str, int] = {}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.by_epoch.append((self.current_epoch, batch[2].tolist()))
        if self.global_rank == 1 and (self.global_step // PHASE) % 2:
            time.sleep(0.0005 * len(batch[0]))  # a slower device for this phase
        if self.global_step >= PHASE and "warm" not in self.memory:
            # At the first step from PHASE on that this replica trains: a replica the plan left out then (a noisy
            # neighbour on a busy machine can make it look that slow) runs no training_step on its idle steps.
            self.memory["warm"] = _resident_bytes()
        return loss


class Record(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        plans = trainer.strategy.plans
        record = {
            "by_epoch": pl_module.by_epoch,
            "memory": {**pl_module.memory, "end": _resident_bytes()},
            "history": len(plans.history),
            "plans": len(plans.plan_book.state_dict()["sizes"]),
            "parameters": flat_parameters(pl_module).tolist(),
            "global_step": trainer.global_step,
        }
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(out: Path, checkpoints: Path, ckpt_path: str | None = None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    every = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=PHASE, save_top_k=-1, filename="{step}")
    trainer = cpu_trainer(
        AdaptiveElasticStrategy(start_method="fork"),
        devices=REPLICAS,
        max_steps=STEPS,
        val_check_interval=100,
        limit_val_batches=2,
        check_val_every_n_epoch=None,
        enable_checkpointing=True,
        callbacks=[every, Record(out)],
    )
    pl.seed_everything(0)
    trainer.fit(SoakModel(), ckpt_path=ckpt_path)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(REPLICAS)]


def test_a_long_run_stays_flat_loses_no_sample_and_resumes_to_the_same_parameters(tmp_path):
    started = time.monotonic()
    records = _fit(tmp_path / "whole", tmp_path / "checkpoints")
    whole_seconds = time.monotonic() - started
    assert all(record["global_step"] == STEPS for record in records)
    for rank, record in enumerate(records):
        assert "warm" in record["memory"], f"rank {rank} trained no step from step {PHASE} on"
        assert record["memory"]["end"] <= 1.05 * record["memory"]["warm"], f"rank {rank}: {record['memory']}"
        assert 0 < record["history"] <= HISTORY_LENGTH
    assert records[0]["plans"] > 2, "the plans followed replica 1's changes of speed"
    epochs: dict[int, list[int]] = {}
    for record in records:
        for epoch, indices in record["by_epoch"]:
            epochs.setdefault(epoch, []).extend(indices)
    assert sorted(epochs) == list(range(STEPS * REPLICAS * BATCH // SIZE))
    for epoch, indices in epochs.items():
        assert sorted(indices) == list(range(SIZE)), f"epoch {epoch}: a sample lost or repeated"

    middle = tmp_path / "checkpoints" / f"step={STEPS // 2}.ckpt"
    resumed = _fit(tmp_path / "resumed", tmp_path / "resumed_checkpoints", ckpt_path=str(middle))
    differences = [
        max(abs(a - b) for a, b in zip(whole["parameters"], again["parameters"], strict=True))
        for whole, again in zip(records, resumed, strict=True)
    ]
    assert max(differences) < 1e-4, f"the resumed run ends {max(differences):.2e} away from the uninterrupted one"
    growth = max(record["memory"]["end"] / record["memory"]["warm"] for record in records)
    print(
        f"soak: {STEPS} steps of {REPLICAS} replicas in {whole_seconds:.0f} s; {records[0]['plans']} plans; memory "
        f"growth after warm-up at most {growth - 1:.1%}; resumed parameters within {max(differences):.1e}"
    )
