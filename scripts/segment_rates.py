"""Throughput of a race over segments of its steps, from the per-step training clock each run recorded.

A race's table gives each run's throughput over the whole run. Where the devices change mid-run (the `straggler`
profile), what matters is each segment: before the change, while the plans follow it, and after. Each run's
``record.json`` holds its training clock at the end of every step and the samples of every step; this prints, for
each algorithm and repeat, the samples per second of the training clock over each segment, and each repeat's
ratio to the `ddp` run of the same repeat.

Usage::

    python scripts/segment_rates.py bench_results/xmc_mini --segments 1-14,14-140,140-160,160-280

A segment ``a-b`` runs from the end of step ``a`` to the end of step ``b`` (steps counted from 1).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def segment_rates(clock: list[float], samples: list[int], segments: list[tuple[int, int]]) -> list[float]:
    """Samples per second over each segment ``(a, b)``: steps ``a + 1`` to ``b`` over their training seconds."""
    for start, end in segments:
        if not 1 <= start < end <= len(clock):
            raise ValueError(f"segment {start}-{end} lies outside the run's {len(clock)} steps")
    return [sum(samples[start:end]) / (clock[end - 1] - clock[start - 1]) for start, end in segments]


def main() -> None:
    """Print the segment table of the race in the folder given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a race's output folder (its results.json and runs/)")
    parser.add_argument("--segments", required=True, help="comma list of a-b step ranges")
    args = parser.parse_args()
    segments = [tuple(int(step) for step in part.split("-")) for part in args.segments.split(",")]
    rates: dict[tuple[str, int], list[float]] = {}
    for run in json.loads((args.folder / "results.json").read_text())["runs"]:
        record = json.loads((args.folder / run["record"]).read_text())
        rates[run["algorithm"], run["repeat"]] = segment_rates(record["clock"], record["samples"], segments)  # type: ignore[arg-type]
    print("| algorithm | repeat | " + " | ".join(f"steps {a}-{b}" for a, b in segments) + " |")
    print("|---|---|" + "---|" * len(segments))
    for (algorithm, repeat), values in sorted(rates.items()):
        ddp = rates.get(("ddp", repeat))
        cells = [
            f"{value:,.0f}" + (f" ({value / base:.2f}×)" if ddp and algorithm != "ddp" else "")
            for value, base in zip(values, ddp or values, strict=True)
        ]
        print(f"| {algorithm} | {repeat} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
