"""The benchmark's command line: the first argument picks the program, each with its own options."""

from __future__ import annotations

import pytest

from lightning_aesgd.bench import main


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["--help"], "usage: aesgd-bench [-h] [--workload"),
        (["overhead", "--help"], "usage: aesgd-bench overhead"),
        (["slowness", "--help"], "usage: aesgd-bench slowness"),
        (["seeds", "--help"], "usage: aesgd-bench seeds"),
    ],
)
def test_each_program_has_its_own_help(argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


def test_unknown_slowness_cases_are_refused():
    with pytest.raises(SystemExit, match="Unknown cases"):
        main(["slowness", "--cases", "user,no_such_case"])
