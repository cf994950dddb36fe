"""Every script in ``examples/`` runs as a user would run it (a subprocess), briefly, and prints its result."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_aesgd.workloads.images import fashion_mnist

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TESTED = {"existing_project.py", "plain_python.py", "compare_with_ddp.py", "fashion_mnist.py", "same_as_ddp.py"}
# Launcher variables a surrounding run may have exported; an example must start as a fresh program.
_LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SUMMARY = "adaptive_elastic: replicas at the end of fit"
NUMBER = r"(\d+\.\d+)"


def run_example(
    name: str, cwd: Path, timeout: float, env: dict[str, str] | None = None, steps: int = 2
) -> tuple[int, str]:
    """Run ``examples/<name> --max-steps <steps>`` in ``cwd``; returns the exit code and stdout + stderr.

    The example and every process it starts share a new session, so a run over ``timeout`` is killed whole.
    """
    environment = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES} | (env or {})
    command = [sys.executable, str(EXAMPLES / name), "--max-steps", str(steps)]
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"{name} ran over {timeout} s; its output ends with:\n{output[-4000:]}")
    return process.returncode, output


def run_ok(name: str, cwd: Path, timeout: float, steps: int = 2) -> str:
    """Run an example and return its output, failing the test with the output's end if it exits non-zero."""
    code, output = run_example(name, cwd, timeout, steps=steps)
    assert code == 0, f"{name} exited with {code}; its output ends with:\n{output[-4000:]}"
    return output


def metric(pattern: str, output: str) -> list[float]:
    """The numbers the single line matching ``pattern`` prints; fails if there is not exactly one such line."""
    found = re.findall(pattern, output)
    assert len(found) == 1, f"expected one line matching {pattern!r}, found {len(found)} in:\n{output[-4000:]}"
    values = found[0] if isinstance(found[0], tuple) else (found[0],)
    return [float(value) for value in values]


def test_every_example_is_tested_here():
    assert {path.name for path in EXAMPLES.glob("*.py")} == TESTED


@pytest.mark.timeout(180)
def test_existing_project_gains_the_strategy_with_one_argument(tmp_path):
    pytest.importorskip("sklearn", reason="the example trains on scikit-learn's bundled digits")
    # The popen launcher runs the script again for rank 1: two interpreter start-ups in a row. Four steps: the first
    # report (and so the summary) falls at the fourth.
    output = run_ok("existing_project.py", tmp_path, timeout=170, steps=4)
    assert SUMMARY in output
    (accuracy,) = metric(rf"validation accuracy of the trained model: {NUMBER}", output)
    assert 0.0 <= accuracy <= 1.0


@pytest.mark.timeout(120)
def test_plain_python_tests_the_merged_model_and_logs_telemetry(tmp_path):
    # Merges at steps 0 and 2: the first holds no whole step yet, the second step 1 (speeds, balance); step 0, the
    # fit's first, is measured by none.
    output = run_ok("plain_python.py", tmp_path, timeout=110, steps=3)
    assert SUMMARY in output
    p_at_1, p_at_5 = metric(rf"test P@1 = {NUMBER}, P@5 = {NUMBER}", output)
    # Two Adagrad steps already rank a true label first for far more rows than chance (500 labels).
    assert 0.05 < p_at_1 <= 1.0
    assert 0.0 < p_at_5 <= 1.0
    header = (tmp_path / "lightning_logs" / "plain_python" / "metrics.csv").read_text().splitlines()[0].split(",")
    for column in ("aesgd/replica_3/batch_size", "aesgd/replica_3/samples_per_sec", "aesgd/step_time_balance"):
        assert column in header
    first, last = metric(rf"aesgd/step_time_balance {NUMBER} -> {NUMBER}", output)
    assert first >= 1.0
    assert last >= 1.0


@pytest.mark.timeout(120)
def test_compare_with_ddp_times_both_strategies(tmp_path):
    output = run_ok("compare_with_ddp.py", tmp_path, timeout=110)
    assert SUMMARY in output  # the adaptive run really ran adaptive_elastic
    for name in ("adaptive_elastic", "ddp"):
        (throughput,) = metric(rf"{name}: 2 steps in +{NUMBER} s, +(\d+) samples/s", output)[1:]
        assert throughput > 0
    (ratio,) = metric(rf"throughput ratio adaptive_elastic / ddp: {NUMBER}x", output)
    assert ratio > 0


@pytest.mark.timeout(150)
def test_same_as_ddp_matches_ddps_weights_with_gradient_sync(tmp_path):
    output = run_ok("same_as_ddp.py", tmp_path, timeout=140)
    (gradients,) = metric(r'sync="gradients": largest weight difference from DDP ([0-9.e+-]+);', output)
    (models,) = metric(r'sync="models": largest weight difference from DDP ([0-9.e+-]+);', output)
    assert gradients < 1e-5, output[-3000:]
    assert models > 1e-4  # Adam: averaging models after two steps is not averaging gradients


@pytest.mark.timeout(120)
@pytest.mark.skipif(not fashion_mnist.is_available(), reason="Fashion-MNIST is not installed (dataset-fashion-mnist)")
def test_fashion_mnist_trains_and_tests(tmp_path):
    output = run_ok("fashion_mnist.py", tmp_path, timeout=110)
    assert SUMMARY in output
    (accuracy,) = metric(rf"test accuracy of the merged model: {NUMBER}", output)
    assert 0.0 <= accuracy <= 1.0


@pytest.mark.timeout(60)
def test_fashion_mnist_without_data_exits_with_the_fix(tmp_path):
    code, output = run_example("fashion_mnist.py", tmp_path, timeout=50, env={fashion_mnist.ENV_VAR: str(tmp_path)})
    assert code == 1
    assert "Fashion-MNIST not found" in output
    assert "apt-get install dataset-fashion-mnist" in output
    assert "Traceback" not in output
