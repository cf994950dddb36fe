"""Reports beside the gradient sums: when they are due, and what comes back, over a faked communicator."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import pytest
import torch
from helpers import FakeCommunicator

from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.engine import report_exchange
from lightning_aesgd.engine.plan_loop import PlanLoop
from lightning_aesgd.engine.plan_settings import PlanSettings
from lightning_aesgd.engine.report_exchange import FIRST_REPORT_STEP, ReportExchange, _step_seconds

STEP_BATCH = 64


def _plans(lag: int = 2, planner: str = "proportional") -> PlanLoop:
    plans = PlanLoop(PlanSettings(planner=planner))
    plans.attach(2)
    plans.plan_book_for(STEP_BATCH, 2, lag=lag)
    return plans


def _due_steps(exchange: ReportExchange, plans: PlanLoop, steps: int) -> list[int]:
    return [step for step in range(steps) if exchange.due(step, plans)]


def test_until_a_report_is_received_reports_are_due_every_lag_plus_one_steps():
    exchange, plans = ReportExchange(), _plans(lag=2)
    # From a fit's fourth step: a report holds whole steps, and the fit's first two are measured by none.
    assert _due_steps(exchange, plans, 10) == [3, 6, 9]


def test_reports_travel_in_rank_order_and_the_latest_keep_stay_in_flight():
    """Rank 1's row lands in its own place; its peer's (here one that adds a copy of rank 1's row) in place 0."""
    exchange, comm = ReportExchange(), FakeCommunicator(world_size=2, rank=1, peers_sum=lambda t: t.flip(0) / 2)
    first, second = PeriodReport(0.25, work=16.0, steps=1.0), PeriodReport(0.75, work=48.0, steps=1.0)
    exchange.launch(first.as_row(), comm, torch.device("cpu"))
    exchange.launch(second.as_row(), comm, torch.device("cpu"))
    waits = []

    @contextmanager
    def waiting():
        waits.append(True)
        yield

    ((rows, _),) = list(exchange.received(keep=1, waiting=waiting))  # the delayed mode keeps the latest in flight
    assert [PeriodReport.from_row(row).work for row in rows] == [8.0, 16.0]
    assert waits == [True]
    ((rows, _),) = list(exchange.received(keep=0, waiting=waiting))
    assert PeriodReport.from_row(rows[1]).merge_weight == 0.75
    assert list(exchange.received(keep=0, waiting=waiting)) == []


def test_reports_space_out_once_the_plan_is_settled_and_steps_are_short():
    exchange, plans = ReportExchange(), _plans(lag=2)
    # Two equal replicas, 5 ms per step over 4 steps each: the plan (equal) is balanced, so settled.
    rows = [PeriodReport(0.5, work=128.0, planned=128.0, steps=4.0, active=0.02).as_row() for _ in range(2)]
    for step in range(0, 40, 4):
        plans.receive(rows, step)
    exchange.space_out(plans)
    assert exchange.due(100, plans)
    assert not any(exchange.due(step, plans) for step in range(101, 124))  # 8 × (lag + 1) = 24 steps: the cap
    assert exchange.due(124, plans)


def test_an_unsettled_plan_brings_the_next_report_to_lag_plus_one_steps_after_the_latest():
    """The report that starts a probe (or a new plan) was scheduled 24 steps ahead while settled: the next one comes
    lag + 1 steps after it, not 24 (a probe held every step at the probed replica's pace all that time)."""
    exchange, plans = ReportExchange(), _plans(lag=2)
    equal = [PeriodReport(0.5, work=128.0, planned=128.0, steps=4.0, active=0.02).as_row() for _ in range(2)]
    for step in range(0, 40, 4):
        plans.receive(equal, step)
    exchange.space_out(plans)
    assert exchange.due(100, plans)  # the next would be at 124
    slow = PeriodReport(0.5, work=128.0, planned=128.0, steps=24.0, active=2.4).as_row()
    plans.receive([equal[0], slow], 100)  # replica 1 slowed down 5x: no longer settled
    exchange.space_out(plans)
    assert _due_steps(exchange, plans, 110) == [103, 106, 109]
    restored = ReportExchange()
    restored.load_state_dict(exchange.state_dict())
    assert restored.state_dict() == exchange.state_dict()


def test_a_report_comes_at_a_probes_step_however_far_apart_settled_reports_are():
    """Settled reports come 24 steps apart; a probe at step 112 is planned from a report at that step, where a replica
    sitting out comes back, not from the first report after it (its segment would end before the verdict)."""
    exchange, plans = ReportExchange(), _plans(lag=2)
    equal = [PeriodReport(0.5, work=128.0, planned=128.0, steps=4.0, active=0.02).as_row() for _ in range(2)]
    for step in range(0, 40, 4):
        plans.receive(equal, step)
    plans.plan_book.schedule(40, [STEP_BATCH, 0])  # replica 1 was left out...
    exchange.space_out(plans)
    assert exchange.due(100, plans)  # the next would be at 124
    plans.admission.probe_at[1] = 112  # ...and is probed at step 112
    exchange.space_out(plans)
    assert _due_steps(exchange, plans, 113) == [112]
    plans.admission.probe_at[1] = 113  # a probe closer than lag + 1 steps: the report still waits that long...
    exchange.due(112, plans)
    exchange.space_out(plans)
    assert _due_steps(exchange, plans, 120) == [115]
    plans.segment_steps = 16  # ...but where replicas sit out, a returning replica's short segment needs it there
    exchange.due(115, plans)
    plans.admission.probe_at[1] = 116
    exchange.space_out(plans)
    assert _due_steps(exchange, plans, 120) == [116]


def test_a_probe_step_is_a_plan_key_and_reports_count_lightnings_global_steps():
    """From the second epoch on the two differ where an epoch stops early (limit_train_batches)."""
    exchange, plans = ReportExchange(), _plans(lag=2)
    equal = [PeriodReport(0.5, work=128.0, planned=128.0, steps=4.0, active=0.02).as_row() for _ in range(2)]
    for step in range(0, 40, 4):
        plans.receive(equal, step)
    plans.plan_book.schedule(40, [STEP_BATCH, 0])
    exchange.space_out(plans)
    assert exchange.due(100, plans)
    plans.admission.probe_at[1] = 160  # the plans' key of global step 112: 48 keys ahead
    exchange.space_out(plans, key_offset=48)
    assert _due_steps(exchange, plans, 113) == [112]


def test_an_unsettled_plan_keeps_reports_every_lag_plus_one_steps():
    """A static plan that unequal replicas cannot balance; an adaptive one would be settled by its next plan."""
    exchange, plans = ReportExchange(), _plans(lag=2, planner="static")
    fast = PeriodReport(0.5, work=128.0, planned=128.0, steps=4.0, active=0.02).as_row()
    slow = PeriodReport(0.5, work=128.0, planned=128.0, steps=4.0, active=0.2).as_row()
    assert _due_steps(exchange, plans, 4) == [3]
    plans.receive([fast, slow], 3)
    exchange.space_out(plans)
    assert _due_steps(exchange, plans, 10) == [6, 9]


def test_a_new_fit_reports_at_its_fourth_step_again_wherever_it_starts():
    exchange, plans = ReportExchange(), _plans(lag=2)
    assert [exchange.due(step, plans) for step in range(5)] == [False, False, False, True, False]
    exchange.start()
    assert [exchange.due(step, plans) for step in range(10, 15)] == [False, False, False, True, False]  # resumed


def test_a_carried_table_needs_no_all_reduce_of_its_own_and_a_declined_one_gets_one():
    exchange, comm = ReportExchange(), FakeCommunicator(world_size=2, rank=1)
    row = PeriodReport(0.5, work=16.0, steps=1.0).as_row()
    carried: list[torch.Tensor] = []

    def carrier(table: torch.Tensor) -> torch.futures.Future:
        carried.append(table)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(table * 3)  # what the carrying sum returns
        return future

    exchange.launch(row, comm, torch.device("cpu"), carrier=carrier)
    assert comm.calls == []
    torch.testing.assert_close(carried[0][1], torch.tensor(row, dtype=torch.float64))
    ((rows, _),) = list(exchange.received(keep=0, waiting=nullcontext))
    assert PeriodReport.from_row(rows[1]).work == 48.0
    exchange.launch(row, comm, torch.device("cpu"), carrier=lambda table: None)
    assert comm.calls == ["all_reduce_sum_async"]
    ((rows, _),) = list(exchange.received(keep=0, waiting=nullcontext))
    assert PeriodReport.from_row(rows[1]).work == 32.0  # the fake's peer sends the same row


def test_one_replica_alone_sums_its_report_without_a_collective():
    """A job of one replica (or the one present while the others sit out): its table, in its world rows, is the sum."""
    exchange, comm = ReportExchange(), FakeCommunicator(world_size=1, rank=0)
    row = PeriodReport(1.0, work=16.0, steps=1.0).as_row()
    exchange.launch(row, comm, torch.device("cpu"), slot=2, rows=3)
    ((rows, _),) = list(exchange.received(keep=0, waiting=nullcontext))
    assert comm.calls == []
    assert [PeriodReport.from_row(each).work for each in rows] == [0.0, 0.0, 16.0]


def test_a_report_that_measured_exactly_lag_plus_one_steps_lets_a_settled_plan_space_reports_out():
    exchange, plans = ReportExchange(), _plans(lag=2)
    rows = [PeriodReport(0.5, work=96.0, planned=96.0, steps=3.0, active=0.015).as_row() for _ in range(2)]
    for step in range(0, 30, 3):
        plans.receive(rows, step)
    exchange.space_out(plans)
    assert exchange.due(100, plans)
    assert not any(exchange.due(step, plans) for step in range(101, 124))


def test_a_new_exchange_and_a_new_fit_start_with_no_report_received():
    """``every`` 0: no report received yet; ``latest`` 0: none launched. A step that does not report says so."""
    exchange, plans = ReportExchange(), _plans(lag=2)
    blank = {"next_report": None, "every": 0, "latest": 0}
    assert exchange.state_dict() == blank
    assert exchange.due(0, plans) is False
    assert exchange.due(FIRST_REPORT_STEP, plans) is True
    exchange.load_state_dict({"next_report": 30, "every": 24, "latest": 6})
    exchange.start()
    assert exchange.state_dict() == blank


@pytest.fixture
def host_reads(monkeypatch):
    """The tensors read to the host by the exchange; a ``meta`` tensor reads as sevens (it holds no numbers)."""
    reads = []

    def to_host(tensor):
        reads.append(tensor.device.type)
        return [7.0] * tensor.numel() if tensor.is_meta else tensor.reshape(-1).tolist()

    monkeypatch.setattr(report_exchange, "to_host", to_host)
    return reads


def test_numbers_beside_the_reports_come_with_them_in_one_host_read_where_they_share_a_device(host_reads):
    exchange, comm = ReportExchange(), FakeCommunicator(world_size=1, rank=0)
    row = PeriodReport(1.0, work=16.0, steps=1.0).as_row()
    exchange.launch(row, comm, torch.device("cpu"))
    ((rows, counts),) = list(exchange.received(0, nullcontext, beside=lambda: torch.tensor([3, 1])))
    assert rows == [row]
    assert counts == [3.0, 1.0]
    assert host_reads == ["cpu"]
    exchange.launch(row, comm, torch.device("cpu"))
    ((rows, counts),) = list(exchange.received(0, nullcontext))  # nothing beside them
    assert (rows, counts) == ([row], None)


def test_numbers_beside_the_reports_on_another_device_are_read_on_their_own(host_reads):
    exchange, comm = ReportExchange(), FakeCommunicator(world_size=1, rank=0)
    row = PeriodReport(1.0, work=16.0, steps=1.0).as_row()
    exchange.launch(row, comm, torch.device("cpu"))
    ((rows, counts),) = list(exchange.received(0, nullcontext, beside=lambda: torch.zeros(2, device="meta")))
    assert rows == [row]
    assert counts == [7.0, 7.0]
    assert host_reads == ["cpu", "meta"]


def test_the_longest_measured_step_ignores_periods_that_measured_no_step():
    assert _step_seconds([]) == 0.0
    assert _step_seconds([PeriodReport(0.0, steps=0.0, active=1.0)]) == 0.0
    reports = [PeriodReport(1.0, steps=1.0, active=0.5), PeriodReport(1.0, steps=4.0, active=0.4)]
    assert _step_seconds(reports) == 0.5
