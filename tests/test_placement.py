"""Where replicas run: several per device, or each rank on its own device (``replica_devices``), and fits."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import warnings

import pytest
import pytorch_lightning as pl
import torch
from helpers import RegressionModel, cpu_trainer
from hypothesis import given
from hypothesis import strategies as st
from pytorch_lightning.accelerators import CUDAAccelerator
from pytorch_lightning.plugins import precision as plugins_precision
from pytorch_lightning.plugins.environments import LightningEnvironment
from pytorch_lightning.plugins.precision import DoublePrecision, MixedPrecision, Precision

from lightning_aesgd import AdaptiveElasticStrategy, placement
from lightning_aesgd.baselines import PostLocalSGDStrategy, SharedDeviceDDPStrategy
from lightning_aesgd.placement import (
    GPU_FEEDER_CORES,
    MIN_CPU_REPLICA_CORES,
    auto_replica_devices,
    available_cores,
    check_replicas_per_device,
    parse_replica_devices,
    precision_for,
    process_group_backend,
    repeat_devices,
    replica_threads,
    shares_a_device,
)

CUDA = [torch.device("cuda", 0), torch.device("cuda", 1)]


@given(st.integers(1, 3), st.integers(1, 5))
def test_each_device_gets_its_replicas_side_by_side(num_devices, replicas_per_device):
    devices = [torch.device("cuda", i) for i in range(num_devices)]
    repeated = repeat_devices(devices, replicas_per_device)
    assert len(repeated) == num_devices * replicas_per_device
    assert repeated[::replicas_per_device] == devices
    assert shares_a_device(repeated) == (replicas_per_device > 1)


def test_replicas_that_share_a_gpu_use_gloo():
    assert process_group_backend(repeat_devices(CUDA, 2), None) == "gloo"
    assert process_group_backend(CUDA, None) is None  # Lightning's own choice (nccl) stands
    assert process_group_backend([torch.device("cpu")] * 2, None) is None
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank"):
        process_group_backend(repeat_devices(CUDA, 2), "nccl")


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_replicas_per_device_must_be_a_whole_number(value):
    with pytest.raises(ValueError, match="replicas_per_device"):
        check_replicas_per_device(value)


@pytest.mark.parametrize("strategy_class", [AdaptiveElasticStrategy, SharedDeviceDDPStrategy, PostLocalSGDStrategy])
def test_strategies_start_replicas_per_device_processes(strategy_class):
    strategy = strategy_class(replicas_per_device=3)
    strategy.parallel_devices = CUDA
    assert strategy.num_processes == 6
    assert strategy.parallel_devices == repeat_devices(CUDA, 3)
    strategy.set_world_ranks()
    assert strategy._get_process_group_backend() == "gloo"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sync", ["gradients", "models"])
def test_two_replicas_train_on_one_device(sync):
    pl.seed_everything(0)
    model = RegressionModel()
    trainer = cpu_trainer(
        AdaptiveElasticStrategy(sync=sync, replicas_per_device=2, start_method="fork"), devices=1, max_steps=6
    )
    trainer.fit(model)
    assert trainer.world_size == 2
    assert trainer.state.finished


# --- replica_devices: every rank's own device (CPU replicas beside GPU replicas) ----------------------------


@given(st.integers(0, 8), st.integers(1, 128))
def test_auto_places_every_gpu_first_and_leaves_their_cores_to_them(cuda_count, cores):
    devices = auto_replica_devices(cuda_count, cores)
    assert devices[:cuda_count] == [torch.device("cuda", i) for i in range(cuda_count)]
    cpu_replicas = len(devices) - cuda_count
    assert all(device.type == "cpu" for device in devices[cuda_count:])
    assert cpu_replicas >= (1 if cuda_count == 0 else 0)
    threads = [replica_threads(devices, rank, cores) for rank in range(len(devices))]
    if cpu_replicas and cuda_count:  # CPU replicas stay off the cores that feed the GPUs
        assert sum(threads[cuda_count:]) <= cores - GPU_FEEDER_CORES * cuda_count
        assert min(threads[cuda_count:]) >= MIN_CPU_REPLICA_CORES // 2
    if cuda_count and not cpu_replicas:
        assert threads == [None] * cuda_count  # GPUs alone: torch's own thread count


def test_a_one_gpu_machine_with_16_cores_gets_a_gpu_replica_and_a_cpu_replica_over_gloo(monkeypatch):
    _one_gpu_machine(monkeypatch, cores=16)
    for strategy_class in (AdaptiveElasticStrategy, SharedDeviceDDPStrategy):
        strategy = strategy_class(replica_devices="auto")
        assert strategy.parallel_devices == [torch.device("cuda", 0), torch.device("cpu")]
        strategy.parallel_devices = [torch.device("cpu")]  # Lightning's connector: replica_devices stand
        assert strategy.num_processes == 2
        strategy.set_world_ranks()
        assert strategy._get_process_group_backend() == "gloo"
    assert [replica_threads(strategy.parallel_devices, rank, 16) for rank in (0, 1)] == [2, 14]


def test_a_trainer_keeps_the_replica_devices(monkeypatch):
    _one_gpu_machine(monkeypatch, cores=4)
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(CUDAAccelerator, "parse_devices", staticmethod(lambda devices: [0]))
    strategy = AdaptiveElasticStrategy(replica_devices=["cuda:0", "cpu", "cpu"])
    trainer = pl.Trainer(accelerator="auto", devices=1, strategy=strategy, logger=False)
    assert trainer.num_devices == 3
    assert isinstance(trainer.accelerator, CUDAAccelerator)  # rank 0's; the CPU ranks take theirs at set-up
    assert trainer.strategy.parallel_devices == [torch.device("cuda", 0), torch.device("cpu"), torch.device("cpu")]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (["cuda:0", "cpu"], "has no CUDA GPU"),
        (["cuda:1"], "has no CUDA GPU"),
        (["cuda", "cpu"], "cuda:<index>"),
        (["mps"], "cuda:<index>"),
        (["cpu", None], "not a replica's device"),
        ("cpu", "'auto' or a non-empty list"),
        ([], "'auto' or a non-empty list"),
    ],
)
def test_bad_replica_devices_fail_at_construction_with_a_hint(spec, match):
    with pytest.raises(ValueError, match=match) as raised:
        AdaptiveElasticStrategy(replica_devices=spec)
    assert "HINT" in str(raised.value)


def test_a_gpu_beyond_the_machines_count_is_refused(monkeypatch):
    _one_gpu_machine(monkeypatch, cores=16)
    with pytest.raises(ValueError, match="has 1 CUDA GPU"):
        parse_replica_devices(["cuda:0", "cuda:1"], 1, 16)
    assert parse_replica_devices(["cuda:0", "cuda:0", "cpu"], 1, 16)[:2] == [torch.device("cuda", 0)] * 2


def test_replica_devices_and_replicas_per_device_are_exclusive():
    with pytest.raises(ValueError, match="set one"):
        AdaptiveElasticStrategy(replica_devices=["cpu", "cpu"], replicas_per_device=2)


def test_nccl_cannot_connect_cpu_and_gpu_replicas():
    with pytest.raises(ValueError, match="CPU and GPU replicas"):
        process_group_backend([torch.device("cuda", 0), torch.device("cpu")], "nccl")


@pytest.mark.parametrize("namespace", ["pytorch_lightning", "lightning.pytorch"])
def test_each_rank_takes_its_own_accelerator_precision_and_threads(monkeypatch, namespace):
    accelerators = importlib.import_module(f"{namespace}.accelerators")
    precision = importlib.import_module(f"{namespace}.plugins.precision")
    strategy_class = (
        importlib.import_module("lightning_aesgd.unified").AdaptiveElasticStrategy
        if namespace == "lightning.pytorch"
        else AdaptiveElasticStrategy
    )
    _one_gpu_machine(monkeypatch, cores=16)
    strategy = strategy_class(replica_devices="auto", sync="models")
    strategy.accelerator = accelerators.CUDAAccelerator()
    strategy.precision_plugin = precision.MixedPrecision("16-mixed", device="cuda", scaler=torch.amp.GradScaler())
    monkeypatch.setenv("LOCAL_RANK", "1")
    strategy.cluster_environment = importlib.import_module(f"{namespace}.plugins.environments").LightningEnvironment()
    threads = torch.get_num_threads()
    try:
        strategy._take_own_device(strategy.parallel_devices)
        assert torch.get_num_threads() == 14
    finally:
        torch.set_num_threads(threads)
    assert strategy.root_device == torch.device("cpu")
    assert type(strategy.accelerator) is accelerators.CPUAccelerator
    assert type(strategy.precision_plugin) is precision.Precision  # 32-bit on the CPU replica


def test_a_cpu_rank_beside_a_gpu_gets_tensors_of_its_own_under_spawn(monkeypatch):
    # Lightning's spawn launcher unshares a spawned process's model only when the Trainer's accelerator is the CPU.
    _one_gpu_machine(monkeypatch, cores=4)
    strategy = AdaptiveElasticStrategy(replica_devices=["cuda:0", "cpu", "cpu"], sync="models")
    model = RegressionModel()
    model.share_memory()
    strategy._lightning_module = model
    monkeypatch.setenv("LOCAL_RANK", "2")
    strategy.cluster_environment = LightningEnvironment()
    before = [tensor.detach().clone() for tensor in model.parameters()]
    threads = torch.get_num_threads()
    try:
        strategy._take_own_device(strategy.parallel_devices)
    finally:
        torch.set_num_threads(threads)
    assert not any(tensor.is_shared() for tensor in model.parameters())
    assert all(torch.equal(old, new) for old, new in zip(before, model.parameters(), strict=True))


def test_a_gpu_replica_of_a_cpu_trainer_autocasts_on_cuda():
    cpu_mixed = MixedPrecision("bf16-mixed", device="cpu")
    on_gpu = precision_for(torch.device("cuda", 0), cpu_mixed, plugins_precision)
    assert isinstance(on_gpu, MixedPrecision)
    assert (on_gpu.device, on_gpu.precision, on_gpu.scaler) == ("cuda", "bf16-mixed", None)
    assert precision_for(torch.device("cpu"), cpu_mixed, plugins_precision).__class__ is Precision
    double = DoublePrecision()
    assert precision_for(torch.device("cpu"), double, plugins_precision) is double  # one dtype on every replica


def test_gradient_sums_across_cpu_and_gpu_replicas_warn_and_point_to_merges(monkeypatch):
    _one_gpu_machine(monkeypatch, cores=16)
    summing, merging = (
        AdaptiveElasticStrategy(replica_devices="auto"),
        AdaptiveElasticStrategy(replica_devices="auto", sync="models"),
    )
    threads = torch.get_num_threads()
    try:
        with pytest.warns(UserWarning, match="sync='models'"):
            summing._take_own_device(summing.parallel_devices)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            merging._take_own_device(merging.parallel_devices)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("strategy_class", [AdaptiveElasticStrategy, SharedDeviceDDPStrategy])
def test_a_grad_scaler_cannot_sum_with_cpu_replicas(monkeypatch, strategy_class):
    _one_gpu_machine(monkeypatch, cores=16)
    strategy = strategy_class(replica_devices="auto")
    strategy.precision_plugin = MixedPrecision("16-mixed", device="cuda", scaler=torch.amp.GradScaler())
    with pytest.raises(ValueError, match="bf16-mixed"):
        strategy._take_own_device(strategy.parallel_devices)


class _RecordThreads(pl.Callback):
    def __init__(self, folder) -> None:
        self.folder = folder

    def on_train_start(self, trainer, pl_module) -> None:
        (self.folder / f"rank{trainer.global_rank}").write_text(
            f"{torch.get_num_threads()} {type(trainer.strategy.precision_plugin).__name__}"
        )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy_class", [AdaptiveElasticStrategy, SharedDeviceDDPStrategy])
def test_cpu_replicas_placed_by_replica_devices_split_the_cores(tmp_path, strategy_class):
    pl.seed_everything(0)
    threads = torch.get_num_threads()
    try:
        # Spawned: a forked replica may have to give up its threads (test_a_forked_replica_trains_after_...).
        strategy = strategy_class(replica_devices=["cpu", "cpu"], start_method="spawn")
        trainer = cpu_trainer(strategy, devices=1, max_steps=4, callbacks=[_RecordThreads(tmp_path)])
        trainer.fit(RegressionModel())
    finally:
        torch.set_num_threads(threads)
    assert trainer.world_size == 2
    assert trainer.state.finished
    expected = f"{max(1, available_cores() // 2)} Precision"
    assert [(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)] == [expected, expected]


FORK_AFTER_PARALLEL_WORK = """
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_aesgd.forked_threads import teams_form_after_fork
from lightning_aesgd.MODULE import STRATEGY


class Wide(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 2048), nn.Tanh(), nn.Linear(2048, 1))

    def training_step(self, batch, batch_idx):
        with open(sys.argv[1], "w") as out:
            out.write(str(torch.get_num_threads()))
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


torch.set_num_threads(2)
if sys.argv[2] == "worked":
    torch.randn(2_000_000).tanh()  # the launching process's own CPU work on two threads: OpenMP's pool starts here
    with open(sys.argv[1] + ".runtime", "w") as out:  # whether this OpenMP hangs a forked team (GNU's does)
        out.write("hangs" if not teams_form_after_fork(2) else "forms teams")
data = DataLoader(TensorDataset(torch.randn(256, 512), torch.randn(256, 1)), batch_size=64)
trainer = pl.Trainer(
    accelerator="cpu", devices=1, strategy=STRATEGY(start_method="fork"), max_steps=3, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Wide(), data)
"""


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("strategy_class", "before"),
    [(AdaptiveElasticStrategy, "worked"), (SharedDeviceDDPStrategy, "worked"), (AdaptiveElasticStrategy, "idle")],
)
def test_a_forked_replica_keeps_its_threads_only_where_they_can_run(tmp_path, strategy_class, before):
    # The lone forked replica inherits the launching process's two threads. After that process "worked" on them, GNU
    # OpenMP would hang it in its first wide kernel: it runs one thread, and says so. After none, it keeps both.
    module = "baselines" if strategy_class is SharedDeviceDDPStrategy else "strategy"
    script = tmp_path / "fork_after_work.py"
    script.write_text(FORK_AFTER_PARALLEL_WORK.replace("MODULE", module).replace("STRATEGY", strategy_class.__name__))
    environment = {**os.environ, "OMP_NUM_THREADS": "2"}  # so that Lightning leaves the replica the script's two
    with subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "threads"), before],
        env=environment, stderr=subprocess.PIPE, text=True, start_new_session=True,
    ) as done:  # fmt: skip
        try:
            _, errors = done.communicate(timeout=100)
        except subprocess.TimeoutExpired:
            os.killpg(done.pid, signal.SIGKILL)  # the forked replica with it
            _, errors = done.communicate()
            pytest.fail(f"the forked replica hung; its output ends with:\n{errors[-3000:]}")
    assert done.returncode == 0, errors[-3000:]
    if before == "worked" and (tmp_path / "threads.runtime").read_text() != "hangs":
        pytest.skip("this build's OpenMP runs a team of threads in a forked process: nothing to guard against")
    capped = before == "worked"
    assert (tmp_path / "threads").read_text() == ("1" if capped else "2")
    assert ("Forked replicas run one intra-op thread each, not 2" in errors) is capped


def _one_gpu_machine(monkeypatch, cores: int) -> None:
    """What ``replica_devices`` sees of a machine with one CUDA GPU and ``cores`` cores."""
    monkeypatch.setattr(placement, "num_cuda_devices", lambda: 1)
    monkeypatch.setattr(placement, "available_cores", lambda: cores)


def _set_up_and_leave_one_out(rank: int, port: int, strategy_class: type) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ["LOCAL_RANK"] = str(rank)
    environment, devices = LightningEnvironment(), [torch.device("cuda", 0)]
    strategy = strategy_class(replicas_per_device=2, parallel_devices=devices, cluster_environment=environment)
    strategy._local_rank = rank  # as Lightning's spawn launcher sets it
    strategy.setup_distributed()
    try:
        assert dist.get_backend() == "gloo"
        assert dist.group.WORLD.bound_device_id is None
        present = dist.new_group([0])  # rank 1 sits out, as a straggler's does
        if rank == 0:
            total = torch.ones(1)
            dist.all_reduce(total, group=present)
            assert total.item() == 1.0
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy_class", [AdaptiveElasticStrategy, SharedDeviceDDPStrategy])
def test_replicas_sharing_a_gpu_can_form_a_group_that_leaves_one_out(strategy_class):
    # Lightning binds a group to a GPU root device; a bound gloo group failed every subgroup that left a rank out
    # (on one H100: 4 replicas sharing it, the first time the slowest sat out). Unbound, the group never touches
    # the GPU it names, so this runs on the CPU.
    from lightning_fabric.plugins.environments.lightning import find_free_network_port

    torch.multiprocessing.spawn(_set_up_and_leave_one_out, args=(find_free_network_port(), strategy_class), nprocs=2)


def test_only_nccl_groups_are_bound_to_their_device():
    gpu = torch.device("cuda", 0)
    assert placement.bound_device("nccl", gpu) == gpu
    assert placement.bound_device("gloo", gpu) is None
    assert placement.bound_device("nccl", torch.device("cpu")) is None
