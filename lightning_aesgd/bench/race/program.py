"""``python -m lightning_aesgd.bench [options]``: the race's command line."""

from __future__ import annotations

import argparse
import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

from lightning_aesgd.bench.common import add_run_options, comma_list
from lightning_aesgd.bench.race.benchmark import BenchSettings, RaceConfigError, run_benchmark
from lightning_aesgd.bench.race.suites import WORKLOADS, Target, get_workload

DEFAULT_PROFILES = "strong,homogeneous"
DEFAULT_ALGORITHMS = "adaptive_sgd,ddp,local_sgd,sma,easgd,post_local_sgd"
TINY_EPOCHS = 2
_CHATTY_LOGGERS = ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric", "lightning_aesgd")
_KNOWN_WARNINGS = (".*sync_dist=True.*", ".*LeafSpec.*", ".*does not have many workers.*")


def build_parser() -> argparse.ArgumentParser:
    """The race's options (the benchmark's default program, so its help names the others)."""
    parser = argparse.ArgumentParser(
        prog="aesgd-bench",
        description="Compare the algorithms on emulated heterogeneous devices: throughput, efficiency against "
        "the ideal, time to a target metric, ratios to DDP. Subcommand `overhead` measures merge, planner and "
        "sampler costs (see `aesgd-bench overhead --help`); `slowness` races both strategies against slowness "
        "in user code, data loading, hooks and CPU quotas (see `aesgd-bench slowness --help`); `seeds` measures "
        "the seed papers' claims (see `aesgd-bench seeds --help`); `scale` the speedup as replicas grow in number "
        "and spread; `placement` the GPU alone against GPU + CPU replicas and CPU replicas alone.",
    )
    names = sorted(WORKLOADS)
    parser.add_argument(
        "--workload", default="xmc_mini", choices=names, metavar="NAME", help=f"what to train: {', '.join(names)}"
    )
    parser.add_argument("--profiles", default=DEFAULT_PROFILES, help="comma list of configs/devices profiles")
    parser.add_argument(
        "--algorithms",
        default=DEFAULT_ALGORITHMS,
        help="comma list of configs/algorithm names; `ddp` races without DDP's per-forward BatchNorm "
        "buffer broadcast, as the strategy runs, `ddp_lightning` with it (Lightning's default)",
    )
    parser.add_argument("--epochs", type=int, help="epochs of every run (default: the workload's)")
    parser.add_argument("--repeats", type=int, default=1, help="repeats of the whole matrix (medians reported)")
    parser.add_argument("--target", help="validation target '<metric>=<value>' (default: the workload's)")
    parser.add_argument("--out", type=Path, help="output directory (default: bench_results/<workload>)")
    parser.add_argument(
        "--no-solo",
        dest="solo",
        action="store_false",
        help="skip the solo run that efficiency is measured against (one real device races itself: no efficiency)",
    )
    add_run_options(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the race, print its table and write its files; returns the exit status."""
    parser = build_parser()
    options = parser.parse_args(argv)
    workload = get_workload(options.workload)
    try:
        workload.overrides(options.tiny)  # fails early, with a hint, when the workload's configs are missing
    except FileNotFoundError as error:
        parser.error(str(error))
    settings = BenchSettings(
        workload=options.workload,
        profiles=_names(options.profiles),
        algorithms=_names(options.algorithms),
        epochs=options.epochs or (TINY_EPOCHS if options.tiny else workload.epochs),
        repeats=options.repeats,
        target=Target.parse(options.target or workload.target),
        out=options.out or Path("bench_results") / options.workload,
        overrides=options.override,
        tiny=options.tiny,
        measure_solo=options.solo,
    )
    with nullcontext() if options.verbose else quiet_lightning():
        try:
            result = run_benchmark(settings)
        except RaceConfigError as error:
            parser.error(str(error))
    print(f"\n{result.table}\n")
    print(f"Wrote {len(result.files)} files under {settings.out}: " + ", ".join(p.name for p in result.files))
    failed = sum(1 for run in result.runs if run.error)
    if failed:
        print(f"{failed} of {len(result.runs)} runs failed (their errors are above, and beneath the table).")
    return 1 if failed else 0


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Keep Lightning's start-up messages, known warnings and the strategy's summaries off the terminal."""
    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        for message in _KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        for logger in loggers:
            logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def _names(text: str) -> list[str]:
    names = comma_list(text)
    if not names:
        raise SystemExit(f"Expected a comma-separated list of names, got {text!r}.")
    return names
