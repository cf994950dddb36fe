"""Replicas sitting out: segments chosen alike on every rank, plans that never disagree, handoffs that catch up."""

from __future__ import annotations

import pickle
from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers import FakeCommunicator
from test_plan_loop import SECONDS_PER_SAMPLE, STEP_BATCH, _group, _report

from lightning_aesgd.core.planners import StaticPlanner
from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.core.speed import StepTime
from lightning_aesgd.engine.admission import PROBE_BUDGET, SITTING_OUT_PROBE_REPORTS, Admission
from lightning_aesgd.engine.comm import LocalCommunicator
from lightning_aesgd.engine.handoff import (
    TensorSlot,
    broadcast_optimizer_state,
    broadcast_tensors,
    filled,
    split_tensors,
)
from lightning_aesgd.engine.report_exchange import ReportExchange
from lightning_aesgd.engine.sampler import PlanBook
from lightning_aesgd.engine.sitting_out import LOCKSTEP_STEPS, SittingOut

SEGMENT = 16


def test_a_plan_book_tells_whether_a_replica_is_left_out_over_a_range_of_steps():
    book = PlanBook([4, 4, 4])
    book.schedule(5, [6, 6, 0])
    book.schedule(20, [4, 4, 4])
    assert book.left_out_throughout(2, 5, 20)
    assert book.left_out_throughout(2, 10, 15)
    assert not book.left_out_throughout(2, 4, 20)  # step 4 still gives it work
    assert not book.left_out_throughout(2, 5, 21)  # and step 20 again
    assert not book.left_out_throughout(0, 5, 20)
    assert book.last_served_step == -1  # asking serves nothing


def test_loading_plans_can_keep_the_steps_already_served():
    book = PlanBook([4, 4])
    book.sizes_at(7)
    book.load_state_dict(PlanBook([8, 0]).state_dict(), keep_served=True)
    assert book.last_served_step == 7
    assert book.latest == (8, 0)
    book.load_state_dict(PlanBook([8, 0]).state_dict())
    assert book.last_served_step == -1


def test_a_held_out_replica_is_given_no_work_and_keeps_its_probe_even_where_it_would_help():
    admission = Admission(align=SEGMENT)
    models = [StepTime(0.0, 1.0), StepTime(0.0, 1.0), StepTime(0.0, 50.0)]
    chosen = admission.decide(3, models, [40, 40, 40], [4] * 3, [None] * 3, lag=2)
    assert chosen == [True, True, False]
    due = admission.probe_at[2]
    assert due % SEGMENT == 0
    assert due >= 3 + 50
    fast = [StepTime(0.0, 1.0)] * 3  # now it would help, but it sits out
    assert admission.decide(20, fast, [60, 60, 0], [4] * 3, [None] * 3, lag=2, held_out={2}) == [True, True, False]
    assert admission.probe_at[2] == due
    assert admission.decide(21, fast, [60, 60, 0], [4] * 3, [None] * 3, lag=2) == [True, True, True]


def _sit_out_run(factors_at, steps, lag=3):
    """Three replicas' plan loops as the sitting-out protocol drives them; returns per-step plans and absences.

    At each segment's start the replica that sat out takes rank zero's shared state (pickled, as a broadcast
    carries it) and every replica names who sits the segment out; within it, that replica neither reports nor
    receives, and the others receive its row as a period that measures nothing.
    """
    replicas = _group(3, planner="proportional")
    for replica in replicas:
        replica.plans.segment_steps = SEGMENT
        replica.plans.plan_book_for(STEP_BATCH, 3, lag=lag)
    sitting = SittingOut(SEGMENT)  # rank zero's, which holds the plans as they train
    sitting.start(_World(3, 0), enabled=True)

    def handoff(source, absent):
        shared = pickle.loads(pickle.dumps(replicas[source].plans.shared_state()))
        for rank in absent:
            replicas[rank].plans.adopt_shared_state(shared)

    plans, absences = [], []
    for step in range(steps):
        if sitting.starts_segment(step):
            sitting.enter(step, replicas[0].plans, handoff)
            absent, (start, end) = sitting.absent, sitting.segment
            chosen = [replica.plans.sitting_out_between(start, end) for replica in replicas]
            assert chosen[0] == chosen[1] == chosen[2] == absent  # every rank names the same replicas
            for replica in replicas:
                replica.plans.held_out = absent
        sitting.stepped()
        sizes = [replica.plans.plan_book.sizes_at(step) for replica in replicas]
        present = [rank for rank in range(3) if rank not in absent]
        for rank in present:
            assert sizes[rank] == sizes[present[0]]  # the replicas taking part slice every step alike
        for rank in absent:
            assert sizes[rank][rank] == sizes[present[0]][rank] == 0  # one sitting out takes nothing, by any book
        rows = [PeriodReport(merge_weight=0.0).as_row()] * 3
        for rank in present:
            size = sizes[present[0]][rank]
            rows[rank] = _report(size, factors_at(step)[rank] * (1e-3 + size * SECONDS_PER_SAMPLE), step)
        for rank in present:
            replicas[rank].receive(rows, step)
        plans.append(sizes[present[0]])
        absences.append(absent)
    return plans, absences, replicas


def test_a_slow_replica_sits_out_whole_segments_and_every_book_agrees_after_each_handoff():
    plans, absences, _ = _sit_out_run(lambda step: (1, 1, 20), steps=50 * SEGMENT)
    assert all(sum(plan) == STEP_BATCH for plan in plans)
    sat_out = sum(1 for absent in absences if 2 in absent)
    assert sat_out >= 0.8 * len(plans), sat_out  # all but the first segment and the probes' segments
    assert all(absent <= {2} for absent in absences)
    probes = [step for step, plan in enumerate(plans) if step > SEGMENT and plan[2] > 0]
    assert probes, "it is still probed"
    assert all(2 not in absences[step] for step in probes)


def test_a_probe_starts_a_segment_that_ends_once_it_is_judged_and_costs_its_budget():
    lag = 3
    plans, absences, replicas = _sit_out_run(lambda step: (1, 1, 20), steps=200 * SEGMENT, lag=lag)
    first_out = next(step for step, absent in enumerate(absences) if 2 in absent)
    present = [step for step in range(first_out, len(plans)) if 2 not in absences[step]]
    starts = [step for step in present if 2 in absences[step - 1]]
    assert len(starts) >= 3, "it is probed now and then"
    segment = SITTING_OUT_PROBE_REPORTS * (lag + 1)
    for start in starts:
        assert start % SEGMENT == 0  # it comes back where a segment begins, its probe is planned there...
        assert plans[start + lag - 1][2] == 0  # ...from the reports at that step (none while it sat out)...
        assert plans[start + lag][2] > 0  # ...and applies lag steps later
        assert all(2 in absences[step] for step in range(start + segment, min(start + SEGMENT, len(plans))))
    assert len(present) == len(starts) * segment  # each probe holds the others for its short segment only
    # The budget counts those steps: each holds the others by up to the probed replica's step at its floor.
    loop = replicas[0].plans
    models = loop.arrival_model.models()
    floor_step, step_without = models[2].seconds(loop.floors[2]), models[0].seconds(STEP_BATCH // 2)
    assert len(present) * (floor_step - step_without) <= 1.5 * PROBE_BUDGET * (len(plans) - first_out) * step_without


def test_a_replica_that_sat_out_and_becomes_fast_is_let_back_in_at_a_segment_start():
    plans, absences, _ = _sit_out_run(lambda step: (1, 1, 20) if step < 100 else (1, 1, 1), steps=600)
    assert any(2 in absent for absent in absences[:100])
    back = next(step for step in range(100, 600) if plans[step][2] > 0)
    assert all(plan[2] > 0 for plan in plans[back:])
    assert not any(absences[back:])
    assert max(plans[-1]) <= 1.1 * min(plans[-1])


def test_no_replica_sits_out_where_leaving_out_is_forbidden_or_segments_are_off():
    replicas = _sit_out_run(lambda step: (1, 1, 50), steps=2 * SEGMENT)[2]
    loop = replicas[0].plans
    start = 2 * SEGMENT
    assert loop.sitting_out_between(start, start + SEGMENT) == {2}
    loop.segment_steps = 0
    assert loop.sitting_out_between(start, start + SEGMENT) == frozenset()
    loop.segment_steps = SEGMENT
    loop.forbid_leaving_out("a test")
    assert loop.sitting_out_between(start, start + SEGMENT) == frozenset()


def test_rank_zero_never_sits_out_however_slow_and_rank_one_may():
    """Lightning's rank-zero code (loggers, callbacks that write files) always sees the model train."""
    replicas = _sit_out_run(lambda step: (50, 50, 1), steps=2 * SEGMENT)[2]
    loop = replicas[0].plans
    start = 2 * SEGMENT
    assert loop.plan_book.latest[:2] == (0, 0)  # both left out of the steps
    assert loop.sitting_out_between(start, start + SEGMENT) == {1}


class _World(FakeCommunicator):
    """A world of ``world_size`` replicas that makes subgroups and records them."""

    def __init__(self, world_size: int, rank: int) -> None:
        super().__init__(world_size, rank)
        self.groups: list[tuple[int, ...]] = []

    def subgroup(self, members):
        self.groups.append(tuple(members))
        return FakeCommunicator(len(members), list(members).index(self.rank)) if self.rank in members else None


class _Plans:
    """A plan loop that leaves replica 2 out of every segment."""

    held_out: frozenset[int] = frozenset()
    lag = 2

    def slowest_step_seconds(self) -> float:
        return self.step_seconds

    def __init__(self, out=frozenset({2}), step_seconds: float = 0.01) -> None:
        self.out = out
        self.step_seconds = step_seconds

    def sitting_out_between(self, start: int, end: int) -> frozenset[int]:
        return self.out


@pytest.mark.parametrize("rank", [0, 2])
def test_segments_choose_alike_hand_off_only_when_behind_and_sum_over_the_others(rank):
    world, plans, handoffs = _World(3, rank), _Plans(), []
    sitting = SittingOut(SEGMENT)
    sitting.start(world, enabled=True)

    def handoff(source, absent):
        handoffs.append((source, absent))

    assert sitting.enter(0, plans, handoff) == frozenset()
    assert not sitting.absent
    for _ in range(LOCKSTEP_STEPS):
        sitting.stepped()
    assert not sitting.starts_segment(SEGMENT - 1)
    assert sitting.enter(SEGMENT, plans, handoff) == frozenset()  # nobody was behind
    assert sitting.absent == {2}
    assert plans.held_out == {2}
    assert sitting.sits_out == (rank == 2)
    assert world.groups == [(0, 1)]
    assert (sitting.comm is None) == (rank == 2)
    assert sitting.catch_up(handoff) == frozenset()  # no step yet since the segment began: nothing to hand
    sitting.stepped()
    assert sitting.catch_up(handoff) == {2}
    assert handoffs == [(0, frozenset({2}))]
    assert sitting.catch_up(handoff) == frozenset()  # caught up until the next step
    sitting.stepped()
    assert sitting.enter(2 * SEGMENT, plans, handoff) == {2}
    assert handoffs[-1] == (0, frozenset({2}))
    assert world.groups == [(0, 1)]  # the group is made once
    sitting.stop()
    assert not sitting.sits_out
    assert sitting.absent == frozenset()


def test_a_segment_where_a_replica_comes_back_lasts_a_probe_and_the_next_ends_where_segments_align():
    plans, handoffs = _Plans(), []
    sitting = SittingOut(SEGMENT)
    sitting.start(_World(3, 0), enabled=True)
    sitting.enter(0, plans, lambda source, absent: handoffs.append(absent))
    for _ in range(LOCKSTEP_STEPS):
        sitting.stepped()
    sitting.enter(SEGMENT, plans, lambda source, absent: handoffs.append(absent))
    assert sitting.segment == (SEGMENT, 2 * SEGMENT)
    assert sitting.absent == {2}
    sitting.stepped()
    plans.out = frozenset()  # replica 2 comes back, for its probe
    assert sitting.enter(2 * SEGMENT, plans, lambda source, absent: handoffs.append(absent)) == {2}
    probe_end = 2 * SEGMENT + SITTING_OUT_PROBE_REPORTS * (plans.lag + 1)
    assert sitting.segment == (2 * SEGMENT, probe_end)
    assert not sitting.absent
    assert not sitting.starts_segment(probe_end - 1)
    assert sitting.starts_segment(probe_end)
    plans.out = frozenset({2})  # judged: it sits out again
    sitting.enter(probe_end, plans, lambda source, absent: handoffs.append(absent))
    assert sitting.segment == (probe_end, 3 * SEGMENT)
    assert sitting.absent == {2}
    assert handoffs == [{2}]  # nobody sat out the probe's segment: nobody was behind at its end


def test_nobody_sits_out_where_it_is_off_or_everyone_would():
    sitting = SittingOut(SEGMENT)
    sitting.start(_World(3, 0), enabled=False)
    assert not sitting.starts_segment(0)
    sitting.start(LocalCommunicator(), enabled=True)  # a lone replica has nobody to sit out from
    assert not sitting.enabled
    sitting.start(_World(3, 0), enabled=True)
    for _ in range(LOCKSTEP_STEPS):
        sitting.stepped()
    with pytest.raises(ValueError, match="Every replica would sit out"):
        sitting.enter(0, _Plans(frozenset({0, 1, 2})), lambda source, absent: None)
    with pytest.raises(ValueError, match="at least one step"):
        SittingOut(0)


def test_reports_over_a_group_keep_world_rows():
    exchange = ReportExchange()
    group = FakeCommunicator(world_size=2, rank=1, peers_sum=lambda tensor: torch.zeros_like(tensor))
    exchange.launch([1.0, 2.0], group, torch.device("cpu"), slot=3, rows=4)
    ((rows, _),) = list(exchange.received(0, nullcontext))
    assert rows == [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 2.0]]
    exchange.due(0, SimpleNamespace(lag=1))
    state = exchange.state_dict()
    other = ReportExchange()
    other.load_state_dict(state)
    assert other.state_dict() == state


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_handoff_broadcasts_each_dtype_once_on_the_model_device(device):
    tensors = [torch.zeros(3, device=device), torch.zeros((), device=device), torch.zeros(2, 2, device=device)]
    tensors.append(torch.zeros(4, dtype=torch.int64, device=device))
    world = FakeCommunicator(world_size=2, device=device)
    broadcast_tensors(world, tensors, src=0)
    assert world.calls == ["broadcast_", "broadcast_"]


def _adam(seed: int, device: str = "cpu") -> torch.optim.Adam:
    torch.manual_seed(seed)
    parameter = torch.nn.Parameter(torch.randn(3, device=device))
    optimizer = torch.optim.Adam([parameter])
    parameter.grad = torch.randn(3, device=device)
    optimizer.step()
    return optimizer


def test_optimizer_state_splits_into_a_picklable_skeleton_and_the_device_tensors():
    state = _adam(seed=0).state_dict()
    skeleton, tensors = split_tensors(state, torch.device("cpu"))
    moments = [skeleton["state"][0][key] for key in ("exp_avg", "exp_avg_sq")]
    assert moments == [TensorSlot(0, (3,), torch.float32), TensorSlot(1, (3,), torch.float32)]
    assert isinstance(skeleton["param_groups"][0]["betas"], tuple)
    # Adam's step count, a scalar, stays in the skeleton on the host on every device: the same slots on a GPU
    # replica as on a CPU one, and never a step count on the GPU.
    assert torch.equal(skeleton["state"][0]["step"], state["state"][0]["step"])
    assert split_tensors(state, torch.device("meta"))[0]["state"][0]["step"].device.type == "cpu"
    rebuilt = filled(pickle.loads(pickle.dumps(skeleton)), tensors)
    assert all(torch.equal(rebuilt["state"][0][key], state["state"][0][key]) for key in state["state"][0])


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_large_states_travel_in_chunks_and_large_tensors_in_place(monkeypatch, device):
    monkeypatch.setattr("lightning_aesgd.engine.handoff.CHUNK_BYTES", 64)  # 16 floats
    tensors = [torch.zeros(4, device=device), torch.zeros(8, device=device), torch.zeros(8, device=device)]
    tensors.append(torch.zeros(40, device=device))  # alone, broadcast as it is
    world = FakeCommunicator(world_size=2, device=device)
    broadcast_tensors(world, tensors, src=0)
    assert world.calls == ["broadcast_", "broadcast_", "broadcast_"]  # [4, 8], [8], [40]


def test_an_empty_tensor_first_of_its_kind_travels_with_the_others():
    # A module may hold nn.Parameter(torch.empty(0)) to track its device; it opens the first chunk.
    mine = [torch.zeros(0), torch.zeros(3)]
    broadcast_tensors(_Filling(2, 1, tensors=[torch.arange(3.0)]), mine, src=0)
    assert mine[1].tolist() == [0.0, 1.0, 2.0]


class _Filling(FakeCommunicator):
    """A world whose broadcasts bring replica ``src``'s tensors and objects (given in order), as a receiver sees them.

    It keeps what this rank broadcast (``tensors_sent``, ``objects``): a sender's record, for a receiver to replay.
    """

    def __init__(self, world_size: int, rank: int, tensors=None, objects=None) -> None:
        super().__init__(world_size, rank)
        self.tensors, self.sent = list(tensors or []), list(objects or [])
        self.tensors_sent, self.objects = [], []

    def broadcast_(self, tensor, src=0):
        super().broadcast_(tensor, src)
        self.tensors_sent.append(tensor.clone())
        if self.tensors:
            tensor.copy_(self.tensors.pop(0))

    def broadcast_object(self, obj, src=0):
        self.objects.append(obj)
        carried = self.sent.pop(0) if self.sent else obj
        return pickle.loads(pickle.dumps(carried))  # as a broadcast carries it


def _flat(tensors):
    return torch.cat([tensor.reshape(-1).float() for tensor in tensors])


def test_broadcast_tensors_writes_the_source_values_back_in_place():
    mine = [torch.zeros(3), torch.zeros(()), torch.zeros(2, 2), torch.zeros(4, dtype=torch.int64)]
    theirs = [torch.arange(3.0), torch.tensor(7.0), torch.ones(2, 2), torch.arange(4)]
    floats = torch.cat([theirs[0], theirs[1].reshape(1), theirs[2].reshape(-1)])
    broadcast_tensors(_Filling(2, 1, tensors=[floats, theirs[3]]), mine, src=0)
    assert _flat(mine).tolist() == _flat(theirs).tolist()
    assert mine[3].dtype == torch.int64


def _engine(rank: int, world: FakeCommunicator, seed: int):
    from lightning_aesgd.engine.gradient_sync import GradientSync
    from lightning_aesgd.engine.plan_settings import PlanSettings

    torch.manual_seed(seed)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    engine = GradientSync(PlanSettings(), delay=0)
    engine.start(module, world, torch.device("cpu"))
    engine.plans.plan_book_for(12, 3, lag=2)
    engine._optimizer = optimizer
    return engine, module, optimizer


def test_a_handoff_gives_a_replica_that_sat_out_the_model_optimizer_plans_and_counts():
    source, source_module, source_optimizer = _engine(0, FakeCommunicator(3, 0), seed=1)
    source.plans.plan_book.schedule(5, [6, 6, 0])
    source.reports.due(0, source.plans)
    sender = _Filling(3, 0)
    source._comm_in_use = sender
    before = _flat(source_module.parameters()).tolist()
    source._handoff(0, frozenset({2}))  # the source sends: nothing of its own changes
    assert _flat(source_module.parameters()).tolist() == before
    # One dtype: one broadcast of the model, one of the optimizer's state; its structure and the plans by pickle.
    assert sender.calls.count("broadcast_") == 2
    assert split_tensors(sender.objects[0], torch.device("cpu"))[1] == []  # the state's tensors were broadcast
    world = _Filling(3, 2, tensors=sender.tensors_sent, objects=sender.objects)
    receiver, module, optimizer = _engine(2, world, seed=2)
    receiver.plans.plan_book.sizes_at(3)  # its sampler had drawn up to step 3
    receiver._handoff(0, frozenset({2}))
    assert _flat(module.parameters()).tolist() == pytest.approx(_flat(source_module.parameters()).tolist())
    theirs, mine = source_optimizer.state_dict()["state"], optimizer.state_dict()["state"]
    assert torch.equal(mine[0]["exp_avg"], theirs[0]["exp_avg"])
    assert receiver.plans.plan_book.sizes_at(6) == (6, 6, 0)
    assert receiver.plans.plan_book.last_served_step == 6  # what its sampler drew stays drawn
    assert receiver.reports.state_dict() == source.reports.state_dict()
    assert receiver.plans.admission is not source.plans.admission  # a copy, as a broadcast carries


def test_a_replica_without_optimizer_state_receives_new_tensors_and_one_that_took_part_keeps_its_own():
    source = _adam(seed=1)
    sender = _Filling(3, 0)
    assert broadcast_optimizer_state(sender, source, src=0, device=torch.device("cpu")) is None  # nothing to load
    assert sender.calls == ["broadcast_"]  # one dtype: both moments together
    fresh = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))])  # it sat out from the start: no state yet
    state = broadcast_optimizer_state(
        _Filling(3, 2, sender.tensors_sent, sender.objects), fresh, src=0, device=torch.device("cpu")
    )
    fresh.load_state_dict(state)
    theirs, mine = source.state_dict()["state"][0], fresh.state_dict()["state"][0]
    assert all(torch.equal(mine[key], theirs[key]) for key in theirs)
    present = _adam(seed=1)  # it took part: the same state, which the broadcast fills in place
    moment = present.state_dict()["state"][0]["exp_avg"]
    broadcast_optimizer_state(_Filling(3, 1, sender.tensors_sent, sender.objects), present, 0, torch.device("cpu"))
    assert present.state_dict()["state"][0]["exp_avg"] is moment
    assert torch.equal(moment, theirs["exp_avg"])


def test_a_source_without_optimizer_sends_only_that():
    sender = _Filling(2, 0)
    assert broadcast_optimizer_state(sender, None, src=0, device=torch.device("cpu")) is None
    assert sender.objects == [None]
    assert "broadcast_" not in sender.calls


def test_a_replica_that_cannot_load_the_state_fails_after_the_handoffs_collectives():
    source, source_module, _ = _engine(0, FakeCommunicator(3, 0), seed=1)
    source._optimizer = torch.optim.SGD(source_module.parameters(), lr=0.1, momentum=0.9)  # another optimizer
    source._optimizer.step()
    sender = _Filling(3, 0)
    source._comm_in_use = sender
    source._handoff(0, frozenset({2}))
    world = _Filling(3, 2, tensors=sender.tensors_sent, objects=sender.objects)
    receiver, _, _ = _engine(2, world, seed=2)  # Adam cannot take SGD's state
    with pytest.raises(KeyError):
        receiver._handoff(0, frozenset({2}))
    assert len(world.objects) == 2  # both broadcasts joined: the others wait for nobody


def test_a_stop_seen_while_a_replica_sits_out_waits_for_the_segment_end_and_then_stops_every_replica():
    engine, _, _ = _engine(0, FakeCommunicator(3, 0, peers_sum=lambda t: torch.zeros_like(t)), seed=1)
    engine.sitting.absent = frozenset({2})
    engine.plans.stop_requested = True  # a report asked to stop: the replica sitting out cannot see it
    assert not engine.stop_requested
    engine._decide_together()
    assert engine.stop_requested
    # The replica that sat out hears of it at the same point, from the others' flags.
    quiet, _, _ = _engine(2, FakeCommunicator(3, 2, peers_sum=lambda t: torch.tensor([1.0, 0.0])), seed=1)
    quiet.sitting.absent = frozenset({2})
    assert not quiet.stop_requested
    quiet._decide_together()
    assert quiet.stop_requested


def test_a_failure_while_a_replica_sits_out_is_raised_by_every_replica_at_the_segment_end():
    from lightning_aesgd.engine.pipeline import NonFiniteReplicasError

    engine, _, _ = _engine(2, FakeCommunicator(3, 2, peers_sum=lambda t: torch.tensor([0.0, 1.0])), seed=1)
    engine.sitting.absent = frozenset({2})
    with pytest.raises(NonFiniteReplicasError, match="while this one sat out"):
        engine._decide_together()


def test_nobody_sits_out_where_a_segment_could_outlast_half_the_timeout():
    sitting = SittingOut(SEGMENT, max_wait=8.0)
    sitting.start(_World(3, 0), enabled=True)
    for _ in range(LOCKSTEP_STEPS):
        sitting.stepped()
    # 16 steps of 0.3 s: 4.8 s, more than half of 8 s
    assert sitting.enter(0, _Plans(step_seconds=0.3), lambda source, absent: None) == frozenset()
    assert sitting.absent == frozenset()
    assert sitting.max_step_seconds == 0.3  # as every rank's plans say after the handoff
    sitting.enter(SEGMENT, _Plans(step_seconds=0.2), lambda source, absent: None)
    assert sitting.absent == {2}


def test_only_the_named_planners_that_leave_replicas_out_let_them_sit_out():
    replicas = _sit_out_run(lambda step: (1, 1, 50), steps=2 * SEGMENT)[2]
    loop = replicas[0].plans
    start = 2 * SEGMENT
    assert loop.sitting_out_between(start, start + SEGMENT) == {2}
    named = loop.settings
    loop.settings = replace(named, leave_out_stragglers=False)
    assert loop.sitting_out_between(start, start + SEGMENT) == frozenset()
    loop.settings = replace(named, planner=StaticPlanner())
    assert loop.sitting_out_between(start, start + SEGMENT) == frozenset()


def test_replicas_may_sit_out_from_the_step_after_ddps_second_forward_and_not_before():
    """DDP's reducer rebuilds its buckets at its second forward, a broadcast among every rank: two steps in lockstep."""
    sitting = SittingOut(SEGMENT)
    sitting.start(_World(3, 0), enabled=True)
    sitting.stepped()
    assert sitting.enter(0, _Plans(), lambda source, absent: None) == frozenset()
    assert sitting.absent == frozenset()  # one step taken: the second forward is still to come
    sitting.start(_World(3, 0), enabled=True)
    sitting.stepped()
    sitting.stepped()
    sitting.enter(0, _Plans(), lambda source, absent: None)
    assert sitting.absent == {2}


def test_a_segment_of_one_step_is_allowed():
    assert SittingOut(1).segment_steps == 1


def test_a_world_of_several_replicas_lets_them_sit_out_and_a_world_of_one_does_not():
    sitting = SittingOut(SEGMENT)
    assert sitting.present == []  # no fit: nobody takes part
    assert sitting.segment == (0, 0)
    sitting.start(_World(3, 0), enabled=True)
    assert sitting.enabled is True
    assert sitting.present == [0, 1, 2]
    assert sitting.segment == (0, 0)  # no segment entered yet
    sitting.start(_World(1, 0), enabled=True)  # a world of one, even one that makes subgroups
    assert sitting.enabled is False
    assert sitting.starts_segment(0) is False


def test_entering_mid_segment_or_twice_at_its_first_step_changes_nothing():
    plans, handoffs = _Plans(), []
    sitting = SittingOut(SEGMENT)
    sitting.start(_World(3, 0), enabled=True)
    for _ in range(LOCKSTEP_STEPS):
        sitting.stepped()
    sitting.enter(SEGMENT, plans, lambda source, absent: handoffs.append(absent))
    assert not sitting.starts_segment(SEGMENT)  # entered already
    sitting.stepped()
    plans.out = frozenset()  # what a new choice would say, were one made
    assert sitting.enter(SEGMENT + 1, plans, lambda source, absent: handoffs.append(absent)) == frozenset()
    assert sitting.absent == {2}
    assert sitting.segment == (SEGMENT, 2 * SEGMENT)
    assert handoffs == []


def test_stopping_closes_the_subgroups_of_the_fit():
    closed = []

    class _Group(FakeCommunicator):
        def close(self):
            closed.append(self)

    class _ClosingWorld(_World):
        def subgroup(self, members):
            return _Group(len(members), 0)

    sitting = SittingOut(SEGMENT)
    sitting.start(_ClosingWorld(3, 0), enabled=True)
    for _ in range(LOCKSTEP_STEPS):
        sitting.stepped()
    sitting.enter(0, _Plans(), lambda source, absent: None)
    group = sitting.comm
    sitting.stop()
    assert closed == [group]
    assert sitting.segment == (0, 0)
    assert sitting.present == []


def test_a_segment_that_takes_exactly_half_the_timeout_still_lets_a_replica_sit_out():
    sitting = SittingOut(SEGMENT, max_wait=8.0)
    sitting.start(_World(3, 0), enabled=True)
    for _ in range(LOCKSTEP_STEPS):
        sitting.stepped()
    sitting.enter(0, _Plans(step_seconds=0.25), lambda source, absent: None)  # 16 steps of 0.25 s: 4 s, not more
    assert sitting.absent == {2}


class _Recording(FakeCommunicator):
    """A world that records the storage of every tensor it broadcasts."""

    def __init__(self, world_size: int = 2, rank: int = 0) -> None:
        super().__init__(world_size, rank)
        self.pointers: list[int] = []

    def broadcast_(self, tensor, src=0):
        super().broadcast_(tensor, src)
        self.pointers.append(tensor.data_ptr())


def test_a_lone_contiguous_tensor_travels_in_place_and_a_lone_strided_one_through_a_buffer(monkeypatch):
    monkeypatch.setattr("lightning_aesgd.engine.handoff.CHUNK_BYTES", 64)
    large, world = torch.zeros(40), _Recording()
    broadcast_tensors(world, [large], src=0)
    assert world.pointers == [large.data_ptr()]  # no copy of it
    mine = [torch.zeros(3, 2).t()]  # a transposed view: not contiguous
    broadcast_tensors(_Filling(2, 1, tensors=[torch.arange(6.0)]), mine, src=0)
    assert mine[0].tolist() == torch.arange(6.0).view(2, 3).tolist()


def test_tensors_that_fill_a_chunk_exactly_travel_together(monkeypatch):
    monkeypatch.setattr("lightning_aesgd.engine.handoff.CHUNK_BYTES", 64)  # 16 floats
    world = FakeCommunicator(world_size=2)
    broadcast_tensors(world, [torch.zeros(8), torch.zeros(8)], src=0)
    assert world.calls == ["broadcast_"]


def test_a_replica_that_took_part_receives_the_optimizer_state_into_its_own_tensors():
    source, sender = _adam(seed=1), _Filling(3, 0)
    broadcast_optimizer_state(sender, source, src=0, device=torch.device("cpu"))
    present = _adam(seed=2)  # the same shapes, other values
    moment = present.state_dict()["state"][0]["exp_avg"]
    receiver = _Filling(3, 1, sender.tensors_sent, sender.objects)
    state = broadcast_optimizer_state(receiver, present, 0, torch.device("cpu"))
    assert receiver.objects == [None]  # a receiver offers nothing of its own to the broadcast
    assert torch.equal(moment, source.state_dict()["state"][0]["exp_avg"])  # filled in place
    assert state["state"][0]["exp_avg"].data_ptr() == moment.data_ptr()
