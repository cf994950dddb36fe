"""The slowness program: its cases, figures from recorded runs, its tables, and one small case end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_aesgd.bench.slowness import program
from lightning_aesgd.bench.slowness.alone import run_alone
from lightning_aesgd.bench.slowness.cases import BATCH, CASES, MACHINERY, Case
from lightning_aesgd.bench.slowness.comparison import CaseResult, run_case, step_time_through
from lightning_aesgd.bench.slowness.machinery import machinery_figures
from lightning_aesgd.bench.slowness.program import runnable_cases
from lightning_aesgd.bench.slowness.report import machinery_table, table, write_report
from lightning_aesgd.bench.slowness.runner import RunResult, _strategy, run_result
from lightning_aesgd.core.apportion import share_error
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.settings import NO_BUFFER_SYNC_AT_FORWARD, StrategySettings


def test_cases_emulate_per_sample_slowness_only_where_it_lands_on_samples():
    user = CASES["user"].profile()
    assert user is not None
    assert user.seconds_per_sample == pytest.approx(0.064 / BATCH)
    assert CASES["user"].profile((1.0,)).factors == (1.0,)
    quota = CASES["quota"].profile()
    assert quota is not None
    assert quota.seconds_per_sample is None
    assert MACHINERY.profile() is None


def test_unknown_cases_are_refused_and_the_quota_cases_are_skipped_where_quotas_are_missing(monkeypatch):
    with pytest.raises(SystemExit, match="no_such_case"):
        runnable_cases(["user", "no_such_case"])
    monkeypatch.setattr("lightning_aesgd.bench.slowness.program.quota_unavailable", lambda: "no cgroup")
    assert runnable_cases(["quota", "hook", "quota-short"]) == ["hook"]
    monkeypatch.setattr("lightning_aesgd.bench.slowness.program.quota_unavailable", lambda: None)
    assert runnable_cases(["quota", "hook"]) == ["quota", "hook"]


def test_throughput_and_plans_come_from_rank_zeros_record():
    record = {
        "times": [0.1 * step for step in range(40)],
        "cpu": [0.02 * step for step in range(40)],
        "plans": {"starts": [0, 5, 35], "sizes": [[32, 32], [48, 16], [50, 14]]},
        "step_time_balance": 1.08,
    }
    result = run_result("adaptive_elastic", record, replicas=2, steps=40)
    assert result.seconds_per_step == pytest.approx(0.1)
    assert result.cpu_seconds_per_step == pytest.approx(0.02)
    assert result.samples_per_second == pytest.approx(2 * BATCH / 0.1)
    assert result.plan_at_check == [48, 16]  # the plan in force at step 30
    assert result.first_plan == [48, 16]  # the first made from measurements
    assert result.smallest_batch == 14
    assert result.final_plan == [50, 14]
    assert result.step_time_balance == pytest.approx(1.08)


def _hook_case() -> CaseResult:
    solo = [StepTime(0.0, 1 / 300), StepTime(0.0, 1 / 100)]  # 300 and 100 samples/s, no fixed cost
    result = CaseResult("hook", "hook", [1.0, 3.0], 64.0, 0, solo_step_times=solo)
    result.runs["ddp"] = RunResult("ddp", 200.0, 0.64, 0.01)
    result.runs["adaptive_elastic"] = RunResult(
        "adaptive_elastic", 360.0, 0.36, 0.01, plan_at_check=[48, 16], step_time_balance=1.04
    )
    return result


def test_case_figures_compare_with_ddp_and_the_ideal():
    result = _hook_case()
    assert result.ratio() == pytest.approx(1.8)
    assert result.efficiency("adaptive_elastic") == pytest.approx(0.9)
    assert result.plan_error() == pytest.approx(0.0)  # 48:16 is 3:1
    row = "| hook | hook | [1, 3] | 64 | 200 | 360 | 1.80 | 1.80-1.80 | 50% | 90% | – | 0% | 0% | 1.04 |"
    assert row in table([result])
    result.repeat_ratios = [1.7, 1.8, 2.1]
    assert result.ratio_range() == (1.7, 2.1)
    assert "| 1.80 | 1.70-2.10 |" in table([result])
    assert "| plan error at step 30 |" in table([result])
    assert "| plan error at step 19 |" in table([result], steps=20)  # a shorter run is judged at its last step


def test_the_plan_is_judged_against_the_split_that_equalises_the_solo_step_times():
    """A replica with a fixed cost per step gets less than its speed at the solo batch says, and should."""
    fast = StepTime(0.0, 1 / 300)  # 96 samples in 0.32 s
    throttled = StepTime(0.16, 0.005)  # 32 samples in 0.32 s; alone at 64 samples, 133 samples/s
    result = CaseResult("quota", "quota", [1.0, 2.0], 0.0, 0, solo_step_times=[fast, throttled])
    result.runs["ddp"] = RunResult("ddp", 200.0, 0.64, 0.01)
    result.runs["adaptive_elastic"] = RunResult("adaptive_elastic", 360.0, 0.36, 0.01, plan_at_check=[96, 32])
    assert result.balanced_plan == [96, 32]
    assert result.ideal == pytest.approx(128 / 0.32)
    assert result.plan_error() == pytest.approx(0.0)
    speed_at_solo_batch = 64 / throttled.seconds(64)
    proportional = speed_at_solo_batch / (300 + speed_at_solo_batch)
    assert share_error([96, 32], [300, speed_at_solo_batch]) == pytest.approx(1 - 0.25 / proportional)
    assert result.nominal_plan_error() == pytest.approx(0.25)  # 1/4 against the nominal 1/3


def test_a_solo_step_time_is_the_line_through_its_two_batch_sizes():
    assert step_time_through((16, 64), [0.2, 0.44]) == StepTime(pytest.approx(0.12), pytest.approx(0.005))
    # Noise that makes the line fall at zero: the larger batch's speed stands for the whole step.
    assert step_time_through((16, 64), [0.3, 0.25]) == StepTime(0.0, pytest.approx(0.25 / 64))
    assert step_time_through((16, 64), [0.01, 0.25]) == StepTime(0.0, pytest.approx(0.25 / 64))


def test_machinery_figures_are_medians_and_excesses_over_one_process():
    wall = {"solo": [700.0, 800.0, 720.0], "ddp": [10_000.0] * 3, "adaptive_elastic": [9_900.0] * 3}
    wall |= {"ddp_one": [900.0, 950.0, 910.0], "adaptive_elastic_one": [930.0, 912.0, 930.0]}
    cpu = {"solo": [700.0] * 3, "ddp": [3_700.0] * 3, "adaptive_elastic": [3_800.0] * 3}
    cpu |= {"ddp_one": [905.0] * 3, "adaptive_elastic_one": [925.0] * 3}
    figures = machinery_figures(wall, cpu, repeats=3)
    assert list(figures)[:3] == ["repeats", "solo_us_per_step", "solo_cpu_us_per_step"]
    assert figures["solo_us_per_step"] == 720.0
    assert figures["ddp_machinery_us"] == pytest.approx(9_280.0)
    assert figures["adaptive_elastic_machinery_cpu_us"] == pytest.approx(3_100.0)
    text = machinery_table(figures)
    assert figures["ddp_one_machinery_us"] == pytest.approx(190.0)
    # Repeat by repeat: 930/900, 912/950, 930/910.
    assert figures["adaptive_elastic_one_vs_ddp_low"] == 0.96
    assert figures["adaptive_elastic_one_vs_ddp_high"] == 930 / 900
    assert text.splitlines()[2] == "| one process, no strategy | 720 | – | 700 | – | – |"
    assert "| DDP, 4 replicas | 10000 | 9280 | 3700 | 3000 | – |" in text
    assert "| adaptive_elastic, 4 replicas | 9900 | 9180 | 3800 | 3100 | 0.99-0.99 |" in text
    assert text.splitlines()[-1] == "| adaptive_elastic, 1 replica | 930 | 210 | 925 | 225 | 0.96-1.03 |"


def test_the_report_keeps_the_published_keys(tmp_path: Path):
    path = write_report(tmp_path, [_hook_case()], None, steps=60, repeats=3)
    report = json.loads(path.read_text())
    assert list(report) == ["cases", "machinery", "steps", "repeats"]
    (case,) = report["cases"]
    assert list(case) == [
        "case",
        "mode",
        "factors",
        "step_ms",
        "workers",
        "solo_step_times",
        "repeat_ratios",
        "first_plans",
        "balanced_plan",
        "ideal",
        "runs",
    ]
    assert case["solo_step_times"][1] == {"overhead": 0.0, "per_sample": 0.01}
    assert list(case["runs"]["ddp"]) == [
        "algorithm",
        "samples_per_second",
        "seconds_per_step",
        "cpu_seconds_per_step",
        "plan_at_check",
        "first_plan",
        "smallest_batch",
        "final_plan",
        "step_time_balance",
    ]


def _random_images() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(4000, 1, 28, 28, generator=generator), torch.randint(0, 10, (4000,)))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_small_case_races_ddp_and_the_strategy_under_slow_hooks(tmp_path):
    case = Case("small", "hook", (1.0, 3.0), step_ms=8.0)
    result = run_case(case, _random_images(), steps=24, out=tmp_path)
    assert set(result.runs) == {"ddp", "adaptive_elastic"}
    assert result.ideal > 0
    assert all(run.samples_per_second > 0 for run in result.runs.values())
    assert result.runs["ddp"].plan_at_check is None
    fast, slow = result.runs["adaptive_elastic"].final_plan
    assert fast > slow, "the replica whose hooks are 3× slower must get the smaller batch"
    assert result.runs["adaptive_elastic"].step_time_balance >= 1.0


def test_alone_prints_one_json_line_per_case_without_ddp(monkeypatch, capsys, tmp_path):
    ran = []

    def run_alone(case, dataset, steps, out):
        ran.append((case.name, steps))
        return {"ms_per_step": 1.0}

    monkeypatch.setattr(program, "run_alone", run_alone)
    monkeypatch.setattr(program, "load_data", lambda: None)
    assert program.main(["--alone", "--cases", "user,step-fixed", "--steps", "12", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"case": "user", "ms_per_step": 1.0},
        {"case": "step-fixed", "ms_per_step": 1.0},
    ]
    assert ran == [("user", 12), ("step-fixed", 12)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_straggler_run_alone_names_when_it_was_left_out(tmp_path):
    case = Case("small-straggler", "hook", (1.0, 1.0, 50.0), step_ms=8.0)
    figures = run_alone(case, _random_images(), steps=30, out=tmp_path)
    assert figures["ms_per_step"] > 0
    assert figures["ms_per_step_from_100"] is None  # too short a run
    assert figures["left_out_at"][:2] == [None, None]
    assert figures["left_out_at"][2] is not None
    assert figures["left_out_at"][2] <= 20


def test_ddp_races_with_the_strategys_buffer_policy_and_equal_shared_replicas_run_no_emulation():
    """DDP's per-forward broadcast of BatchNorm buffers is a second collective per step the strategy does not run."""
    ddp, callbacks = _strategy("ddp", CASES["step"].profile(), replicas_sharing=4)
    assert NO_BUFFER_SYNC_AT_FORWARD.items() <= ddp._ddp_kwargs.items()
    assert NO_BUFFER_SYNC_AT_FORWARD.items() <= StrategySettings().ddp_options().items()
    assert ddp._ddp_kwargs["gradient_as_bucket_view"] is StrategySettings().gradient_as_bucket_view is True
    assert len(callbacks) == 1  # the step mode reaches DDP through the callback
    assert CASES["shared-cores-equal"].profile() is None


def test_the_worst_first_plan_of_the_repeats_is_judged_against_the_balanced_split():
    result = _hook_case()
    result.first_plans = [[48, 16], None, [56, 8]]  # 3:1 is right; the repeat without one is skipped
    assert result.worst_first_plan_error() == pytest.approx(0.5)  # 56:8 gives the slow replica half its share
    assert "| 90% | 50% | 0% |" in table([result])
    result.first_plans = [[64, 0]]  # leaves out a replica the balanced split keeps
    assert result.worst_first_plan_error() == 1.0
    result.first_plans = [None]
    assert result.worst_first_plan_error() is None
