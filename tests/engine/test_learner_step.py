"""Several learners in one process: stacked flats, the batched step, and merges that count every learner.

Each learner of a batched step must end exactly where a module of its own would, trained alone on its slice of
the batch with an optimizer of its own; the checks compare against such separate modules.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from helpers import FakeCommunicator
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

from lightning_aesgd.core.merge import SMA, ElasticAverage
from lightning_aesgd.engine import learner_tuning
from lightning_aesgd.engine.averager import ElasticAverager, MergeSettings
from lightning_aesgd.engine.flat import (
    FlatView,
    floating_buffers,
    module_device,
    optimizer_state_tensors,
    trainable_parameters,
)
from lightning_aesgd.engine.learner_tuning import LearnerTuning, fits_in_memory, measure_learners, tune_learners
from lightning_aesgd.engine.learners import LearnerStep, LearnerStepError, learner_rows


@pytest.fixture(autouse=True)
def _one_thread():
    """Batched matmuls on several threads start a thread pool that a later forked replica (another test file's
    fork launcher) would inherit in a state it cannot use: the child's first matmul then waits forever."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Net(nn.Module):
    """A small net with BatchNorm (buffers of each learner's own) and a frozen layer (shared by the learners)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(3, 5)
        self.norm = nn.BatchNorm1d(5)
        self.out = nn.Linear(5, 1)
        self.logged: list[tuple[str, object, dict]] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.norm(self.hidden(self.frozen(x)))))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, prog_bar=True)
        self.log("rate", 0.5)
        return {"loss": loss, "prediction": self(x)}

    def log(self, name: str, value: object, **options: object) -> None:
        self.logged.append((name, value, options))


def _batch(rows: int, seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, generator=generator), torch.randn(rows, 1, generator=generator)


def _stacked(learners: int) -> tuple[Net, ElasticAverager, LearnerStep]:
    torch.manual_seed(0)
    net = Net()
    averager = ElasticAverager(net, FakeCommunicator(world_size=1), MergeSettings(ElasticAverage()), learners)
    step = LearnerStep(net, [*averager.params.tensors, *averager.buffers.tensors], learners)
    return net, averager, step


def _train_stacked(net: Net, step: LearnerStep, batches: list[tuple[Tensor, Tensor]]) -> list[dict]:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    outputs = []
    for batch in batches:
        optimizer.zero_grad()
        output = step(net.training_step, batch, 0)
        (output["loss"] * step.learners).backward()
        optimizer.step()
        outputs.append(output)
    return outputs


def _train_alone(net: Net, batches: list[tuple[Tensor, Tensor]]) -> None:
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for batch in batches:
        optimizer.zero_grad()
        net.training_step(batch, 0)["loss"].backward()
        optimizer.step()


@pytest.fixture
def float64():
    """Double precision: BatchNorm over 2 or 3 rows magnifies float32 rounding beyond any tight tolerance."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.mark.parametrize("rows", [8, 10], ids=["full", "short"])
def test_each_learner_of_a_batched_step_trains_as_a_module_of_its_own(rows, float64):
    """Learner j takes its rows of the batch (the first ``rows mod k`` one more in a short step)."""
    learners = 4
    net, averager, step = _stacked(learners)
    torch.manual_seed(0)
    initial = Net()  # the stacked net's initial model, for the learners trained alone
    batches = [_batch(rows, seed) for seed in range(3)]
    _train_stacked(net, step, batches)
    sizes = [each for first, end, each in learner_rows(rows, learners) for _ in range(first, end)]
    assert sizes == ([2] * 4 if rows == 8 else [3, 3, 2, 2])
    begin = 0
    for learner, size in enumerate(sizes):
        alone = copy.deepcopy(initial)
        _train_alone(alone, [(x[begin : begin + size], y[begin : begin + size]) for x, y in batches])
        begin += size
        expected = torch.cat([alone.state_dict()[name].reshape(-1) for name in _stacked_names(net)])
        ours = torch.cat([averager.params.current()[learner], averager.buffers.current()[learner]])
        torch.testing.assert_close(ours, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(net.frozen.weight, initial.frozen.weight)  # shared, and untouched


def _stacked_names(net: Net) -> list[str]:
    params = [name for name, p in net.named_parameters() if p.requires_grad]
    return params + [name for name, b in net.named_buffers() if b.is_floating_point()]


def test_the_step_logs_each_value_once_as_the_learners_mean_and_returns_their_mean_loss():
    net, _, step = _stacked(2)
    batch = _batch(8, seed=1)
    output = step(net.training_step, batch, 0)
    losses = [nn.functional.mse_loss(net_copy(batch, j), batch[1][4 * j : 4 * j + 4]) for j, net_copy in _copies(net)]
    expected = torch.stack(losses).mean()
    torch.testing.assert_close(output["loss"], expected)
    assert output["prediction"].shape == (2, 4, 1)  # other outputs keep a leading learner axis
    names = [(name, options) for name, _, options in net.logged]
    assert names == [("loss", {"prog_bar": True}), ("rate", {})]
    torch.testing.assert_close(net.logged[0][1], expected.detach())
    assert net.logged[1][1] == 0.5
    assert "log" not in vars(net), "the recorder must leave the module's own log method in place"


def _copies(net: Net):
    """Each learner as a module of its own, built from its row of the stacked tensors (training mode)."""
    for learner in range(2):
        alone = Net()
        alone.load_state_dict({name: t[learner] if _is_row(net, name) else t for name, t in net.state_dict().items()})

        def run(batch, j, alone=alone):
            return alone(batch[0][4 * j : 4 * j + 4])

        yield learner, run


def _is_row(net: Net, name: str) -> bool:
    return name in _stacked_names(net)


def test_a_step_that_reads_a_tensor_to_the_host_fails_with_a_hint():
    net, _, step = _stacked(2)

    def reads_the_loss(batch, batch_idx):
        loss = net.training_step(batch, batch_idx)["loss"]
        return loss if loss.item() > 0 else -loss

    with pytest.raises(LearnerStepError, match=r"\.item\(\).*HINT"):
        step(reads_the_loss, _batch(8, seed=2), 0)


def test_a_step_that_reads_a_list_to_the_host_fails_with_a_hint():
    net, _, step = _stacked(2)

    def lists_the_targets(batch, batch_idx):
        net.targets = batch[1].tolist()
        return net.training_step(batch, batch_idx)["loss"]

    with pytest.raises(LearnerStepError, match=r"storage.*HINT"):
        step(lists_the_targets, _batch(8, seed=2), 0)


def test_a_step_that_returns_nothing_fails_with_a_hint():
    net, _, step = _stacked(2)
    with pytest.raises(LearnerStepError, match=r"loss tensor.*HINT"):
        step(lambda batch, batch_idx: {"prediction": net(batch[0])}, _batch(8, seed=2), 0)


def test_a_step_may_return_values_that_are_not_tensors_beside_its_loss():
    net, _, step = _stacked(2)

    def with_a_note(batch, batch_idx):
        return {"loss": net.training_step(batch, batch_idx)["loss"], "note": "fine", "rows": len(batch[0])}

    output = step(with_a_note, _batch(8, seed=2), 0)
    assert (output["note"], output["rows"]) == ("fine", 4)
    assert output["loss"].shape == ()


def test_a_step_that_updates_a_shared_integer_buffer_with_each_learners_value_fails_with_a_hint():
    net, _, step = _stacked(2)
    net.register_buffer("positives", torch.zeros((), dtype=torch.long))  # one for all learners, not stacked

    def counts_positives(batch, batch_idx):
        net.positives.add_((batch[1] > 0).sum())
        return net.training_step(batch, batch_idx)["loss"]

    with pytest.raises(LearnerStepError, match=r"one for all learners.*floating buffer"):
        step(counts_positives, _batch(8, seed=2), 0)


@dataclass(frozen=True)
class _Features:
    """A batch class of the user's, as XMC's sparse batches are: vmap cannot look inside it."""

    x: Tensor
    y: Tensor


@pytest.mark.parametrize(
    ("batch", "named"),
    [
        (_Features(*_batch(8, seed=2)), "_Features"),
        ((_batch(8, seed=2)[0], _batch(8, seed=2)[1].numpy()), "ndarray"),
        ((torch.zeros(8, 3), torch.zeros(6, 1)), r"\[6, 8\] rows"),
    ],
    ids=["dataclass", "numpy", "ragged"],
)
def test_a_batch_that_cannot_be_dealt_to_learners_fails_with_a_hint(batch, named):
    net, _, step = _stacked(2)
    with pytest.raises(LearnerStepError, match=rf"{named}.*HINT"):
        step(lambda b, i: net.training_step(b, i)["loss"], batch, 0)


def test_auto_keeps_one_learner_where_the_batch_cannot_be_dealt_to_learners(caplog):
    net = Net()
    features = _Features(*_batch(8, seed=0))
    with caplog.at_level("WARNING", logger="lightning_aesgd"):
        assert measure_learners(net, lambda b, i: net.training_step((b.x, b.y), i)["loss"], features, 1) == 0.0
    assert "keeps 1 learner: A batch holding _Features cannot be dealt to learners" in caplog.text
    comm = FakeCommunicator(world_size=1)
    assert tune_learners(lambda k: 0.0, comm, LearnerTuning(max_learners=4)) == (1, [0.0])


def test_the_users_own_errors_pass_through_unchanged():
    _, _, step = _stacked(2)

    def broken(batch, batch_idx):
        raise RuntimeError("the user's bug")

    with pytest.raises(RuntimeError, match=r"^the user's bug$"):
        step(broken, _batch(8, seed=2), 0)


@given(rows=st.integers(1, 200), learners=st.integers(1, 9))
def test_learner_rows_deal_every_row_once_and_as_equally_as_possible(rows, learners):
    groups = learner_rows(rows, learners)
    assert sum((end - first) * each for first, end, each in groups) == rows
    sizes = [each for first, end, each in groups for _ in range(first, end)]
    assert len(groups) <= 2
    assert max(sizes) - min(sizes) <= 1
    assert len(sizes) == min(rows, learners)  # a learner without a row is in no group


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_stacked_flat_view_binds_a_row_per_learner_and_shows_one_model(device):
    tensors = [torch.ones(2, 3, device=device), torch.zeros(4, device=device)]
    view = FlatView(tensors, bind=True, learners=3)
    assert view.live is not None
    assert view.live.shape == (3, 10)
    assert view.numel == 10
    assert [t.shape for t in tensors] == [(3, 2, 3), (3, 4)]
    assert {t.device.type for t in (*tensors, view.learner_mean(), view.read())} == {device}
    view.write_(torch.arange(10.0, device=device))  # one model: every learner takes it
    shown = torch.full((10,), 7.0, device=device)
    view.show_(shown)
    assert [t.shape for t in tensors] == [(2, 3), (4,)]
    view.restack_()
    assert [t.shape for t in tensors] == [(3, 2, 3), (3, 4)]
    if device == "cpu":
        torch.testing.assert_close(view.read(), torch.arange(10.0).repeat(3, 1))
        torch.testing.assert_close(tensors[1][2], torch.arange(6.0, 10.0))
        assert shown.eq(7.0).all(), "showing a model must not write it"


def test_buffers_of_several_dtypes_are_each_shown_in_their_own():
    tensors = [torch.ones(2), torch.ones(3, dtype=torch.float16)]
    view = FlatView(tensors, learners=2)
    view.show_(torch.arange(5.0))
    assert [t.dtype for t in tensors] == [torch.float32, torch.float16]
    torch.testing.assert_close(tensors[1], torch.tensor([2.0, 3.0, 4.0], dtype=torch.float16))
    view.restack_()
    assert [(t.shape, t.dtype) for t in tensors] == [((2, 2), torch.float32), ((2, 3), torch.float16)]


def test_an_unbound_view_of_one_learner_reads_and_writes_its_tensors_in_order():
    tensors = [torch.zeros(2, 2), torch.zeros(3, dtype=torch.float16)]
    view = FlatView(tensors)
    view.write_(torch.arange(7.0))
    torch.testing.assert_close(tensors[0], torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    expected = torch.arange(7.0)
    for values in (view.read(), view.read_into(torch.empty(7)), view.learner_mean()):
        torch.testing.assert_close(values, expected)
    with pytest.raises(ValueError, match="cannot fill 7 elements"):
        view.write_(torch.zeros(6))


def test_a_bound_views_current_values_are_its_live_buffer_and_rows_write_each_learner():
    tensors = [torch.zeros(2), torch.zeros(1)]
    view = FlatView(tensors, bind=True, learners=2)
    assert view.current() is view.live
    view.write_(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    torch.testing.assert_close(tensors[0], torch.tensor([[1.0, 2.0], [4.0, 5.0]]))
    stacked = FlatView([torch.zeros(2), torch.zeros(1, dtype=torch.float16)], learners=2)  # unbound: blocks
    stacked.write_(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    torch.testing.assert_close(stacked.read(), torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))


def test_a_complex_tensor_is_viewed_as_its_real_pairs():
    tensor = torch.tensor([1 + 2j, 3 - 4j])
    view = FlatView([tensor])
    assert view.numel == 4
    torch.testing.assert_close(view.read(), torch.tensor([1.0, 2.0, 3.0, -4.0]))
    view.write_(torch.tensor([5.0, 6.0, 7.0, 8.0]))
    torch.testing.assert_close(tensor, torch.tensor([5 + 6j, 7 + 8j]))


def test_a_view_follows_tensors_assigned_anew_where_their_layout_is_the_same():
    """A module's buffer assigned anew (an EMA): an unbound view of one learner follows it; others cannot."""
    old, new = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.ones(3)]
    view = FlatView(old)
    assert view.follow(old)
    assert not view.follow(old[:1])  # fewer tensors
    assert not view.follow([torch.ones(2), torch.ones(4)])  # another shape
    assert not view.follow([torch.ones(2), torch.ones(3, dtype=torch.float64)])  # another dtype
    assert view.follow(new)
    assert all(viewed is tensor for viewed, tensor in zip(view.tensors, new, strict=True))
    torch.testing.assert_close(view.read(), torch.ones(5))
    bound = FlatView([torch.zeros(2)], bind=True)
    assert bound.follow(bound.tensors)  # its own tensors: nothing to follow
    assert not bound.follow([torch.ones(2)])  # bound: it owns the storage
    assert not FlatView([torch.zeros(2)], learners=2).follow([torch.ones(2)])  # learners: stacked blocks


def test_a_view_of_meta_tensors_lives_on_their_device_and_a_module_of_no_tensors_on_the_cpu():
    view = FlatView([torch.zeros(3, device="meta")])
    assert view.device.type == "meta"
    assert view.read().device.type == "meta"
    assert module_device(nn.ReLU()) == torch.device("cpu")


def test_only_per_parameter_moments_of_an_optimizer_are_merged():
    """Adam's moments have their parameter's shape and are merged; its step count and a user's note are not."""
    weight = nn.Parameter(torch.ones(2, 2))
    optimizer = torch.optim.Adam([weight])
    weight.grad = torch.ones(2, 2)
    optimizer.step()
    optimizer.state[weight]["note"] = 3
    assert set(map(id, optimizer_state_tensors(optimizer))) == {
        id(optimizer.state[weight]["exp_avg"]),
        id(optimizer.state[weight]["exp_avg_sq"]),
    }


def test_learners_need_a_bindable_model():
    with pytest.raises(ValueError, match="learners_per_device=1"):
        FlatView([torch.ones(2, dtype=torch.bfloat16)], bind=True, learners=2)
    with pytest.raises(ValueError, match=r"torch.float32 on cpu, torch.float64 on cpu\. HINT: cast the model"):
        FlatView([torch.ones(2), torch.ones((), dtype=torch.float64)], bind=True, learners=2)
    with pytest.raises(ValueError, match="cannot stack complex parameters"):
        FlatView([torch.ones(2, dtype=torch.cfloat)], bind=True, learners=2)


def test_a_merge_counts_every_learner_of_every_replica():
    """SMA over 2 replicas × 2 learners: n = 4, the mean is over the four learners' snapshots."""
    torch.manual_seed(0)
    net = nn.Linear(2, 1)
    comm = FakeCommunicator(world_size=2)  # an identical peer
    rule = SMA(alpha=0.1, central_momentum=0.0)
    averager = ElasticAverager(net, comm, MergeSettings(rule, weights="uniform"), learners=2)
    start = averager.params.read()[0]
    averager.before_local_step()
    with torch.no_grad():
        averager.params.live[0].add_(1.0)  # learner 0 moved; learner 1 did not
    averager.after_local_step(4)
    center, _ = averager.merge(1.0)
    # Snapshots are the start for both learners: every correction is 0, and the center stays where it was.
    torch.testing.assert_close(center, start)
    torch.testing.assert_close(averager.params.read(), torch.stack([start + 1.0, start]))
    averager.before_local_step()
    averager.after_local_step(4)
    center, _ = averager.merge(1.0)
    # Now learner 0's snapshot is start + 1: x̂₀ − z = 1, so it gives up α, and z moves by α·n·(mean − z) = α·4·½.
    torch.testing.assert_close(center, start + 0.1 * 4 * 0.5)
    torch.testing.assert_close(averager.params.read()[0], start + 1.0 - 0.1)
    assert averager.num_models == 4


def test_the_global_model_is_shown_unstacked_for_evaluation_and_adopted_at_the_end():
    torch.manual_seed(0)
    net = Net()
    averager = ElasticAverager(net, FakeCommunicator(world_size=1), MergeSettings(ElasticAverage()), learners=2)
    with torch.no_grad():
        averager.params.live[0].add_(2.0)
    rows = averager.params.read()
    averager.swap_in_global_model()
    assert net.hidden.weight.shape == (5, 3)
    torch.testing.assert_close(FlatView(trainable_parameters(net)).read(), rows.mean(dim=0))
    net(torch.randn(4, 3))  # a plain forward works on the shown model
    averager.swap_out()
    assert net.hidden.weight.shape == (2, 5, 3)
    torch.testing.assert_close(averager.params.read(), rows)
    averager.adopt_global_model()
    assert [b.shape for b in floating_buffers(net)] == [(5,), (5,)]
    torch.testing.assert_close(FlatView(trainable_parameters(net)).read(), rows.mean(dim=0))


def test_tuning_measures_while_learners_pay_and_every_replica_decides_on_the_summed_rates():
    measured: list[int] = []
    rates = {1: 100.0, 2: 190.0, 3: 200.0, 4: 400.0}

    def measure(learners: int) -> float:
        measured.append(learners)
        return rates[learners]

    comm = FakeCommunicator(world_size=2)  # an identical peer: the job's rate is twice this replica's
    kept, job = tune_learners(measure, comm, LearnerTuning(max_learners=4, min_gain=0.1))
    assert (kept, job, measured) == (2, [200.0, 380.0, 400.0], [1, 2, 3])
    assert comm.calls == ["host_all_reduce_sum_"] * 3


def test_a_replica_out_of_memory_ends_the_tuning_for_all():
    comm = FakeCommunicator(world_size=2, peers_sum=lambda t: torch.tensor([50.0, 1.0, 0.0], dtype=t.dtype))
    kept, job = tune_learners(lambda k: 100.0 * k, comm, LearnerTuning(max_learners=4))
    assert (kept, job) == (1, [0.0])  # the peer failed at 1 learner already: no rate counts


def test_a_measurement_that_fails_on_one_replica_fails_every_replica_after_the_collective():
    def fails_at_two(learners: int) -> float:
        if learners == 2:
            raise RuntimeError("CUDA error: an illegal memory access")
        return 100.0

    comm = FakeCommunicator(world_size=2)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        tune_learners(fails_at_two, comm, LearnerTuning(max_learners=4, min_gain=0.0))
    assert comm.calls == ["host_all_reduce_sum_"] * 2, "the failing replica still joins the collective"
    peer_failed = FakeCommunicator(world_size=2, peers_sum=lambda t: torch.tensor([0.0, 1.0, 1.0], dtype=t.dtype))
    with pytest.raises(RuntimeError, match=r"1 replica\(s\) failed while measuring 1 learners"):
        tune_learners(lambda k: 100.0, peer_failed, LearnerTuning(max_learners=4))


def test_auto_keeps_one_learner_where_the_step_cannot_run_batched(caplog):
    net = Net()

    def reads_the_loss(batch, batch_idx):
        loss = net.training_step(batch, batch_idx)["loss"]
        return loss if loss.item() > 0 else -loss

    with caplog.at_level("WARNING", logger="lightning_aesgd"):
        assert measure_learners(net, reads_the_loss, _batch(8, seed=0), 2, repeats=1) == 0.0
        assert measure_learners(net, reads_the_loss, _batch(8, seed=0), 1, repeats=1) > 0.0
    assert "learners_per_device='auto' keeps 1 learner: The training step failed batched" in caplog.text
    assert [p.dim() for p in net.parameters()] == [p.dim() for p in Net().parameters()]
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_aesgd"):  # another replica's measurement: no second warning
        assert measure_learners(net, reads_the_loss, _batch(8, seed=0), 2, repeats=1, quiet=True) == 0.0
    assert "keeps 1 learner" not in caplog.text


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    ],
)
def test_learners_that_run_a_device_library_out_of_memory_do_not_fit(message):
    net = Net()

    def allocates_too_much(batch, batch_idx):
        raise RuntimeError(message)

    assert measure_learners(net, allocates_too_much, _batch(8, seed=0), 1, repeats=1) == 0.0


def test_a_measurement_failing_otherwise_is_raised():
    def fails(batch, batch_idx):
        raise RuntimeError("CUDA error: an illegal memory access")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        measure_learners(Net(), fails, _batch(8, seed=0), 1, repeats=1)


def test_measuring_learners_leaves_the_module_as_it_was():
    torch.manual_seed(0)
    net = Net()
    tensors = [*net.parameters(), *net.buffers()]
    storages = [t.data_ptr() for t in tensors]
    values = [t.detach().clone() for t in tensors]
    for learners in (1, 3):
        rate = measure_learners(net, net.training_step, _batch(8, seed=0), learners, repeats=2)
        assert rate > 0
    assert [t.data_ptr() for t in tensors] == storages
    assert all(torch.equal(t, v) for t, v in zip(tensors, values, strict=True)), "BatchNorm statistics included"
    assert all(p.grad is None for p in net.parameters())
    assert net.logged == [], "a measurement logs nothing"
    assert "log" not in vars(net)


def test_learners_fit_a_device_with_room_left_for_their_optimizer_state():
    gib = 2**30
    assert fits_in_memory(peak_bytes=10 * gib, parameter_bytes=gib, learners=2, total_bytes=16 * gib)
    assert not fits_in_memory(peak_bytes=10 * gib, parameter_bytes=gib, learners=3, total_bytes=16 * gib)


def test_learners_that_fill_exactly_the_share_of_memory_they_may_use_fit():
    # 5 + 2·2·1 = 9 = 0.9·10 bytes: at the limit, not over it.
    assert fits_in_memory(peak_bytes=5, parameter_bytes=1, learners=2, total_bytes=10)
    assert not fits_in_memory(peak_bytes=6, parameter_bytes=1, learners=2, total_bytes=10)


def test_one_learner_at_most_and_no_gain_asked_are_a_valid_tuning():
    tuning = LearnerTuning(max_learners=1, min_gain=0.0)
    assert tune_learners(lambda k: 100.0, FakeCommunicator(world_size=1), tuning) == (1, [100.0])


def test_one_replica_whose_learners_do_not_fit_ends_the_search_though_its_peer_measured_a_rate():
    measured: list[int] = []

    def measure(learners: int) -> float:
        measured.append(learners)
        return 100.0 if learners == 1 else 0.0  # two learners do not fit here

    comm = FakeCommunicator(world_size=2, peers_sum=lambda t: torch.tensor([150.0, 0.0, 0.0], dtype=t.dtype))
    kept, job = tune_learners(measure, comm, LearnerTuning(max_learners=4, min_gain=0.1))
    assert (kept, job, measured) == (1, [250.0, 0.0], [1, 2])


def test_a_slow_rate_is_a_rate_not_a_failure():
    # Below one sample per second (a large model on a slow device), learners still pay.
    assert tune_learners(lambda k: 0.5 * k, FakeCommunicator(world_size=1), LearnerTuning(max_learners=2)) == (
        2,
        [0.5, 1.0],
    )


def test_a_measurement_times_the_steps_after_the_first_and_counts_every_learners_rows(monkeypatch):
    """With each step one second of a scripted clock, the untimed first step left out: learners·rows per second."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(learner_tuning, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    net = Net()
    indices: list[int] = []

    def one_second_step(batch, batch_idx):
        clock.now += 1.0
        indices.append(batch_idx)
        return net.training_step(batch, batch_idx)

    assert measure_learners(net, one_second_step, _batch(8, seed=0), 1, repeats=2) == 8.0
    assert measure_learners(net, one_second_step, _batch(8, seed=0), 2, repeats=3) == 16.0
    assert set(indices) == {0}, "the step is timed as the first of an epoch"


def test_measuring_a_module_without_a_log_method_leaves_it_without_one():
    net = nn.Sequential(nn.Linear(3, 1))

    def step(batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(net(x), y)

    assert measure_learners(net, step, _batch(8, seed=0), 1, repeats=1) > 0
    assert not hasattr(net, "log")


def test_each_learner_is_measured_on_the_whole_batch_and_a_scalar_in_it_is_kept_as_it_is():
    x, y = _batch(4, seed=0)
    scale = torch.tensor(2.0)
    repeated = learner_tuning._repeated({"x": x, "y": y, "scale": scale, "name": "b"}, 3)
    assert torch.equal(repeated["x"], torch.cat([x, x, x]))
    assert torch.equal(repeated["y"], torch.cat([y, y, y]))
    assert repeated["scale"].shape == ()
    assert repeated["name"] == "b"


def test_learners_on_a_shared_gpu_fit_what_this_process_holds_and_what_is_free(monkeypatch):
    # Replicas on one 80 GiB GPU: this one holds 5 GiB and 10 GiB are free; the device's total is not its own.
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 4 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 * gib)
    net = nn.Linear(gib // 4 // 8, 8, bias=False, device="meta")  # 1 GiB of float32 parameters, none allocated
    fits = [learner_tuning._fits_device(net, torch.device("cuda:0"), k) for k in (2, 5)]
    assert fits == [True, False]  # 4 + 2·2·1 <= 0.9·15 < 4 + 2·5·1
    # Four replicas measuring at once share the free 10 GiB: 2.5 GiB each.
    assert not learner_tuning._fits_device(net, torch.device("cuda:0"), 2, sharers=4)  # 4 + 4 > 0.9·7.5
    assert learner_tuning._fits_device(net, torch.device("cuda:0"), 1, sharers=4)  # 4 + 2 <= 6.75


@pytest.mark.parametrize("learners", [1, 2])
def test_a_scalar_parameter_and_buffer_are_bound_shown_and_adopted(learners):
    module = nn.Linear(2, 1)
    module.temperature = nn.Parameter(torch.tensor(2.0))
    module.register_buffer("scale", torch.tensor(3.0))
    averager = ElasticAverager(module, FakeCommunicator(world_size=1), MergeSettings(ElasticAverage()), learners)
    assert module.temperature.shape == ((learners,) if learners > 1 else ())
    module.temperature.grad = torch.ones_like(module.temperature)
    averager.swap_in_global_model()
    assert module.temperature.shape == ()
    averager.swap_out()
    averager.adopt_global_model()
    assert (module.temperature.shape, module.scale.shape) == ((), ())
    torch.testing.assert_close(module.temperature.detach(), torch.tensor(2.0))
    assert learners == 1 or module.temperature.grad is None, "the learners' gradients do not outlive them"


class SharedNet(nn.Module):
    """One block registered under two names (``again``), and an output layer tied to the input layer's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(3, 3)
        self.again = self.block
        self.inner = nn.Linear(3, 3, bias=False)
        self.outer = nn.Linear(3, 3, bias=False)
        self.outer.weight = self.inner.weight
        self.out = nn.Linear(3, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.outer(torch.tanh(self.inner(self.again(torch.tanh(self.block(x)))))))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        return {"loss": nn.functional.mse_loss(self(x), y)}


def test_a_module_registered_twice_and_tied_weights_train_each_learner_as_a_module_of_its_own(float64):
    """torch's own ``tie_weights`` left a module registered twice holding the batched tensor after the step."""
    learners, rows = 2, 6
    torch.manual_seed(0)
    net = SharedNet()
    initial = copy.deepcopy(net)
    averager = ElasticAverager(net, FakeCommunicator(world_size=1), MergeSettings(ElasticAverage()), learners)
    step = LearnerStep(net, [*averager.params.tensors, *averager.buffers.tensors], learners)
    batches = [_batch(rows, seed) for seed in range(3)]
    _train_stacked(net, step, batches)  # type: ignore[arg-type]
    assert all(p.double().sum().isfinite() for p in net.parameters())  # no tensor escaped from the batched step
    for learner in range(learners):
        alone = copy.deepcopy(initial)
        part = slice(learner * rows // learners, (learner + 1) * rows // learners)
        _train_alone(alone, [(x[part], y[part]) for x, y in batches])  # type: ignore[arg-type]
        expected = torch.cat([p.reshape(-1) for p in alone.parameters()])
        torch.testing.assert_close(averager.params.current()[learner], expected, atol=1e-12, rtol=0)
