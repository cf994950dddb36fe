"""The merge machinery keeps every tensor on the model's device, checked on the ``meta`` device.

A ``meta`` tensor meets a CPU tensor with the error a CUDA tensor meets it with ("Expected all tensors to be on
the same device"), so a model on ``meta`` finds, on a machine without a GPU, every tensor the machinery creates
on the CPU by mistake. The fake communicator takes tensors of the model's device only, as NCCL does.

A ``meta`` tensor holds no numbers: the engine's reads back to the host (:func:`~lightning_aesgd.engine.flat.
to_host`) are stood in for, answering a chosen number for every element. Each test runs on the CPU too, where
the same reads return the real numbers and the values are checked.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from helpers import FakeCommunicator, RegressionData
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_aesgd.core.merge import get_merge_rule
from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.engine import averager as averager_module
from lightning_aesgd.engine import comm as comm_module
from lightning_aesgd.engine import finite_guard, report_exchange, sparse_sums
from lightning_aesgd.engine.averager import ElasticAverager, MergeSettings
from lightning_aesgd.engine.comm import NoMergeWeightError, WeightedAllReduce
from lightning_aesgd.engine.finite_guard import Exclusions, flags_of, guarded, renormalised
from lightning_aesgd.engine.flat import FlatView, to_host
from lightning_aesgd.engine.gradients import GradientSum
from lightning_aesgd.engine.model_merge import ModelMerge
from lightning_aesgd.engine.pipeline import TrainerHooks
from lightning_aesgd.engine.plan_settings import PlanSettings

DEVICES = ["cpu", "meta"]
RULES = {"elastic_average": {"alpha": 0.5, "momentum": 0.5}, "sma": {}, "easgd": {}}


class HostReads:
    """Stands in for the engine's reads back to the host and records every tensor read.

    On the CPU a read returns the tensor's numbers; on ``meta``, which has none, ``value`` for every element.
    """

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.value = 1.0

    def __call__(self, tensor: Tensor) -> list[float]:
        self.tensors.append(tensor)
        return [self.value] * tensor.numel() if tensor.is_meta else to_host(tensor)

    def devices(self) -> set[str]:
        return {tensor.device.type for tensor in self.tensors}


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> HostReads:
    reads = HostReads()
    for module in (comm_module, averager_module, sparse_sums, report_exchange, finite_guard):
        monkeypatch.setattr(module, "to_host", reads)
    return reads


def _bufferless(device: str) -> nn.Module:
    model = nn.Linear(3, 2, device=device)
    if device != "meta":
        with torch.no_grad():
            model.weight.fill_(1.0)
            model.bias.fill_(-1.0)
    return model


def _on(device: str, tensors: list[Tensor]) -> None:
    assert {tensor.device.type for tensor in tensors} == {device}


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_flat_view_reads_an_empty_flat_on_its_device(device):
    flat = FlatView([], device=torch.device(device)).read()
    assert flat.device.type == device
    assert flat.numel() == 0


@pytest.mark.parametrize("bind", [False, True], ids=["copied", "bound"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_flat_view_reads_and_writes_on_the_tensors_device(device, bind):
    tensors = [torch.ones(2, 2, device=device), torch.zeros(3, device=device, dtype=torch.float16)]
    view = FlatView(tensors, bind=bind, device=torch.device(device))
    flat = view.read()
    _on(device, [flat, view.current(), view.read_into(torch.empty_like(flat))])
    view.write_(flat.add(1.0))
    if device == "cpu":
        torch.testing.assert_close(view.read(), torch.tensor([2.0] * 4 + [1.0] * 3))


@pytest.mark.parametrize("device", DEVICES)
def test_a_weighted_mean_with_an_empty_flat_stays_on_the_device_and_reads_the_host_once(device, host_reads):
    comm = FakeCommunicator(world_size=2, rank=1, device=device)
    flats = [torch.full((3,), 2.0, device=device), torch.empty(0, device=device)]
    means, rows = WeightedAllReduce(comm)(flats, 1.0, row=[5.0, 6.0])
    _on(device, means)
    assert [mean.numel() for mean in means] == [3, 0]
    assert len(host_reads.tensors) == 1
    assert host_reads.devices() == {device}
    assert [len(row) for row in rows] == [2, 2]
    if device == "cpu":  # an identical peer doubles the bucket: this replica's row, twice, in its own slot
        torch.testing.assert_close(means[0], flats[0])
        assert rows == [[0.0, 0.0], [10.0, 12.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_the_rows_of_a_half_precision_model_travel_on_its_device(device, host_reads):
    comm = FakeCommunicator(world_size=1, device=device)
    means, rows = WeightedAllReduce(comm)([torch.ones(3, dtype=torch.float16, device=device)], 2.0, row=[70000.0])
    _on(device, means)
    assert comm.calls == ["all_reduce_sum_", "all_reduce_sum_"]  # the rows leave the half-precision bucket
    assert len(host_reads.tensors) == 1
    if device == "cpu":
        assert rows == [[70000.0]]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("device", DEVICES)
def test_every_rule_merges_a_bufferless_model_on_its_device(device, rule, host_reads):
    model = _bufferless(device)
    comm = FakeCommunicator(world_size=2, device=device)  # an identical peer: the merge changes nothing
    averager = ElasticAverager(model, comm, MergeSettings(get_merge_rule(rule, **RULES[rule])))
    averager.before_local_step()
    assert averager.after_local_step(num_samples=4)
    center, _ = averager.merge(weight=4.0)
    _on(device, [center, *model.parameters(), *averager.rule_state.values(), *averager.global_model()])
    assert "all_reduce_sum_" in comm.calls
    assert host_reads.devices() == {device}
    if device == "cpu":
        torch.testing.assert_close(model.weight, torch.ones(2, 3))
        torch.testing.assert_close(model.bias, -torch.ones(2))


@pytest.mark.parametrize("mode", ["reset", "average"])
@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_state_is_merged_on_the_device_and_counted_on_the_host(device, mode, host_reads):
    model = _bufferless(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for parameter in model.parameters():
        optimizer.state[parameter]["momentum_buffer"] = torch.full_like(parameter, 0.5)
    comm = FakeCommunicator(world_size=2, device=device)
    ElasticAverager(model, comm, MergeSettings(get_merge_rule("elastic_average"), optimizer_state=mode)).merge(
        weight=1.0, optimizer=optimizer
    )
    assert len(host_reads.tensors) == 1  # the moment count is host data: summed on the host group, not read back
    if mode == "reset":
        assert not optimizer.state
        return
    assert comm.calls == ["host_all_reduce_max_", "all_reduce_sum_"]
    moments = [optimizer.state[parameter]["momentum_buffer"] for parameter in model.parameters()]
    _on(device, moments)
    if device == "cpu":
        for moment in moments:
            torch.testing.assert_close(moment, torch.full_like(moment, 0.5))


@pytest.mark.parametrize("device", DEVICES)
def test_the_finite_check_reads_the_host_once_for_a_finite_model(device, host_reads):
    averager = ElasticAverager(
        _bufferless(device), FakeCommunicator(device=device), MergeSettings(get_merge_rule("sma"))
    )
    assert averager.is_finite()
    assert len(host_reads.tensors) == 1
    assert host_reads.devices() == {device}


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_that_is_not_finite_is_found_on_its_device(device, host_reads):
    model = _bufferless(device)
    if device == "cpu":
        with torch.no_grad():
            model.weight[0, 0] = math.nan
    host_reads.value = math.nan  # what the meta model's sums would read
    averager = ElasticAverager(model, FakeCommunicator(device=device), MergeSettings(get_merge_rule("sma")))
    assert not averager.is_finite()
    assert host_reads.devices() == {device}


def test_finite_values_whose_sum_overflows_are_finite(host_reads):
    model = _bufferless("cpu")
    with torch.no_grad():
        model.weight.fill_(3e38)
    averager = ElasticAverager(model, FakeCommunicator(), MergeSettings(get_merge_rule("sma")))
    assert averager.is_finite()
    assert len(host_reads.tensors) == 2  # the sum overflowed: the elementwise check tells it from a NaN


class _Scaler:
    """A GradScaler as the engine reads it, whose loss scale never drops (no step skipped)."""

    def __init__(self, device: str) -> None:
        self._scale = torch.tensor(1024.0, device=device)

    def is_enabled(self) -> bool:
        return True


@pytest.mark.parametrize("device", DEVICES)
def test_a_merge_of_the_engine_reads_the_device_back_once(device, host_reads):
    # After the collective only (the summed weight and the rows): the finite probe, the scaler's flags and the last
    # merged norm travel in it as device numbers. On `meta` any other read would raise.
    module = nn.Linear(2, 1, device=device)
    settings = MergeSettings(get_merge_rule("elastic_average"), period=3)
    options = {"lr_scaling": False, "lr_schedule": None, "step_batch_size": None}
    options |= {"plan_lag": None, "sample_costs": None, "checkpoint_replicas": True}
    engine = ModelMerge(settings, PlanSettings(), l2_nudge=True, **options)
    comm = FakeCommunicator(world_size=1, device=device)
    engine.start(module, comm, torch.device(device), TrainerHooks(grad_scaler=_Scaler(device)))
    loader = engine.training_loader(DataLoader(RegressionData(32), batch_size=4))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    reads_per_merge = []
    for index, _ in enumerate(loader):
        before = len(host_reads.tensors)
        engine.begin_step(0, index, index)
        engine.optimizer_step(optimizer, lambda: None)
        if engine.synced_last_step:
            reads_per_merge.append(len(host_reads.tensors) - before)
    assert reads_per_merge == [1] * engine.averager.merges
    assert engine.averager.merges == 3
    assert host_reads.devices() == {device}


@pytest.mark.parametrize("device", DEVICES)
def test_a_weight_and_row_numbers_on_the_device_travel_as_host_ones_do(device, host_reads):
    comm = FakeCommunicator(world_size=2, rank=1, device=device)
    flats = [torch.full((3,), 2.0, device=device)]
    on_device = {"device": device, "dtype": torch.float64}
    row = [torch.tensor(5.0, **on_device), 6.0, torch.tensor(7.0, device=device)]  # any dtype of the device
    means, rows = WeightedAllReduce(comm)(flats, torch.tensor(3.0, **on_device), row=row)
    _on(device, means)
    assert len(host_reads.tensors) == 1
    if device == "cpu":
        host_means, host_rows = WeightedAllReduce(comm)(flats, 3.0, row=[5.0, 6.0, 7.0])
        torch.testing.assert_close(means[0], host_means[0])
        assert rows == host_rows == [[0.0] * 3, [10.0, 12.0, 14.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_a_lone_replica_without_a_row_reads_nothing_back(device, host_reads):
    # The end-of-fit merge of a lone GPU replica: its total is its own host weight (on `meta` a read would raise).
    flats = [torch.full((3,), 2.0, device=device)]
    means, rows = WeightedAllReduce(FakeCommunicator(world_size=1, device=device))(flats, 3.0)
    _on(device, means)
    assert (len(host_reads.tensors), rows) == (0, [])
    with pytest.raises(NoMergeWeightError):
        WeightedAllReduce(FakeCommunicator(world_size=1, device=device))(flats, 0.0)
    if device == "cpu":
        torch.testing.assert_close(means[0], flats[0])


def test_the_finite_guard_stays_on_the_device_without_reading_it():
    """On a device the guard decides, renormalises and counts there: any read of a meta tensor would raise."""
    buffer = torch.empty(5, device="meta")
    contribution = guarded(buffer, 0.25)
    assert (contribution.device.type, contribution.numel()) == ("meta", 7)
    summed = renormalised(contribution)
    assert (summed.device.type, summed.numel()) == ("meta", 5)
    exclusions = Exclusions()
    exclusions.add_step([flags_of(contribution), flags_of(contribution)], world_size=4)  # counted on the device


class _MetaBucket:
    """DDP's last gradient bucket as the hook sees it, on ``meta``."""

    def __init__(self) -> None:
        self.params = [nn.Parameter(torch.empty(2, 2, device="meta")), nn.Parameter(torch.empty(3, device="meta"))]

    def buffer(self) -> Tensor:
        return torch.empty(7, device="meta")

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[nn.Parameter]:
        return self.params


def test_a_report_carried_in_the_last_buckets_sum_stays_on_the_device():
    """The table rides in the bucket's all-reduce and comes back on the device, split and joined there."""
    reduce = GradientSum(comm=FakeCommunicator(world_size=2, device="meta"))
    table = torch.empty(2, 11, dtype=torch.float64, device="meta")
    carried: list[torch.futures.Future[Tensor] | None] = []
    reduce.on_last_bucket = lambda: carried.append(reduce.carry(table))
    reduce.begin_step()
    summed = reduce.reduce(_MetaBucket()).wait()
    reduce.end_step()
    assert carried[0] is not None
    rows = carried[0].wait()
    assert (summed.device.type, summed.numel()) == ("meta", 7)
    assert (rows.device.type, rows.dtype, rows.shape) == ("meta", torch.float64, table.shape)


@pytest.mark.parametrize("device", DEVICES)
def test_the_merge_of_several_learners_stays_on_the_device(device, host_reads):
    model = nn.Sequential(nn.Linear(3, 4, device=device), nn.BatchNorm1d(4, device=device))
    comm = FakeCommunicator(world_size=2, device=device)
    averager = ElasticAverager(model, comm, MergeSettings(get_merge_rule("sma")), learners=3)
    assert model[0].weight.shape == (3, 4, 3)
    averager.before_local_step()
    assert averager.after_local_step(num_samples=6)
    center, _ = averager.merge(weight=6.0)
    averager.swap_in_global_model()
    assert model[0].weight.shape == (4, 3)
    averager.swap_out()
    averager.adopt_global_model()
    _on(device, [center, *model.parameters(), *model.buffers(), *averager.rule_state.values()])
    assert host_reads.devices() == {device}


class _SparseBucket(_MetaBucket):
    """A bucket holding an embedding's sparse gradient (a row repeated), on ``device``; NaN unless ``finite``."""

    def __init__(self, device: str, finite: bool) -> None:
        self.params = [nn.Parameter(torch.empty(5, 2, device=device))]
        values = torch.ones(3, 2) if finite else torch.full((3, 2), float("nan"))
        self.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3, 1]]), values, (5, 2)).to(device)

    def buffer(self) -> Tensor:
        return self.grad


@pytest.mark.parametrize(
    ("device", "method", "finite"),
    # Sparse meta tensors lack the ops of densifying and of renormalising: on `meta`, the gather of finite rows.
    [("meta", "gather", True), ("cpu", "gather", False), ("cpu", "densify", True), ("cpu", "densify", False)],
)
def test_a_sparse_sum_without_a_sparse_all_reduce_reads_the_device_once(device, method, finite, host_reads):
    # As on NCCL: the exchange of rows is read on the host, and the finite flag rides in it. On `meta` any other
    # read (a finite test of its own) would raise.
    host_reads.value = 0.0  # on `meta`, every replica's row: no rows, no share, finite
    reduce = GradientSum(comm=FakeCommunicator(world_size=2, device=device), sparse_reduction=method)
    reduce.begin_step()
    summed = reduce.reduce(_SparseBucket(device, finite)).wait()
    reduce.end_step()
    assert (summed.device.type, summed.is_sparse) == (device, True)
    assert len(host_reads.tensors) == 1
    if device == "cpu":  # the fake's peer sends what this replica does: both finite, or both left out
        expected = torch.zeros(5, 2)
        expected[[1, 3]] = torch.tensor([[2.0, 2.0], [1.0, 1.0]]) * 2 if finite else 0.0
        torch.testing.assert_close(summed.to_dense(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_a_report_and_the_exclusion_counts_are_read_in_one_wait(device, host_reads):
    # Under gradient sync with the guard on a device: the counts of replicas left out of sums ride in the read of
    # the report's rows.
    exchange, comm = report_exchange.ReportExchange(), FakeCommunicator(world_size=2, device=device)
    exchange.launch(PeriodReport(0.5, work=8.0, steps=1.0).as_row(), comm, torch.device(device))
    exclusions = Exclusions()
    one_left_out = torch.tensor([0.5, 1.0], dtype=torch.float64, device=device)  # [Σ fᵢ·sᵢ, Σ (1 − fᵢ)]
    exclusions.add_step([one_left_out], world_size=2)
    ((rows, counts),) = list(exchange.received(0, lambda: contextlib.nullcontext(), exclusions.take))
    assert len(host_reads.tensors) == 1
    assert len(rows) == 2
    if device == "cpu":
        assert PeriodReport.from_row(rows[0]).work == 16.0  # the fake's peer sends what this replica does
        assert exclusions.counted(counts) == (1, 0)
        assert exclusions.read() == (0, 0)  # counted once
