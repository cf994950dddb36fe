"""A real torchrun with a rank that dies: the others fail fast, torchrun restarts the group, fit resumes exactly.

The process test launches ``python -m torch.distributed.run`` (one agent, or two for the two-node form) on 2 CPU
processes (gloo) with ``--max-restarts=1``. Rank 1 exits abruptly at global step ``DIE_AT`` of the first attempt
(a marker file keeps it alive in the second); rank 0 must fail at the next merge instead of hanging, torchrun
starts both again, and ``fit(ckpt_path="last")`` continues from the last checkpoint. Every rank writes the indices
its ``training_step`` sees, per attempt. The other tests check the per-attempt store of
:mod:`lightning_aesgd.torchrun_store` without a launch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_aesgd.torchrun_store import attempt_prefix, attempt_store, shared_store_warning

SAMPLES = 64
STEPS_PER_EPOCH = SAMPLES // 8  # 2 ranks × batch 4
CHECKPOINT_EVERY = 5
DIE_AT = 12  # in the second epoch, after the checkpoint of step 10
RESUMED_AT = DIE_AT // CHECKPOINT_EVERY * CHECKPOINT_EVERY
EPOCHS = 2
# Launcher variables a surrounding run may have exported; torchrun must start as a fresh program.
_LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

AGENT_STORE = {
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RESTART_COUNT": "1",
    "TORCHELASTIC_MAX_RESTARTS": "3",
    "MASTER_ADDR": "localhost",
    "MASTER_PORT": "29500",
    "GROUP_WORLD_SIZE": "1",
}


def test_each_single_node_attempt_gets_keys_of_its_own():
    assert attempt_prefix(AGENT_STORE) == "aesgd/attempt_1"
    assert attempt_prefix(AGENT_STORE | {"TORCHELASTIC_RESTART_COUNT": "2"}) == "aesgd/attempt_2"
    assert shared_store_warning(AGENT_STORE) is None


@pytest.mark.timeout(60)
def test_the_attempt_store_writes_under_the_attempt_prefix_in_the_agent_store():
    from datetime import timedelta

    import torch.distributed as dist

    agent = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # as torchrun's agent hosts it
    agent.set_timeout(timedelta(seconds=5))  # a missing key fails the test instead of blocking it
    env = AGENT_STORE | {"MASTER_PORT": str(agent.port)}
    store = attempt_store(timedelta(seconds=5), env)
    store.set("default_pg/0/key", "fresh")
    assert agent.check(["aesgd/attempt_1/default_pg/0/key"])
    assert agent.get("aesgd/attempt_1/default_pg/0/key") == b"fresh"
    assert not agent.check(["default_pg/0/key"]), "nothing outside the attempt's prefix"


@pytest.mark.parametrize(
    "change",
    [
        {"TORCHELASTIC_USE_AGENT_STORE": "False"},  # each attempt's rank 0 hosts a fresh store
        {"GROUP_WORLD_SIZE": "2"},  # restart counts differ between nodes: no prefix is safe
    ],
)
def test_no_prefix_where_the_store_is_fresh_or_attempts_cannot_be_told_apart(change):
    assert attempt_prefix(AGENT_STORE | change) is None
    assert attempt_store(None, AGENT_STORE | change) is None


def test_outside_torchrun_nothing_changes():
    assert attempt_prefix({"MASTER_PORT": "29500"}) is None
    assert shared_store_warning({"MASTER_PORT": "29500"}) is None


def test_several_nodes_sharing_the_agent_store_are_told_the_fix():
    nodes = AGENT_STORE | {"GROUP_WORLD_SIZE": "2"}
    warning = shared_store_warning(nodes)
    assert warning is not None
    assert "HINT: launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning
    assert shared_store_warning(nodes | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) is None
    assert shared_store_warning(nodes | {"TORCHELASTIC_MAX_RESTARTS": "0"}) is None


SCRIPT = textwrap.dedent(
    f"""
    import json, os, sys
    from datetime import timedelta
    from pathlib import Path

    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from lightning_aesgd import AdaptiveElasticStrategy

    OUT = Path(sys.argv[1])
    # Not TORCHELASTIC_RESTART_COUNT: on several nodes each agent counts its own restarts.
    ATTEMPT = "1" if (OUT / "died").exists() else "0"


    class Indexed(Dataset):
        def __init__(self):
            generator = torch.Generator().manual_seed(0)
            self.x = torch.randn({SAMPLES}, 4, generator=generator)
            self.y = self.x.sum(1, keepdim=True)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, index):
            return self.x[index], self.y[index], index


    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            record = {{"epoch": self.current_epoch, "step": self.global_step, "indices": index.tolist()}}
            with open(OUT / f"seen_rank{{self.global_rank}}_attempt{{ATTEMPT}}.jsonl", "a") as file:
                file.write(json.dumps(record) + "\\n")
            marker = OUT / "died"
            if self.global_rank == 1 and self.global_step == {DIE_AT} and not marker.exists():
                marker.touch()
                os._exit(3)  # no clean-up at all, as a crash or an OOM kill
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(Indexed(), batch_size=4, shuffle=True)


    pl.seed_everything(1)
    checkpoint = ModelCheckpoint(
        dirpath=OUT / "checkpoints", save_last=True, save_top_k=0, every_n_train_steps={CHECKPOINT_EVERY}
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
        max_epochs={EPOCHS},
        strategy=AdaptiveElasticStrategy(planner="static", timeout=timedelta(seconds=30)),
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), ckpt_path="last")
    (OUT / f"finished_rank{{trainer.global_rank}}_attempt{{ATTEMPT}}").write_text(str(trainer.global_step))
    """
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return int(probe.getsockname()[1])


def _agents(form: str) -> list[tuple[list[str], dict[str, str]]]:
    """The torchrun arguments and extra environment of each agent (each a node) of a launch form."""
    if form == "standalone":
        return [(["--nproc-per-node=2", "--standalone"], {})]
    if form == "static":  # torchrun's default rendezvous
        return [(["--nproc-per-node=2", f"--master-port={_free_port()}"], {})]
    assert form == "two-nodes"
    # Two agents on this machine, one process each. Each agent counts its own restarts, so only a fresh store
    # per rendezvous round keeps attempts apart (see lightning_aesgd.torchrun_store).
    endpoint = f"--rdzv-endpoint=localhost:{_free_port()}"
    arguments = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", endpoint, "--rdzv-id=two-nodes"]
    return [(arguments, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})] * 2


def _start_agent(arguments: list[str], cwd: Path, environment: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--max-restarts=1", *arguments]
    return subprocess.Popen(
        command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _torchrun(form: str, out: Path, timeout: float) -> tuple[int, str]:
    """Run the script under torchrun's agents, each in a session of its own, all killed when over ``timeout``.

    Returns the largest exit code and every agent's output.
    """
    script = out / "train.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    agents = _agents(form)
    processes = [_start_agent([*arguments, str(script), str(out)], out, base | extra) for arguments, extra in agents]
    deadline = time.monotonic() + timeout
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for each in processes:
                os.killpg(each.pid, signal.SIGKILL)
            output = "\n".join(each.communicate()[0] for each in processes)
            pytest.fail(f"torchrun ({form}) ran over {timeout} s; its output ends with:\n{output[-4000:]}")
    return max(process.returncode for process in processes), "\n".join(outputs)


def _seen(out: Path, rank: int, attempt: int) -> list[dict]:
    path = out / f"seen_rank{rank}_attempt{attempt}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["standalone", "static", "two-nodes"])
def test_a_rank_that_dies_is_restarted_by_torchrun_and_the_epoch_resumes_exactly(tmp_path, form):
    code, output = _torchrun(form, tmp_path, timeout=100)
    tail = output[-4000:]
    assert (tmp_path / "died").exists(), f"rank 1 never reached step {DIE_AT}:\n{tail}"
    assert code == 0, f"torchrun exited with {code}:\n{tail}"
    for rank in range(2):
        finished = tmp_path / f"finished_rank{rank}_attempt1"
        assert finished.exists(), f"rank {rank} did not finish the restarted attempt:\n{tail}"
        assert int(finished.read_text()) == EPOCHS * STEPS_PER_EPOCH
    assert not list(tmp_path.glob("finished_*_attempt0")), "the first attempt must have failed"

    interrupted = RESUMED_AT // STEPS_PER_EPOCH
    first = [record for rank in range(2) for record in _seen(tmp_path, rank, 0)]
    second = [record for rank in range(2) for record in _seen(tmp_path, rank, 1)]
    assert min(record["step"] for record in second) == RESUMED_AT, "the restart resumes from the last checkpoint"
    done = [i for r in first if r["epoch"] == interrupted and r["step"] < RESUMED_AT for i in r["indices"]]
    resumed = [i for r in second if r["epoch"] == interrupted for i in r["indices"]]
    assert done, "the checkpoint must fall inside the interrupted epoch"
    assert resumed, "the restarted attempt must finish the interrupted epoch"
    assert sorted(done + resumed) == list(range(SAMPLES)), "every index of the interrupted epoch exactly once"
