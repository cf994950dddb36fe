"""``python -m lightning_aesgd.bench placement``: GPU alone, GPU + CPU replicas, CPU replicas alone, side by side.

Per workload (XMC EURLex-shaped, the Fashion-MNIST CNN) and algorithm (``hogbatch`` by default) it trains every
placement (:mod:`.cases`) and reports throughput on the training clock, time to a target metric, the final
validation and test metric, each beside the GPU alone's under the same emulation. The same placements then run
with the GPU replica emulated ``--weak-gpu`` times slower (rows marked *emulated*), so that what the CPU replicas
add shows on a strong and on a weak GPU. Without CUDA the GPU cases are skipped, each row saying why.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

from lightning_aesgd.bench.common import add_run_options, comma_list
from lightning_aesgd.bench.placement.benchmark import PlacementSettings, WorkloadResult, run_workload
from lightning_aesgd.bench.placement.cases import PLACEMENTS, Machine
from lightning_aesgd.bench.placement.report import workload_table, write_report
from lightning_aesgd.bench.placement.workloads import WORKLOADS
from lightning_aesgd.bench.race.program import quiet_lightning
from lightning_aesgd.bench.race.suites import Target

DEFAULT_WEAK_GPU = 20.0
"""The weak GPU's emulated slowdown: the GPU targets' "GPU replica emulated 20x slower"."""


def build_parser() -> argparse.ArgumentParser:
    """The placement program's options."""
    parser = argparse.ArgumentParser(prog="aesgd-bench placement", description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--algorithms", default="hogbatch", help="comma list of configs/algorithm names")
    parser.add_argument("--placements", default=",".join(PLACEMENTS), help=f"comma list of {', '.join(PLACEMENTS)}")
    parser.add_argument(
        "--weak-gpu", type=float, default=DEFAULT_WEAK_GPU, help="emulated slowdown of GPU ranks (0 or 1: none)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats (median and min–max reported)")
    parser.add_argument("--epochs", type=int, help="epochs of every run (default: the workload's)")
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="WORKLOAD:METRIC=VALUE",
        help="a workload's target in place of its own, e.g. xmc_eurlex:val/p@1=0.8 (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results") / "placement", help="output directory")
    add_run_options(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run every workload, print its table and write the files; returns the exit status."""
    parser = build_parser()
    options = parser.parse_args(argv)
    try:
        settings = settings_from(options)
    except ValueError as error:
        parser.error(str(error))
    machine = Machine.detect()
    print(f"machine: {machine.cuda_count} CUDA GPU(s), {machine.cores} cores", flush=True)
    results: list[WorkloadResult] = []
    with nullcontext() if options.verbose else quiet_lightning():
        for name in settings.workloads:
            results.append(run_workload(settings, name, machine))
            print(f"\n{name} (target {results[-1].target})\n{workload_table(results[-1])}\n", flush=True)
    files = write_report(settings.out, results, machine, _settings_record(settings))
    print(f"Wrote {', '.join(str(path) for path in files)}")
    return 0


def settings_from(options: argparse.Namespace) -> PlacementSettings:
    """The settings of parsed ``options``; raises ``ValueError`` for unknown names and bad values."""
    workloads = _known(comma_list(options.workloads), list(WORKLOADS), "workloads")
    placements = _known(comma_list(options.placements), PLACEMENTS, "placements")
    algorithms = comma_list(options.algorithms)
    if not algorithms:
        raise ValueError("--algorithms names no algorithm, e.g. --algorithms hogbatch,ddp.")
    if options.weak_gpu < 0 or options.repeats < 1:
        raise ValueError("--weak-gpu must be >= 0 (0 or 1: no emulation) and --repeats >= 1.")
    return PlacementSettings(
        workloads=workloads,
        algorithms=algorithms,
        placements=placements,
        weak_gpu=options.weak_gpu,
        repeats=options.repeats,
        out=options.out,
        epochs=options.epochs,
        targets=parse_targets(options.target),
        overrides=options.override,
        tiny=options.tiny,
    )


def parse_targets(texts: Sequence[str]) -> dict[str, Target]:
    """Targets by workload from ``WORKLOAD:METRIC=VALUE`` options.

    Example:
        >>> parse_targets(["fashion_mnist:val/acc=0.88"])
        {'fashion_mnist': Target(metric='val/acc', value=0.88)}
    """
    targets = {}
    for text in texts:
        workload, separator, target = text.partition(":")
        if not separator or workload not in WORKLOADS:
            raise ValueError(f"A target reads WORKLOAD:METRIC=VALUE with a workload of {', '.join(WORKLOADS)}.")
        targets[workload] = Target.parse(target)
    return targets


def _known(names: list[str], known: Sequence[str], option: str) -> list[str]:
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise ValueError(f"--{option}: unknown or none {unknown}; choose from {', '.join(known)}.")
    return names


def _settings_record(settings: PlacementSettings) -> dict[str, object]:
    record = {key: value for key, value in vars(settings).items() if key not in ("out", "targets")}
    return {**record, "targets": {name: str(target) for name, target in settings.targets.items()}}
