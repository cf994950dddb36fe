"""Alternate a command between two commits of this repository on one machine, and compare the figures it prints.

Each commit is checked out into a temporary worktree. The command runs in that worktree, with it first on
``PYTHONPATH``: BASE, then NEW, ``--pairs`` times, so that the machine's drift falls on both alike. The command's
last output line must be a JSON object (one run, one line: give one case per command). For each numeric figure, the
script prints both commits' runs, their medians and ranges, and in how many pairs NEW's was lower. A difference
counts as reproduced only where the ranges do not overlap. ``--same PATH`` copies a file or folder of this checkout
into both worktrees first, so that both commits are measured by the same instrument (a benchmark newer than BASE).
Example, the step-fixed pairs of docs/results/slowness::

    bench="python -m lightning_aesgd.bench slowness --alone --cases step-fixed --steps 400"
    python scripts/alternate_commits.py db5e685 2cf688a --same lightning_aesgd/bench --pairs 8 -- $bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]


def main() -> int:
    """Run the pairs and print the comparison; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--pairs", type=int, default=8, help="runs of each commit, alternated")
    parser.add_argument("--same", action="append", default=[], help="a path of this checkout copied into both")
    parser.usage = "%(prog)s BASE NEW [--pairs N] [--same PATH ...] -- COMMAND ..."
    arguments = sys.argv[1:]
    split = arguments.index("--") if "--" in arguments else len(arguments)
    options, command = parser.parse_args(arguments[:split]), arguments[split + 1 :]
    if not command:
        parser.error("give the command to run after --")
    if os.sep in command[0] and os.path.exists(command[0]):
        command[0] = os.path.abspath(command[0])  # it runs in the worktrees (not resolved: a venv's link is the venv)
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        trees: dict[str, Path] = {}
        try:
            for name, commit in (("base", options.base), ("new", options.new)):
                trees[name] = _worktree(commit, Path(scratch) / name)
                for path in options.same:
                    _copy(REPOSITORY / path, trees[name] / path)
            for pair in range(options.pairs):
                for name, tree in trees.items():
                    runs[name].append(_run(command, tree))
                    print(f"pair {pair} {name}: {json.dumps(runs[name][-1])}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "remove", "--force", str(tree)], check=False)
    print(comparison(runs["base"], runs["new"]))
    return 0


def comparison(base: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
    """Per numeric figure: each commit's median and range, and the pairs in which NEW's was lower.

    Example:
        >>> print(comparison([{"ms": 12.0}, {"ms": 14.0}], [{"ms": 11.0}, {"ms": 11.5}]))
        ms: base median 13.00 (12.00-14.00), new median 11.25 (11.00-11.50), new lower in 2 of 2 pairs, ranges apart
    """
    lines = []
    for key, value in base[0].items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        pairs = [
            (b[key], a[key]) for b, a in zip(base, new, strict=False) if _number(b.get(key)) and _number(a.get(key))
        ]
        if not pairs:
            continue
        before, after = [b for b, _ in pairs], [a for _, a in pairs]
        lower = sum(a < b for b, a in pairs)
        apart = max(after) < min(before) or min(after) > max(before)
        lines.append(
            f"{key}: base median {statistics.median(before):.2f} ({min(before):.2f}-{max(before):.2f}), "
            f"new median {statistics.median(after):.2f} ({min(after):.2f}-{max(after):.2f}), "
            f"new lower in {lower} of {min(len(before), len(after))} pairs, "
            f"{'ranges apart' if apart else 'ranges overlap'}"
        )
    return "\n".join(lines)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _worktree(commit: str, path: Path) -> Path:
    command = ["git", "-C", str(REPOSITORY), "worktree", "add", "--quiet", "--detach", str(path), commit]
    subprocess.run(command, check=True)
    return path


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        shutil.copy2(source, target)


def _run(command: list[str], tree: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        sys.stderr.write(result.stderr[-4000:])
        raise SystemExit(f"{' '.join(command)} failed in {tree.name} (exit status {result.returncode})")
    figures: dict[str, Any] = json.loads(lines[-1])
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
