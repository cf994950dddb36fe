"""Bad input, systematically: random options, Trainer and DataLoader settings either train or fail early.

Every example draws strategy options (valid and invalid), Trainer settings (supported and not) and a training
DataLoader, and fits a tiny model in one process. The run must either finish (finite parameters, the number of
steps Lightning's loop settings imply) or fail before the first training batch, with no checkpoint written, and
with an error of the kinds users are told to expect: Lightning's and torch's own ``ValueError``, ``TypeError``
or ``MisconfigurationException`` for their settings, and for anything the strategy checks, an error whose
message carries a ``HINT:``. Any other exception, a failure after training began, or a hang is a bug.

Hypothesis explores combinations but, over a few hundred examples, revisits many of the same choices; a second
test therefore tries every invalid setting once, alone in an otherwise default run, and requires the strategy's
own options to be refused.
"""

from __future__ import annotations

import inspect
import math
import os
import random
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
)

import lightning_aesgd
from lightning_aesgd import EASGD, SMA, AdaptiveElasticStrategy, ElasticAverage, InverseTimeDecay, SlowdownProfile
from lightning_aesgd.core.planners import ProportionalPlanner, StaticPlanner
from lightning_aesgd.engine.loading import inspect_train_loader

FUZZ_EXAMPLES = int(os.environ.get("AESGD_FUZZ_EXAMPLES", 400))
"""Cases the fuzz test fits: 400 in the suite; more for a deeper search (the timeout grows with them)."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(150 * max(1, FUZZ_EXAMPLES // 400))]  # a hang fails the test

PACKAGE_DIR = Path(lightning_aesgd.__file__).parent
TORCH_DIR = Path(torch.__file__).parent

# --- what a run is made of ------------------------------------------------------------------------------------


def _costs_per_sample(dataset: Any) -> list[float]:
    return [1.0 + index % 3 for index in range(len(dataset))]


def _one_cost(dataset: Any) -> list[float]:
    return [1.0]  # one cost for a whole dataset: the wrong length


def _negative_costs(dataset: Any) -> list[float]:
    return [-1.0] * len(dataset)


def _values(*values: Any) -> st.SearchStrategy[Any]:
    return st.sampled_from(values)


def _rule(rule_class: type, **arguments: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.tuples(st.just(rule_class), st.fixed_dictionaries({}, optional=arguments))


# Every setting: (a strategy of valid values, the invalid values). Merge rules are given as (class, arguments)
# and built inside the run, so that a rule's own checks are part of what is tested.
Table = dict[str, tuple[st.SearchStrategy[Any], tuple[Any, ...]]]

STRATEGY_OPTIONS: Table = {
    "sync": (_values("models", "gradients"), ("both", None, "")),
    "period": (_values(1, 2, 3), (0, -1, 2.0, 1.5, "2", True, None)),
    "warmup_steps": (_values(0, 2), (-1, 1.0, None)),
    "merge_rule": (
        st.one_of(
            _values("elastic_average", "sma", "easgd"),
            _rule(ElasticAverage, alpha=_values(0.0, 0.5, 1.0), momentum=_values(0.0, 0.3)),
            _rule(SMA, alpha=_values(0.1, 1.0), central_momentum=_values(0.0, 0.9)),
            _rule(EASGD, beta=_values(0.9, 1.0)),
        ),
        (
            *("gossip", "", "ElasticAverage", None, 1, object(), ElasticAverage),  # not a rule (the class itself)
            *((ElasticAverage, {"alpha": value}) for value in (1.5, -0.1, math.nan)),
            *((ElasticAverage, {"momentum": value}) for value in (1.0, -0.5)),
            (SMA, {"alpha": 2.0}),
            (SMA, {"central_momentum": 1.0}),
            *((EASGD, {"beta": value}) for value in (0.0, 1.5)),
        ),
    ),
    "merge_weights": (_values("samples", "updates", "uniform"), ("loss", None)),
    "l2_nudge": (st.booleans(), ("yes",)),
    "merge_buffers": (st.booleans(), (None,)),
    "optimizer_state": (_values("keep", "reset", "average"), ("drop", None)),
    "planner": (
        st.one_of(_values("proportional", "balanced", "additive", "static"), st.builds(ProportionalPlanner)),
        ("greedy", None, 3, StaticPlanner((1.0, 2.0))),
    ),
    "shares": (_values([1.0], [2.0]), ([1.0, 1.0], [0.0], [-1.0], [], ["a"], [math.nan], 1.0, "1")),
    "min_batch": (_values(1, 2, 4), (0, -1, 100, 1.5, "1", None)),
    "max_batch": (_values(None, 4, 64), (1, 0, 2.5, "4")),
    "min_share": (_values(0.0, 0.1, 1.0), (-0.1, 1.5, math.nan, "0.1")),
    "step_batch_size": (_values(None, 1, 2, 3, 8, 64), (0, -2, 2.0, True, "8")),
    "plan_lag": (_values(None, 2, 3, 5), (1, 0, 2.5, True)),
    "speed_smoothing": (_values(0.0, 0.5, 0.8, 0.99), (1.0, -0.1, 1.5, math.nan, "0.8")),
    "plan_gain": (_values(0.1, 0.5, 1.0), (0.0, -1.0, 2.0, math.nan)),
    "plan_after_warmup": (st.booleans(), ("yes",)),
    "leave_out_stragglers": (st.booleans(), ("yes", 1)),
    "sample_costs": (_values(None, "auto", "dataset", _costs_per_sample), ("bogus", _one_cost, _negative_costs, 1.0)),
    "lr_scaling": (st.booleans(), ("no",)),
    "lr_schedule": (_values(None, InverseTimeDecay(decay=0.1, warmup_steps=2)), (0.05, "1/t")),
    "slowdown": (
        _values(None, [1.0], [1.5], {"factors": [1.0], "mode": "step"}, SlowdownProfile((1.0,))),
        ([0.5], [1.0, 1.0], [], {"factors": [1.0], "mode": "warp"}, {"mode": "step"}, "fast", 2.0),
    ),
    "checkpoint_replicas": (st.booleans(), (None,)),
    "telemetry": (st.booleans(), (None,)),
    "timeout": (_values(None, timedelta(seconds=60)), (-1,)),
    "gradient_delay": (_values(0, 1), (2, -1, 1.5, "1")),
    "compensate_momentum": (st.booleans(), ("yes",)),
    "gradient_delay_warmup": (_values(0, 2), (-1, 1.5)),
    "gradient_delay_lr_scale": (_values(1.0, 0.5), (0.0, -1.0, math.nan, "0.5")),
    "find_unused_parameters": (st.booleans(), ("no",)),
    "gradient_as_bucket_view": (st.booleans(), ("no",)),  # with model merging too, where no DDP wraps the model
    "replicas_per_device": (_values(1), (0, -1, 1.5, "2")),
    "learners_per_device": (_values(1, 2, 3, "auto"), (0, -1, 1.5, "2", True, "many")),
    "max_learners": (_values(8, 1, 3), (0, -1, 2.5, "4")),
    "learner_min_gain": (_values(0.1, 0.0, 1.0), (-0.1, "0.1")),
    # One process: the fuzzed fits run in this one (more would relaunch the test runner).
    "replica_devices": (_values(None, ["cpu"]), ("cpu", [], ["cuda:99"], ["gpu"], [None])),
    "process_group_backend": (_values(None, "gloo"), ()),
    "start_method": (_values("popen"), ()),
    "perod": (st.nothing(), (2,)),  # a typo
    "alpha": (st.nothing(), (0.5,)),  # belongs to the merge rule
}

MERGE_OPTIONS = {"period", "merge_rule", "merge_weights", "l2_nudge", "merge_buffers", "optimizer_state", "lr_scaling"}
GRADIENT_OPTIONS = {
    "gradient_delay",
    "compensate_momentum",
    "gradient_delay_warmup",
    "gradient_delay_lr_scale",
    "find_unused_parameters",
}
CONNECTOR_ARGUMENTS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}


def test_every_option_of_the_strategy_is_fuzzed():
    """An option added to the strategy joins the fuzz table (with its invalid values), or this fails."""
    keywords = set(inspect.signature(AdaptiveElasticStrategy.__init__).parameters) - {"self", "unexpected"}
    assert keywords - CONNECTOR_ARGUMENTS <= set(STRATEGY_OPTIONS), (
        keywords - CONNECTOR_ARGUMENTS - set(STRATEGY_OPTIONS)
    )


TRAINER_SETTINGS: Table = {
    "max_steps": (_values(1, 2, 3, 5, -1), (-2,)),
    "max_epochs": (_values(1, 2), (-2,)),
    "limit_train_batches": (_values(1, 2, 0.5, 1.0, 0), (0.01, 1.5)),
    "accumulate_grad_batches": (_values(1), (2, 0)),
    "gradient_clip_val": (_values(None, 0.5), ()),
    "gradient_clip_algorithm": (_values("norm", "value"), ("max",)),
    "precision": (_values("32-true", "bf16-mixed", "16-mixed", "64-true", "bf16-true"), ("8", "32-mixed")),
    "fast_dev_run": (_values(False, True, 2), (-1,)),
    "overfit_batches": (_values(0, 1, 0.5), (-1,)),
    # Not 0: Lightning accepts val_check_interval=0 and then divides by it after the first batch.
    "val_check_interval": (_values(None, 1, 2, 0.5, 1.0), (1000, 1.5)),
    "num_sanity_val_steps": (_values(0, 2), ()),
    "limit_val_batches": (_values(0, 2, 1.0), (-1,)),
    "log_every_n_steps": (_values(1, 50), ()),
    "use_distributed_sampler": (st.booleans(), ()),
    "reload_dataloaders_every_n_epochs": (_values(0, 1), (-1,)),
}


class MapData(Dataset):
    """``size`` samples of a fixed regression problem; ``sample_costs`` on request."""

    def __init__(self, size: int, with_costs: bool = False) -> None:
        generator = torch.Generator().manual_seed(size)
        self.x = torch.randn(size, 4, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)
        if with_costs:
            self.sample_costs = torch.arange(size, dtype=torch.float64) % 3 + 1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.x[index], self.y[index]


class UnsizedData(Dataset):
    """A map-style dataset without ``__len__``."""

    def __init__(self, size: int) -> None:
        self.data = MapData(size)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.data[index]


class StreamData(IterableDataset):
    """An iterable dataset: it cannot be split by index."""

    def __init__(self, size: int) -> None:
        self.data = MapData(size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return (self.data[i] for i in range(len(self.data)))


@dataclass(frozen=True)
class LoaderSpec:
    """How the training DataLoader is built."""

    kind: str = "map"
    size: int = 16
    costs: bool = False
    batch_size: int | None = 4
    shuffle: bool | None = True
    drop_last: bool = False
    num_workers: int = 0
    prefetch_factor: int = 2
    sampler: str | None = None

    def build(self) -> DataLoader:
        """The DataLoader; torch's own refusals surface from the hook, as they would in a user's code."""
        dataset: Dataset = {"map": MapData(self.size, self.costs), "unsized": UnsizedData(self.size)}.get(
            self.kind, StreamData(self.size)
        )
        options: dict[str, Any] = {"num_workers": self.num_workers, "drop_last": self.drop_last}
        if self.num_workers > 0:
            options.update(prefetch_factor=self.prefetch_factor, persistent_workers=self.prefetch_factor == 1)
        if self.sampler == "batch":  # batch_size, shuffle and drop_last given as a plain torch BatchSampler
            indices = range(self.size)
            order = RandomSampler(indices) if self.shuffle else SequentialSampler(indices)
            batches = BatchSampler(order, batch_size=self.batch_size, drop_last=options.pop("drop_last"))
            return DataLoader(dataset, batch_sampler=batches, **options)
        if self.sampler is not None:  # a sampler replaces `shuffle`
            return DataLoader(dataset, self.batch_size, sampler=_sampler(self.sampler, self.size), **options)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=self.shuffle, **options)

    def trained_batches(self, distributed_sampler: bool) -> tuple[int, bool]:
        """The per-replica batch size and ``drop_last`` of the loader the strategy is given.

        Lightning's distributed sampler injection (``use_distributed_sampler=True``, the default) rebuilds a loader
        built from a plain ``BatchSampler`` with neither its batch size nor its ``drop_last``: torch's defaults, 1
        and False, apply (under DDP too). Without the injection the strategy keeps the ``BatchSampler``'s.
        """
        assert self.batch_size is not None
        if self.sampler == "batch" and distributed_sampler:
            return 1, False
        return self.batch_size, self.drop_last


def _sampler(name: str, size: int) -> Any:
    indices = list(range(size))
    return {
        "sequential": lambda: SequentialSampler(indices),
        "random": lambda: RandomSampler(indices),
        "replacement": lambda: RandomSampler(indices, replacement=True, num_samples=max(size, 1)),
        "subset": lambda: SubsetRandomSampler(indices[: max(size // 2, 1)]),
    }[name]()


LOADER_SETTINGS: Table = {
    "kind": (_values("map"), ("unsized", "stream")),
    "size": (_values(1, 2, 3, 5, 8, 16, 33), (0,)),
    "costs": (st.booleans(), ()),
    "batch_size": (_values(1, 2, 3, 4, 8, 16), (None,)),
    "shuffle": (_values(True, False, None), ()),
    "drop_last": (st.booleans(), ()),
    "num_workers": (_values(0, 0, 0, 0, 0, 1), ()),  # a worker process costs a fraction of a second
    "prefetch_factor": (_values(1, 2), ()),
    "sampler": (_values(None, None, None, None, "sequential", "random", "batch"), ("replacement", "subset")),
}


@dataclass(frozen=True)
class ModelSpec:
    """The LightningModule: its optimizer, scheduler, buffers, validation and optimization mode."""

    optimizer: str = "sgd"
    scheduler: bool = False
    batch_norm: bool = False
    validation: bool = True
    manual: bool = False


MODEL_SETTINGS: Table = {
    "optimizer": (_values("sgd", "momentum", "adam", "lbfgs"), ()),
    "scheduler": (st.booleans(), ()),
    "batch_norm": (st.booleans(), ()),
    "validation": (st.booleans(), ()),
    "manual": (_values(False), (True,)),
}


class Centering(nn.Module):
    """Subtracts a running mean kept in a floating buffer, as BatchNorm does, but for batches of one sample too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.mean.lerp_(x.detach().mean(dim=0).to(self.mean.dtype), 0.1)
        return x - self.mean.to(x.dtype)


class FuzzModel(pl.LightningModule):
    """A tiny regression model that builds its loaders and optimizer from the drawn specs."""

    def __init__(self, spec: ModelSpec, loader: LoaderSpec) -> None:
        super().__init__()
        self.spec, self.loader = spec, loader
        self.net = nn.Sequential(Centering() if spec.batch_norm else nn.Identity(), nn.Linear(4, 1))
        self.automatic_optimization = not spec.manual

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        if self.spec.manual:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).float(), y.float()))

    def configure_optimizers(self) -> Any:
        params = self.parameters()
        optimizer = {
            "sgd": lambda: torch.optim.SGD(params, lr=0.01),
            "momentum": lambda: torch.optim.SGD(params, lr=0.01, momentum=0.9),
            "adam": lambda: torch.optim.Adam(params, lr=0.01),
            "lbfgs": lambda: torch.optim.LBFGS(params, lr=0.1, max_iter=2),
        }[self.spec.optimizer]()
        if not self.spec.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return self.loader.build()

    def val_dataloader(self) -> Any:
        return DataLoader(MapData(8), batch_size=4) if self.spec.validation else []


@dataclass
class Probe(pl.Callback):
    """Counts training batches that began and that ended."""

    batches: int = 0
    ended: int = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.batches += 1

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ended += 1


@dataclass(frozen=True)
class Case:
    """One drawn example."""

    options: dict[str, Any]
    trainer: dict[str, Any]
    loader: LoaderSpec
    model: ModelSpec


TABLES = {"options": STRATEGY_OPTIONS, "trainer": TRAINER_SETTINGS, "loader": LOADER_SETTINGS, "model": MODEL_SETTINGS}
INVALID = [
    (table, name, value) for table, settings in TABLES.items() for name, (_, bad) in settings.items() for value in bad
]
"""Every invalid setting: (table, name, value)."""


def _valid(draw: Callable[..., Any], coins: random.Random, table: Table, chance: float) -> dict[str, Any]:
    """Valid entries of ``table``, each present with probability ``chance``."""
    return {name: draw(valid) for name, (valid, _) in table.items() if not valid.is_empty and coins.random() < chance}


@st.composite
def cases(draw: Callable[..., Any]) -> Case:
    """Valid settings, and in 3 examples of 5 one invalid setting, drawn uniformly from all of them.

    Which settings are present and which invalid one is used is decided by a ``random.Random`` seeded by the
    draw: Hypothesis's own integers and floats favour their bounds, which would give most examples every setting
    and the same few invalid values.
    """
    coins = random.Random(draw(st.integers(0, 2**32 - 1)))
    drawn = {
        "options": _valid(draw, coins, STRATEGY_OPTIONS, chance=0.3),
        "trainer": _valid(draw, coins, TRAINER_SETTINGS, chance=0.3),
        "loader": _valid(draw, coins, LOADER_SETTINGS, chance=1.0),
        "model": _valid(draw, coins, MODEL_SETTINGS, chance=1.0),
    }
    if coins.random() < 0.6:
        table, name, value = INVALID[coins.randrange(len(INVALID))]
        drawn[table][name] = value
    options = drawn["options"]
    if set(options) & MERGE_OPTIONS and "sync" not in options:
        options["sync"] = "models"  # merge options are model merging's; with the default sync they are an error
    if options.get("sync") == "models":  # the gradient options are sync="gradients"'s; with models an error
        for name in GRADIENT_OPTIONS & set(options):
            del options[name]
    if "shares" in options and "planner" not in options:
        options["planner"] = "static"  # shares are the static planner's; with another one they are an error
    return Case(options, drawn["trainer"], LoaderSpec(**drawn["loader"]), ModelSpec(**drawn["model"]))


# --- what a run may do ----------------------------------------------------------------------------------------


def _build_options(options: dict[str, Any]) -> dict[str, Any]:
    built = dict(options)
    rule = built.get("merge_rule")
    if isinstance(rule, tuple):
        rule_class, arguments = rule
        built["merge_rule"] = rule_class(**arguments)
    return built


def _expected_steps(trainer: pl.Trainer, case: Case) -> int:
    """Optimizer steps the fit makes, from the loop's settings and the planned sampler's epoch length."""
    spec, options, limit = case.loader, case.options, trainer.limit_train_batches
    if limit == 0:
        return 0  # Lightning skips training without looking at the loader
    batch_size, drop_last = spec.trained_batches(case.trainer.get("use_distributed_sampler", True))
    learners = trainer.strategy.engine.learners  # as chosen, where learners_per_device='auto'
    total = options.get("step_batch_size") or batch_size * learners  # one replica
    per_epoch = spec.size // total if drop_last else math.ceil(spec.size / total)
    batches = min(per_epoch, int(limit)) if isinstance(limit, int) else int(per_epoch * limit)
    max_steps = trainer.max_steps if trainer.max_steps >= 0 else math.inf
    return int(min(max_steps, (trainer.max_epochs or 1) * batches))


def _project_caused(error: BaseException) -> bool:
    """Whether the error was raised by the package, or by torch on its behalf (a bad option passed through)."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [index for index, frame in enumerate(frames) if Path(frame.filename).is_relative_to(PACKAGE_DIR)]
    if not ours:
        return False
    inner = frames[ours[-1] + 1 :]
    return all(Path(frame.filename).is_relative_to(TORCH_DIR) for frame in inner)


def _check_clean_failure(error: Exception) -> None:
    """The error is one a user can act on: Lightning's and torch's usual types, the package's with a HINT."""
    name = type(error).__name__
    if not _project_caused(error):
        assert isinstance(error, (ValueError, TypeError, MisconfigurationException)), f"unexpected {name}: {error}"
        return
    assert "HINT:" in str(error), f"the package's {name} has no HINT: {error}"
    ours = type(error).__module__.startswith("lightning_aesgd")
    assert ours or isinstance(error, (ValueError, TypeError)), f"the package raised a raw {name}: {error}"


def _fit(case: Case, root: str) -> Exception | None:
    """Fit ``case`` and check the outcome; returns the exception of a fit that failed (cleanly)."""
    probe = Probe()
    checkpoints = Path(root, "checkpoints")
    model = FuzzModel(case.model, case.loader)
    before = [p.detach().clone() for p in model.parameters()]
    trainer, failure = _try_fit(case, model, probe, root, checkpoints)
    if failure is not None:
        assert probe.batches == 0, f"{type(failure).__name__} after {probe.batches} training batches: {failure}"
        assert not checkpoints.exists() or not any(checkpoints.iterdir()), "a checkpoint of a failed fit"
        for old, new in zip(before, model.parameters(), strict=True):
            # Lightning converts the model for `*-true` precisions before anything can fail: values change then.
            assert new.dtype != old.dtype or torch.equal(old, new.detach()), "a failed fit changed the model"
        _check_clean_failure(failure)
        return failure
    assert trainer is not None
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    expected = _expected_steps(trainer, case)
    assert trainer.global_step == expected
    assert probe.ended == expected
    return None


def _try_fit(
    case: Case, model: FuzzModel, probe: Probe, root: str, checkpoints: Path
) -> tuple[pl.Trainer | None, Exception | None]:
    """Build the strategy and the Trainer and fit; returns the Trainer, or the exception that ended the attempt."""
    trainer = None
    try:
        strategy = AdaptiveElasticStrategy(**_build_options(case.options))
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=[probe, ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1)],
            **{"max_epochs": 1, **case.trainer},
        )
        trainer.fit(model)
    except Exception as error:
        return trainer, error
    return trainer, None


@settings(
    # About 30 ms per example on 2 cores (a fit of a few steps, or an early error); more where a worker starts.
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI is reproducible
    database=None,
    # No shrinking: a failure reports the whole drawn case, which reads plainly, where shrinking a Trainer run
    # takes minutes.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
def test_any_options_train_or_fail_before_training_with_a_hint(case: Case) -> None:
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _fit(case, root)
        finally:
            _destroy_process_group()


def _destroy_process_group() -> None:
    # Lightning leaves the process group up after fit; every example must set up its own, as a fresh run does
    # (the `timeout` option, for one, is only used there).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _case_with(table: str, name: str, value: Any) -> Case:
    """The default case, training two steps, with one setting changed."""
    drawn: dict[str, dict[str, Any]] = {"options": {}, "trainer": {"max_steps": 2}, "loader": {}, "model": {}}
    drawn[table][name] = value
    if name == "shares":
        drawn["options"]["planner"] = "static"
    return Case(drawn["options"], drawn["trainer"], LoaderSpec(**drawn["loader"]), ModelSpec(**drawn["model"]))


def _setting_id(table: str, name: str, value: Any) -> str:
    shown = type(value).__name__ if " at 0x" in repr(value) else repr(value)  # no addresses: ids must be stable
    return f"{table}.{name}={shown}"


@pytest.mark.parametrize(("table", "name", "value"), INVALID, ids=[_setting_id(*setting) for setting in INVALID])
def test_every_invalid_setting_alone_trains_or_fails_before_training_with_a_hint(
    table: str, name: str, value: Any
) -> None:
    """The sweep the random test cannot promise: every invalid value, once, in an otherwise default run."""
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            failure = _fit(_case_with(table, name, value), root)
        finally:
            _destroy_process_group()
    if table == "options":  # the strategy's own options: refused, never silently trained with
        assert failure is not None, f"{name}={value!r} trained"


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("distributed_sampler", [True, False])
def test_a_plain_batch_sampler_trains_as_the_loader_lightning_hands_over(
    distributed_sampler: bool, drop_last: bool, shuffle: bool
) -> None:
    """A torch ``BatchSampler`` is ``batch_size``, ``shuffle`` and ``drop_last``; the strategy trains what reaches it.

    Lightning's sampler injection leaves a plain loader of batch size 1 (as under DDP); without it the strategy
    keeps the BatchSampler's batch size and order, and refuses the ``drop_last=True`` it cannot keep.
    """
    spec = LoaderSpec(size=10, batch_size=3, shuffle=shuffle, drop_last=drop_last, sampler="batch")
    if not drop_last:
        facts = inspect_train_loader(spec.build())
        assert (facts.dataset_size, facts.batch_size, facts.shuffle) == (10, 3, shuffle)
    case = Case({}, {"max_epochs": 1, "use_distributed_sampler": distributed_sampler}, spec, ModelSpec())
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            failure = _fit(case, root)  # trained the steps of `LoaderSpec.trained_batches`, or failed early
        finally:
            _destroy_process_group()
    if drop_last and not distributed_sampler:
        assert isinstance(failure, TypeError), failure
        assert "drop_last=True" in str(failure)
    else:
        assert failure is None, failure


@pytest.mark.parametrize("batch_sampler", [False, True])
def test_a_sampler_of_another_length_than_the_dataset_is_refused(batch_sampler: bool) -> None:
    """A plain sampler over 8 indices of a 16-sample dataset would be trained as all 16: refused with the fix."""
    order = SequentialSampler(range(8))
    if batch_sampler:
        loader = DataLoader(MapData(16), batch_sampler=BatchSampler(order, batch_size=2, drop_last=False))
    else:
        loader = DataLoader(MapData(16), batch_size=2, sampler=order)
    with pytest.raises(TypeError, match=r"draws 8 indices of a dataset of 16 samples.*HINT"):
        inspect_train_loader(loader)
