"""`scripts/large_model_steps.py`: time per step of a large dense model, the defaults against two DDPs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "large_model_steps.py"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_quick_race_times_every_contender(tmp_path):
    command = [sys.executable, str(SCRIPT), "--width", "64", "--layers", "1", "--max-steps", "8"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=140, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "0.0 million parameters, 2 replicas, batch 32 each" in finished.stdout
    for name in ("ddp", "ddp_bucket_view", "adaptive_elastic"):
        (median,) = re.findall(rf"^{name}: \[[0-9., ]+\] ms per step, median ([0-9.]+)$", finished.stdout, re.M)
        assert float(median) > 0
    for rival in ("ddp", "ddp_bucket_view"):
        assert re.search(
            rf"^adaptive_elastic - {rival}: [+-][0-9.]+ ms per step \(standard error nan\) over 1 repeat$",
            finished.stdout,
            re.M,
        )


def test_a_paired_difference_is_the_mean_of_the_race_by_race_differences():
    line = load_script("large_model_steps").paired_difference("a", [10.0, 14.0, 9.0], "b", [9.0, 11.0, 10.0])
    # differences 1, 3, -1: mean 1, standard deviation 2, standard error 2 / sqrt(3)
    assert line == "a - b: +1.0 ms per step (standard error 1.2) over 3 repeats"
