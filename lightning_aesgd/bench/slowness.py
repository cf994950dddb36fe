"""``python -m lightning_aesgd.bench slowness``: the strategy against slowness it did not create, beside DDP.

Every case trains the same small MLP on real data (Fashion-MNIST's images, or scikit-learn's digits where
Fashion-MNIST is not installed) with 4 replicas, once under Lightning's ``DDPStrategy`` and once under
``strategy="adaptive_elastic"`` with its defaults, in the same run. The slowness comes from
:class:`~lightning_aesgd.callbacks.SlowdownCallback`, applied to both strategies alike, in the place the
case's mode says: the user's ``training_step``, the DataLoader's collate function, ``on_train_batch_end``, a
real CPU quota per process, or (for comparison) the emulation inside the optimizer step. Per case it reports:

* throughput (samples per second over the steps after a warm-up) and its ratio to DDP's;
* efficiency: throughput over the ideal, the sum of the replicas' solo speeds (one process alone at cost 1
  measures ``s₁``; the ideal is ``s₁ · Σ 1/fᵢ``);
* the plan at step 30 against the speed-proportional ideal (largest relative share error), and the smallest
  batch any replica got;
* a ``machinery`` case: wall time per step of a model that does almost nothing, for one process without any
  strategy, DDP and ``adaptive_elastic``: the difference is each strategy's per-step cost.

Results are ratios measured within one run on this machine, never absolute device speeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_aesgd.callbacks import SlowdownCallback
from lightning_aesgd.core.planning import share_error
from lightning_aesgd.cpu_quota import quota_unavailable
from lightning_aesgd.slowdown import SlowdownProfile
from lightning_aesgd.strategy import AdaptiveElasticStrategy
from lightning_aesgd.workloads.images import FashionCNN

REPLICAS = 4
BATCH = 64  # per replica and step; the step batch is 256
HETEROGENEOUS = (1.0, 1.0, 2.0, 4.0)
HOMOGENEOUS = (1.0, 1.0, 1.0, 1.0)
WARMUP_STEPS = 10  # steps before the throughput clock starts (start-up, first plans)
PLAN_CHECK_STEP = 30
RESULTS_FILE = "slowness.json"


@dataclass(frozen=True)
class Case:
    """One kind of slowness: where it lands, how much per step, on which devices.

    Attributes:
        name: the case's name in tables.
        mode: the slowdown mode (see :mod:`lightning_aesgd.slowdown`).
        factors: each replica's cost factor.
        step_ms: milliseconds of a cost-1 replica's step that the emulation adds (64-sample batches).
        workers: DataLoader worker processes per replica.
        network: ``"mlp"`` (little compute: the emulation is the device) or ``"cnn"`` (a small convolutional
            network: real compute per step, few parameters, for the modes that slow real work down).
        base: the ``step`` mode's common factor.
    """

    name: str
    mode: str
    factors: tuple[float, ...]
    step_ms: float = 64.0
    workers: int = 0
    network: str = "mlp"
    base: float = 1.0

    def profile(self, factors: tuple[float, ...] | None = None) -> SlowdownProfile:
        """The slowdown profile of this case (for other ``factors`` when given, e.g. one solo replica)."""
        per_sample = self.step_ms / 1000 / BATCH if self.mode in ("user", "data", "hook") else None
        mode: Any = self.mode
        return SlowdownProfile(factors or self.factors, base=self.base, mode=mode, seconds_per_sample=per_sample)


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("user", "user", HETEROGENEOUS),
        Case("user+workers", "user", HETEROGENEOUS, workers=1),
        Case("data", "data", HETEROGENEOUS, workers=1),
        Case("hook", "hook", HETEROGENEOUS),
        Case("quota", "quota", HETEROGENEOUS, step_ms=0.0, network="cnn"),
        Case("step", "step", HETEROGENEOUS, step_ms=0.0, network="cnn", base=2.0),
        Case("short", "user", HETEROGENEOUS, step_ms=5.0),
        Case("equal-60ms", "user", HOMOGENEOUS, step_ms=60.0),
        Case("equal-5ms", "user", HOMOGENEOUS, step_ms=5.0),
    )
}
"""The cases by name; ``machinery`` is measured separately."""


@dataclass
class RunResult:
    """What one run measured (rank zero's view)."""

    algorithm: str
    samples_per_second: float
    seconds_per_step: float
    cpu_seconds_per_step: float
    plan_at_check: list[int] | None = None
    smallest_batch: int | None = None
    final_plan: list[int] | None = None


@dataclass
class CaseResult:
    """One case: DDP, adaptive_elastic, and the ideal."""

    case: str
    mode: str
    factors: list[float]
    step_ms: float
    workers: int
    ideal: float | None
    runs: dict[str, RunResult] = field(default_factory=dict)

    def ratio(self) -> float:
        """adaptive_elastic's throughput over DDP's."""
        return self.runs["adaptive_elastic"].samples_per_second / self.runs["ddp"].samples_per_second

    def efficiency(self, algorithm: str) -> float | None:
        """Throughput over the ideal (the sum of solo speeds)."""
        return None if self.ideal is None else self.runs[algorithm].samples_per_second / self.ideal

    def plan_error(self) -> float | None:
        """Largest relative share error of the plan at step 30 against the speed-proportional ideal."""
        plan = self.runs["adaptive_elastic"].plan_at_check
        return None if plan is None else share_error(plan, [1 / f for f in self.factors])


class Classifier(pl.LightningModule):
    """The user's model in every case: an image classifier trained with SGD.

    Args:
        network: ``"mlp"`` (one hidden layer of 64 units), ``"cnn"`` (:class:`FashionCNN`) or ``"tiny"`` (one
            linear layer: almost no work per step).
        lr: SGD learning rate.
    """

    def __init__(self, network: str, lr: float = 0.05) -> None:
        super().__init__()
        layers: dict[str, Callable[[], nn.Module]] = {
            "mlp": lambda: nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10)),
            "cnn": FashionCNN,
            "tiny": lambda: nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10)),
        }
        self.net = layers[network]()
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:  # noqa: D102
        inputs, labels = batch
        return nn.functional.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:  # noqa: D102
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LoaderModule(Classifier):
    """The classifier with its training DataLoader (so that the ``data`` mode finds the hook that builds it).

    Args:
        dataset: the training data.
        network: see :class:`Classifier`.
        workers: DataLoader worker processes.
    """

    def __init__(self, dataset: TensorDataset, network: str, workers: int) -> None:
        super().__init__(network)
        self.dataset = dataset
        self.workers = workers

    def train_dataloader(self) -> DataLoader[Any]:  # noqa: D102
        return DataLoader(self.dataset, batch_size=BATCH, shuffle=True, num_workers=self.workers)


class StepClock(pl.Callback):
    """Rank zero's wall clock at the end of every step, and the plan ``adaptive_elastic`` used, as JSON.

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
        router = getattr(trainer.strategy, "router", None)
        plans = router.plan_book.state_dict() if router is not None and router.plan_book is not None else None
        self.path.write_text(json.dumps({"times": self.times, "cpu": self.cpu, "plans": plans}))


def load_data() -> TensorDataset:
    """Fashion-MNIST's 60,000 training images, or the digits scaled to 28×28 where it is not installed."""
    from lightning_aesgd.workloads.fashion_mnist import is_available, load_split

    if is_available():
        images, labels = load_split("train")
        return TensorDataset(images.reshape(-1, 1, 28, 28).float(), labels)
    from lightning_aesgd.workloads.digits import load_digits_tensors

    features, labels = load_digits_tensors()
    images = nn.functional.interpolate(features.reshape(-1, 1, 8, 8), size=(28, 28), mode="bilinear")
    repeats = 32  # 57,504 rows: one epoch outlasts every run
    return TensorDataset(images.repeat(repeats, 1, 1, 1), labels.repeat(repeats))


def run_once(
    case: Case,
    algorithm: str,
    dataset: TensorDataset,
    steps: int,
    out: Path,
    factors: tuple[float, ...] | None = None,
) -> RunResult:
    """Train ``steps`` steps of ``case`` under ``algorithm`` (``ddp``, ``adaptive_elastic`` or ``solo``)."""
    factors = factors or case.factors
    path = out / "runs" / f"{case.name}-{algorithm}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    callbacks: list[pl.Callback] = [StepClock(path)]
    profile = case.profile(factors) if case.mode != "none" else None
    # Only the `step` mode is emulated by the strategy itself, inside its optimizer step; every other mode is the
    # callback's, for every strategy alike.
    inside = algorithm == "adaptive_elastic" and profile is not None and profile.mode == "step"
    if profile is not None and not inside:
        callbacks.append(SlowdownCallback(profile, replicas_sharing=len(case.factors)))
    strategy: Any = "auto"
    if algorithm == "adaptive_elastic":
        strategy = AdaptiveElasticStrategy(slowdown=profile if inside else None, start_method="fork")
    elif algorithm == "ddp":
        strategy = pl.strategies.DDPStrategy(start_method="fork")
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=len(factors),
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
    trainer.fit(LoaderModule(dataset, case.network, case.workers))
    record = json.loads(path.read_text())
    return _result(algorithm, record, len(factors), steps)


def _result(algorithm: str, record: dict[str, Any], replicas: int, steps: int) -> RunResult:
    times, cpu = record["times"], record["cpu"]
    first = min(WARMUP_STEPS, len(times) // 2)
    seconds = (times[-1] - times[first - 1]) / (len(times) - first)
    cpu_seconds = (cpu[-1] - cpu[first - 1]) / (len(cpu) - first)
    result = RunResult(algorithm, BATCH * replicas / seconds, seconds, cpu_seconds)
    plans = record["plans"]
    if plans is not None:
        starts, sizes = plans["starts"], plans["sizes"]
        at_check = max(i for i, start in enumerate(starts) if start <= min(PLAN_CHECK_STEP, steps - 1))
        result.plan_at_check = sizes[at_check]
        result.smallest_batch = min(min(plan) for plan in sizes)
        result.final_plan = sizes[-1]
    return result


def run_case(case: Case, dataset: TensorDataset, steps: int, out: Path, repeats: int = 1) -> CaseResult:
    """DDP and adaptive_elastic on ``case``, and replicas alone for the ideal ``Σᵢ solo speedᵢ``.

    Sleeping devices are measured once at factor 1 (``solo speed at f = s₁/f``); under quotas every distinct
    factor runs alone, with its quota of the shared machine. With ``repeats`` > 1 the two strategies alternate
    and each keeps its run of median throughput.
    """
    factors = sorted(set(case.factors)) if case.mode == "quota" else [1.0]
    solo = {f: run_once(case, "solo", dataset, steps, out, factors=(f,)).samples_per_second for f in factors}
    quota = case.mode == "quota"
    ideal = sum(solo[f] for f in case.factors) if quota else solo[1.0] * sum(1 / f for f in case.factors)
    result = CaseResult(case.name, case.mode, list(case.factors), case.step_ms, case.workers, ideal)
    runs: dict[str, list[RunResult]] = {"ddp": [], "adaptive_elastic": []}
    for _ in range(repeats):
        for algorithm, done in runs.items():
            done.append(run_once(case, algorithm, dataset, steps, out))
    for algorithm, done in runs.items():
        result.runs[algorithm] = sorted(done, key=lambda run: run.samples_per_second)[len(done) // 2]
    return result


def machinery(dataset: TensorDataset, steps: int, out: Path, repeats: int = 3) -> dict[str, float]:
    """Microseconds per step of a near-empty model: one process alone, DDP and adaptive_elastic (4 replicas).

    The three runs are repeated ``repeats`` times, interleaved, and the medians reported: on a shared machine
    single runs of a few seconds differ by several percent.
    """
    tiny = Case("machinery", "none", HOMOGENEOUS, step_ms=0.0, network="tiny")
    names = ("solo", "ddp", "adaptive_elastic")
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for algorithm, factors in zip(names, ((1.0,), HOMOGENEOUS, HOMOGENEOUS), strict=True):
            result = run_once(tiny, algorithm, dataset, steps, out, factors=factors)
            wall[algorithm].append(1e6 * result.seconds_per_step)
            cpu[algorithm].append(1e6 * result.cpu_seconds_per_step)
    figures: dict[str, float] = {"repeats": repeats}
    for name in names:
        figures[f"{name}_us_per_step"] = statistics.median(wall[name])
        figures[f"{name}_cpu_us_per_step"] = statistics.median(cpu[name])
    for name in names[1:]:
        figures[f"{name}_machinery_us"] = figures[f"{name}_us_per_step"] - figures["solo_us_per_step"]
        figures[f"{name}_machinery_cpu_us"] = figures[f"{name}_cpu_us_per_step"] - figures["solo_cpu_us_per_step"]
    return figures


def table(results: Sequence[CaseResult]) -> str:
    """The cases as a markdown table."""
    lines = [
        "| case | slowness in | costs | ms/step at cost 1 | DDP samples/s | adaptive samples/s | ÷ DDP "
        "| efficiency DDP | efficiency adaptive | plan error at step 30 | smallest batch | final plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        ddp, adaptive = result.runs["ddp"], result.runs["adaptive_elastic"]
        error = result.plan_error()
        lines.append(
            f"| {result.case} | {result.mode}{' (1 worker)' if result.workers else ''} "
            f"| {_factors(result.factors)} | {result.step_ms:g} | {ddp.samples_per_second:.0f} "
            f"| {adaptive.samples_per_second:.0f} | {result.ratio():.2f} | {_percent(result.efficiency('ddp'))} "
            f"| {_percent(result.efficiency('adaptive_elastic'))} | {_percent(error)} | {adaptive.smallest_batch} "
            f"| {adaptive.final_plan} |"
        )
    return "\n".join(lines)


def machinery_table(figures: dict[str, float]) -> str:
    """The per-step machinery figures as a markdown table."""
    lines = [
        f"| per step, near-empty model (median of {figures['repeats']:.0f}) | wall µs | machinery µs "
        "| CPU µs of rank 0 | machinery CPU µs |",
        "|---|---|---|---|---|",
        f"| one process, no strategy | {figures['solo_us_per_step']:.0f} | – "
        f"| {figures['solo_cpu_us_per_step']:.0f} | – |",
    ]
    for name, label in (("ddp", "DDP, 4 replicas"), ("adaptive_elastic", "adaptive_elastic, 4 replicas")):
        lines.append(
            f"| {label} | {figures[f'{name}_us_per_step']:.0f} | {figures[f'{name}_machinery_us']:.0f} "
            f"| {figures[f'{name}_cpu_us_per_step']:.0f} | {figures[f'{name}_machinery_cpu_us']:.0f} |"
        )
    return "\n".join(lines)


def _factors(factors: Sequence[float]) -> str:
    return "[" + ", ".join(f"{f:g}" for f in factors) + "]"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def build_parser() -> argparse.ArgumentParser:
    """The slowness subcommand's options."""
    parser = argparse.ArgumentParser(prog="aesgd-bench slowness", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs per strategy (median reported)")
    parser.add_argument("--machinery-steps", type=int, default=200, help="steps of the machinery runs (0: skip)")
    parser.add_argument("--machinery-repeats", type=int, default=3, help="interleaved repeats of the machinery runs")
    parser.add_argument("--out", type=Path, default=Path("bench_results") / "slowness", help="output directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cases, print the tables and write them as JSON; returns the exit status."""
    options = build_parser().parse_args(argv)
    names = [name.strip() for name in options.cases.split(",") if name.strip()]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"Unknown cases {unknown}; choose from {', '.join(CASES)}.")
    if "quota" in names and quota_unavailable() is not None:
        print(f"skipping the quota case: {quota_unavailable()}")
        names.remove("quota")
    options.out.mkdir(parents=True, exist_ok=True)
    # One thread per replica process (4 replicas share 2 cores; forked replicas inherit it): several threads of a
    # process under a CPU quota spin waiting for each other while the quota has them throttled.
    torch.set_num_threads(1)
    dataset = load_data()
    results = []
    for name in names:
        results.append(run_case(CASES[name], dataset, options.steps, options.out, options.repeats))
        print(f"{name}: adaptive_elastic ÷ DDP = {results[-1].ratio():.2f}", flush=True)
    steps, repeats = options.machinery_steps, options.machinery_repeats
    figures = machinery(dataset, steps, options.out, repeats) if steps else None
    report = {
        "cases": [asdict(r) for r in results],
        "machinery": figures,
        "steps": options.steps,
        "repeats": options.repeats,
    }
    (options.out / RESULTS_FILE).write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + table(results))
    if figures is not None:
        print("\n" + machinery_table(figures))
    print(f"\nWrote {options.out / RESULTS_FILE}")
    return 0
