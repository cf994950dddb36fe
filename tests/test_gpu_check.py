"""The plans of `scripts/gpu_check.py` (runs and their judgement) and `scripts/gpu_bench.sh`, checked without a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


def _environment(**extra: str) -> dict[str, str]:
    """This process's environment without the ``AESGD_GPU_*`` settings of a surrounding GPU session, plus ``extra``.

    On the GPU machine the suite itself runs inside ``scripts/gpu_session.sh``, whose race filter and worker count
    would otherwise reach the scripts under test.
    """
    kept = {key: value for key, value in os.environ.items() if not key.startswith("AESGD_GPU_")}
    return {**kept, **extra}


@pytest.fixture
def gpu_check(monkeypatch):
    for key in [key for key in os.environ if key.startswith("AESGD_GPU_")]:  # a surrounding session's settings
        monkeypatch.delenv(key)
    monkeypatch.chdir(ROOT)  # the script reads configs/ relative to the repository, as gpu_check.sh runs it
    return load_script("gpu_check")


def test_every_algorithm_config_is_run_on_xmc_but_those_needing_dense_layers(gpu_check):
    names = {name for name, _ in gpu_check.jobs([])}
    configs = {path.stem for path in (ROOT / "configs" / "algorithm").glob("*.yaml")}
    assert {f"xmc_mini {name}" for name in configs - gpu_check.DENSE_ONLY} <= names
    assert "xmc_mini crossbow" not in names


def test_gpu_check_runs_every_test_file_that_has_cuda_tests():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    with_cuda = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if "pytest.mark.cuda" in path.read_text() and path != Path(__file__).resolve()
    }
    assert with_cuda, "no test file has cuda tests"
    assert {name for name in with_cuda if name not in script} == set()


def test_a_config_with_its_own_local_optimizer_is_judged_against_ddp_under_it(gpu_check):
    local = gpu_check.local_optimizer("adaptive_sgd_paper")
    assert "+local_optimizer=sgd" in local
    assert gpu_check.local_optimizer("adaptive_elastic") == ()
    runs = dict(gpu_check.jobs(["trainer.max_steps=2"]))
    reference = runs[" ".join(["xmc_mini ddp", *local])]
    assert reference[-len(local) - 1 :] == ["algorithm=ddp", *local]
    assert "trainer.max_steps=2" in reference
    finished = {"xmc_mini adaptive_sgd_paper": {"test/p@1": 0.8468}, "xmc_mini ddp": {"test/p@1": 0.9352}}
    assert not gpu_check._near_ddp("adaptive_sgd_paper", finished), "no DDP run under its optimizer"
    finished[" ".join(["xmc_mini ddp", *local])] = {"test/p@1": 0.8418}
    assert gpu_check._near_ddp("adaptive_sgd_paper", finished)
    finished["xmc_mini sma"] = {"test/p@1": 0.9500}
    assert not gpu_check._near_ddp("sma", finished), "0.0148 above DDP's is beyond the slack"


def test_a_filter_that_keeps_no_run_fails_instead_of_passing_empty(gpu_check, monkeypatch, capsys):
    monkeypatch.setitem(os.environ, "AESGD_GPU_CHECK_ONLY", "no run has this name")
    monkeypatch.setattr(gpu_check, "missing_modules", lambda names: [])
    assert gpu_check.main([]) == 1
    assert "FAIL no run's name matches AESGD_GPU_CHECK_ONLY='no run has this name'" in capsys.readouterr().out


def test_a_kept_xmc_run_brings_its_ddp_reference(gpu_check, monkeypatch):
    monkeypatch.setitem(os.environ, "AESGD_GPU_CHECK_ONLY", "adaptive_sgd_paper")
    monkeypatch.setattr(gpu_check, "missing_modules", lambda names: [])
    ran = []
    monkeypatch.setattr(gpu_check, "run", lambda name, overrides: ran.append(name) or {"test/p@1": 0.85})
    assert gpu_check.main([]) == 0
    assert sorted(ran) == sorted(
        ["xmc_mini adaptive_sgd_paper", gpu_check._reference_name(gpu_check.local_optimizer("adaptive_sgd_paper"))]
    )


def test_every_race_of_gpu_bench_composes_for_each_entrant(tmp_path):
    from lightning_aesgd.bench.race.benchmark import BenchSettings, _profile_config
    from lightning_aesgd.bench.race.program import build_parser
    from lightning_aesgd.bench.race.suites import Target, get_workload

    calls = tmp_path / "calls.jsonl"
    fake_python = tmp_path / "python"  # records each race's arguments instead of running it
    fake_python.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@" >> {calls}\n'
    )
    fake_python.chmod(0o755)
    env = _environment(AESGD_PYTHON=str(fake_python))
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh")], env=env, check=True, timeout=60)

    races = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [argv[argv.index("--out") + 1].rsplit("/", 1)[-1] for argv in races] == [
        "xmc_mini_one_gpu",
        "fashion_mnist_one_gpu",
        "xmc_mini_shared_strong",
    ]
    for argv in races:
        options = build_parser().parse_args(argv[2:])  # past "-m lightning_aesgd.bench"
        workload = get_workload(options.workload)
        settings = BenchSettings(
            options.workload, options.profiles.split(","), options.algorithms.split(","), options.epochs,
            options.repeats, Target.parse(workload.target), Path(options.out), options.override,
        )  # fmt: skip
        for profile in settings.profiles:
            for algorithm in settings.algorithms:
                cfg = _profile_config(settings, workload.overrides(False), profile, algorithm)
                assert cfg.trainer.max_epochs == options.epochs
                assert cfg.trainer.val_check_interval == 1.0  # validation thinned: runs there are mostly validation


def test_a_gpu_bench_filter_that_names_no_race_fails():
    env = _environment(AESGD_PYTHON="true", AESGD_GPU_BENCH_ONLY="xmc_mini")  # a part of a name is none
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh")], env=env, capture_output=True, timeout=60)
    assert done.returncode == 2
    assert b"names no race" in done.stderr


def test_a_gpu_bench_race_with_failed_runs_leaves_the_other_races_to_run_and_fails_at_the_end(tmp_path):
    calls = tmp_path / "calls"
    failing_python = tmp_path / "python"  # every race "has a failed run": the bench's exit status 1
    failing_python.write_text(f"#!/bin/sh\necho race >> {calls}\nexit 1\n")
    failing_python.chmod(0o755)
    env = _environment(AESGD_PYTHON=str(failing_python))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh")], env=env, capture_output=True, timeout=60)
    assert done.returncode == 1
    assert calls.read_text().split() == ["race"] * 3
    assert b"3 of 3 races had failed runs" in done.stderr


@pytest.mark.timeout(300)
def test_a_gpu_session_runs_its_stages_and_reports_each_one(tmp_path):
    # One quick cuda test, through the arguments after `--`: it skips without a GPU and passes in seconds on one
    # (all of them take minutes there, and the suite on a GPU runs this test too).
    env = _environment(OUT=str(tmp_path), AESGD_GPU_SKIP_WHEELS="1", AESGD_GPU_STAGE_SECONDS="240")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # python3: this interpreter's
    script = str(ROOT / "scripts" / "gpu_session.sh")
    stage = ["cuda-tests@200", "--", "-k", "test_cuda_stamps_are_readable_once_the_device_reached_them"]
    done = subprocess.run([script, "run", *stage], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(at most 200 s)" in done.stdout  # the stage's own time box, not the default
    assert "== cuda-tests: exit 0" in done.stdout
    assert "tests/test_cuda.py" in done.stdout
    log = (tmp_path / "cuda-tests.log").read_text()
    assert re.search(r"\b1 (skipped|passed)\b", log), log
    for spec, error in (("cuda-tests+nope", "no stage 'nope'"), ("cuda-tests@soon", "a number of seconds")):
        refused = subprocess.run([script, "run", spec], env=env, capture_output=True, text=True, check=False)
        assert refused.returncode == 2, spec
        assert error in refused.stderr, refused.stderr
