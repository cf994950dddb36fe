"""Real XMC data from the Extreme Classification Repository's BoW files: parsing, errors, and a short training run."""

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from helpers import single_process_trainer

import lightning_aesgd.workloads.xmc.files as files
from lightning_aesgd.workloads import XMCFileError, XMCFilesDataModule, XMCModule, read_xmc_file
from lightning_aesgd.workloads.xmc.batch import SparseXMCDataset

# Five points, eight features, six labels: point 1 has no label (its line starts with a space), point 2's features
# are out of order, point 3 repeats a label, point 4 has labels but no feature.
TRAIN = """5 8 6
0,3 0:0.5 4:1.5
 2:1.0 7:0.25
1 6:2.0 1:3.0 3:0.5
2,5,2 0:1.0
4,1
"""
FEATURES = np.array(
    [
        [0.5, 0, 0, 0, 1.5, 0, 0, 0],
        [0, 0, 1.0, 0, 0, 0, 0, 0.25],
        [0, 3.0, 0, 0.5, 0, 0, 2.0, 0],
        [1.0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ],
    dtype=np.float32,
)
LABELS = np.array(
    [[1, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 1], [0, 1, 0, 0, 1, 0]],
    dtype=np.float32,
)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _assert_parsed(path: Path) -> None:
    features, labels = read_xmc_file(path)
    for matrix in (features, labels):
        assert isinstance(matrix, sp.csr_matrix)
        assert matrix.dtype == np.float32
        assert matrix.has_sorted_indices
    np.testing.assert_array_equal(features.toarray(), FEATURES)
    np.testing.assert_array_equal(labels.toarray(), LABELS)
    np.testing.assert_array_equal(np.diff(features.indptr), [2, 2, 3, 1, 0])


def test_a_file_parses_to_the_hand_computed_matrices(tmp_path: Path) -> None:
    _assert_parsed(_write(tmp_path / "train.txt", TRAIN))


def test_our_parser_agrees_where_scikit_learn_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "_parse_with_sklearn", lambda handle, header: None)
    _assert_parsed(_write(tmp_path / "train.txt", TRAIN))


def test_scikit_learn_parses_files_with_sorted_features(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    path = _write(tmp_path / "train.txt", "3 5 4\n0,2 1:0.5 3:1.0\n 0:2.0\n3 4:1.0\n")
    with path.open("rb") as handle:
        header = files._parse_header(handle.readline(), path)
        rows = files._parse_with_sklearn(handle, header)
    assert rows is not None  # the fast path took it (a point without labels included)
    features, labels = read_xmc_file(path)
    np.testing.assert_array_equal(features.toarray(), [[0, 0.5, 0, 1, 0], [2, 0, 0, 0, 0], [0, 0, 0, 0, 1]])
    np.testing.assert_array_equal(labels.toarray(), [[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]])


@pytest.mark.parametrize("sklearn", [True, False])
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5 8\n0 1:1.0\n", r"malformed header '5 8'.*num_points num_features num_labels"),
        ("0,3 0:0.5 4:1.5\n1 2:1.0\n", r"malformed header '0,3 0:0.5 4:1.5'"),
        ("2 8 6\n0 1:1.0\n", r"declares 2 points but the file holds 1.*HINT"),
        ("1 8 6\n6 1:1.0\n", r"point 0 \(line 2\) has label id 6, outside \[0, 6\).*num_labels.*HINT: ids are 0-based"),
        ("2 8 6\n0 1:1.0\n1 8:1.0\n", r"point 1 \(line 3\) has feature id 8, outside \[0, 8\).*num_features"),
        ("1 8 6\n0 -1:1.0\n", r"feature id -1, outside"),
        ("1 8 6\n0 1:1.0 1:2.0\n", r"lists feature 1 twice"),
        ("1 8 6\n0 1:x\n", r"line 2: cannot parse '0 1:x'"),
        ("1 8 6\nzero 1:1.0\n", r"line 2: cannot parse"),
    ],
)
def test_malformed_files_name_the_problem_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sklearn: bool, text: str, message: str
) -> None:
    if not sklearn:
        monkeypatch.setattr(files, "_parse_with_sklearn", lambda handle, header: None)
    path = _write(tmp_path / "train.txt", text)
    with pytest.raises(XMCFileError, match=message) as error:
        read_xmc_file(path)
    assert str(path) in str(error.value)


def test_missing_files_and_mismatched_pairs_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(XMCFileError, match=r"not found: .*train\.txt\. HINT: download .* set data\.path"):
        XMCFilesDataModule(tmp_path)
    train = _write(tmp_path / "train.txt", TRAIN)
    with pytest.raises(XMCFileError, match=r"not found: .*test\.txt"):
        XMCFilesDataModule(tmp_path)
    with pytest.raises(XMCFileError, match=r"is a file, so the test file is unknown\. HINT: set data\.test_path"):
        XMCFilesDataModule(train)
    other = _write(tmp_path / "other.txt", "1 9 6\n0 1:1.0\n")
    with pytest.raises(XMCFileError, match=r"declares 8 features and 6 labels but .*other\.txt declares 9 and 6"):
        XMCFilesDataModule(train, test_path=other)
    with pytest.raises(XMCFileError, match=r"declares 9 features but the training file declares 8"):
        read_xmc_file(other, num_features=8, num_labels=6)


def _learnable_files(folder: Path, rows: int, seed: int) -> None:
    """Points whose label is written in their features: label l ↔ features 2l and 2l + 1."""
    rng = np.random.default_rng(seed)
    for name, count in (("train.txt", rows), ("test.txt", rows // 4)):
        lines = [f"{count} 24 8"]
        for _ in range(count):
            label = int(rng.integers(8))
            noise = sorted(set(rng.integers(16, 24, size=3).tolist()))
            pairs = [(2 * label + 1, 1.0), (2 * label, 1.0)] + [(n, 0.5) for n in noise]  # out of order on purpose
            lines.append(f"{label} " + " ".join(f"{i}:{v}" for i, v in pairs))
        (folder / name).write_text("\n".join(lines) + "\n")


def test_the_datamodule_serves_splits_that_the_model_learns(tmp_path: Path) -> None:
    _learnable_files(tmp_path, rows=400, seed=0)
    datamodule = XMCFilesDataModule(tmp_path, batch_size=32, val_fraction=0.25)
    assert datamodule.model_dimensions() == {"num_features": 24, "num_labels": 8}
    datamodule.setup("fit")
    assert isinstance(datamodule.splits.train, SparseXMCDataset)
    assert (len(datamodule.splits.train), len(datamodule.splits.val), len(datamodule.splits.test)) == (300, 100, 100)
    costs = datamodule.train_costs  # non-zeros: the two label features and one to three noise features
    assert costs.shape == (300,)
    assert costs.min() >= 3
    assert costs.max() <= 5
    torch.manual_seed(0)
    model = XMCModule(**datamodule.model_dimensions(), hidden=16, lr=0.5)
    trainer = single_process_trainer(epochs=4)
    trainer.fit(model, datamodule=datamodule)
    tested = trainer.test(model, datamodule=datamodule, verbose=False)[0]
    assert tested["test/p@1"] > 0.9


def test_normalize_gives_unit_rows(tmp_path: Path) -> None:
    _learnable_files(tmp_path, rows=40, seed=1)
    datamodule = XMCFilesDataModule(tmp_path, normalize=True)
    X_train, _, X_test, _ = datamodule.data
    for features in (X_train, X_test):
        np.testing.assert_allclose(np.sqrt(features.multiply(features).sum(axis=1)).A.ravel(), 1.0, rtol=1e-6)
        assert features.dtype == np.float32


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_main_job_trains_on_the_files_with_two_heterogeneous_replicas(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from lightning_aesgd.train import config_dir, run

    data = tmp_path / "data"
    data.mkdir()
    _learnable_files(data, rows=400, seed=2)
    overrides = [
        f"hydra.runtime.output_dir={tmp_path}",
        "data=xmc_files",
        f"data.path={data}",
        "data.batch_size=16",
        "algorithm=adaptive_elastic",
        "devices.num_replicas=2",
        "devices.slowdown.base=1",
        "devices.slowdown.factors=[1,3]",
        "trainer.max_epochs=2",
        "+trainer.enable_progress_bar=false",
        "++trainer.enable_model_summary=false",
    ]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    results = run(cfg)
    assert results["test/p@1"] > 0.9  # chance: 1/8
    assert (tmp_path / "logs" / "metrics.csv").exists()
