"""Steps 1-4 of scripts/gpu_check.sh: the main job on the GPUs, one run per configuration, judged as a table.

Each run is ``python -m lightning_aesgd.train`` in a process of its own (what a user runs); its test metrics come
from the job's ``results:`` line. Exits 1 if a package is missing, a run fails or an XMC config's test P@1 is more
than ``P_AT_1_SLACK`` from Lightning DDP's; a data set whose files are absent is skipped, with why.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ALGORITHMS = sorted(path.stem for path in Path("configs/algorithm").glob("*.yaml"))
# Batched learners need dense layers and one row per sample: not XMC's sparse bags (run on Fashion-MNIST below).
DENSE_ONLY = {"crossbow"}
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


def main(extra: list[str]) -> int:
    """Run every configuration; return the exit status."""
    missing = missing_modules(NEEDED)
    if missing:
        print(f"FAIL missing Python packages: {missing}. HINT: install them (or carry their wheels) first.")
        return 1
    failures = 0
    p_at_1: dict[str, float] = {}
    for algorithm in ALGORITHMS:
        if algorithm in DENSE_ONLY:
            continue
        metrics = run(
            f"xmc_mini {algorithm}", ["experiment=gpu", f"algorithm={algorithm}", "trainer.max_epochs=3", *extra]
        )
        if metrics is None:
            failures += 1
        elif "test/p@1" in metrics:
            p_at_1[algorithm] = metrics["test/p@1"]
    for experiment in ("digits", "fashion_mnist"):
        absent = _absent_data(experiment)
        if absent:
            print(f"skip {experiment}: {absent}")
            continue
        overrides = [f"experiment={experiment}", "trainer=gpu", "devices=real", "launch.start_method=spawn", *extra]
        failures += run(experiment, overrides) is None
    # Crossbow's batched learners on the workload: 64 rows per learner, the tuner's choice in the log.
    if not _absent_data("fashion_mnist"):
        learners = ["experiment=fashion_mnist", "trainer=gpu", "devices=real", "launch.start_method=spawn"]
        crossbow = [*learners, "algorithm=crossbow", "data.batch_size=64", *extra]
        failures += run("fashion_mnist crossbow (learners per device)", crossbow) is None
    for algorithm in ("adaptive_elastic", "adaptive_sgd", "ddp"):
        shared = ["experiment=gpu_shared", f"algorithm={algorithm}", "devices.num_replicas=2"]
        shared += ["devices.slowdown.factors=[1,2]", "trainer.max_epochs=1", *extra]
        failures += run(f"2 replicas on one GPU, {algorithm}", shared) is None
    for algorithm in ("hogbatch", "adaptive_elastic", "ddp"):
        placed = ["devices=gpu_cpu", f"algorithm={algorithm}", "trainer.max_epochs=1", *extra]
        failures += run(f"GPU and CPU replicas (devices=gpu_cpu), {algorithm}", placed) is None
    reference = p_at_1.get("ddp")
    if reference is None:
        print("FAIL no P@1 from Lightning's DDP to compare with")
        failures += 1
    else:
        for algorithm, value in sorted(p_at_1.items()):
            off = abs(value - reference) > P_AT_1_SLACK
            failures += off
            print(f"{'FAIL' if off else 'ok  '} {algorithm}: test P@1 {value:.4f} against DDP's {reference:.4f}")
    print(f"gpu_check: {failures} failure(s)")
    return 1 if failures else 0


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
