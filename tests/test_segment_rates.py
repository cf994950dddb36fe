"""`scripts/segment_rates.py`: a race's throughput over segments of its steps, from the recorded clock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "segment_rates.py"


def test_a_segment_counts_the_samples_of_its_steps_over_their_seconds():
    clock = [1.0, 2.0, 4.0, 8.0]  # the training clock at the end of steps 1 to 4
    samples = [10, 20, 40, 80]
    rates = load_script("segment_rates").segment_rates(clock, samples, [(1, 3), (3, 4), (1, 4)])
    assert rates == [60 / 3, 80 / 4, 140 / 7]


@pytest.mark.parametrize("segment", [(0, 2), (2, 2), (3, 5)])
def test_a_segment_outside_the_run_is_refused(segment):
    with pytest.raises(ValueError, match="outside the run's 4 steps"):
        load_script("segment_rates").segment_rates([1.0, 2.0, 3.0, 4.0], [1, 1, 1, 1], [segment])


def test_the_table_gives_each_repeat_its_ratio_to_ddp_of_the_same_repeat(tmp_path):
    runs = []
    for algorithm, seconds in (("adaptive_elastic", 1.0), ("ddp", 2.0)):
        record = tmp_path / f"{algorithm}.json"
        record.write_text(json.dumps({"clock": [seconds * step for step in (1, 2, 3)], "samples": [8, 8, 8]}))
        runs.append({"algorithm": algorithm, "repeat": 0, "record": record.name})
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs}))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--segments", "1-3"], capture_output=True, text=True, check=True
    ).stdout
    assert "| adaptive_elastic | 0 | 8 (2.00×) |" in out
    assert "| ddp | 0 | 4 |" in out
