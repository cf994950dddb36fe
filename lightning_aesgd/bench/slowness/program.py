"""``python -m lightning_aesgd.bench slowness``: the strategy against slowness it did not create, beside DDP.

Every case trains a small image classifier (an MLP, or a small CNN where the slowness acts on real compute) on real
data (Fashion-MNIST's images, or scikit-learn's digits where Fashion-MNIST is not installed) with 4 replicas, once
under Lightning's ``DDPStrategy`` and once under ``strategy="adaptive_elastic"`` with its defaults, in the same
run. The slowness comes from :class:`~lightning_aesgd.callbacks.SlowdownCallback`, applied to both strategies
alike, in the place the case's mode says: the user's ``training_step``, the DataLoader's collate function,
``on_train_batch_end``, a real CPU quota per process, or (for comparison) the emulation inside the optimizer step.
Per case it reports:

* throughput (samples per second over the steps after a warm-up) and its ratio to DDP's;
* efficiency: throughput over the ideal, the step batch over the step time of the split that equalises the
  replicas' solo step times (each factor's replica trained alone at two batch sizes gives ``tᵢ(b) = aᵢ + cᵢ·b``;
  without fixed costs the ideal is the sum of the solo speeds);
* the plan at step 30 against that balanced split and against the nominal ``∝ 1/fᵢ`` (largest relative share
  error), how closely the replicas finish their steps by the strategy's own clocks, and the smallest batch any
  replica got;
* a ``machinery`` case: wall time per step of a model that does almost nothing, for one process without any
  strategy, DDP and ``adaptive_elastic`` (4 replicas, and 1): the difference is each strategy's per-step cost.

Results are ratios measured within one run on this machine, never absolute device speeds.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_aesgd.bench.common import comma_list
from lightning_aesgd.bench.slowness.alone import run_alone
from lightning_aesgd.bench.slowness.cases import CASES
from lightning_aesgd.bench.slowness.comparison import run_case
from lightning_aesgd.bench.slowness.machinery import measure_machinery
from lightning_aesgd.bench.slowness.model import load_data
from lightning_aesgd.bench.slowness.report import machinery_table, table, write_report
from lightning_aesgd.emulation.cpu_quota import quota_unavailable


def build_parser() -> argparse.ArgumentParser:
    """The slowness program's options."""
    parser = argparse.ArgumentParser(prog="aesgd-bench slowness", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs per strategy (median reported)")
    parser.add_argument("--machinery-steps", type=int, default=200, help="steps of the machinery runs (0: skip)")
    parser.add_argument("--machinery-repeats", type=int, default=3, help="interleaved repeats of the machinery runs")
    parser.add_argument(
        "--alone",
        action="store_true",
        help="run each case under adaptive_elastic only and print its figures as one JSON line (to compare versions)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results") / "slowness", help="output directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cases, print the tables and write them as JSON; returns the exit status."""
    options = build_parser().parse_args(argv)
    names = runnable_cases(comma_list(options.cases))
    # One thread per replica process (4 replicas share 2 cores; forked replicas inherit it): several threads of a
    # process under a CPU quota spin waiting for each other while the quota has them throttled.
    torch.set_num_threads(1)
    dataset = load_data()
    if options.alone:
        for name in names:
            print(json.dumps({"case": name, **run_alone(CASES[name], dataset, options.steps, options.out)}), flush=True)
        return 0
    results = []
    for name in names:
        results.append(run_case(CASES[name], dataset, options.steps, options.out, options.repeats))
        print(f"{name}: adaptive_elastic ÷ DDP = {results[-1].ratio():.2f}", flush=True)
    steps, repeats = options.machinery_steps, options.machinery_repeats
    figures = measure_machinery(dataset, steps, options.out, repeats) if steps else None
    path = write_report(options.out, results, figures, options.steps, options.repeats)
    print("\n" + table(results, options.steps))
    if figures is not None:
        print("\n" + machinery_table(figures))
    print(f"\nWrote {path}")
    return 0


def runnable_cases(names: list[str]) -> list[str]:
    """``names`` without the quota cases where this machine cannot set CPU quotas; unknown names end the program."""
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"Unknown cases {unknown}; choose from {', '.join(CASES)}.")
    quota_cases = [name for name in names if CASES[name].mode == "quota"]
    if not quota_cases or (reason := quota_unavailable()) is None:
        return names
    print(f"skipping the quota cases {', '.join(quota_cases)}: {reason}")
    return [name for name in names if name not in quota_cases]
