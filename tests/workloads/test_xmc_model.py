"""Sparse batches, the XMC network, its LightningModule and DataModule, and learnability on ``mini``."""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import scipy.sparse as sp
import torch
from helpers import single_process_trainer
from lightning_fabric.utilities.apply_func import move_data_to_device

from lightning_aesgd.workloads.xmc.batch import SparseBatch, SparseXMCDataset, collate_sparse
from lightning_aesgd.workloads.xmc.datamodule import XMCDataModule
from lightning_aesgd.workloads.xmc.model import XMCModule, XMCNet
from lightning_aesgd.workloads.xmc.stats import popularity_precision


@pytest.fixture
def one_thread() -> Iterator[None]:
    # The model is tiny: intra-op threads gain nothing, and on a busy 2-core machine their spin-waiting made
    # each small op 100× slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def datamodule() -> XMCDataModule:
    module = XMCDataModule("mini", batch_size=32)
    module.setup("fit")
    return module


def _random_csr(rows: int, cols: int, density: float, seed: int) -> sp.csr_matrix:
    matrix = sp.random(rows, cols, density=density, format="lil", dtype=np.float32, random_state=seed)
    matrix[np.arange(rows), np.arange(rows) % cols] = 1.0  # no empty rows, so every row has a label
    return sp.csr_matrix(matrix)


def test_collated_batch_round_trips_the_csr_rows() -> None:
    features, labels = _random_csr(9, 30, 0.2, seed=0), _random_csr(9, 12, 0.2, seed=1)
    labels.data[:] = 1.0
    dataset = SparseXMCDataset(features, labels)
    batch = collate_sparse([dataset[i] for i in (4, 0, 7)])
    assert len(batch) == 3
    assert batch.indices.dtype == torch.int64
    assert batch.weights.dtype == torch.float32
    ends = torch.cat([batch.offsets[1:], torch.tensor([batch.indices.numel()])])
    for position, row in enumerate((4, 0, 7)):
        dense = torch.zeros(30)
        start, end = batch.offsets[position], ends[position]
        dense[batch.indices[start:end]] = batch.weights[start:end]
        torch.testing.assert_close(dense, torch.from_numpy(features[row].toarray().ravel()))
    torch.testing.assert_close(batch.dense_labels(12), torch.from_numpy(labels[[4, 0, 7]].toarray()))
    torch.testing.assert_close(dataset.sample_costs, torch.from_numpy(np.diff(features.indptr)).float())


def test_embedding_bag_forward_equals_dense_matmul() -> None:
    features = _random_csr(6, 40, 0.15, seed=2)
    dataset = SparseXMCDataset(features, _random_csr(6, 5, 0.3, seed=3))
    batch = collate_sparse([dataset[i] for i in range(6)])
    net = XMCNet(num_features=40, num_labels=5, hidden=8)
    with torch.no_grad():
        net.hidden_bias.normal_()
        hidden = torch.from_numpy(features.toarray()) @ net.embedding.weight + net.hidden_bias
        expected = net.output(torch.relu(hidden))
        torch.testing.assert_close(net(batch.indices, batch.offsets, batch.weights), expected)


def test_a_batch_on_the_meta_device_gives_its_labels_and_forward_without_reading_a_value() -> None:
    # The meta device holds no values: what works there reads none back to the host (a GPU step would wait).
    features, labels = _random_csr(6, 40, 0.15, seed=2), _random_csr(6, 5, 0.3, seed=3)
    batch = collate_sparse([SparseXMCDataset(features, labels)[i] for i in range(6)]).to("meta")
    assert batch.dense_labels(5).shape == (6, 5)
    net = XMCNet(num_features=40, num_labels=5, hidden=8).to("meta")
    assert net(batch.indices, batch.offsets, batch.weights).shape == (6, 5)


def test_batch_moves_like_a_tensor_collection() -> None:
    batch = collate_sparse(
        [SparseXMCDataset(_random_csr(3, 5, 0.5, 0), _random_csr(3, 4, 0.5, 1))[i] for i in range(3)]
    )
    moved = move_data_to_device(batch, torch.device("cpu"))  # Lightning's batch transfer
    assert isinstance(moved, SparseBatch)
    torch.testing.assert_close(moved.indices, batch.indices)
    assert batch.to("cpu").device == torch.device("cpu")


def test_datamodule_splits_and_loaders(datamodule: XMCDataModule) -> None:
    spec = datamodule.spec
    assert (datamodule.num_features, datamodule.num_labels) == (2_000, 500)
    assert len(datamodule.train_set) + len(datamodule.val_set) == spec.n_train
    assert len(datamodule.val_set) == round(0.1 * spec.n_train)
    assert len(datamodule.test_set) == spec.n_test
    costs = datamodule.train_costs
    assert costs.shape == (len(datamodule.train_set),)
    assert costs.min() >= 1
    batch = next(iter(datamodule.train_dataloader()))
    assert isinstance(batch, SparseBatch)
    assert len(batch) == 32
    # Validation rows are the held-out end of the training split, never seen in training.
    last_val = datamodule.val_set[len(datamodule.val_set) - 1]
    np.testing.assert_array_equal(last_val.feature_ids.numpy(), datamodule.data.X_train[-1].indices)


def test_datamodule_applies_overrides_and_rejects_empty_splits() -> None:
    module = XMCDataModule("mini", seed=3, overrides={"n_train": 1_000, "signal": 0.4})
    assert (module.spec.seed, module.spec.n_train, module.spec.signal) == (3, 1_000, 0.4)
    with pytest.raises(ValueError, match="val_fraction"):
        XMCDataModule("mini", val_fraction=0.0)


def test_module_rejects_sparse_gradients_with_adam() -> None:
    with pytest.raises(ValueError, match="HINT"):
        XMCModule(10, 5, optimizer="adam", sparse_gradients=True)
    XMCModule(10, 5, optimizer="sgd", sparse_gradients=True)


@pytest.mark.parametrize("loss", ["softmax", "bce"])
def test_losses_prefer_the_true_labels(loss: str) -> None:
    module = XMCModule(10, 4, loss=loss)  # type: ignore[arg-type]
    target = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    good, bad = torch.tensor([[5.0, 5.0, -5.0, -5.0]]), torch.tensor([[-5.0, -5.0, 5.0, 5.0]])
    assert module.loss(good, target) < module.loss(bad, target)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_module_learns_mini_beyond_popularity(datamodule: XMCDataModule, tmp_path: Path) -> None:
    pl.seed_everything(0)
    module = XMCModule(datamodule.num_features, datamodule.num_labels)
    trainer = single_process_trainer(epochs=3)
    untrained = trainer.test(module, datamodule=datamodule, verbose=False)[0]["test/p@1"]
    trainer.fit(module, datamodule=datamodule)
    assert {"train/loss", "val/loss", "val/p@3", "val/p@5", "val/ndcg@5"} <= set(trainer.callback_metrics)
    assert trainer.callback_metrics["val/p@1"] > 0.5
    trained = trainer.test(module, datamodule=datamodule, verbose=False)[0]
    baseline = popularity_precision(datamodule.data.Y_train, datamodule.data.Y_test)
    assert trained["test/p@1"] > untrained + 0.3
    assert trained["test/p@1"] > 3 * baseline
    assert trained["test/p@5"] <= trained["test/p@3"] <= trained["test/p@1"]

    checkpoint = tmp_path / "xmc.ckpt"
    trainer.save_checkpoint(checkpoint)
    restored = XMCModule.load_from_checkpoint(checkpoint)
    batch = next(iter(datamodule.test_dataloader()))
    torch.testing.assert_close(restored(batch), module(batch))


def test_batched_fetch_equals_collating_rows_one_by_one(datamodule: XMCDataModule) -> None:
    dataset = datamodule.train_set
    rows = [5, 0, 17, 5, 3]  # unordered, repeated
    gathered = dataset.__getitems__(rows)
    collated = collate_sparse([dataset[i] for i in rows])
    for name in ("indices", "offsets", "weights", "label_ids", "label_offsets"):
        torch.testing.assert_close(getattr(gathered, name), getattr(collated, name))
    assert collate_sparse(gathered) is gathered  # the DataLoader then hands the batch to collate as it is


@pytest.mark.parametrize("check", [False, True])
def test_the_optimizer_step_states_its_sparse_invariant_choice(check):
    # torch warns "Sparse invariant checks are implicitly disabled" from inside Adagrad's sparse update, once per
    # process: the step states the choice, so every replica stays quiet (the main job's test checks the console).
    module = XMCModule(10, 5, check_sparse_invariants=check)
    seen: list[bool] = []

    class Optimizer:
        def step(self, closure=None):
            seen.append(torch.sparse.check_sparse_tensor_invariants.is_enabled())

    before = torch.sparse.check_sparse_tensor_invariants.is_enabled()
    module.optimizer_step(0, 0, Optimizer(), lambda: None)
    assert seen == [check]
    assert torch.sparse.check_sparse_tensor_invariants.is_enabled() == before
