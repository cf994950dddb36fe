"""The race: its pure figures and table, the post-local-SGD baseline it races, and a tiny run end to end."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_aesgd.baselines import PostLocalSGDStrategy
from lightning_aesgd.bench import main
from lightning_aesgd.bench.race.analysis import (
    RunFigures,
    aggregate,
    ideal_throughput,
    median_step_seconds,
    run_figures,
    throughput_after_first_step,
    time_to_target,
)
from lightning_aesgd.bench.race.benchmark import BenchSettings, _profile_config
from lightning_aesgd.bench.race.recorder import RunRecord, Validation, batch_length
from lightning_aesgd.bench.race.report import failed_runs, race_table
from lightning_aesgd.bench.race.runner import shrink_replicas
from lightning_aesgd.bench.race.suites import Target, Workload, get_workload
from lightning_aesgd.emulation.profiles import SlowdownChange, SlowdownProfile
from lightning_aesgd.settings import NO_BUFFER_SYNC_AT_FORWARD

# --- pure figures ---------------------------------------------------------------------------------------------


def test_target_direction_follows_the_metric():
    assert Target.parse("val/p@1=0.6").reached(0.61)
    assert not Target.parse("val/p@1=0.6").reached(0.59)
    assert Target.parse("val/loss=2").reached(1.5)
    with pytest.raises(ValueError, match="metric"):
        Target.parse("0.6")


def test_ideal_throughput_sums_the_emulated_solo_speeds():
    profile = SlowdownProfile((1, 1, 2, 4), base=2)
    # Σ 100 / (2·fᵢ) = 50 + 50 + 25 + 12.5
    assert ideal_throughput(100.0, profile, 4, [128] * 10) == pytest.approx(137.5)
    assert ideal_throughput(100.0, None, 4, [128] * 10) == pytest.approx(400.0)


def test_ideal_throughput_follows_a_change_of_factors():
    profile = SlowdownProfile((1, 1), (SlowdownChange(step=1, replica=1, factor=3),))
    # Step 0 at 200 samples/s, step 1 at 100 + 100/3: 100 samples in 0.5 s + 0.75 s.
    assert ideal_throughput(100.0, profile, 2, [100, 100]) == pytest.approx(200 / 1.25)


def test_time_to_target_is_the_first_validation_that_meets_it():
    validations = [Validation(1.0, 5, 0, {"val/p@1": 0.5}), Validation(2.0, 10, 1, {"val/p@1": 0.7})]
    assert time_to_target(validations, Target("val/p@1", 0.6)) == 2.0
    assert time_to_target(validations, Target("val/p@1", 0.8)) is None


def test_aggregate_takes_medians_and_ratios_to_ddp():
    def run(algorithm: str, repeat: int, throughput: float, reached: float | None) -> RunFigures:
        return RunFigures("strong", algorithm, repeat, throughput=throughput, efficiency=0.5, time_to_target=reached)

    runs = [run("ddp", 0, 100, 10.0), run("ddp", 1, 120, 12.0), run("ddp", 2, 110, None)]
    runs += [run("adaptive_sgd", r, 200 + r, 5.0) for r in range(3)]
    rows = {row.algorithm: row for row in aggregate(runs)}
    assert rows["ddp"].throughput == 110
    assert rows["ddp"].time_to_target == 12.0  # the missed target counts as infinitely late
    assert rows["adaptive_sgd"].throughput_vs_ddp == pytest.approx(201 / 110)
    assert rows["adaptive_sgd"].time_to_target_vs_ddp == pytest.approx(5 / 12)
    # Repeat by repeat: 200/100, 201/120, 202/110, each against the DDP run beside it.
    assert rows["adaptive_sgd"].throughput_vs_ddp_range == pytest.approx((201 / 120, 200 / 100))
    assert rows["ddp"].throughput_vs_ddp_range == (1.0, 1.0)


def test_race_table_marks_missing_figures():
    rows = aggregate([RunFigures("strong", "ddp", 0, throughput=100.0, step_seconds=0.0125, efficiency=0.5)])
    lines = race_table(rows, Target("val/acc", 0.9)).splitlines()
    assert lines[0].startswith("| profile | algorithm | samples/s | step ms (median) | efficiency | time to val/acc")
    assert "| throughput ÷ ddp | per repeat | ÷ ddp after step 1 | time to target ÷ ddp |" in lines[0]
    assert lines[2] == "| strong | ddp | 100.0 | 12.50 | 50% | not reached | – | 1.00 | 1.00-1.00 | – | – |"
    one_step = aggregate([RunFigures("strong", "ddp", 0, throughput=100.0, efficiency=0.5)])
    assert race_table(one_step, Target("val/acc", 0.9)).splitlines()[2].startswith("| strong | ddp | 100.0 | – |")


def test_a_failed_run_is_named_beneath_the_table_it_has_no_row_in():
    error = "Traceback (most recent call last):\n  ...\nAttributeError: no perform_nocolor_split\n"
    runs = [RunFigures("strong", "ddp", 0, throughput=100.0), RunFigures("strong", "adaptive_elastic", 0, error=error)]
    assert [row.algorithm for row in aggregate(runs)] == ["ddp"]
    assert failed_runs(runs).splitlines() == [
        "Failed runs, left out of the table:",
        "- strong / adaptive_elastic / repeat 0: AttributeError: no perform_nocolor_split",
    ]
    assert failed_runs(runs[:1]) == ""


def test_the_ratio_after_the_first_step_leaves_out_a_warm_up_both_entrants_pay():
    # The same 1 s warm-up, then steps of 0.4 s (DDP) and 0.2 s: over 3 steps the whole-clock ratio is 1.8 / 1.4,
    # from the first step's end 0.8 / 0.4.
    target = Target("val/acc", 0.9)
    runs = [
        run_figures(RunRecord(2, clock, [100, 100, 100]), RunFigures("strong", name, 0), 1.0, None, target)
        for name, clock in (("ddp", [1.0, 1.4, 1.8]), ("adaptive_elastic", [1.0, 1.2, 1.4]))
    ]
    assert [run.throughput_after_first_step for run in runs] == pytest.approx([250.0, 500.0])
    rows = {row.algorithm: row for row in aggregate(runs)}
    assert rows["adaptive_elastic"].throughput_vs_ddp == pytest.approx(1.8 / 1.4)
    assert rows["adaptive_elastic"].after_first_step_vs_ddp == pytest.approx(2.0)
    assert rows["ddp"].after_first_step_vs_ddp == pytest.approx(1.0)
    assert math.isnan(throughput_after_first_step([1.0], [100]))


def test_the_median_step_leaves_the_warm_up_and_a_stall_out():
    warm_up, stall = 0.4, 0.25
    clock = list(itertools.accumulate([warm_up, 0.005, 0.004, stall, 0.005, 0.006]))
    assert median_step_seconds(clock) == pytest.approx(0.005)
    assert math.isnan(median_step_seconds([warm_up]))


def test_record_round_trips_through_json(tmp_path: Path):
    record = RunRecord(2, [0.5, 1.0], [64, 64], [Validation(1.0, 2, 0, {"val/p@1": 0.5})])
    record.save(tmp_path / "record.json")
    assert RunRecord.load(tmp_path / "record.json") == record
    assert record.total_samples / record.seconds == 128


def test_batch_length_reads_tensors_tuples_and_sized_batches():
    import torch

    assert batch_length((torch.zeros(5, 3), torch.zeros(5))) == 5
    assert batch_length({"x": torch.zeros(4, 2)}) == 4
    assert batch_length([1, 2, 3][:0] or range(7)) == 7


def test_shrink_replicas_keeps_the_extremes_of_the_profile():
    cfg = OmegaConf.create({"devices": {"num_replicas": 4, "slowdown": {"factors": [1, 1, 2, 4], "base": 3}}})
    shrink_replicas(cfg, 2)
    assert cfg.devices.num_replicas == 2
    assert list(cfg.devices.slowdown.factors) == [1, 4]


def test_a_workload_without_its_configs_says_so():
    with pytest.raises(FileNotFoundError, match=r"configs/model/no_such_model\.yaml"):
        Workload("xmc_mini", "no_such_model", 1, "val/acc=0.5").overrides()


def test_post_local_sgd_strategy_checks_its_schedule():
    strategy = PostLocalSGDStrategy(period=4, warmup_steps=3)
    assert (strategy.period, strategy.warmup_steps, strategy._model_averaging_period) == (4, 3, 4)
    with pytest.raises(ValueError, match="period"):
        PostLocalSGDStrategy(period=0)


# --- end to end -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_benchmark_writes_sane_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    algorithms = ["adaptive_sgd", "ddp", "post_local_sgd"]
    argv = ["--tiny", "--profiles", "strong", "--algorithms", ",".join(algorithms), "--out", str(tmp_path)]
    assert main(argv) == 0

    results = json.loads((tmp_path / "results.json").read_text())
    runs = results["runs"]
    assert [run["algorithm"] for run in runs] == algorithms
    assert all(run["error"] is None for run in runs), [run["error"] for run in runs]
    # Tiny steps are mostly fixed overhead, which the step emulation does not stretch (only the computing thread's
    # work is), so an emulated replica there runs faster than base × f times the solo speed: efficiency can pass 1,
    # by how much depends on the machine's load during the short solo run. What holds anywhere: it is the throughput
    # over the ideal one.
    assert all(run["throughput"] > 0 and run["ideal_throughput"] > 0 for run in runs), runs
    assert all(run["efficiency"] == pytest.approx(run["throughput"] / run["ideal_throughput"]) for run in runs), runs
    assert all(0 < run["step_seconds"] < run["seconds"] for run in runs), runs
    # Equal epochs: every algorithm processed the same samples.
    assert len({run["samples"] for run in runs}) == 1
    assert results["settings"]["solo_samples_per_second"] > 0
    rows = {row["algorithm"]: row for row in results["aggregate"]}
    assert rows["ddp"]["throughput_vs_ddp"] == pytest.approx(1.0)
    assert all(math.isfinite(row["throughput_vs_ddp"]) and row["final_metric"] is not None for row in rows.values())

    record = RunRecord.load(tmp_path / runs[0]["record"])
    assert record.plans is not None
    assert all(sum(sizes) == 64 for sizes in record.plans["sizes"])
    for name in ("results.md", "metric_strong.png", "batch_sizes_strong.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| strong | adaptive_sgd |" in capsys.readouterr().out


def test_ddp_races_as_the_strategy_configures_it_unless_asked(tmp_path: Path):
    own = ["algorithm=ddp", "algorithm.sync_buffers_at_forward=true"]
    variants = {"ddp_b64": ["algorithm=ddp", "data.batch_size=64"], "ddp_own": own}
    target = Target.parse("val/acc=0.85")
    settings = BenchSettings("fashion_mnist", ["strong"], [], 1, 1, target, tmp_path, variants=variants)
    base = get_workload("fashion_mnist").overrides()

    def strategy(algorithm: str):
        return instantiate(_profile_config(settings, base, "strong", algorithm).algorithm)

    for fair in ("ddp", "ddp_b64", "post_local_sgd"):
        assert NO_BUFFER_SYNC_AT_FORWARD.items() <= strategy(fair)._ddp_kwargs.items(), fair
    for fair in ("ddp", "ddp_b64"):  # its gradients in its buckets, as the strategy's
        assert strategy(fair)._ddp_kwargs["gradient_as_bucket_view"] is True, fair
    for broadcasting in ("ddp_lightning", "ddp_own"):  # Lightning's default, as a user gets it
        assert strategy(broadcasting)._ddp_kwargs == {}, broadcasting
    assert not hasattr(strategy("sync_adaptive"), "sync_buffers_at_forward")  # the switch is DDP's alone


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_the_solo_run_the_race_reports_no_efficiency(tmp_path: Path):
    argv = ["--tiny", "--no-solo", "--profiles", "strong", "--algorithms", "ddp", "--out", str(tmp_path)]
    assert main(argv) == 0

    results = json.loads((tmp_path / "results.json").read_text())
    assert not (tmp_path / "runs" / "solo").exists()
    assert results["settings"]["solo_samples_per_second"] is None
    [run] = results["runs"]
    assert run["error"] is None
    assert run["throughput"] > 0
    assert run["efficiency"] is None
