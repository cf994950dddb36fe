"""The benchmark: every algorithm under every device profile, repeated, interleaved, reported as ratios.

Runs are interleaved (for each repeat, for each profile, for each algorithm) so that drift of a shared
machine hits every algorithm alike. One single-replica run without emulation first measures the solo speed
behind the efficiency figures. DDP races without its per-forward buffer broadcast, as the strategy runs
(:func:`entrant_overrides`); ``ddp_lightning`` is Lightning's DDP as it comes.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_aesgd.bench.race.analysis import AggregateFigures, RunFigures, aggregate, run_figures
from lightning_aesgd.bench.race.recorder import RunKey, RunRecord
from lightning_aesgd.bench.race.report import failed_runs, race_table, write_results
from lightning_aesgd.bench.race.runner import compose_config, run_once, shrink_replicas, threads_per_replica
from lightning_aesgd.bench.race.suites import Target, get_workload
from lightning_aesgd.emulation.profiles import as_profile

ADAPTIVE = "adaptive_sgd"
"""The algorithm whose per-replica batch sizes are plotted."""
TINY_REPLICAS = 2

BUFFER_BROADCAST = "algorithm.sync_buffers_at_forward"
"""The ``ddp`` config's switch for DDP's broadcast of BatchNorm buffers from rank zero at every forward."""
BUCKET_VIEW = "algorithm.gradient_as_bucket_view"
"""DDP's option that keeps the gradients in its communication buckets, which the strategy sets (not in the config)."""
LIGHTNING_DDP = "ddp_lightning"
"""The entrant that races Lightning's DDP as it comes, buffer broadcast included (``ddp`` races without it)."""
BUILT_IN_VARIANTS: dict[str, list[str]] = {LIGHTNING_DDP: ["algorithm=ddp", f"{BUFFER_BROADCAST}=true"]}


@dataclass
class BenchSettings:
    """What to run; see ``python -m lightning_aesgd.bench --help``."""

    workload: str
    profiles: list[str]
    algorithms: list[str]
    epochs: int
    repeats: int
    target: Target
    out: Path
    overrides: list[str] = field(default_factory=list)
    tiny: bool = False
    variants: dict[str, list[str]] = field(default_factory=dict)
    """Entrants that are not a plain ``configs/algorithm`` name: the name raced, and the overrides that stand for
    ``algorithm=<name>`` (e.g. ``{"sma_b64": ["algorithm=sma", "data.batch_size=64"]}``)."""
    measure_solo: bool = True
    """Whether to measure the solo speed first; without it, efficiency figures are NaN."""


@dataclass
class BenchResult:
    """What a benchmark produced."""

    solo_speed: float
    runs: list[RunFigures]
    rows: list[AggregateFigures]
    table: str
    files: list[Path]


def run_benchmark(settings: BenchSettings) -> BenchResult:
    """Measure the solo speed, run the interleaved matrix, then write the table, the JSON and the plots."""
    base = get_workload(settings.workload).overrides(settings.tiny)
    _check_entrants(settings, base)
    configs = {profile: _profile_config(settings, base, profile) for profile in settings.profiles}
    solo = _solo_speed(settings, base, configs) if settings.measure_solo else math.nan
    if settings.measure_solo:
        print(f"solo speed (one replica, no emulation): {solo:.1f} samples/s")
    runs: list[RunFigures] = []
    records: dict[RunKey, RunRecord] = {}
    total = settings.repeats * len(settings.profiles) * len(settings.algorithms)
    for repeat in range(settings.repeats):
        for profile in settings.profiles:
            for algorithm in settings.algorithms:
                key = (profile, algorithm, repeat)
                figures, record = _run(settings, base, key, solo)
                runs.append(figures)
                if record is not None:
                    records[key] = record
                print(f"[{len(runs)}/{total}] {_progress(figures)}")
    rows = aggregate(runs)
    table = "\n\n".join(filter(None, [race_table(rows, settings.target), failed_runs(runs)]))
    files = write_results(settings.out, _settings_dict(settings, solo, configs), runs, rows, table)
    files += _plots(settings, records, configs)
    return BenchResult(solo, runs, rows, table, files)


class RaceConfigError(ValueError):
    """A run of the race whose config cannot be composed (a misspelt algorithm, profile or override)."""


def _check_entrants(settings: BenchSettings, base: list[str]) -> None:
    """Compose every run's config before any runs, so that a misspelt name fails the race at once.

    Raises:
        RaceConfigError: naming the run and Hydra's reason (which lists the options of a group, for a name it lacks).
    """
    for profile in settings.profiles:
        for algorithm in settings.algorithms:
            try:
                _profile_config(settings, base, profile, algorithm)
            except Exception as error:
                reason = str(error).split("\nConfig search path")[0].strip()  # Hydra's reason, without where it looked
                raise RaceConfigError(f"The race cannot compose the run {profile} / {algorithm}: {reason}") from error


def _profile_config(settings: BenchSettings, base: list[str], profile: str, algorithm: str = "ddp") -> DictConfig:
    chosen = entrant_overrides(settings.variants, algorithm)
    overrides = [*base, *chosen, f"devices={profile}", f"trainer.max_epochs={settings.epochs}"]
    cfg = compose_config([*overrides, *settings.overrides])
    if settings.tiny:
        shrink_replicas(cfg, TINY_REPLICAS)
    return cfg


def entrant_overrides(variants: dict[str, list[str]], algorithm: str) -> list[str]:
    """The overrides that stand for ``algorithm=<name>`` in the race: DDP races as the fairest rival.

    Lightning's DDP broadcasts the BatchNorm buffers from rank zero at every forward, a second collective per step
    for models that have them, which the strategy skips (it hands rank zero's buffers over at evaluation,
    checkpoints and the end of fit). Every DDP entrant (``ddp``, and ``post_local_sgd``, whose local steps would
    otherwise still broadcast) therefore races without that broadcast, unless its overrides set the switch
    themselves; ``ddp_lightning`` is Lightning's DDP as it comes. ``ddp`` so raced also keeps its gradients in its
    buckets (``gradient_as_bucket_view``), as the strategy does: no copy of each summed bucket back into them.

    Example:
        >>> entrant_overrides({}, "ddp")
        ['algorithm=ddp', 'algorithm.sync_buffers_at_forward=false', '+algorithm.gradient_as_bucket_view=true']
        >>> entrant_overrides({}, "sma"), entrant_overrides({}, "ddp_lightning")
        (['algorithm=sma'], ['algorithm=ddp', 'algorithm.sync_buffers_at_forward=true'])
    """
    chosen = variants.get(algorithm) or BUILT_IN_VARIANTS.get(algorithm) or [f"algorithm={algorithm}"]
    algorithms = [override.split("=", 1)[1] for override in chosen if override.startswith("algorithm=")]
    sets_switch = any(override.lstrip("+").startswith(f"{BUFFER_BROADCAST}=") for override in chosen)
    if algorithms[-1:] in (["ddp"], ["post_local_sgd"]) and not sets_switch:
        in_buckets = [f"+{BUCKET_VIEW}=true"] if algorithms[-1] == "ddp" else []
        return [*chosen, f"{BUFFER_BROADCAST}=false", *in_buckets]
    return list(chosen)


def _solo_speed(settings: BenchSettings, base: list[str], configs: dict[str, DictConfig]) -> float:
    """Samples per training second of one replica alone, no emulation, same per-replica batch.

    It runs with the torch threads each replica of the profiles gets, so that it measures one of their devices.
    """
    replicas = [cfg.devices.num_replicas for cfg in configs.values()]
    threads = threads_per_replica(max(replicas)) if all(isinstance(n, int) for n in replicas) else None
    solo = ["algorithm=ddp", "devices.num_replicas=1", "devices.slowdown=null", "trainer.max_epochs=1"]
    cfg = compose_config([*base, *settings.overrides, *solo, "++trainer.limit_val_batches=0"])
    record = run_once(cfg, settings.out / "runs" / "solo", threads=threads)
    if record.seconds <= 0:
        raise RuntimeError("The solo run recorded no training time.")
    return record.total_samples / record.seconds


def _run(settings: BenchSettings, base: list[str], key: RunKey, solo: float) -> tuple[RunFigures, RunRecord | None]:
    profile, algorithm, repeat = key
    run_dir = settings.out / "runs" / profile / algorithm / f"repeat_{repeat}"
    figures = RunFigures(profile, algorithm, repeat, record=str(run_dir.relative_to(settings.out) / "record.json"))
    try:
        cfg = _profile_config(settings, base, profile, algorithm)
        record = run_once(cfg, run_dir)
    except Exception as error:  # one failed run must not lose the others
        traceback.print_exc()
        figures.error = f"{type(error).__name__}: {error}"
        return figures, None
    return run_figures(record, figures, solo, as_profile(cfg.devices.slowdown), settings.target), record


def _plots(settings: BenchSettings, records: dict[RunKey, RunRecord], configs: dict[str, DictConfig]) -> list[Path]:
    try:  # plots are optional: the tables and the JSON file carry every figure
        from lightning_aesgd.bench.race.plots import plot_batch_sizes, plot_metric_curves
    except ModuleNotFoundError as error:
        print(f"No plots: {error}. HINT: pip install 'lightning-aesgd[bench]' (the bench extra: matplotlib).")
        return []
    files = [plot_metric_curves(records, profile, settings.target, settings.out) for profile in settings.profiles]
    for profile in settings.profiles:
        record = records.get((profile, ADAPTIVE, 0))
        slowdown = as_profile(configs[profile].devices.slowdown)  # with its changes: the targets follow them
        path = plot_batch_sizes(record, profile, ADAPTIVE, settings.out, slowdown) if record is not None else None
        if path is not None:
            files.append(path)
    return files


def _settings_dict(settings: BenchSettings, solo: float, configs: dict[str, DictConfig]) -> dict[str, Any]:
    devices = {profile: OmegaConf.to_container(cfg.devices, resolve=True) for profile, cfg in configs.items()}
    return {
        "workload": settings.workload,
        "profiles": settings.profiles,
        "algorithms": settings.algorithms,
        "epochs": settings.epochs,
        "repeats": settings.repeats,
        "target": str(settings.target),
        "overrides": settings.overrides,
        "tiny": settings.tiny,
        "variants": settings.variants,
        "entrants": {name: entrant_overrides(settings.variants, name) for name in settings.algorithms},
        "solo_samples_per_second": solo if math.isfinite(solo) else None,
        "devices": devices,
    }


def _progress(figures: RunFigures) -> str:
    name = f"{figures.profile} / {figures.algorithm} / repeat {figures.repeat}"
    if figures.error is not None:
        return f"{name}: FAILED ({figures.error})"
    reached = "not reached" if figures.time_to_target is None else f"{figures.time_to_target:.1f} s"
    efficiency = f", efficiency {figures.efficiency:.0%}" if math.isfinite(figures.efficiency) else ""
    return f"{name}: {figures.throughput:.1f} samples/s{efficiency}, target {reached}"
