"""`scripts/paired_seeds.py`: the defaults against DDP at small batches with BatchNorm, seed by seed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

from lightning_aesgd.workloads.images import fashion_mnist

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "paired_seeds.py"


def test_seeds_are_a_range_or_a_list():
    seeds_of = load_script("paired_seeds").seeds_of
    assert seeds_of("3-6") == [3, 4, 5, 6]
    assert seeds_of("1,4,9") == [1, 4, 9]
    assert seeds_of("7") == [7]


def test_the_summary_pairs_each_seed_with_its_own_rival_run():
    # Seed 1 scores high under both, seed 2 low under both: unpaired, the spread of the seeds would swamp the
    # constant +0.01 of the defaults; paired, its standard error is 0.
    results = {
        1: {"ddp": {"score": 0.90, "ms_per_step": 10.0}, "adaptive_elastic": {"score": 0.91, "ms_per_step": 8.0}},
        2: {"ddp": {"score": 0.70, "ms_per_step": 12.0}, "adaptive_elastic": {"score": 0.71, "ms_per_step": 9.0}},
    }
    (line,) = load_script("paired_seeds").summary(results, ["ddp"])
    assert "score +0.0100 ± 0.0000 (standard error, 2 seeds)" in line
    assert "ms per step 8.50 against 11.00" in line
    assert f"÷ ddp's: {8.5 / 11:.2f}" in line


def test_one_seed_has_no_standard_error():
    results = {1: {"ddp": {"score": 0.5, "ms_per_step": 1.0}, "adaptive_elastic": {"score": 0.5, "ms_per_step": 1.0}}}
    (line,) = load_script("paired_seeds").summary(results, ["ddp"])
    assert f"± {math.nan:.4f}" in line


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.skipif(not fashion_mnist.is_available(), reason="Fashion-MNIST is not installed (dataset-fashion-mnist)")
def test_a_quick_race_scores_both_strategies_on_one_seed(tmp_path):
    out = tmp_path / "paired.json"
    command = [sys.executable, str(SCRIPT), "--seeds", "3", "--rivals", "ddp", "--max-steps", "12", "--out", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "adaptive_elastic - ddp: score" in finished.stdout
    results = json.loads(out.read_text())["results"]["3"]
    assert set(results) == {"ddp", "adaptive_elastic"}
    for run in results.values():
        assert 0.0 <= run["score"] <= 1.0
        assert run["ms_per_step"] > 0


def test_an_unknown_rival_is_refused_with_the_choices(tmp_path):
    finished = subprocess.run(
        [sys.executable, str(SCRIPT), "--rivals", "ddp,dpp"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert finished.returncode == 2
    assert "unknown rival(s) ['dpp']: choose from ddp_lightning, ddp" in finished.stderr
