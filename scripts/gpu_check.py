"""Steps 1-4 of scripts/gpu_check.sh: the main job on the GPUs, one run per configuration, judged as a table.

Each run is ``python -m lightning_aesgd.train`` in a process of its own (what a user runs); its test metrics come
from the job's ``results:`` line. Exits 1 if a package is missing, a run fails or an XMC config's test P@1 is more
than ``P_AT_1_SLACK`` from Lightning DDP's under the same local optimizer (a config such as
``adaptive_sgd_paper`` brings its own: plain SGD where the workload uses Adagrad); a data set whose files are
absent is skipped, with why. ``AESGD_GPU_CHECK_ONLY`` (a regular expression) keeps the runs whose names match.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ALGORITHMS = sorted(path.stem for path in Path("configs/algorithm").glob("*.yaml"))
# Batched learners need dense layers and one row per sample: not XMC's sparse bags (run on Fashion-MNIST below).
DENSE_ONLY = {"crossbow"}
XMC_ALGORITHMS = [algorithm for algorithm in ALGORITHMS if algorithm not in DENSE_ONLY]
P_AT_1_SLACK = 0.01
RESULTS = re.compile(r"results: (.*)$", re.MULTILINE)


def run(name: str, overrides: list[str]) -> dict[str, float] | None:
    """One job; its results, or None (with its output's tail printed) if it failed."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "lightning_aesgd.train", *overrides, f"hydra.run.dir={out}"]
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    output = done.stdout + done.stderr
    found = RESULTS.findall(output)
    seconds = time.monotonic() - started
    if done.returncode != 0 or not found:
        print(f"FAIL {name} ({seconds:.0f} s, exit {done.returncode})\n{output[-4000:]}", flush=True)
        return None
    results = dict(item.split("=") for item in found[-1].split(", "))
    metrics = {key: float(value) for key, value in results.items()}
    shown = ", ".join(f"{key}={value:.4f}" for key, value in metrics.items() if key.startswith("test/"))
    print(f"ok   {name} ({seconds:.0f} s): {shown}", flush=True)
    return metrics


NEEDED = ("hydra", "omegaconf", "scipy", "torchmetrics", "pytorch_lightning")
"""What the main job imports beyond torch (digits also needs scikit-learn, checked where it runs)."""


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The modules of ``names`` that cannot be imported here."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def jobs(extra: list[str]) -> list[tuple[str, list[str]]]:
    """Every run of steps 1-4 as (name, overrides); data sets whose files are absent are left out, with why."""
    xmc = ["experiment=gpu", "trainer.max_epochs=3", *extra]
    planned = [(f"xmc_mini {algorithm}", [*xmc, f"algorithm={algorithm}"]) for algorithm in XMC_ALGORITHMS]
    # Lightning's DDP again under each other local optimizer that a config sets, as the fair reference for it.
    for local in sorted({local_optimizer(algorithm) for algorithm in XMC_ALGORITHMS} - {()}):
        planned.append((_reference_name(local), [*xmc, "algorithm=ddp", *local]))
    for experiment in ("digits", "fashion_mnist"):
        absent = _absent_data(experiment)
        if absent:
            print(f"skip {experiment}: {absent}")
            continue
        overrides = [f"experiment={experiment}", "trainer=gpu", "devices=real", "launch.start_method=spawn", *extra]
        planned.append((experiment, overrides))
    # Crossbow's batched learners on the workload: 64 rows per learner, the tuner's choice in the log.
    if not _absent_data("fashion_mnist"):
        learners = ["experiment=fashion_mnist", "trainer=gpu", "devices=real", "launch.start_method=spawn"]
        planned.append(
            (
                "fashion_mnist crossbow (learners per device)",
                [*learners, "algorithm=crossbow", "data.batch_size=64", *extra],
            )
        )
    for algorithm in ("adaptive_elastic", "adaptive_sgd", "ddp"):
        shared = ["experiment=gpu_shared", f"algorithm={algorithm}", "devices.num_replicas=2"]
        shared += ["devices.slowdown.factors=[1,2]", "trainer.max_epochs=1", *extra]
        planned.append((f"2 replicas on one GPU, {algorithm}", shared))
    for algorithm in ("hogbatch", "adaptive_elastic", "ddp"):
        placed = ["devices=gpu_cpu", f"algorithm={algorithm}", "trainer.max_epochs=1", *extra]
        planned.append((f"GPU and CPU replicas (devices=gpu_cpu), {algorithm}", placed))
    return planned


def main(extra: list[str]) -> int:
    """Run every configuration; return the exit status."""
    missing = missing_modules(NEEDED)
    if missing:
        print(f"FAIL missing Python packages: {missing}. HINT: install them (or carry their wheels) first.")
        return 1
    only = re.compile(os.environ.get("AESGD_GPU_CHECK_ONLY", ""))
    every = jobs(extra)
    kept = {name for name, _ in every if only.search(name)}
    # A kept XMC run is judged against DDP under its local optimizer: that reference runs too.
    kept |= {_reference_name(local_optimizer(a)) for a in XMC_ALGORITHMS if f"xmc_mini {a}" in kept}
    planned = [job for job in every if job[0] in kept]
    if not planned:
        print(f"FAIL no run's name matches AESGD_GPU_CHECK_ONLY={only.pattern!r}. HINT: e.g. 'xmc_mini|gpu_cpu'.")
        return 1
    # Runs are independent processes: several at a time share the GPU and shorten the check on a many-core host.
    with ThreadPoolExecutor(max_workers=int(os.environ.get("AESGD_GPU_CHECK_JOBS", "1"))) as pool:
        outcomes = list(pool.map(lambda job: run(*job), planned))
    failures = sum(metrics is None for metrics in outcomes)
    finished = {name: metrics for (name, _), metrics in zip(planned, outcomes, strict=True) if metrics is not None}
    for algorithm in XMC_ALGORITHMS:
        if f"xmc_mini {algorithm}" in finished:
            failures += not _near_ddp(algorithm, finished)
    print(f"gpu_check: {failures} failure(s)")
    return 1 if failures else 0


def local_optimizer(algorithm: str) -> tuple[str, ...]:
    """The local optimizer's keys an algorithm config sets (``local_optimizer``, ``local_lr``, …) as overrides."""
    config = yaml.safe_load(Path(f"configs/algorithm/{algorithm}.yaml").read_text())
    return tuple(f"+{key}={value}" for key, value in sorted(config.items()) if key.startswith("local_"))


def _reference_name(local: tuple[str, ...]) -> str:
    """The run name of Lightning's DDP under the local optimizer ``local`` (the workload's own where empty)."""
    return " ".join(["xmc_mini ddp", *local])


def _near_ddp(algorithm: str, finished: dict[str, dict[str, float]]) -> bool:
    """Whether ``algorithm``'s test P@1 is within the slack of DDP's under the same local optimizer; says which."""
    reference = finished.get(_reference_name(local_optimizer(algorithm)), {}).get("test/p@1")
    value = finished[f"xmc_mini {algorithm}"].get("test/p@1")
    if reference is None or value is None:
        print(f"FAIL {algorithm}: no test P@1 of its own or of DDP under its local optimizer to compare")
        return False
    near = abs(value - reference) <= P_AT_1_SLACK
    print(f"{'ok  ' if near else 'FAIL'} {algorithm}: test P@1 {value:.4f} against DDP's {reference:.4f}")
    return near


def _absent_data(experiment: str) -> str | None:
    """Why ``experiment``'s data cannot be read offline here, or None where it can."""
    if experiment == "digits" and missing_modules(("sklearn",)):
        return "scikit-learn (which ships the digits) is not installed"
    if experiment == "fashion_mnist":
        from lightning_aesgd.workloads.images.fashion_mnist import ENV_VAR, is_available, resolve_data_dir

        if not is_available():
            folder = resolve_data_dir()
            return f"no Fashion-MNIST files in {folder} (apt-get install dataset-fashion-mnist, or set {ENV_VAR})"
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
