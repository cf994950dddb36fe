"""Stalled replicas: the error tells the late from the absent and names the fix; a stalled process ends with the job."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_aesgd import ReplicaStalledError
from lightning_aesgd.engine import stalls
from lightning_aesgd.engine.comm import TorchCommunicator
from lightning_aesgd.engine.stalls import (
    GONE,
    Heartbeat,
    RollCall,
    alive_key,
    is_peer_failure,
    keep_alive,
    roll_call,
    stop_heartbeat,
)

GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete"
GLOO_RESET = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:20125: Connection reset by peer."


def _error(roll, cause=GLOO_TIMEOUT, world_size=3) -> ReplicaStalledError:
    return ReplicaStalledError(
        collective="all-reduce #7", rank=0, world_size=world_size, waited=20.04, roll=roll, cause=cause
    )


# --- the message ----------------------------------------------------------------------------------------------


def test_the_message_names_the_absent_replicas_how_long_the_others_waited_and_the_fix():
    roll = RollCall(waited={0: 20.04, 2: 19.5}, arrived={0: 100.0, 2: 100.5}, absent=(1,))
    error = _error(roll).during("the merge after global step 12")
    message = str(error)
    assert error.missing == [1]
    assert error.late == {}
    assert error.timed_out
    assert "all-reduce #7 during the merge after global step 12 timed out after waiting 20.0 s" in message
    assert "replica(s) [1] had not arrived and show no sign of life (exited, crashed, or hung" in message
    assert "replica 0 20.0 s, replica 2 19.5 s" in message
    assert "Timed out waiting 20000ms" in message  # the backend's own words stay
    assert message.splitlines()[-1].startswith("HINT: look at what replica(s) [1] were doing")
    assert "`timeout=`" in message


def test_the_message_names_a_late_replica_apart_with_how_late_it_was():
    # Replicas 0-2 arrived together and gave up after 1 s; replica 3 came 3 s after the first.
    roll = RollCall(waited={0: 1.0, 1: 1.0, 2: 1.0}, arrived={0: 100.0, 1: 100.1, 2: 100.05, 3: 103.0})
    error = _error(roll, world_size=4)
    message = str(error)
    assert error.late == {3: 3.0}
    assert error.missing == []
    assert "replica(s) [3] arrived late (replica 3 3.0 s after the first)" in message
    assert "had not arrived" not in message
    assert message.splitlines()[-1].startswith("HINT: look at what replica(s) [3] were doing")
    assert "`timeout=` well above the 3.0 s seen here" in message


def test_the_message_tells_a_live_replica_that_never_came_from_one_that_is_gone():
    roll = RollCall(waited={0: 20.0}, arrived={0: 100.0, 3: 126.0}, absent=(2,), stalled=(1,))
    message = str(_error(roll, world_size=4))
    assert "replica(s) [3] arrived late (replica 3 26.0 s after the first)" in message
    assert "replica(s) [1] had not arrived although alive (heartbeat beating: stalled elsewhere)" in message
    assert "replica(s) [2] had not arrived and show no sign of life" in message
    assert "HINT: look at what replica(s) [1, 2] were doing" in message


def test_a_lost_connection_does_not_claim_the_others_are_late():
    error = _error(RollCall(waited={0: 0.01}, arrived={0: 100.0}, absent=(1,)), cause=GLOO_RESET, world_size=2)
    assert error.missing == [1]
    assert "lost a peer's connection" in str(error)
    assert "replica(s) [1] did not answer the roll call and show no sign of life" in str(error)
    assert "had not arrived" not in str(error)


def test_when_all_arrived_in_time_the_message_blames_the_connection():
    error = _error(RollCall(waited={0: 20.0, 1: 0.5}, arrived={0: 100.0, 1: 100.2}), world_size=2)
    assert error.missing == []
    assert "every replica answered the roll call afterwards, none late" in str(error)
    assert "HINT: look at what the replicas that waited least were doing" in str(error)


def test_without_a_store_the_message_says_what_is_known():
    error = _error(None, cause=GLOO_RESET)
    assert error.missing is None
    assert error.answers is None
    assert error.late == {}
    assert not error.timed_out
    assert "lost a peer's connection" in str(error)
    assert "which replicas had not arrived is unknown" in str(error)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (GLOO_TIMEOUT, True),
        (GLOO_RESET, True),
        ("Connection closed by peer [127.0.0.1]:4", True),
        ("bad dtype", False),
        ("peer access is not supported between these two devices", False),
    ],
)
def test_peer_failures_are_told_from_other_errors(message, expected):
    assert is_peer_failure(RuntimeError(message)) is expected


# --- the roll call's decisions, on one process's store ----------------------------------------------------------


@pytest.fixture
def beating():
    """Start replica ``rank``'s heartbeat, beating fast (20 a second) so that the tests' waits stay short.

    Each is stopped after its test: a thread left beating would outlive the test in this process, and be beating
    whenever a later test forks its replicas from it.
    """
    started: list[Heartbeat] = []

    def start(store, rank: int) -> Heartbeat:
        started.append(Heartbeat(store, rank, interval=0.05))
        return started[-1]

    yield start
    for heartbeat in started:
        heartbeat.stop()


def test_a_replica_that_answered_is_present_with_its_wait_and_arrival(beating):
    store = dist.HashStore()
    now = time.time()
    store.set("call/2", f"4.500 {now - 5.5:.3f}")  # replica 2 failed in the same collective, arriving first
    beating(store, 1).enter("call")  # replica 1 is inside it still
    roll = roll_call(store, "call", rank=0, world_size=3, waited=5.0, stale_after=0.5, patience=5.0)
    assert roll is not None
    assert roll.waited == {0: 5.0, 2: 4.5}
    assert set(roll.arrived) == {0, 1, 2}
    assert roll.late == {1: pytest.approx(5.5, abs=0.1)}  # it entered after replica 2 had given up
    assert roll.missing == []


def test_a_live_replica_is_waited_for_and_reported_late_by_how_late_it_arrived(beating):
    store = dist.HashStore()
    late = beating(store, 1)
    threading.Timer(0.6, late.enter, args=("call",)).start()  # it arrives 0.6 s after the roll call begins
    started = time.monotonic()
    roll = roll_call(store, "call", rank=0, world_size=2, waited=0.2, stale_after=0.3, patience=10.0)
    elapsed = time.monotonic() - started
    assert roll is not None
    assert roll.absent == ()
    assert roll.stalled == ()
    # Arrived at +0.6 s, the first (this replica) at -0.2 s: 0.8 s after the first, and after it gave up.
    assert roll.late == {1: pytest.approx(0.8, abs=0.15)}
    assert 0.6 <= elapsed < 2, "it waits past the stale time for a live replica, and no longer than it takes"


def test_a_replica_whose_heartbeat_stopped_or_never_began_is_absent_after_a_few_beats_not_the_whole_patience():
    store = dist.HashStore()
    store.set(alive_key(1), "1000.000")  # replica 1 beat once, then stopped; replica 2 never beat
    started = time.monotonic()
    roll = roll_call(store, "call", rank=0, world_size=3, waited=1.0, stale_after=0.3, patience=30.0)
    elapsed = time.monotonic() - started
    assert roll is not None
    assert roll.absent == (1, 2)
    assert roll.stalled == ()
    assert 0.3 <= elapsed < 2


def test_a_replica_that_said_it_is_gone_is_absent_at_once():
    store = dist.HashStore()
    store.set(alive_key(1), GONE)
    started = time.monotonic()
    roll = roll_call(store, "call", rank=0, world_size=2, waited=1.0, stale_after=5.0, patience=30.0)
    assert roll is not None
    assert roll.absent == (1,)
    assert time.monotonic() - started < 1


def test_a_live_replica_that_never_arrives_is_stalled_once_the_patience_runs_out(beating):
    store = dist.HashStore()
    beating(store, 1).enter("an earlier collective")
    started = time.monotonic()
    roll = roll_call(store, "call", rank=0, world_size=2, waited=1.0, stale_after=0.2, patience=0.6)
    elapsed = time.monotonic() - started
    assert roll is not None
    assert roll.stalled == (1,)
    assert roll.absent == ()
    assert 0.6 <= elapsed < 2


def test_the_roll_call_reads_the_heartbeats_of_a_groups_members_by_their_world_rank(beating):
    store = dist.HashStore()
    beating(store, 7).enter("call")  # the group's rank 1 is the world's rank 7
    roll = roll_call(store, "call", rank=0, world_size=2, waited=1.0, stale_after=0.3, patience=5.0, members=[5, 7])
    assert roll is not None
    assert set(roll.arrived) == {0, 1}


def test_an_answer_without_an_arrival_counts_as_present():
    store = dist.HashStore()
    store.set("call/1", "4.5")  # as a replica of an earlier version answers
    roll = roll_call(store, "call", rank=0, world_size=2, waited=5.0, stale_after=0.3, patience=5.0)
    assert roll is not None
    assert roll.waited == {0: 5.0, 1: 4.5}
    assert roll.missing == []
    assert roll.late == {}


def test_a_roll_call_without_a_store_knows_nothing():
    assert roll_call(None, "call", rank=0, world_size=2, waited=1.0) is None


class _BrokenStore:
    def clone(self):
        raise RuntimeError("Connection refused")

    def set_timeout(self, timeout):
        raise RuntimeError("Connection refused")

    def set(self, key, value):
        raise RuntimeError("Connection refused")


def test_a_roll_call_whose_store_is_gone_knows_nothing():
    assert roll_call(_BrokenStore(), "call", rank=0, world_size=2, waited=1.0) is None


# --- the heartbeat ----------------------------------------------------------------------------------------------


def test_the_heartbeat_carries_the_collective_entered_last_and_says_gone_when_stopped(beating):
    store = dist.HashStore()
    heartbeat = beating(store, 3)
    heartbeat.enter("aesgd/roll_call/4")
    entered = time.time()
    deadline = time.monotonic() + 2
    while "aesgd/roll_call/4" not in store.get(alive_key(3)).decode() and time.monotonic() < deadline:
        time.sleep(0.01)
    beat, since, key = store.get(alive_key(3)).decode().split()
    assert key == "aesgd/roll_call/4"
    assert float(since) == pytest.approx(entered, abs=0.1)
    assert float(beat) >= float(since) - 0.01
    heartbeat.stop(gone=True)
    assert store.get(alive_key(3)).decode() == GONE


def test_the_heartbeat_starts_once_a_process_and_never_raises_into_training(monkeypatch):
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda hook_args: raised.append(hook_args))
    store = dist.HashStore()
    first = keep_alive(store, 0)
    assert first is not None
    assert first._thread.daemon, "it never keeps the interpreter alive"
    assert keep_alive(store, 0) is first
    assert keep_alive(None, 0) is None
    broken = keep_alive(_BrokenStore(), 0)  # a later group's store, gone: the thread ends quietly
    assert broken is not None
    assert broken is not first
    broken._thread.join(2)
    assert not broken._thread.is_alive()
    assert raised == []


def test_the_communicator_translates_a_timeout_and_leaves_other_errors_alone():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # the conftest destroys it
    comm = TorchCommunicator(torch.device("cpu"))
    comm.all_reduce_sum_(torch.ones(2))  # collective #0

    def timeout():
        raise RuntimeError(GLOO_TIMEOUT)

    with pytest.raises(ReplicaStalledError, match=r"all-reduce #1 timed out") as caught:
        comm._collective("all-reduce", timeout)
    assert caught.value.answers is not None
    assert caught.value.missing == []
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert stalls._heartbeat is not None
    assert stalls._heartbeat._position is not None
    assert stalls._heartbeat._position[0] == stalls.roll_call_key("1"), "the heartbeat shows the collective entered"

    def other():
        raise RuntimeError("Tensors must be CPU and dense")

    with pytest.raises(RuntimeError, match="dense") as caught_other:
        comm._collective("broadcast", other)
    assert not isinstance(caught_other.value, ReplicaStalledError)


def test_a_second_fit_in_one_process_group_holds_its_roll_calls_apart():
    # Each fit makes a new communicator, whose collectives count from 0 again. Under the first fit's keys, a roll
    # call of the second would read the first fit's answers as arrivals (and a heartbeat position as being inside).
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # the conftest destroys it

    def timeout():
        raise RuntimeError(GLOO_TIMEOUT)

    with pytest.raises(ReplicaStalledError):
        TorchCommunicator(torch.device("cpu"))._collective("all-reduce", timeout)  # the first fit's #0 answers
    first = stalls._heartbeat._position[0]
    group_store = stalls.default_store()  # the group's view of ``store`` (torch prefixes its keys)
    assert group_store.check([f"{first}/0"]), "the first fit's roll call answered under its key"

    TorchCommunicator(torch.device("cpu")).all_reduce_sum_(torch.ones(1))  # the second fit's #0
    second = stalls._heartbeat._position[0]
    assert second != first
    assert not group_store.check([f"{second}/0"]), "no answer waits under the second fit's key"


# --- four real gloo processes: a late replica and an absent one ---------------------------------------------------

WORLD = 4
COLLECTIVE_TIMEOUT = 1.0  # seconds: the failing all-reduce's, far below the late replica's 3 s
LATE_SECONDS = 3.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _replica(rank: int, port: int, out: str, scenario: str) -> None:
    """Replica ``rank`` of 4: after one collective in step, replica 3 comes 3 s late (``"late"``) or never, its
    heartbeat stopped as a hung interpreter's (``"absent"``); each writes what its error said to ``out``."""
    torch.set_num_threads(1)  # a forked worker can hang in its first OpenMP kernel otherwise
    # Ample patience, so that a loaded machine cannot make the late replica stalled; it ends once replica 3 shows.
    stalls.PATIENCE_MIN_SECONDS = 30.0
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    results = Path(out)
    try:
        comm = TorchCommunicator(torch.device("cpu"))
        comm.all_reduce_sum_(torch.ones(1))  # everyone is connected and in step
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=COLLECTIVE_TIMEOUT))
        if rank == 3 and scenario == "absent":
            stop_heartbeat()  # as a replica hung holding the interpreter: no more beats, and no collective
            _await_results(results, count=WORLD - 1)
            return
        if rank == 3:
            time.sleep(LATE_SECONDS)
        started = time.monotonic()
        try:
            comm.all_reduce_sum_(torch.ones(1))
            record = {"error": None}
        except ReplicaStalledError as error:
            record = {
                "error": str(error),
                "late": {str(r): s for r, s in error.late.items()},
                "missing": error.missing,
                "absent": None if error.roll is None else list(error.roll.absent),
                "roll_call_seconds": time.monotonic() - started - error.waited,
            }
        (results / f"{rank}.json").write_text(json.dumps(record))
        if rank == 0:  # the store's host stays until every roll call is over
            _await_results(results, count=WORLD if scenario == "late" else WORLD - 1)
    finally:
        dist.destroy_process_group()


def _await_results(results: Path, count: int, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while len(list(results.glob("*.json"))) < count and time.monotonic() < deadline:
        time.sleep(0.1)


def _run_replicas(tmp_path: Path, scenario: str) -> dict[int, dict]:
    port = _free_port()
    mp.start_processes(_replica, args=(port, str(tmp_path), scenario), nprocs=WORLD, join=True, start_method="fork")
    return {int(path.stem): json.loads(path.read_text()) for path in tmp_path.glob("*.json")}


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_four_replicas_name_one_that_came_3_s_late_as_late_not_absent(tmp_path):
    records = _run_replicas(tmp_path, "late")
    assert set(records) == {0, 1, 2, 3}
    for rank in (0, 1, 2):
        record = records[rank]
        assert record["error"] is not None, f"replica {rank}'s all-reduce did not fail"
        assert record["missing"] == [], record["error"]
        assert list(record["late"]) == ["3"], record["error"]
        assert LATE_SECONDS - 0.5 < record["late"]["3"] < LATE_SECONDS + 3, record["error"]
        assert "replica(s) [3] arrived late (replica 3 " in record["error"]
        assert "had not arrived" not in record["error"]
        assert "HINT:" in record["error"]
    # The late replica's own error says that it is the late one, having read the others' answers.
    assert records[3]["error"] is not None
    assert "3" in records[3]["late"], records[3]["error"]


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_four_replicas_name_one_without_a_heartbeat_as_absent_after_a_few_beats(tmp_path):
    records = _run_replicas(tmp_path, "absent")
    assert set(records) == {0, 1, 2}
    for record in records.values():
        assert record["error"] is not None
        assert record["absent"] == [3], record["error"]
        assert record["late"] == {}, record["error"]
        # A replica whose own collective timed out says "had not arrived"; one whose connection the timed-out
        # replica reset first says "did not answer the roll call": which comes first depends on the machine's load.
        assert re.search(
            r"replica\(s\) \[3\] (had not arrived|did not answer the roll call) and show no sign of life",
            record["error"],
        )
        # Decided by its stale heartbeat (3 s), not by the patience (30 s here).
        assert record["roll_call_seconds"] < 15, record["error"]


# --- a real training job -------------------------------------------------------------------------------------------

STALL_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    from pathlib import Path

    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_aesgd import AdaptiveElasticStrategy

    OUT = Path(sys.argv[1])


    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if self.global_rank == 1 and self.global_step == 3:
                (OUT / "stalled_pid").write_text(str(os.getpid()))
                time.sleep(300)  # far beyond the timeout, and the test's
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=4)


    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=8,
        strategy=AdaptiveElasticStrategy(sync="SYNC", timeout=timedelta(seconds=TIMEOUT)),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model())
    """
)
# Seconds. Lightning's rendezvous waits this long for the second process too, whose start-up (imports) on a loaded
# machine can take most of 8 s; with a CUDA build of torch and 12 other test workers it took over 16 s (the suite on
# a GPU machine). The job then fails near 2 x 30 s after the stall (the timeout, then as long for the roll call).
STALL_TIMEOUT = 30
_LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _gone(pid: int) -> bool:
    """Whether the process has ended (a zombie awaiting its reaper counts as ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def _run(script: Path, out: Path, timeout: float) -> tuple[int, str]:
    environment = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    with subprocess.Popen(
        [sys.executable, str(script), str(out)], cwd=out, env=environment, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    ) as process:  # fmt: skip
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"the stalled job ran over {timeout} s; its output ends with:\n{output[-4000:]}")
    return process.returncode, output


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads process states from /proc")
@pytest.mark.parametrize(
    ("sync", "where"), [("models", "the merge after global step 3"), ("gradients", "the gradient sum of global step 3")]
)
def test_a_stalled_replica_fails_the_job_with_its_rank_and_does_not_outlive_it(tmp_path, sync, where):
    script = tmp_path / "stall.py"
    script.write_text(STALL_SCRIPT.replace("TIMEOUT", str(STALL_TIMEOUT)).replace("SYNC", sync))
    code, output = _run(script, tmp_path, timeout=200)
    ended = time.time()
    assert code != 0, output[-4000:]
    assert (tmp_path / "stalled_pid").exists(), f"the job failed before replica 1 stalled:\n{output[-4000:]}"
    stalled_for = ended - (tmp_path / "stalled_pid").stat().st_mtime  # from the stall, whatever start-up took
    # About 65 s (the timeout, the roll call's patience as long, the teardown); the replica wakes only after 300 s.
    assert stalled_for < 150, f"the job must fail near the timeout ({STALL_TIMEOUT} s), not when the replica wakes"
    assert "ReplicaStalledError" in output, output[-4000:]
    assert re.search(f"during {re.escape(where)} (timed out|lost a peer's connection)", output), output[-4000:]
    assert "replica(s) [1] had not arrived although alive" in output  # asleep, its heartbeat beating
    assert "HINT:" in output
    assert "`timeout=`" in output
    pid = int((tmp_path / "stalled_pid").read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the stalled replica outlived the job")


# --- audit additions: boundaries and the small parts around the roll call ---------------------------------------


def test_a_replica_arriving_the_moment_another_gave_up_is_not_late():
    assert RollCall(waited={0: 1.0}, arrived={0: 100.0, 1: 101.0}).late == {}


def test_lateness_is_rounded_to_the_millisecond():
    assert RollCall(waited={0: 1.0}, arrived={0: 100.0, 1: 103.0004}).late == {1: 3.0}


def test_without_an_answer_that_says_when_it_gave_up_no_replica_is_late():
    assert RollCall(waited={}, arrived={0: 100.0, 1: 130.0}).late == {}
    assert RollCall(waited={1: 4.5}, arrived={0: 100.0}).late == {}  # replica 1's answer carried no arrival


def test_a_replica_found_absent_stays_absent_though_it_answers_while_the_roll_call_waits_for_another(beating):
    store = dist.HashStore()
    store.set(alive_key(1), GONE)  # replica 1 said it is gone: absent at once
    beating(store, 2).enter("an earlier collective")  # replica 2 lives but never arrives
    threading.Timer(0.2, store.set, args=("call/1", "0.300 100.000")).start()
    roll = roll_call(store, "call", rank=0, world_size=3, waited=1.0, stale_after=5.0, patience=0.6)
    assert roll is not None
    assert roll.absent == (1,)
    assert roll.stalled == (2,)
    assert roll.waited == {0: 1.0}


def test_the_error_keeps_the_first_line_of_the_backends_words_cut_to_300_characters():
    error = _error(None, cause="x" * 400 + "\nthe second line")
    assert f"Backend: {'x' * 300}\n" in str(error)
    assert "the second line" not in str(error)


def test_an_error_without_the_backends_words_still_says_what_is_known():
    error = _error(RollCall(waited={0: 1.0}, arrived={0: 100.0}, absent=(1,)), cause="")
    assert not error.timed_out
    assert "Backend: \nHINT: look at what replica(s) [1] were doing" in str(error)


def test_a_where_said_first_stays_when_a_later_collective_names_another():
    error = _error(None).during("the gradient sum of global step 3").during("the merge after global step 3")
    assert error.where == "the gradient sum of global step 3"
    assert "during the gradient sum of global step 3 " in str(error)
    assert "the merge" not in str(error)


def test_the_stalled_error_measures_the_wait_on_its_clock_and_knows_nothing_without_a_store():
    error = stalls.stalled_error(
        RuntimeError(GLOO_RESET), "broadcast #2", "call", rank=1, world_size=2, started=10.0, clock=lambda: 12.5
    )
    assert error.waited == 2.5
    assert error.roll is None
    assert (error.collective, error.rank, error.world_size) == ("broadcast #2", 1, 2)
    assert "Replica 1's broadcast #2 lost a peer's connection after waiting 2.5 s" in str(error)


def test_a_heartbeat_stopped_without_gone_leaves_its_last_stamp_for_the_roll_call_to_find_stale(beating):
    store = dist.HashStore()
    heartbeat = beating(store, 4)
    deadline = time.monotonic() + 2
    while not store.check([alive_key(4)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    heartbeat.stop()
    assert not heartbeat._thread.is_alive()
    assert store.get(alive_key(4)).decode() != GONE


class _UnclonableStore:
    """A store that cannot give a connection of its own: the heartbeat writes to it as it is."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value


def test_a_heartbeat_beats_into_a_store_that_cannot_clone_itself(beating):
    store = _UnclonableStore()
    heartbeat = beating(store, 2)
    deadline = time.monotonic() + 2
    while alive_key(2) not in store.values and time.monotonic() < deadline:
        time.sleep(0.01)
    heartbeat.stop(gone=True)
    assert store.values[alive_key(2)] == GONE


def test_the_exit_hook_is_registered_once_and_says_gone_only_for_this_processs_heartbeat(monkeypatch):
    registered = []
    monkeypatch.setattr(stalls, "_exit_registered", False)
    monkeypatch.setattr(stalls.atexit, "register", registered.append)
    store = dist.HashStore()
    keep_alive(store, 0)
    try:
        keep_alive(store, 1)
        assert registered == [stalls._say_gone]
        stalls._heartbeat.pid = -1  # as a forked child sees its parent's heartbeat
        stalls._say_gone()
        assert not stalls._heartbeat._stopping.is_set(), "a forked child leaves its parent's heartbeat beating"
        assert store.get(alive_key(1)).decode() != GONE
        stalls._heartbeat.pid = os.getpid()
        stalls._say_gone()
        assert store.get(alive_key(1)).decode() == GONE
    finally:
        stop_heartbeat()  # no heartbeat left for the next test in this process


def test_without_a_heartbeat_entering_stopping_and_exiting_do_nothing():
    stop_heartbeat()
    assert stalls._heartbeat is None
    stalls.entering("call")
    stop_heartbeat(gone=True)
    stalls._say_gone()
    assert stalls._heartbeat is None


def test_what_the_replica_is_doing_is_known_within_and_restored_after():
    assert stalls.now_doing() is None
    with stalls.doing("the merge after global step 3"):
        with stalls.doing("the gradient sum of global step 4", step_key="aesgd/roll_call/0/step_4"):
            assert stalls.now_doing() == stalls.Doing("the gradient sum of global step 4", "aesgd/roll_call/0/step_4")
        assert stalls.now_doing() == stalls.Doing("the merge after global step 3")
    assert stalls.now_doing() is None
