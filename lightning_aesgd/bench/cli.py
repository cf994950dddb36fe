"""Command line: ``python -m lightning_aesgd.bench [PROGRAM] [options]``, where PROGRAM picks the benchmark.

``overhead``, ``slowness``, ``seeds``, ``scale`` and ``placement`` name their programs; without a program name, the
arguments are the race's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from lightning_aesgd.bench import overhead, placement, race, scale, seeds, slowness

PROGRAMS: dict[str, Callable[[Sequence[str]], int]] = {
    "overhead": overhead.main,
    "slowness": slowness.main,
    "seeds": seeds.main,
    "scale": scale.main,
    "placement": placement.main,
}
"""The programs run by name; the race is the default."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the program the first argument names (the race without one); returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in PROGRAMS:
        return PROGRAMS[args[0]](args[1:])
    return race.main(args)
