"""`scripts/gpu_sharing_probe.py`, run on the CPU: its table, and the error where the device is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_sharing_probe.py"


def _probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False, env=os.environ
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_probe_measures_each_process_count_with_and_without_waits():
    result = _probe("--device", "cpu", "--processes", "1,2", "--seconds", "0.3")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if re.match(r"\| \d", line)]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| 1", "at the end (no device to wait for)"],
        ["| 1", "every step (no device to wait for)"],
        ["| 2", "at the end (no device to wait for)"],
        ["| 2", "every step (no device to wait for)"],
    ]
    for row in rows:
        per_process, milliseconds, total = (float(cell) for cell in row.strip("| ").split(" | ")[2:])
        assert per_process > 0
        assert total >= per_process
        # steps/s is printed to 0.1: on a loaded machine (1.4 steps/s) that rounding alone is 3.5% of it
        assert milliseconds == pytest.approx(1000 / per_process, rel=0.01 + 0.05 / per_process)


def test_a_missing_gpu_fails_with_a_hint():
    # The test process hides any GPU (conftest.py), and the probe inherits that.
    result = _probe("--device", "cuda:0", "--seconds", "0.1")
    assert result.returncode == 2
    assert "HINT: --device cpu" in result.stderr


@pytest.mark.timeout(300)
def test_a_process_that_fails_fails_the_probe_instead_of_hanging():
    # Every process fails at its first tensor (this torch has no XPU): the others must not wait at the barrier.
    result = _probe("--device", "xpu", "--processes", "2", "--seconds", "0.1")
    assert result.returncode != 0
    assert "a probe process failed or hung" in result.stderr


def test_each_row_comes_out_before_the_next_run(monkeypatch):
    # A time box that stops the probe keeps the rows it measured.
    probe = load_script("gpu_sharing_probe")
    runs = []

    def measure(device, processes, seconds, synchronise):
        runs.append(processes)
        if processes == 2:
            raise TimeoutError("the time box")
        return [10.0] * processes

    monkeypatch.setattr(probe, "measure", measure)
    lines = probe.table("cpu", [1, 2], 0.1)
    first = [next(lines) for _ in range(6)]  # the heading, then both modes of one process
    assert [line[:4] for line in first[-2:]] == ["| 1 ", "| 1 "]
    assert runs == [1, 1]
    with pytest.raises(TimeoutError):
        next(lines)
