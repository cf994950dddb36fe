"""``python -m lightning_aesgd.bench scale``: the speedup over lockstep DDP as the replicas grow in number and spread.

Two parts, each printed as a markdown table and written to ``scale.json``:

* measured (:mod:`.measured`): DDP and ``adaptive_elastic`` at 2, 4 and 8 replica processes whose cost factors
  span the same range (log-spaced from 1 to 4), the slowness benchmark's ``user`` case: throughput, its ratio to
  DDP, and efficiency against the replicas' solo speeds. Both strategies take the same samples per step, so the
  time to a target number of steps (and, with the same updates, to a target metric) follows throughput;
* simulated (:mod:`.simulation`): 16 to 256 replicas whose cost factors are drawn within a spread, with measured
  per-step noise (:mod:`.noise`), lockstep DDP against the strategy's real plan loop, timed per step, and the real
  sampler's split at that scale (:mod:`.sampling`).

Results are ratios within one run on this machine (measured), or of the model in :mod:`.simulation` (simulated).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_aesgd.bench.common import comma_list
from lightning_aesgd.bench.scale.measured import LARGEST_COST, MEASURED_REPLICAS, run_measured
from lightning_aesgd.bench.scale.noise import STEP_TIME_RATIOS, measure_step_noise
from lightning_aesgd.bench.scale.report import measured_table, sampler_table, simulated_table, write_report
from lightning_aesgd.bench.scale.sampling import check_sampler
from lightning_aesgd.bench.scale.simulation import Simulation, simulate
from lightning_aesgd.bench.slowness.comparison import CaseResult

PARTS = ("measured", "simulated")
SIMULATED_REPLICAS = (16, 32, 64, 128, 256)
SPREADS = (1.0, 2.0, 4.0, 8.0)


def build_parser() -> argparse.ArgumentParser:
    """The scale program's options."""
    parser = argparse.ArgumentParser(prog="aesgd-bench scale", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--replicas", default=_joined(MEASURED_REPLICAS), help="measured replica counts")
    parser.add_argument("--largest-cost", type=float, default=LARGEST_COST, help="the measured slowest cost factor")
    parser.add_argument("--steps", type=int, default=50, help="training steps per measured run")
    parser.add_argument("--sim-replicas", default=_joined(SIMULATED_REPLICAS), help="simulated replica counts")
    parser.add_argument("--spreads", default=_joined(SPREADS), help="simulated spreads (largest cost factor)")
    parser.add_argument("--sim-steps", type=int, default=300, help="simulated steps per fleet (10 of warm-up)")
    parser.add_argument("--noise-scale", type=float, default=1.0, help="0: no noise, 1: the measured noise")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated fleets and noise")
    parser.add_argument(
        "--measure-noise", type=int, default=0, metavar="STEPS", help="only measure step-time noise over STEPS steps"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results") / "scale", help="output directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen parts, print the tables and write them as JSON; returns the exit status."""
    options = build_parser().parse_args(argv)
    # One thread per replica process (up to 8 replicas share 2 cores; forked replicas inherit it).
    torch.set_num_threads(1)
    if options.measure_noise:
        print(measure_step_noise(options.measure_noise, options.out))
        return 0
    parts = comma_list(options.parts)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"Unknown parts {unknown}; choose from {', '.join(PARTS)}.")
    simulations: list[Simulation] = []
    sampler_us: dict[int, float] = {}
    if "simulated" in parts:
        simulations, sampler_us = run_simulated(options)
        print("\n" + simulated_table(simulations) + "\n\n" + sampler_table(sampler_us), flush=True)
    measured: list[CaseResult] = []
    if "measured" in parts:
        replicas = [int(count) for count in comma_list(options.replicas)]
        measured = run_measured(replicas, options.largest_cost, options.steps, options.out)
        print("\n" + measured_table(measured))
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(options).items()}
    path = write_report(options.out, measured, simulations, sampler_us, settings)
    print(f"\nWrote {path}")
    return 0


def run_simulated(options: argparse.Namespace) -> tuple[list[Simulation], dict[int, float]]:
    """Every simulated fleet, and per count the real sampler's microseconds per batch under its widest fleet's plan."""
    simulations: list[Simulation] = []
    sampler_us: dict[int, float] = {}
    for replicas in (int(count) for count in comma_list(options.sim_replicas)):
        for spread in (float(value) for value in comma_list(options.spreads)):
            simulations.append(
                simulate(replicas, spread, options.sim_steps, STEP_TIME_RATIOS, options.noise_scale, options.seed)
            )
        sampler_us[replicas] = check_sampler(simulations[-1].final_plan)
    return simulations, sampler_us


def _joined(values: Sequence[float]) -> str:
    return ",".join(f"{value:g}" for value in values)
