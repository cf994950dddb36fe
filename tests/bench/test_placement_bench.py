"""The placement program: its cases, which ranks are slowed, what is skipped without CUDA, ratios, and a tiny run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_aesgd.bench import main
from lightning_aesgd.bench.placement import workloads
from lightning_aesgd.bench.placement.benchmark import PlacementSettings, run_workload
from lightning_aesgd.bench.placement.cases import (
    NO_GPU,
    Case,
    Machine,
    baseline_of,
    build_cases,
    emulations,
    gpu_factors,
    slowdown_override,
)
from lightning_aesgd.bench.placement.figures import RunFigures, Spread, summarise
from lightning_aesgd.bench.placement.program import build_parser, parse_targets, settings_from
from lightning_aesgd.bench.placement.report import gpu_cell, markdown_report, spread_cell
from lightning_aesgd.bench.race.runner import compose_config
from lightning_aesgd.bench.race.suites import Target
from lightning_aesgd.emulation.profiles import as_profile
from lightning_aesgd.placement import replica_threads

H100_NODE = Machine(cuda_count=1, cores=16)  # the GPU targets' machine
CPU_ONLY = Machine(cuda_count=0, cores=2)  # this project's CI


def _cases(machine: Machine, weak_gpu: float = 20.0) -> dict[str, Case]:
    return {case.name: case for case in build_cases(machine, weak_gpu)}


def test_on_a_gpu_node_the_weak_gpu_slows_gpu_ranks_only():
    cases = _cases(H100_NODE)
    assert list(cases) == ["gpu", "gpu_cpu", "cpu", "gpu+weak20", "gpu_cpu+weak20", "cpu+weak20"]
    assert all(case.skip is None for case in cases.values())
    assert cases["gpu"].devices == ("cuda:0",)
    assert cases["gpu_cpu"].devices == ("cuda:0", "cpu")
    assert cases["cpu"].devices == ("cpu",)
    assert cases["gpu+weak20"].factors == (20.0,)
    assert cases["gpu_cpu+weak20"].factors == (20.0, 1.0)  # rank 0 on the GPU, rank 1 on the CPU at real speed
    assert "devices.slowdown={mode:step,base:1,factors:[20,1]}" in cases["gpu_cpu+weak20"].overrides
    for name in ("gpu", "gpu_cpu", "cpu", "cpu+weak20"):
        assert cases[name].factors is None
        assert "devices.slowdown=null" in cases[name].overrides
    assert [case.emulated for case in cases.values()] == [False, False, False, True, True, False]


def test_every_gpu_of_a_larger_node_is_slowed_and_every_cpu_replica_is_not():
    case = _cases(Machine(cuda_count=2, cores=40))["gpu_cpu+weak20"]
    assert case.devices == ("cuda:0", "cuda:1", "cpu", "cpu", "cpu", "cpu")
    assert case.factors == (20.0, 20.0, 1.0, 1.0, 1.0, 1.0)
    assert gpu_factors(["cpu", "cpu"], 20) is None
    assert gpu_factors(["cuda:0", "cpu"], 1) is None
    assert slowdown_override(None) == "devices.slowdown=null"


def test_the_cpu_case_is_the_replicas_gpu_cpu_adds_with_their_threads():
    cases = _cases(H100_NODE)
    assert cases["cpu"].devices == tuple(d for d in cases["gpu_cpu"].devices if d == "cpu")
    assert "launch.replica_devices=[cpu]" in cases["cpu"].overrides
    assert "trainer.accelerator=cpu" in cases["cpu"].overrides
    gpu_cpu = [torch.device(device) for device in H100_NODE.auto_devices()]
    assert cases["cpu"].threads == replica_threads(gpu_cpu, 1, 16) == 14
    # With no GPU rank the weak GPU changes nothing: one run serves both rows.
    assert cases["cpu"].run_key == cases["cpu+weak20"].run_key
    assert cases["gpu"].run_key != cases["gpu+weak20"].run_key
    assert "launch.replica_devices=[cuda:0]" in cases["gpu"].overrides
    assert not any(o.startswith("launch.replica_devices") for o in cases["gpu_cpu"].overrides)  # `auto` as users run it


def test_without_cuda_the_gpu_cases_are_skipped_with_the_reason_and_the_cpu_case_runs():
    cases = _cases(CPU_ONLY)
    for name in ("gpu", "gpu_cpu", "gpu+weak20", "gpu_cpu+weak20"):
        assert cases[name].skip == NO_GPU
        assert cases[name].overrides == ()
    assert "no CUDA GPU" in NO_GPU
    assert cases["cpu"].skip is None
    assert cases["cpu"].devices == ("cpu",)  # devices=gpu_cpu without a GPU: every core to CPU replicas
    assert cases["cpu"].threads is None
    assert cases["gpu+weak20"].emulated  # a skipped row still says what it would have been


def test_a_node_with_too_few_spare_cores_has_no_cpu_case():
    cases = _cases(Machine(cuda_count=1, cores=4))
    assert cases["gpu_cpu"].devices == ("cuda:0",)
    assert cases["cpu"].skip is not None
    assert "adds no CPU replica" in cases["cpu"].skip


def test_weak_gpu_zero_or_one_disables_the_emulated_group():
    assert emulations(0) == emulations(1) == (1.0,)
    assert [case.name for case in build_cases(H100_NODE, 1)] == ["gpu", "gpu_cpu", "cpu"]
    with pytest.raises(ValueError, match="Unknown placement"):
        build_cases(H100_NODE, 20, ["gpu", "tpu"])


def test_each_case_composes_one_factor_per_replica():
    for case in build_cases(H100_NODE, 20):
        cfg = compose_config(["algorithm=hogbatch", *case.overrides])
        if case.placement == "gpu_cpu":
            assert cfg.algorithm.replica_devices == "auto"
        else:
            assert list(cfg.algorithm.replica_devices) == list(case.devices)
        profile = as_profile(cfg.algorithm.slowdown)
        if case.emulated:
            assert profile is not None
            assert (profile.mode, profile.base) == ("step", 1.0)
            assert len(profile.factors) == len(case.devices)
        else:
            assert profile is None


@pytest.mark.filterwarnings("ignore:GPU available but not used")
@pytest.mark.parametrize("algorithm", ["hogbatch", "ddp"])
def test_on_a_gpu_node_each_case_builds_its_replicas_and_slows_only_the_gpu(monkeypatch, algorithm: str):
    from pytorch_lightning.accelerators import CUDAAccelerator

    from lightning_aesgd import placement
    from lightning_aesgd.callbacks import SlowdownCallback
    from lightning_aesgd.train import build

    monkeypatch.setattr(placement, "num_cuda_devices", lambda: 1)
    monkeypatch.setattr(placement, "available_cores", lambda: 16)
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(CUDAAccelerator, "parse_devices", staticmethod(lambda devices: [0]))
    for case in build_cases(H100_NODE, 20):
        trainer, _model, _datamodule = build(compose_config([f"algorithm={algorithm}", *case.overrides, "~logger"]))
        strategy = trainer.strategy
        assert [str(device) for device in strategy.parallel_devices] == list(case.devices)
        # hogbatch slows its own step; DDP gets the same profile through the callback.
        inside = getattr(strategy, "slowdown", None)
        outside = [c.profile for c in trainer.callbacks if isinstance(c, SlowdownCallback)]
        profiles = [profile for profile in (inside, *outside) if profile is not None]
        if case.emulated:
            assert [profile.factors for profile in profiles] == [case.factors]
        else:
            assert profiles == []


def _run(case: str, repeat: int, throughput: float, time: float | None, final: float, test: float) -> RunFigures:
    return RunFigures(
        "hogbatch", case, repeat, throughput=throughput, time_to_target=time, final_metric=final, test_metric=test
    )


def test_ratios_pair_each_repeat_with_the_gpu_alone():
    cases = _cases(H100_NODE)
    gpu = [_run("gpu", 0, 1000.0, 10.0, 0.80, 0.79), _run("gpu", 1, 800.0, 12.0, 0.81, 0.80)]
    both = [_run("gpu_cpu", 0, 990.0, 10.0, 0.80, 0.785), _run("gpu_cpu", 1, 820.0, None, 0.79, 0.79)]
    row = summarise("hogbatch", cases["gpu_cpu"], both, gpu)
    assert row.runs == 2
    assert row.throughput == Spread(905.0, 820.0, 990.0)
    assert row.throughput_ratio is not None
    assert (row.throughput_ratio.low, row.throughput_ratio.high) == (pytest.approx(0.99), pytest.approx(1.025))
    assert row.time_to_target == Spread(math.inf, 10.0, math.inf)  # missed once: the median waits for most repeats
    assert row.time_ratio == Spread(1.0, 1.0, 1.0)  # only where both reached the target
    assert row.test_difference is not None
    assert row.test_difference.low == pytest.approx(-0.01)
    assert row.test_difference.high == pytest.approx(-0.005)
    assert spread_cell(row.throughput_ratio, ".2f") == "1.01 (0.99–1.02)"
    assert spread_cell(row.time_to_target, ".1f") == "missed (10.0–missed)"


def test_without_the_gpu_alone_there_is_no_ratio_and_failed_runs_are_counted():
    case = _cases(CPU_ONLY)["cpu"]
    failed = RunFigures("hogbatch", "cpu", 1, error="RuntimeError: boom")
    row = summarise("hogbatch", case, [_run("cpu", 0, 500.0, None, 0.3, 0.3), failed], None)
    assert (row.runs, row.errors) == (1, ["RuntimeError: boom"])
    assert row.throughput == Spread(500.0, 500.0, 500.0)
    assert row.throughput_ratio is None
    assert row.test_difference is None
    assert baseline_of(case, build_cases(CPU_ONLY, 20)) is not None  # the skipped GPU alone: its runs are none


def test_the_table_says_emulated_and_skipped():
    assert gpu_cell(_cases(H100_NODE)["gpu_cpu+weak20"]) == "emulated 20× slower"
    assert gpu_cell(_cases(H100_NODE)["gpu"]) == "real"
    assert gpu_cell(_cases(H100_NODE)["cpu+weak20"]) == "none (nothing to slow)"


def test_fashion_mnist_is_skipped_with_the_reason_when_its_files_are_absent(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("AESGD_FASHION_MNIST_DIR", str(tmp_path))  # an empty folder
    reason = workloads.unavailable("fashion_mnist")
    assert reason is not None
    assert "absent" in reason
    assert workloads.unavailable("xmc_eurlex") is None
    settings = PlacementSettings(["fashion_mnist"], ["hogbatch"], ["gpu", "cpu"], 20.0, 1, tmp_path / "out")
    result = run_workload(settings, "fashion_mnist", CPU_ONLY)
    assert (result.skip, result.runs) == (reason, [])
    assert f"skipped: {reason}" in markdown_report([result], CPU_ONLY)


def test_fashion_mnist_is_the_experiment_with_a_stated_target():
    overrides = workloads.WORKLOADS["fashion_mnist"].overrides(tiny=True)
    assert "experiment=fashion_mnist" in overrides
    assert "++data.subset=256" in overrides
    assert workloads.WORKLOADS["fashion_mnist"].target == "val/acc=0.85"
    assert workloads.WORKLOADS["xmc_eurlex"].target == "val/p@1=0.8"
    assert workloads.on_test_split("val/acc") == "test/acc"


def test_options():
    options = build_parser().parse_args([])
    settings = settings_from(options)
    assert (settings.workloads, settings.algorithms) == (["xmc_eurlex", "fashion_mnist"], ["hogbatch"])
    assert (settings.weak_gpu, settings.repeats, settings.placements) == (20.0, 1, ["gpu", "gpu_cpu", "cpu"])
    assert parse_targets(["xmc_eurlex:val/p@1=0.7"]) == {"xmc_eurlex": Target("val/p@1", 0.7)}
    with pytest.raises(ValueError, match="WORKLOAD:METRIC=VALUE"):
        parse_targets(["val/p@1=0.7"])
    with pytest.raises(ValueError, match="unknown"):
        settings_from(build_parser().parse_args(["--placements", "gpu,tpu"]))
    with pytest.raises(SystemExit) as exit_info:
        main(["placement", "--help"])
    assert exit_info.value.code == 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_tiny_run_measures_the_cpu_case_and_skips_the_gpu_cases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    # A machine without CUDA wherever the test runs (the suite hides GPUs; this makes the rows' reasons certain).
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: CPU_ONLY))
    assert main(["placement", "--tiny", "--workloads", "xmc_eurlex", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "placement.json").read_text())
    assert report["machine"] == {"cuda_count": 0, "cores": 2}
    (workload,) = report["workloads"]
    rows = {row["case"]: row for row in workload["rows"]}
    assert set(rows) == {"gpu", "gpu_cpu", "cpu", "gpu+weak20", "gpu_cpu+weak20", "cpu+weak20"}
    for name in ("gpu", "gpu_cpu", "gpu+weak20", "gpu_cpu+weak20"):
        assert rows[name]["skip"] == NO_GPU
        assert (rows[name]["runs"], rows[name]["throughput"]) == (0, None)
    for name in ("cpu", "cpu+weak20"):
        assert rows[name]["runs"] == 1
        assert rows[name]["errors"] == []
        assert rows[name]["throughput"]["median"] > 0
        assert 0.0 <= rows[name]["test_metric"]["median"] <= 1.0
        assert rows[name]["throughput_ratio"] is None  # no GPU alone to compare with
    assert len(workload["runs"]) == 1  # the weak GPU's CPU row reuses the CPU run
    table = (tmp_path / "placement.md").read_text()
    assert table.count(f"skipped: {NO_GPU}") == 4
    assert "| hogbatch | CPU replicas alone | cpu | none |" in table
    assert "emulated 20× slower" in table
    assert "| hogbatch | CPU replicas alone |" in capsys.readouterr().out
