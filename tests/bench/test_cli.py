"""The benchmark's command line: the first argument picks the program, each with its own options."""

from __future__ import annotations

import pytest

from lightning_aesgd.bench import main
from lightning_aesgd.bench.race import benchmark as race_benchmark


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


def test_a_misspelt_algorithm_fails_the_race_before_any_run(tmp_path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        main(["--tiny", "--algorithms", "ddp,nope", "--profiles", "strong", "--out", str(tmp_path / "race")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "cannot compose the run strong / nope: In 'train': Could not find 'algorithm/nope'" in error
    assert "Available options in 'algorithm'" in error
    assert "\tadaptive_sgd\n" in error
    assert "Config search path" not in error
    assert not (tmp_path / "race").exists(), "nothing ran, the solo run included"


def test_a_race_with_a_failed_run_exits_non_zero(tmp_path, monkeypatch: pytest.MonkeyPatch):
    def fails(cfg, run_dir):
        raise RuntimeError("a run that crashed")

    monkeypatch.setattr(race_benchmark, "run_once", fails)
    argv = ["--tiny", "--no-solo", "--algorithms", "ddp", "--profiles", "strong", "--out", str(tmp_path)]
    assert main(argv) == 1
    assert "RuntimeError: a run that crashed" in (tmp_path / "results.md").read_text()


def test_a_misspelt_profile_fails_the_race_before_any_run(tmp_path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        main(["--tiny", "--algorithms", "ddp", "--profiles", "strongg", "--out", str(tmp_path / "race")])
    assert exit_info.value.code == 2
    assert (
        "cannot compose the run strongg / ddp: In 'train': Could not find 'devices/strongg'" in capsys.readouterr().err
    )
    assert not (tmp_path / "race").exists()
