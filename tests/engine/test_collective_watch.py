"""The collective watch: a device collective that the host does not wait in (NCCL) is named when it stalls.

NCCL needs GPUs, one per rank; the watch needs only works that say whether they completed. The pure tests give it
works of their own and a clock; the gloo tests give it real works, with ``watch_after`` forcing a watch where gloo
would not need one, and check the report against a replica made late by a known time.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning_fabric.plugins.environments.lightning import find_free_network_port

from lightning_aesgd import ReplicaStalledError
from lightning_aesgd.engine import stalls
from lightning_aesgd.engine.collective_watch import CollectiveWatch
from lightning_aesgd.engine.comm import TorchCommunicator


class _Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watch(timeout: float = 10.0) -> tuple[CollectiveWatch, _Clock]:
    clock = _Clock()
    return CollectiveWatch(timeout, rank=1, world_size=3, clock=clock, poll=3600.0), clock


def test_a_collective_within_its_time_or_completed_is_not_reported():
    watch, clock = _watch()
    first, second = _Work(), _Work()
    watch.watch(first, "all-reduce #0", "k0", issued=clock.now)
    clock.now += 5.0
    watch.watch(second, "all-reduce #1", "k1", issued=clock.now)
    assert watch.check() is None
    first.done = True
    clock.now += 9.0  # the first would be late now, but it completed; the second is within its 10 s
    assert watch.check() is None
    second.done = True
    clock.now += 100.0
    assert watch.check() is None
    assert watch.stalled is None


def test_the_watch_thread_queries_the_works_from_the_device_of_the_thread_that_issued_them(monkeypatch):
    # A rank of a multi-GPU node issues on cuda:k; a new thread starts on cuda:0, where a query would open a context.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    devices: list[tuple[int, str]] = []
    thread = threading.current_thread
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: devices.append((index, thread().name)))
    watch = CollectiveWatch(10.0, rank=1, world_size=2, poll=0.01)
    work = _Work()
    watch.watch(work, "all-reduce #0", "k0", issued=time.monotonic())
    work.done = True
    deadline = time.monotonic() + 5.0
    while watch._thread is not None and time.monotonic() < deadline:  # it ends once nothing is in flight
        time.sleep(0.01)
    assert devices == [(3, "aesgd-collective-watch-1")]


def test_the_oldest_unfinished_collective_past_its_time_is_reported_once_with_what_the_replica_was_doing():
    watch, clock = _watch(timeout=10.0)
    watch.watch(_Work(), "all-reduce", "aesgd/roll_call/step_4", clock.now, where="the gradient sum of global step 4")
    clock.now += 12.5
    error = watch.check()
    assert isinstance(error, ReplicaStalledError)
    assert watch.stalled is error
    assert error.timed_out
    assert error.rank == 1
    assert error.waited == pytest.approx(12.5)
    message = str(error)
    assert "Replica 1's all-reduce during the gradient sum of global step 4 timed out after waiting 12.5 s" in message
    assert "the device collective had not completed after 10 s" in message
    assert "HINT:" in message
    # One report: later collectives wait behind the stalled one, and a later check finds nothing new.
    watch.watch(_Work(), "all-reduce #9", "k9", clock.now)
    clock.now += 100.0
    assert watch.check() is None
    assert watch.stalled is error


def test_a_where_named_near_the_collective_stays_when_the_error_is_raised_elsewhere():
    watch, clock = _watch(timeout=1.0)
    watch.watch(_Work(), "all-reduce", "k", clock.now, where="the gradient sum of global step 4")
    clock.now += 2.0
    error = watch.check()
    assert error is not None
    assert error.during("the merge after global step 5") is error


def test_the_watch_thread_reports_a_stall_and_idles_while_nothing_is_in_flight(caplog):
    watch = CollectiveWatch(0.2, rank=0, world_size=2, poll=0.02)
    finished = _Work()
    finished.done = True
    watch.watch(finished, "all-reduce #0", "k0", time.monotonic())
    deadline = time.monotonic() + 5.0
    while watch._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch._thread is None, "a watch with nothing in flight keeps no thread"
    with caplog.at_level("ERROR", logger="lightning_aesgd.engine.collective_watch"):
        watch.watch(_Work(), "all-reduce #1", "k1", time.monotonic())
        while watch.stalled is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert watch.stalled is not None, "the thread did not report a collective 0.2 s past due within 5 s"
    assert "all-reduce #1 timed out" in caplog.text


def test_finished_work_is_let_go_at_the_next_collective_and_nothing_is_kept_once_stopped():
    # A work holds its tensors (a step's gradient buckets): kept until a poll a second later, they outlived their step.
    watch, clock = _watch()
    for index in range(3):
        done = _Work()
        done.done = True
        watch.watch(done, f"all-reduce #{index}", f"k{index}", clock.now)
    watch.watch(_Work(), "all-reduce #3", "k3", clock.now)
    assert [flight.name for flight in watch._in_flight] == ["all-reduce #3"]
    watch.stop()
    watch.watch(_Work(), "all-reduce #4", "k4", clock.now)
    assert len(watch._in_flight) == 0


# --- two real gloo processes: a replica 4 s late to a watched collective ----------------------------------------

LATE_SECONDS = 4.0
WATCH_AFTER = 1.0


def _replica(rank: int, port: int, out: str, kind: str) -> None:
    """Replica ``rank`` of 2; replica 1 comes 4 s late to a collective that replica 0's watch reports after 1 s."""
    torch.set_num_threads(1)
    stalls.PATIENCE_MIN_SECONDS = 30.0  # ample: the roll call ends once replica 1 shows, however loaded the machine
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    results = Path(out)
    try:
        unwatched = TorchCommunicator(torch.device("cpu"))._watch is None  # gloo's host waits: it needs no watch
        comm = TorchCommunicator(torch.device("cpu"), watch=True, watch_after=WATCH_AFTER)
        dist.all_reduce(torch.ones(1))  # both connected and in step, unwatched
        if kind == "async":  # as gradient sums: each step's first bucket launched before its arrival
            _step(comm, 6)
            time.sleep(1.5)  # the heartbeats show step 6 entered
        if rank == 1:
            time.sleep(LATE_SECONDS)
        total = torch.ones(1)
        if kind == "async":
            total = _step(comm, 7)
        else:
            comm.all_reduce_sum_(total)
        record: dict = {"total": total.item(), "unwatched": unwatched}
        if rank == 0:  # the watch reported while the host waited; the next collective raises its report
            deadline = time.monotonic() + 30
            while comm._watch is not None and comm._watch.stalled is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the roll call ends about a beat after replica 1 arrived
            try:
                comm.broadcast_(torch.zeros(1))
                record["error"] = None
            except ReplicaStalledError as error:
                late = {str(r): s for r, s in error.late.items()}
                record.update(error=str(error), late=late, missing=error.missing, waited=error.waited)
        (results / f"{rank}.json").write_text(json.dumps(record))
        deadline = time.monotonic() + 60
        while len(list(results.glob("*.json"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # replica 0 hosts the store: it stays until both have written
    finally:
        dist.destroy_process_group()


def _step(comm: TorchCommunicator, step: int) -> torch.Tensor:
    """A gradient sum's collectives in step ``step``: a bucket filled during the backward, then the last at arrival."""
    key = stalls.roll_call_key(f"step_{step}")
    with stalls.doing(f"the gradient sum of global step {step}", step_key=key):
        first = torch.ones(1)
        launched = comm.all_reduce_sum_async(first)
        stalls.entering(key)
        comm.all_reduce_sum_async(torch.ones(1)).wait()
        launched.wait()
    return first


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_watched_collective_names_the_replica_that_came_late_and_the_next_collective_raises_it(tmp_path, kind):
    mp.start_processes(
        _replica, args=(find_free_network_port(), str(tmp_path), kind), nprocs=2, join=True, start_method="fork"
    )
    records = {int(path.stem): json.loads(path.read_text()) for path in tmp_path.glob("*.json")}
    assert records[0]["total"] == records[1]["total"] == 2.0  # the late collective itself completed
    assert records[0]["unwatched"]
    assert "error" not in records[1], "replica 1 met its collective at once: its watch has nothing to report"
    error = records[0]["error"]
    assert error is not None, "replica 0's next collective did not raise the watch's report"
    assert records[0]["missing"] == [], error
    assert list(records[0]["late"]) == ["1"], error
    assert LATE_SECONDS - 0.5 < records[0]["late"]["1"] < LATE_SECONDS + 3, error
    assert "replica(s) [1] arrived late" in error
    # Reported at the watch's time (its poll is a second), not when replica 1 came.
    assert WATCH_AFTER <= records[0]["waited"] < WATCH_AFTER + 2.5, error
    if kind == "async":
        assert "all-reduce during the gradient sum of global step 7 timed out" in error
    else:
        assert "Replica 0's all-reduce #0 timed out" in error


def test_the_watch_thread_never_raises_into_training_and_stops_watching_when_it_fails(monkeypatch, caplog):
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)

    def broken_clock() -> float:
        raise RuntimeError("the clock is gone")

    watch = CollectiveWatch(0.1, rank=0, world_size=2, poll=0.01, clock=broken_clock)
    with caplog.at_level("WARNING", logger="lightning_aesgd.engine.collective_watch"):
        watch.watch(_Work(), "all-reduce #0", "k0", 0.0)
        thread = watch._thread
        assert thread is not None
        thread.join(5.0)
    assert not thread.is_alive()
    assert raised == []
    assert "The collective watch of replica 0 stopped: the clock is gone" in caplog.text
    watch.watch(_Work(), "all-reduce #1", "k1", 0.0)  # a failed watch keeps nothing
    assert len(watch._in_flight) == 0
    assert watch.stalled is None


def test_a_work_that_cannot_say_whether_it_finished_is_let_go():
    class _Aborted:
        def is_completed(self) -> bool:
            raise RuntimeError("NCCL communicator was aborted")

    watch, clock = _watch(timeout=1.0)
    watch.watch(_Aborted(), "all-reduce #0", "k0", clock.now)
    clock.now += 5.0
    assert watch.check() is None
