"""One slowness run: a few dozen steps of a case under one strategy, timed by rank zero after a warm-up.

Replicas are forked processes on the CPU. Only the ``step`` mode is emulated by ``adaptive_elastic`` itself,
inside its optimizer step; every other mode is :class:`~lightning_aesgd.callbacks.SlowdownCallback`'s, applied
to every strategy alike.

Lightning's DDP runs without its per-forward broadcast of the buffers, as the strategy does (it hands rank zero's
buffers to every replica at evaluation, checkpoints and the end of fit): for a model with BatchNorm layers that
broadcast is a second collective per step, which would slow DDP down for a reason that is not the algorithm.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from torch.utils.data import TensorDataset

from lightning_aesgd.bench.slowness.cases import BATCH, Case
from lightning_aesgd.bench.slowness.model import Classifier
from lightning_aesgd.callbacks import SlowdownCallback
from lightning_aesgd.emulation.profiles import SlowdownProfile
from lightning_aesgd.engine.telemetry import step_time_balance, taking_part
from lightning_aesgd.settings import NO_BUFFER_SYNC_AT_FORWARD
from lightning_aesgd.strategy import AdaptiveElasticStrategy

WARMUP_STEPS = 10  # steps before the throughput clock starts (start-up, first plans)
PLAN_CHECK_STEP = 30


def plan_check_step(steps: int) -> int:
    """The step whose plan is judged: :data:`PLAN_CHECK_STEP`, or the last step of a shorter run."""
    return min(PLAN_CHECK_STEP, steps - 1)


@dataclass
class RunResult:
    """What one run measured (rank zero's view)."""

    algorithm: str
    samples_per_second: float
    seconds_per_step: float
    cpu_seconds_per_step: float
    plan_at_check: list[int] | None = None
    first_plan: list[int] | None = None  # the first plan made from measurements (None: the initial split held)
    smallest_batch: int | None = None
    final_plan: list[int] | None = None
    step_time_balance: float | None = None


class StepClock(pl.Callback):
    """Rank zero's wall clock at the end of every step, the plans ``adaptive_elastic`` used, as JSON.

    With them, the slowest replica's active time per step over the fastest's as the strategy last measured it
    (:func:`~lightning_aesgd.engine.telemetry.step_time_balance`): whether the plan made the replicas finish
    together, whatever their speeds turned out to be.

    Args:
        path: where rank zero writes the record.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.times: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:  # noqa: D102
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        if not trainer.is_global_zero:
            return
        loop = getattr(trainer.strategy, "plans", None)
        plans = loop.plan_book.state_dict() if loop is not None and loop.plan_book is not None else None
        stats = loop.stats() if loop is not None else []
        if stats and loop is not None and loop.plan_book is not None:
            stats = taking_part(stats, loop.plan_book.latest)[0]  # a left-out replica's time is stale
        balance = step_time_balance(stats) if stats else None
        record = {"times": self.times, "cpu": self.cpu, "plans": plans, "step_time_balance": balance}
        self.path.write_text(json.dumps(record))


def run_once(
    case: Case,
    algorithm: str,
    dataset: TensorDataset,
    steps: int,
    out: Path,
    factors: tuple[float, ...] | None = None,
    batch_size: int = BATCH,
    name: str | None = None,
) -> RunResult:
    """Train ``steps`` steps of ``case`` under ``algorithm`` (``ddp``, ``adaptive_elastic`` or ``solo``).

    ``factors`` replace the case's own (their number is the number of processes), e.g. ``(1.0,)`` for one
    replica alone, which under a CPU quota still gets the share of the cores one of the case's replicas gets.
    ``batch_size`` is per replica and step; ``name`` names the run's record (the algorithm by default).
    """
    factors = factors or case.factors
    path = out / "runs" / f"{case.name}-{name or algorithm}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    strategy, slowdown = _strategy(algorithm, case.profile(factors), replicas_sharing=len(case.factors))
    pl.seed_everything(0)
    trainer = _trainer(len(factors), strategy, steps, [StepClock(path), *slowdown])
    trainer.fit(Classifier(dataset, case.network, case.workers, batch_size=batch_size))
    return run_result(algorithm, json.loads(path.read_text()), len(factors), steps, batch_size)


def run_result(algorithm: str, record: dict[str, Any], replicas: int, steps: int, batch_size: int = BATCH) -> RunResult:
    """The figures of a :class:`StepClock` record: per-step times after the warm-up, and the plans."""
    times, cpu = record["times"], record["cpu"]
    first = min(WARMUP_STEPS, len(times) // 2)
    seconds = (times[-1] - times[first - 1]) / (len(times) - first)
    cpu_seconds = (cpu[-1] - cpu[first - 1]) / (len(cpu) - first)
    result = RunResult(algorithm, batch_size * replicas / seconds, seconds, cpu_seconds)
    plans = record["plans"]
    if plans is not None:
        starts, sizes = plans["starts"], plans["sizes"]
        at_check = max(i for i, start in enumerate(starts) if start <= plan_check_step(steps))
        result.plan_at_check = sizes[at_check]
        result.first_plan = sizes[1] if len(sizes) > 1 else None
        result.smallest_batch = min(min(plan) for plan in sizes)
        result.final_plan = sizes[-1]
        result.step_time_balance = record.get("step_time_balance")
    return result


def _strategy(algorithm: str, profile: SlowdownProfile | None, replicas_sharing: int) -> tuple[Any, list[pl.Callback]]:
    """The Lightning strategy of ``algorithm``, and the callbacks that apply ``profile`` where it does not."""
    inside = algorithm == "adaptive_elastic" and profile is not None and profile.mode == "step"
    slowdown: list[pl.Callback] = []
    if profile is not None and not inside:
        slowdown.append(SlowdownCallback(profile, replicas_sharing=replicas_sharing))
    if algorithm == "adaptive_elastic":
        return AdaptiveElasticStrategy(slowdown=profile if inside else None, start_method="fork"), slowdown
    if algorithm == "ddp":
        # DDP as the strategy configures it: no per-forward broadcast, the gradients in the buckets.
        fair = {**NO_BUFFER_SYNC_AT_FORWARD, "gradient_as_bucket_view": True}
        return pl.strategies.DDPStrategy(start_method="fork", **fair), slowdown
    return "auto", slowdown


def _trainer(devices: int, strategy: Any, steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    """A CPU Trainer of ``steps`` training steps that keeps no logs, checkpoints or validation."""
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
