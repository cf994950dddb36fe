"""Two "nodes" of two processes each under torchrun, on one machine: multi-node runs launch as DDP's do.

The test starts two torchrun agents (``--nnodes=2 --nproc-per-node=2``, ``--node-rank`` 0 and 1, torchrun's
static rendezvous on ``127.0.0.1`` and a free port), each running a script that fits a tiny regression with
``Trainer(num_nodes=2, devices=2, strategy=AdaptiveElasticStrategy(...))`` while its replicas emulate devices of
factors 1, 1, 2 and 4 (slowness in ``training_step``, per sample). Every rank writes a JSON file: its global,
local and node rank, the world size Lightning saw, its plan book, its merge history and merge count, and the
indices its ``training_step`` consumed per epoch. The test then checks what a multi-node run must hold across all
four: distinct ranks laid out by node, one plan book and one merge history on every rank, plans that sum to the
step batch and follow the speeds, and every sample of every epoch used exactly once across the four replicas.
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

SAMPLES = 192
BATCH = 8  # the loader's batch: a step takes 8 × 4 replicas = 32 indices
STEP_BATCH = BATCH * 4
EPOCHS = 3
STEPS_PER_EPOCH = SAMPLES // STEP_BATCH
FACTORS = (1, 1, 2, 4)  # rank order: node 0 holds the two fast replicas, node 1 the slow ones
# Launcher variables a surrounding run may have exported; torchrun must start as a fresh program.
_LAUNCH_VARIABLES = (
    "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_NTASKS",
)  # fmt: skip

SCRIPT = textwrap.dedent(
    f"""
    import json, os, sys
    from datetime import timedelta
    from pathlib import Path

    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from lightning_aesgd import AdaptiveElasticStrategy, SlowdownCallback

    OUT = Path(sys.argv[1])


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
            self.seen = {{}}

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            self.seen.setdefault(str(self.current_epoch), []).extend(index.tolist())
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(Indexed(), batch_size={BATCH}, shuffle=True)


    class Report(pl.Callback):
        # Callbacks' on_train_end runs before the strategy's teardown, which ends the engine.
        def on_train_end(self, trainer, pl_module):
            strategy = trainer.strategy
            plans = strategy.plans
            report = {{
                "global_rank": trainer.global_rank,
                "local_rank": trainer.local_rank,
                "node_rank": trainer.node_rank,
                "world_size": trainer.world_size,
                "num_nodes": trainer.num_nodes,
                "environment": {{k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK")}},
                "plans": plans.plan_book.state_dict(),
                "history": [[r.step, list(r.speeds), list(r.sizes)] for r in plans.history],
                "merges": strategy.engine.sync_count,
                "global_step": trainer.global_step,
                "seen": pl_module.seen,
            }}
            (OUT / f"rank{{trainer.global_rank}}.json").write_text(json.dumps(report))


    pl.seed_everything(1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        max_epochs={EPOCHS},
        strategy=AdaptiveElasticStrategy(sync="SYNC", planner="balanced", timeout=timedelta(seconds=60)),
        # 1.5 ms per sample at factor 1, in the user's training_step: per-sample slowness that plans can balance.
        callbacks=[
            SlowdownCallback({{"factors": {list(FACTORS)}, "mode": "user", "seconds_per_sample": 0.0015}}),
            Report(),
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model())
    """
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _node_command(node_rank: int, port: int, script: Path, out: Path) -> list[str]:
    """One node's torchrun: what the README's two-node commands run, with this machine as both nodes."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node_rank}",
        "--master-addr=127.0.0.1", f"--master-port={port}",
        str(script), str(out),
    ]  # fmt: skip


def _start_node(command: list[str], cwd: Path, environment: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _run_two_nodes(out: Path, timeout: float, sync: str) -> tuple[list[int], str]:
    """Start both nodes' agents, each in a session of its own; all are killed when over ``timeout``."""
    script = out / "train.py"
    script.write_text(SCRIPT.replace("SYNC", sync))
    environment = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    port = _free_port()
    agents = [_start_node(_node_command(node, port, script, out), out, environment) for node in (0, 1)]
    deadline = time.monotonic() + timeout
    outputs = []
    for agent in agents:
        try:
            outputs.append(agent.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for each in agents:
                os.killpg(each.pid, signal.SIGKILL)
            output = "\n".join(each.communicate()[0] for each in agents)
            pytest.fail(f"the two torchrun nodes ran over {timeout} s; their output ends with:\n{output[-4000:]}")
    return [agent.returncode for agent in agents], "\n".join(outputs)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sync", ["gradients", "models"])
def test_two_torchrun_nodes_of_two_processes_share_plans_merges_and_every_sample(tmp_path, sync):
    codes, output = _run_two_nodes(tmp_path, timeout=80, sync=sync)
    tail = output[-4000:]
    assert codes == [0, 0], f"torchrun exited with {codes}:\n{tail}"
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]

    # Four replicas, laid out as torchrun numbers them: node n holds global ranks 2n and 2n + 1.
    assert [r["global_rank"] for r in reports] == [0, 1, 2, 3]
    assert [(r["node_rank"], r["local_rank"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {(r["world_size"], r["num_nodes"]) for r in reports} == {(4, 2)}
    assert [r["environment"]["RANK"] for r in reports] == ["0", "1", "2", "3"], "Lightning's ranks are torchrun's"
    assert {r["global_step"] for r in reports} == {EPOCHS * STEPS_PER_EPOCH}

    # One plan book, one merge history and one merge count on every rank: all decide alike.
    plans = reports[0]["plans"]
    assert all(r["plans"] == plans for r in reports), [r["plans"] for r in reports]
    assert all(r["history"] == reports[0]["history"] for r in reports)
    assert len({r["merges"] for r in reports}) == 1
    assert reports[0]["merges"] == EPOCHS * STEPS_PER_EPOCH, "a sum (gradients) or a merge (models) every step"
    assert all(sum(sizes) == STEP_BATCH for sizes in plans["sizes"])
    assert all(min(sizes) >= 1 for sizes in plans["sizes"])
    assert len(plans["sizes"]) > 1, "the measured speeds changed the plan"
    final = plans["sizes"][-1]
    assert final[0] > final[3], f"the 4× slower replica gets a smaller batch: {final}"
    assert final[1] > final[3], f"the 4× slower replica gets a smaller batch: {final}"

    # Across the two nodes every sample of every epoch is used exactly once.
    for epoch in range(EPOCHS):
        consumed = [i for r in reports for i in r["seen"][str(epoch)]]
        assert sorted(consumed) == list(range(SAMPLES)), f"epoch {epoch}"
