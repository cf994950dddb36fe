"""Dense workloads: IDX parsing, the Fashion-MNIST and digits DataModules, the networks and ImageClassifier."""

import gzip
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from helpers import single_process_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_aesgd.workloads.images import fashion_mnist
from lightning_aesgd.workloads.images.data import Sample, split_holdout
from lightning_aesgd.workloads.images.digits import DigitsDataModule, load_digits_tensors
from lightning_aesgd.workloads.images.fashion_mnist import (
    DEBIAN_DIR,
    ENV_VAR,
    FashionMNISTDataModule,
    is_available,
    load_split,
    read_idx,
    resolve_data_dir,
)
from lightning_aesgd.workloads.images.models import DigitsMLP, FashionCNN, ImageClassifier

_NO_FASHION = f"no Fashion-MNIST: run `apt-get install dataset-fashion-mnist` or set {ENV_VAR}"


@pytest.fixture
def one_thread() -> Iterator[None]:
    # The models are small: on a busy 2-core machine intra-op threads spin-wait more than they compute.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes()
    return header + array.astype(np.uint8).tobytes()


def _write_idx(path: Path, array: np.ndarray) -> None:
    data = _idx_bytes(array)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def _write_fashion(folder: Path, num_train: int = 50, num_test: int = 12, suffix: str = ".gz") -> None:
    rng = np.random.default_rng(0)
    for split, count in (("train", num_train), ("test", num_test)):
        image_stem, label_stem = fashion_mnist.FILES[split]
        _write_idx(folder / f"{image_stem}{suffix}", rng.integers(0, 256, (count, 28, 28)))
        _write_idx(folder / f"{label_stem}{suffix}", np.arange(count) % 10)


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_read_idx_round_trips_images_and_labels(tmp_path: Path, suffix: str) -> None:
    images = np.random.default_rng(1).integers(0, 256, (3, 28, 28)).astype(np.uint8)
    labels = np.array([9, 0, 4], dtype=np.uint8)
    _write_idx(tmp_path / f"images{suffix}", images)
    _write_idx(tmp_path / f"labels{suffix}", labels)
    read_images, read_labels = read_idx(tmp_path / f"images{suffix}"), read_idx(tmp_path / f"labels{suffix}")
    assert read_images.dtype == np.uint8
    assert read_images.flags.writeable
    np.testing.assert_array_equal(read_images, images)
    np.testing.assert_array_equal(read_labels, labels)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (bytes([0, 0, 0x0D, 1]) + np.array([2], dtype=">u4").tobytes() + bytes(8), "magic number"),  # float32
        (bytes([8, 0, 0x08, 1]) + np.array([2], dtype=">u4").tobytes() + bytes(2), "magic number"),
        (_idx_bytes(np.zeros((2, 3)))[:-1], "header declares shape"),  # truncated
        (_idx_bytes(np.zeros((2, 3))) + b"\x00", "header declares shape"),  # trailing bytes
        (bytes([0, 0, 0x08, 3]) + np.array([2], dtype=">u4").tobytes(), "file ends"),  # short header
    ],
)
def test_read_idx_rejects_malformed_files(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.gz"
    path.write_bytes(gzip.compress(data))
    with pytest.raises(ValueError, match=message):
        read_idx(path)


def test_load_split_reads_a_folder_of_idx_files(tmp_path: Path) -> None:
    _write_fashion(tmp_path, num_train=20, num_test=7)
    assert is_available(tmp_path)
    images, labels = load_split("test", tmp_path)
    assert images.shape == (7, 28, 28)
    assert images.dtype == labels.dtype == torch.uint8
    assert labels.tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_load_split_rejects_mismatched_files(tmp_path: Path) -> None:
    _write_fashion(tmp_path, num_train=20)
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(19))
    with pytest.raises(ValueError, match="labels"):
        load_split("train", tmp_path)
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.full(20, 10))
    with pytest.raises(ValueError, match=r"0\.\.9"):
        load_split("train", tmp_path)


def test_missing_data_error_names_the_fix(tmp_path: Path) -> None:
    _write_fashion(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    assert not is_available(tmp_path)
    load_split("train", tmp_path)  # the complete split still loads
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte") as error:
        load_split("test", tmp_path)
    assert "apt-get install dataset-fashion-mnist" in str(error.value)
    assert ENV_VAR in str(error.value)
    with pytest.raises(FileNotFoundError, match="missing t10k-images-idx3-ubyte"):  # the Hydra job asks before a fit
        FashionMNISTDataModule(tmp_path).check_data()


def test_data_dir_prefers_argument_then_environment_then_debian(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_data_dir() == DEBIAN_DIR == Path("/usr/share/datasets/fashion-mnist")
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    assert resolve_data_dir() == tmp_path
    assert resolve_data_dir(tmp_path / "other") == tmp_path / "other"
    _write_fashion(tmp_path)
    assert FashionMNISTDataModule(val_size=10).splits.test[0][0].shape == (1, 28, 28)


def test_split_holdout_is_a_seeded_partition() -> None:
    kept, held_out = split_holdout(100, 30, seed=3)
    assert sorted(torch.cat([kept, held_out]).tolist()) == list(range(100))
    assert len(held_out) == 30
    assert torch.equal(held_out, split_holdout(100, 30, seed=3)[1])
    assert not torch.equal(held_out, split_holdout(100, 30, seed=4)[1])
    with pytest.raises(ValueError, match="HINT"):
        split_holdout(100, 100, seed=0)


def test_fashion_datamodule_splits_normalises_and_subsets(tmp_path: Path) -> None:
    _write_fashion(tmp_path, num_train=50, num_test=12)
    module = FashionMNISTDataModule(tmp_path, batch_size=8, val_size=10, seed=1, subset=25)
    module.setup("fit")
    train, val, test = module.splits.train, module.splits.val, module.splits.test
    assert (len(train), len(val), len(test)) == (25, 10, 12)  # type: ignore[arg-type]
    images, labels = next(iter(module.train_dataloader()))
    assert images.shape == (8, 1, 28, 28)
    assert images.dtype == torch.float32
    assert labels.dtype == torch.int64

    raw_images, raw_labels = load_split("train", tmp_path)
    kept, held_out = split_holdout(50, 10, seed=1)
    first_val_image, first_val_label = val[0]
    expected = (raw_images[held_out[0]].float() / 255 - fashion_mnist.MEAN) / fashion_mnist.STD
    torch.testing.assert_close(first_val_image[0], expected)
    assert first_val_label == raw_labels[held_out[0]]
    # The subset is a prefix of the training part, so it never overlaps validation.
    torch.testing.assert_close(train[len(train) - 1][1], raw_labels[kept[24]].long())  # type: ignore[arg-type]


def test_fashion_datamodule_rejects_oversized_subset(tmp_path: Path) -> None:
    _write_fashion(tmp_path, num_train=50)
    with pytest.raises(ValueError, match="subset"):
        FashionMNISTDataModule(tmp_path, val_size=10, subset=0)
    with pytest.raises(ValueError, match="subset=41"):
        FashionMNISTDataModule(tmp_path, val_size=10, subset=41).setup("fit")


def _digits_splits(seed: int) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    module = DigitsDataModule(seed=seed)
    module.setup("fit")
    splits = (module.splits.train, module.splits.val, module.splits.test)
    assert all(isinstance(split, TensorDataset) for split in splits)
    return splits  # type: ignore[return-value]


def test_digits_datamodule_partitions_the_data_by_seed() -> None:
    splits = _digits_splits(seed=0)
    assert [len(split) for split in splits] == [1797 - 180 - 360, 180, 360]
    features = torch.cat([split.tensors[0] for split in splits])
    all_features, all_labels = load_digits_tensors()
    assert features.dtype == torch.float32
    assert features.min() == 0.0
    assert features.max() == 1.0
    # Together the splits hold every digit exactly once (compared as multisets of rows, labels included).
    rows = torch.cat([features, torch.cat([split.tensors[1] for split in splits])[:, None].float()], dim=1)
    all_rows = torch.cat([all_features, all_labels[:, None].float()], dim=1)
    assert Counter(map(tuple, rows.tolist())) == Counter(map(tuple, all_rows.tolist()))
    assert torch.equal(splits[2].tensors[1], _digits_splits(seed=0)[2].tensors[1])
    assert not torch.equal(splits[2].tensors[1], _digits_splits(seed=1)[2].tensors[1])


def test_networks_map_inputs_to_ten_scores_and_the_cnn_has_batchnorm_buffers() -> None:
    cnn = FashionCNN(width=4)
    assert cnn(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert any(name.endswith("running_mean") for name, _ in cnn.named_buffers())
    assert DigitsMLP()(torch.rand(5, 64)).shape == (5, 10)


def test_classifier_validates_arguments_and_builds_the_named_optimizer() -> None:
    with pytest.raises(ValueError, match="Unknown optimizer"):
        ImageClassifier(optimizer="lbfgs")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown network"):
        ImageClassifier("resnet")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="momentum"):
        ImageClassifier(momentum=1.0)
    sgd = ImageClassifier("digits_mlp", lr=0.2, momentum=0.5, weight_decay=1e-4).configure_optimizers()
    assert isinstance(sgd, torch.optim.SGD)
    assert (sgd.defaults["lr"], sgd.defaults["momentum"], sgd.defaults["weight_decay"]) == (0.2, 0.5, 1e-4)
    assert isinstance(ImageClassifier("digits_mlp", lr=1e-3, optimizer="adam").configure_optimizers(), torch.optim.Adam)


def _accuracy(module: ImageClassifier, loader: DataLoader[Sample]) -> float:
    module.eval()
    with torch.no_grad():
        correct = sum(int((module(inputs).argmax(1) == labels).sum()) for inputs, labels in loader)
    return correct / len(loader.dataset)  # type: ignore[arg-type]


@pytest.mark.usefixtures("one_thread")
def test_classifier_learns_digits_and_restores_from_checkpoint(tmp_path: Path) -> None:
    pl.seed_everything(0)
    datamodule = DigitsDataModule()
    module = ImageClassifier("digits_mlp", lr=0.05)
    trainer = single_process_trainer(epochs=8)
    trainer.fit(module, datamodule=datamodule)
    assert {"train/loss_epoch", "val/loss", "val/acc"} <= trainer.callback_metrics.keys()
    assert trainer.callback_metrics["val/acc"] > 0.9
    result = trainer.test(module, datamodule=datamodule, verbose=False)[0]
    assert result["test/acc"] > 0.9
    assert result["test/loss"] < 0.5
    # Exactly the fraction of correct test samples (micro average), however the batches fell.
    assert result["test/acc"] == pytest.approx(_accuracy(module, datamodule.test_dataloader()), abs=1e-6)

    checkpoint = tmp_path / "digits.ckpt"
    trainer.save_checkpoint(checkpoint)
    restored = ImageClassifier.load_from_checkpoint(checkpoint)
    assert restored.hparams["network"] == "digits_mlp"
    inputs = next(iter(datamodule.test_dataloader()))[0]
    torch.testing.assert_close(restored(inputs), module(inputs))


def test_classifier_with_a_module_restores_when_given_the_module_again(tmp_path: Path) -> None:
    module = ImageClassifier(nn.Linear(64, 3), num_classes=3)
    assert "network" not in module.hparams
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    loader = DataLoader(TensorDataset(torch.rand(8, 64), torch.arange(8) % 3))
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    checkpoint = tmp_path / "linear.ckpt"
    trainer.save_checkpoint(checkpoint)
    restored = ImageClassifier.load_from_checkpoint(checkpoint, network=nn.Linear(64, 3))
    assert restored.hparams["num_classes"] == 3
    inputs = torch.rand(4, 64)
    torch.testing.assert_close(restored(inputs), module(inputs))


@pytest.mark.slow
@pytest.mark.skipif(not is_available(), reason=_NO_FASHION)
def test_fashion_cnn_learns_a_subset_well_above_chance() -> None:
    pl.seed_everything(0)
    datamodule = FashionMNISTDataModule(batch_size=64, val_size=1000, subset=4000)
    module = ImageClassifier("fashion_cnn")
    trainer = single_process_trainer(epochs=1)
    trainer.fit(module, datamodule=datamodule)
    # Chance is 0.1; this run reaches about 0.82 (the full two epochs reach about 0.89).
    assert trainer.callback_metrics["val/acc"] > 0.7
    assert trainer.test(module, datamodule=datamodule, verbose=False)[0]["test/acc"] > 0.7
