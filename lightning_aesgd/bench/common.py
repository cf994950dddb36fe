"""What the benchmark programs share: run options, comma-separated options, JSON files and markdown tables."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of every program that trains through the main job's configs: overrides, ``--tiny``, ``--verbose``."""
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="extra Hydra override (repeatable)"
    )
    parser.add_argument("--tiny", action="store_true", help="a seconds-long configuration (tests)")
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's and the strategy's messages")


def comma_list(text: str) -> list[str]:
    """The stripped, non-empty items of a comma-separated option.

    Example:
        >>> comma_list(" ddp, adaptive_sgd,,")
        ['ddp', 'adaptive_sgd']
    """
    return [item.strip() for item in text.split(",") if item.strip()]


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as indented JSON, creating the directory first; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table of ``header`` and ``rows`` (cells written with ``str``).

    Example:
        >>> print(markdown_table(["a", "b"], [[1, "x"]]))
        | a | b |
        |---|---|
        | 1 | x |
    """
    lines = [_row(header), "|" + "---|" * len(header)]
    lines += [_row(row) for row in rows]
    return "\n".join(lines)


def format_number(value: float | None, spec: str, missing: str = "–") -> str:
    """``value`` in format ``spec``, or ``missing`` where it is ``None``, NaN or infinite."""
    if value is None or not math.isfinite(value):
        return missing
    return format(value, spec)


def _row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"
