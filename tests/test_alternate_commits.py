"""`scripts/alternate_commits.py`: two commits' runs alternated, and their figures compared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "alternate_commits.py"


def test_figures_are_compared_by_medians_ranges_and_pairs():
    lines = load_script("alternate_commits").comparison(
        [{"ms": 12.0, "left": None, "name": "a"}, {"ms": 14.0, "left": 3, "name": "a"}],
        [{"ms": 13.0, "left": 5, "name": "b"}, {"ms": 11.0, "left": 4, "name": "b"}],
    )
    assert lines == (
        "ms: base median 13.00 (12.00-14.00), new median 12.00 (11.00-13.00), new lower in 1 of 2 pairs, ranges overlap"
    )  # figures that are not numbers in the first run are not compared


def _worktrees() -> str:
    command = ["git", "-C", str(SCRIPT.parents[1]), "worktree", "list"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


@pytest.mark.timeout(120)
def test_each_commit_runs_in_a_worktree_of_its_own_removed_afterwards():
    before = _worktrees()
    figures = "import json, os; print(json.dumps({'n': len(os.listdir('lightning_aesgd'))}))"
    command = [sys.executable, str(SCRIPT), "HEAD", "HEAD", "--pairs", "2", "--same", "pyproject.toml", "--"]
    result = subprocess.run(
        [*command, sys.executable, "-c", figures], capture_output=True, text=True, timeout=100, check=False
    )
    assert result.returncode == 0, result.stderr
    assert len([line for line in result.stdout.splitlines() if line.startswith("pair ")]) == 4
    assert "new lower in 0 of 2 pairs, ranges overlap" in result.stdout
    assert _worktrees() == before


def test_same_copies_a_folder_or_a_file_of_this_checkout_over_the_worktrees(tmp_path):
    copy = load_script("alternate_commits")._copy
    (tmp_path / "here" / "bench").mkdir(parents=True)
    (tmp_path / "here" / "bench" / "new.py").write_text("new")
    (tmp_path / "tree" / "bench").mkdir(parents=True)
    (tmp_path / "tree" / "bench" / "old.py").write_text("old")
    copy(tmp_path / "here" / "bench", tmp_path / "tree" / "bench")
    assert sorted(path.name for path in (tmp_path / "tree" / "bench").iterdir()) == ["new.py"]
    (tmp_path / "here" / "setup.cfg").write_text("mine")
    copy(tmp_path / "here" / "setup.cfg", tmp_path / "tree" / "setup.cfg")
    assert (tmp_path / "tree" / "setup.cfg").read_text() == "mine"


def test_a_failing_command_names_the_commit_and_stops():
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "HEAD",
            "HEAD",
            "--pairs",
            "1",
            "--",
            sys.executable,
            "-c",
            "raise SystemExit(3)",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert result.returncode != 0
    assert "failed in base (exit status 3)" in result.stderr
