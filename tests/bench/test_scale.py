"""The scale program: the simulation against its closed forms, the measured profiles, its tables and command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_aesgd.bench import main
from lightning_aesgd.bench.scale.measured import log_spaced_costs, scale_case
from lightning_aesgd.bench.scale.noise import STEP_TIME_RATIOS, relative_step_times
from lightning_aesgd.bench.scale.program import build_parser
from lightning_aesgd.bench.scale.report import measured_table, simulated_table, write_report
from lightning_aesgd.bench.scale.sampling import check_sampler
from lightning_aesgd.bench.scale.simulation import (
    SECONDS_PER_SAMPLE,
    WARMUP_STEPS,
    draw_costs,
    draw_noise,
    lockstep_step_times,
    planned_step_times,
    simulate,
    speedup_bound,
)
from lightning_aesgd.bench.slowness.cases import BATCH
from lightning_aesgd.bench.slowness.comparison import CaseResult
from lightning_aesgd.bench.slowness.runner import WARMUP_STEPS as MEASURED_WARMUP_STEPS
from lightning_aesgd.bench.slowness.runner import RunResult
from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.engine.plan_loop import PlanLoop


def _no_time() -> float:
    """A clock that never moves: the planning costs nothing, so results are exact."""
    return 0.0


def test_without_noise_or_spread_the_plans_are_ddps_and_only_planning_differs():
    sim = simulate(8, 1.0, 40, STEP_TIME_RATIOS, noise_scale=0.0, clock=_no_time)
    assert sim.costs == (1.0,) * 8
    assert sim.final_plan == (BATCH,) * 8
    assert sim.adaptive_seconds == pytest.approx(sim.ddp_seconds, rel=1e-12)
    assert sim.ddp_seconds == pytest.approx(sim.steps * SECONDS_PER_SAMPLE * BATCH)
    assert sim.planning_seconds == 0.0
    assert sim.speedup == pytest.approx(1.0)


def test_a_timed_planning_cost_is_added_to_the_adaptive_steps():
    ticks = iter(range(10**6))
    sim = simulate(4, 1.0, 30, STEP_TIME_RATIOS, noise_scale=0.0, clock=lambda: 1e-3 * next(ticks))
    reports = len([13, 17, 21, 25, 29])  # the timed steps that report (the cadence test below)
    assert sim.planning_seconds == pytest.approx(1e-3 * reports)  # 1 ms per report taken in
    assert sim.speedup == pytest.approx(sim.ddp_seconds / (sim.adaptive_seconds + 1e-3 * reports))
    assert sim.speedup < sim.speedup_without_planning


def test_reports_come_at_the_strategys_cadence_and_only_they_cost_planning_time():
    ticks = iter(range(10**6))
    clock = lambda: 1e-3 * next(ticks)  # noqa: E731
    _, planning, _ = planned_step_times(np.ones(4), np.ones((30, 4)), clock)
    # From a fit's fourth step, every lag + 1 = 3 steps until the plan is settled and every report measured 3 steps
    # (the report at step 9, of steps 6-8), then about a quarter second apart: ⌈0.25 s / 64 ms⌉ = 4 steps.
    assert np.flatnonzero(planning).tolist() == [3, 6, 9, 13, 17, 21, 25, 29]
    assert planning[planning > 0] == pytest.approx(1e-3)
    # Steps of 94 ms (the balanced plan of factors [1, 1, 2, 4]): ⌈0.25 / 0.094⌉ = 3, as before settling.
    _, planning, sizes = planned_step_times(np.array([1.0, 1.0, 2.0, 4.0]), np.ones((30, 4)), clock)
    assert sizes == (93, 93, 47, 23)
    assert np.flatnonzero(planning).tolist() == list(range(3, 30, 3))


def test_reports_of_hundreds_of_replicas_come_further_apart_once_settled():
    ticks = iter(range(10**7))
    clock = lambda: 1e-3 * next(ticks)  # noqa: E731
    # 256 replicas: ⌈0.512 s / 64 ms⌉ = 8 steps apart once settled (core.schedule.report_seconds); 100: 4, as 4 do.
    _, planning, _ = planned_step_times(np.ones(256), np.ones((40, 256)), clock)
    assert np.flatnonzero(planning).tolist() == [3, 6, 9, 17, 25, 33]
    _, planning, _ = planned_step_times(np.ones(100), np.ones((40, 100)), clock)
    assert np.flatnonzero(planning).tolist() == [3, 6, 9, *range(13, 40, 4)]


def test_a_period_with_idle_steps_beside_working_ones_measures_nothing(monkeypatch: pytest.MonkeyPatch):
    received: list[tuple[int, list[float]]] = []
    receive = PlanLoop.receive

    def recording(self: PlanLoop, rows: list[list[float]], step: int) -> None:
        received.append((step, rows[-1]))
        receive(self, rows, step)

    monkeypatch.setattr(PlanLoop, "receive", recording)
    # A replica 60× slower than seven others is left out by the first plan (step 3), from step 3 + lag = 5 on.
    _, _, sizes = planned_step_times(np.array([1.0] * 7 + [60.0]), np.ones((12, 8)), _no_time)
    assert sizes[-1] == 0
    planned, steps = PeriodReport.field_index("planned"), PeriodReport.field_index("steps")
    by_step = dict(received)
    assert (by_step[3][planned], by_step[3][steps]) == (BATCH, 1)  # step 2, whole once step 3 began
    assert (by_step[6][planned], by_step[6][steps]) == (2 * BATCH, 0)  # steps 3-4 worked, step 5 idle: unmeasured
    assert (by_step[9][planned], by_step[9][steps]) == (0, 3)  # all idle: steps counted, nothing planned


def test_without_noise_the_speedup_approaches_the_sum_of_speeds_over_n_times_the_slowest():
    sim = simulate(16, 4.0, 80, STEP_TIME_RATIOS, noise_scale=0.0, clock=_no_time)
    speeds = [1 / cost for cost in sim.costs]
    assert sim.bound == pytest.approx(sum(speeds) / (16 * min(speeds)))
    assert 0.95 * sim.bound <= sim.speedup <= sim.bound * (1 + 1e-9)
    assert sum(sim.final_plan) == 16 * BATCH


@settings(max_examples=20, deadline=None)
@given(
    replicas=st.integers(2, 24),
    spread=st.floats(1.0, 8.0),
    seed=st.integers(0, 2**16),
)
def test_noiseless_plans_never_lose_to_ddp_nor_beat_the_bound(replicas: int, spread: float, seed: int):
    sim = simulate(replicas, spread, 60, STEP_TIME_RATIOS, noise_scale=0.0, seed=seed, clock=_no_time)
    assert 1.0 - 1e-9 <= sim.speedup <= sim.bound * (1 + 1e-9)
    assert 1.0 <= sim.realised_spread <= spread * (1 + 1e-9)


def test_the_bound_of_log_spaced_costs_is_the_mean_of_a_geometric_series():
    # Speeds r⁰…r^(n−1) with r = s^(−1/(n−1)): Σv / (n·min v) = (1 − r⁻ⁿ) / (n·(1 − r⁻¹)) over the slowest.
    assert speedup_bound([1.0, 4.0]) == pytest.approx(2.5)
    costs = [4.0 ** (rank / 7) for rank in range(8)]
    ratio = 4.0 ** (1 / 7)
    assert speedup_bound(costs) == pytest.approx((ratio**8 - 1) / (8 * (ratio - 1)))


def test_draws_stay_in_their_ranges():
    rng = np.random.default_rng(0)
    costs = draw_costs(256, 8.0, rng)
    assert costs.min() >= 1.0
    assert costs.max() <= 8.0
    assert np.all(draw_noise(5, 3, STEP_TIME_RATIOS, 0.0, rng) == 1.0)
    noise = draw_noise(50, 4, [0.5, 2.0], 1.0, rng)
    assert set(np.unique(noise)) <= {0.5, 2.0}
    assert draw_noise(50, 4, [0.5, 2.0], 4.0, rng).min() > 0  # scaled noise never makes a step free


def test_lockstep_steps_last_as_long_as_their_slowest_replica():
    costs = np.array([1.0, 3.0])
    noise = np.array([[1.0, 1.0], [2.0, 0.5]])
    expected = SECONDS_PER_SAMPLE * BATCH * np.array([3.0, 2.0])
    assert lockstep_step_times(costs, noise) == pytest.approx(expected)


def test_simulation_times_the_steps_after_the_measured_runs_warm_up():
    assert WARMUP_STEPS == MEASURED_WARMUP_STEPS
    assert simulate(2, 1.0, 15, [1.0], clock=_no_time).steps == 15 - WARMUP_STEPS
    with pytest.raises(ValueError, match="warm-up"):
        simulate(2, 1.0, WARMUP_STEPS, [1.0])


def test_the_stored_noise_is_relative_step_times():
    assert tuple(sorted(STEP_TIME_RATIOS)) == STEP_TIME_RATIOS
    assert np.median(STEP_TIME_RATIOS) == pytest.approx(1.0, abs=1e-3)
    assert relative_step_times([0.0, 2.0, 4.0, 7.0, 9.0], skipped=2) == [1.0, 1.0, 1.5]


def test_the_real_sampler_splits_an_uneven_plan_at_scale():
    plan = [BATCH] * 32
    plan[0], plan[-1] = BATCH + 40, BATCH - 40
    assert check_sampler(plan, steps=2) >= 0.0


def test_measured_counts_share_one_spread_of_speeds():
    for replicas in (2, 4, 8):
        costs = log_spaced_costs(replicas)
        assert len(costs) == replicas
        assert (min(costs), max(costs)) == (1.0, 4.0)
        assert list(costs) == sorted(costs)
    case = scale_case(8)
    assert (case.name, case.mode, case.step_ms) == ("user-8", "user", 64.0)


def test_tables_hold_the_ratio_beside_its_bound(tmp_path: Path):
    solo = [StepTime(0.0, 1 / 1000), StepTime(0.0, 3 / 1000)]  # the ideal: [96, 32] in 96 ms, 1333 samples/s
    result = CaseResult("user-2", "user", [1.0, 3.0], 64.0, 0, solo_step_times=solo)
    result.runs["ddp"] = RunResult("ddp", 500.0, 0.256, 0.01)
    result.runs["adaptive_elastic"] = RunResult("adaptive_elastic", 1200.0, 0.107, 0.01, final_plan=[96, 32])
    assert "| 2 | [1, 3] | 500 | 1200 | 2.40 | 2.00 | 38% | 90% | [96, 32] |" in measured_table([result])
    record = json.loads(write_report(tmp_path, [result], [], {}, {}).read_text())["measured"][0]
    assert (record["ratio"], record["balanced_plan"]) == (pytest.approx(2.4), [96, 32])
    sim = simulate(4, 2.0, 20, [1.0], noise_scale=0.0, clock=_no_time)
    assert f"| 4 | [1, 2] | {sim.realised_spread:.2f} |" in simulated_table([sim])


def test_the_command_line_runs_a_small_simulation(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    argv = ["scale", "--parts", "simulated", "--sim-replicas", "4", "--spreads", "1,2", "--sim-steps", "20"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "scale.json").read_text())
    assert [sim["spread"] for sim in report["simulated"]] == [1.0, 2.0]
    assert report["measured"] == []
    assert "| 4 | [1, 2] |" in capsys.readouterr().out


def test_options_and_unknown_parts():
    options = build_parser().parse_args([])
    assert (options.replicas, options.sim_replicas, options.spreads) == ("2,4,8", "16,32,64,128,256", "1,2,4,8")
    with pytest.raises(SystemExit) as exit_info:
        main(["scale", "--help"])
    assert exit_info.value.code == 0
    with pytest.raises(SystemExit, match="Unknown parts"):
        main(["scale", "--parts", "simulated,nothing"])
