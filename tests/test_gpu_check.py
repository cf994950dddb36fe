"""The plan of ``scripts/gpu_check.py`` (its runs and their judgement), checked without a GPU."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.chdir(ROOT)  # the script reads configs/ relative to the repository, as gpu_check.sh runs it
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_algorithm_config_is_run_on_xmc_but_those_needing_dense_layers(gpu_check):
    names = {name for name, _ in gpu_check.jobs([])}
    configs = {path.stem for path in (ROOT / "configs" / "algorithm").glob("*.yaml")}
    assert {f"xmc_mini {name}" for name in configs - gpu_check.DENSE_ONLY} <= names
    assert "xmc_mini crossbow" not in names


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
