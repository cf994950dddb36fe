"""A replica that stalls: the error names who had not arrived and the fix, and the stalled process ends with the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_aesgd import ReplicaStalledError
from lightning_aesgd.engine.comm import TorchCommunicator, is_peer_failure, roll_call

GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete"
GLOO_RESET = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:20125: Connection reset by peer."


def _error(answers, cause=GLOO_TIMEOUT, world_size=3) -> ReplicaStalledError:
    return ReplicaStalledError(
        collective="all-reduce #7", rank=0, world_size=world_size, waited=20.04, answers=answers, cause=cause
    )


def test_the_message_names_the_absent_replicas_how_long_the_others_waited_and_the_fix():
    error = _error({0: 20.04, 2: 19.5}).during("the merge after global step 12")
    message = str(error)
    assert error.missing == [1]
    assert error.timed_out
    assert "all-reduce #7 during the merge after global step 12 timed out after waiting 20.0 s" in message
    assert "replica(s) [1] had not arrived" in message
    assert "replica 0 20.0 s, replica 2 19.5 s" in message
    assert "Timed out waiting 20000ms" in message  # the backend's own words stay
    assert message.splitlines()[-1].startswith("HINT: look at what replica(s) [1] were doing")
    assert "`timeout=`" in message


def test_a_lost_connection_does_not_claim_the_others_are_late():
    error = _error({0: 0.01}, cause=GLOO_RESET, world_size=2)
    assert error.missing == [1]
    assert "replica(s) [1] did not answer the roll call (exited, crashed or stalled)" in str(error)


def test_without_a_store_the_message_says_what_is_known():
    error = _error(None, cause=GLOO_RESET)
    assert error.missing is None
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


def test_the_roll_call_finds_who_answered_within_its_time():
    store = dist.HashStore()
    store.set("call/2", "4.5")  # replica 2 failed in the same collective; replica 1 never arrived
    started = time.monotonic()
    answers = roll_call(store, "call", rank=0, world_size=3, waited=5.0, seconds=0.3)
    assert answers == {0: 5.0, 2: 4.5}
    assert 0.3 <= time.monotonic() - started < 5, "it waits for the absent, but no longer than asked"


def test_a_roll_call_without_a_store_knows_nothing():
    assert roll_call(None, "call", rank=0, world_size=2, waited=1.0) is None


class _BrokenStore:
    def set_timeout(self, timeout):
        raise RuntimeError("Connection refused")


def test_a_roll_call_whose_store_is_gone_knows_nothing():
    assert roll_call(_BrokenStore(), "call", rank=0, world_size=2, waited=1.0) is None


def test_the_communicator_translates_a_timeout_and_leaves_other_errors_alone():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the conftest destroys it
    comm = TorchCommunicator(torch.device("cpu"))
    comm.all_reduce_sum_(torch.ones(2))  # collective #0

    def timeout():
        raise RuntimeError(GLOO_TIMEOUT)

    with pytest.raises(ReplicaStalledError, match=r"all-reduce #1 timed out") as caught:
        comm._collective("all-reduce", timeout)
    assert caught.value.answers is not None
    assert isinstance(caught.value.__cause__, RuntimeError)

    def other():
        raise RuntimeError("Tensors must be CPU and dense")

    with pytest.raises(RuntimeError, match="dense") as caught_other:
        comm._collective("broadcast", other)
    assert not isinstance(caught_other.value, ReplicaStalledError)


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
STALL_TIMEOUT = 8  # seconds: above the second process's start-up (imports) on a loaded 2-core machine
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
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads process states from /proc")
@pytest.mark.parametrize(
    ("sync", "where"), [("models", "the merge after global step 3"), ("gradients", "the gradient sum of global step 3")]
)
def test_a_stalled_replica_fails_the_job_with_its_rank_and_does_not_outlive_it(tmp_path, sync, where):
    script = tmp_path / "stall.py"
    script.write_text(STALL_SCRIPT.replace("TIMEOUT", str(STALL_TIMEOUT)).replace("SYNC", sync))
    started = time.monotonic()
    code, output = _run(script, tmp_path, timeout=100)
    elapsed = time.monotonic() - started
    assert code != 0, output[-4000:]
    assert elapsed < 60, f"the job must fail near the timeout ({STALL_TIMEOUT} s), not when the replica wakes"
    assert "ReplicaStalledError" in output, output[-4000:]
    assert f"during {where} timed out" in output
    assert "replica(s) [1] had not arrived" in output
    assert "HINT:" in output
    assert "`timeout=`" in output
    pid = int((tmp_path / "stalled_pid").read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the stalled replica outlived the job")
