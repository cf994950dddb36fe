"""The slowness benchmark: figures from recorded runs, and one small case of both strategies end to end."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_aesgd.bench.slowness import BATCH, Case, CaseResult, RunResult, _result, run_case, table


def test_throughput_and_plans_come_from_rank_zeros_record():
    record = {
        "times": [0.1 * step for step in range(40)],
        "cpu": [0.02 * step for step in range(40)],
        "plans": {"starts": [0, 5, 35], "sizes": [[32, 32], [48, 16], [50, 14]]},
    }
    result = _result("adaptive_elastic", record, replicas=2, steps=40)
    assert result.seconds_per_step == pytest.approx(0.1)
    assert result.cpu_seconds_per_step == pytest.approx(0.02)
    assert result.samples_per_second == pytest.approx(2 * BATCH / 0.1)
    assert result.plan_at_check == [48, 16]  # the plan in force at step 30
    assert result.smallest_batch == 14
    assert result.final_plan == [50, 14]


def test_case_figures_compare_with_ddp_and_the_ideal():
    result = CaseResult("hook", "hook", [1.0, 3.0], 64.0, 0, ideal=400.0)
    result.runs["ddp"] = RunResult("ddp", 200.0, 0.64, 0.01)
    result.runs["adaptive_elastic"] = RunResult("adaptive_elastic", 360.0, 0.36, 0.01, plan_at_check=[48, 16])
    assert result.ratio() == pytest.approx(1.8)
    assert result.efficiency("adaptive_elastic") == pytest.approx(0.9)
    assert result.plan_error() == pytest.approx(0.0)  # 48:16 is 3:1
    assert "| hook | hook | [1, 3] | 64 | 200 | 360 | 1.80 | 50% | 90% | 0% |" in table([result])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_small_case_races_ddp_and_the_strategy_under_slow_hooks(tmp_path):
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.rand(4000, 1, 28, 28, generator=generator), torch.randint(0, 10, (4000,)))
    case = Case("small", "hook", (1.0, 3.0), step_ms=8.0)
    result = run_case(case, dataset, steps=24, out=tmp_path)
    assert set(result.runs) == {"ddp", "adaptive_elastic"}
    assert result.ideal is not None
    assert result.ideal > 0
    assert all(run.samples_per_second > 0 for run in result.runs.values())
    assert result.runs["ddp"].plan_at_check is None
    fast, slow = result.runs["adaptive_elastic"].final_plan
    assert fast > slow, "the replica whose hooks are 3× slower must get the smaller batch"
