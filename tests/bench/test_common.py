"""What the benchmark programs share: comma lists, JSON files, markdown tables and number formats."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning_aesgd.bench.common import comma_list, format_number, markdown_table, write_json


def test_comma_list_drops_blanks():
    assert comma_list(" a, b ,,c,") == ["a", "b", "c"]
    assert comma_list(" , ") == []


def test_write_json_creates_the_directory(tmp_path: Path):
    path = write_json(tmp_path / "deep" / "out.json", {"x": [1, 2]})
    assert json.loads(path.read_text()) == {"x": [1, 2]}
    assert path.read_text().endswith("}\n")


def test_markdown_table_has_a_separator_per_column():
    assert markdown_table(("a", "b"), [(1, None), ("x", [2])]).splitlines() == [
        "| a | b |",
        "|---|---|",
        "| 1 | None |",
        "| x | [2] |",
    ]


def test_format_number_marks_missing_values():
    assert format_number(0.456, ".0%") == "46%"
    assert format_number(None, ".1f") == "–"
    assert format_number(math.nan, ".1f", missing="not reached") == "not reached"
