r"""Real XMC data from the Extreme Classification Repository's bag-of-words files, read from disk (never downloaded).

The repository's BoW files hold one header line ``num_points num_features num_labels`` and then one point per
line, ``l1,l2,... f1:v1 f2:v2 ...``: 0-based label ids separated by commas (none for a point without labels, the
line then starts with a space), then 0-based ``feature:value`` pairs. After the header this is the multi-label
SVMlight format that scikit-learn's ``load_svmlight_file(multilabel=True)`` reads; it parses the points where it
is installed and accepts the file (its parser wants each row's features sorted), and a small parser of our own
does otherwise. Either way the header is checked against the points, and every id against its range.

The result uses the generator's structures: float32 CSR features and binary float32 CSR labels, served as
:class:`~lightning_aesgd.workloads.xmc.batch.SparseXMCDataset`, so the model, the metrics and cost-aware
routing work unchanged.

Example:
    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = pathlib.Path(folder) / "train.txt"
    ...     _ = path.write_text("2 4 3\n0,2 1:0.5 3:1.0\n 0:2.0\n")
    ...     features, labels = read_xmc_file(path)
    >>> features.toarray().tolist(), labels.toarray().tolist()
    ([[0.0, 0.5, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]], [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import scipy.sparse as sp
from torch import Tensor

from lightning_aesgd.workloads.datamodule import SplitDataModule, Splits
from lightning_aesgd.workloads.xmc.batch import SparseXMCDataset, collate_sparse

_FORMAT_HINT = (
    "an Extreme Classification Repository BoW file starts with the line `num_points num_features num_labels`, "
    "then one point per line: `l1,l2,... f1:v1 f2:v2 ...` with 0-based ids"
)


class XMCFileError(ValueError):
    """A missing or malformed XMC file; the message names the file and the fix."""


class XMCHeader(NamedTuple):
    """The first line of an XMC file."""

    num_points: int
    num_features: int
    num_labels: int


@dataclass(frozen=True)
class _Rows:
    """Parsed points before validation: CSR pointers, ids and values of features and labels."""

    feature_ptr: np.ndarray
    feature_ids: np.ndarray
    feature_values: np.ndarray
    label_ptr: np.ndarray
    label_ids: np.ndarray


def read_header(path: str | os.PathLike[str]) -> XMCHeader:
    """Read and check the header line of an XMC file.

    Args:
        path: The file.

    Returns:
        The three counts of the header.

    Raises:
        XMCFileError: If the file does not exist or its first line is not three non-negative integers (with at
            least one feature and one label).
    """
    path = _existing(path)
    with path.open("rb") as handle:
        return _parse_header(handle.readline(), path)


def read_xmc_file(
    path: str | os.PathLike[str], num_features: int | None = None, num_labels: int | None = None
) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Read an XMC BoW file into float32 CSR features and binary float32 CSR labels.

    Each row's features come out sorted by id; repeated labels of a point count once.

    Args:
        path: The file.
        num_features: The feature count it must declare, e.g. the training file's when reading the test file.
        num_labels: The label count it must declare.

    Returns:
        ``(features, labels)`` of shapes ``(num_points, num_features)`` and ``(num_points, num_labels)``.

    Raises:
        XMCFileError: If the file is missing, its header is malformed or disagrees with its points or with
            ``num_features``/``num_labels``, a line cannot be parsed, an id lies out of range, or a point repeats a
            feature.
    """
    path = _existing(path)
    with path.open("rb") as handle:
        header = _parse_header(handle.readline(), path)
        for name, expected, found in (
            ("features", num_features, header.num_features),
            ("labels", num_labels, header.num_labels),
        ):
            if expected is not None and expected != found:
                raise XMCFileError(
                    f"{path}: the header declares {found} {name} but the training file declares {expected}. HINT: "
                    "train and test files of one data set share their feature and label spaces; pass the matching "
                    "pair of files."
                )
        rows = _parse_with_sklearn(handle, header)
    if rows is None:
        # scikit-learn is missing or refused the file: our parser reads it, or says exactly what is wrong.
        rows = _parse_points(path, header)
    return _assemble(rows, header, path)


def _existing(path: str | os.PathLike[str]) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise XMCFileError(
            f"XMC file not found: {path}. HINT: download the data set from the Extreme Classification Repository "
            "yourself (nothing is downloaded for you) and set data.path to the directory holding train.txt and "
            "test.txt, or to the training file with data.test_path set to the test file."
        )
    return path


def _parse_header(line: bytes, path: Path) -> XMCHeader:
    fields = line.split()
    counts = [int(field) for field in fields if field.isdigit()]
    if len(fields) != 3 or len(counts) != 3 or counts[1] < 1 or counts[2] < 1:
        shown = line.decode("utf-8", "replace").strip()
        raise XMCFileError(
            f"{path}: malformed header {shown!r}. HINT: {_FORMAT_HINT}; add or fix the header line (files in "
            "plain SVMlight format lack it)."
        )
    return XMCHeader(*counts)


def _parse_with_sklearn(handle: Any, header: XMCHeader) -> _Rows | None:
    """Parse the points after the header with scikit-learn's C parser; ``None`` where it is missing or refuses."""
    try:
        from sklearn.datasets import load_svmlight_file
    except ImportError:
        return None
    try:
        features, labels = load_svmlight_file(handle, dtype=np.float32, multilabel=True, zero_based=True)
    except ValueError:  # unsorted or repeated features, negative ids, a malformed line: ours explains
        return None
    if features.shape[0] != header.num_points:  # it skips blank lines, which are points without labels or words
        return None
    label_counts = np.fromiter((len(point) for point in labels), dtype=np.int64, count=len(labels))
    label_values = np.fromiter((label for point in labels for label in point), dtype=np.float64)
    if not np.array_equal(label_values, np.round(label_values)):
        return None
    return _Rows(
        feature_ptr=np.asarray(features.indptr, dtype=np.int64),
        feature_ids=np.asarray(features.indices, dtype=np.int64),
        feature_values=np.asarray(features.data, dtype=np.float32),
        label_ptr=_pointers(label_counts),
        label_ids=label_values.astype(np.int64),
    )


def _parse_points(path: Path, header: XMCHeader) -> _Rows:
    """Our own parser of the points: any feature order, each line checked, errors naming the line."""
    label_ids: list[int] = []
    label_counts: list[int] = []
    pairs: list[np.ndarray] = []
    feature_counts: list[int] = []
    with path.open(encoding="utf-8") as handle:
        handle.readline()
        for number, line in enumerate(handle, start=2):
            parts = line.split()
            labels = parts.pop(0).split(",") if parts and ":" not in parts[0] else []
            try:
                point_labels = [int(label) for label in labels]
                numbers = np.asarray(" ".join(parts).replace(":", " ").split(), dtype=np.float64)
                parsed = all(part.count(":") == 1 for part in parts)
            except ValueError:
                parsed = False
            if not parsed:
                raise XMCFileError(f"{path}, line {number}: cannot parse {line.strip()[:80]!r}. HINT: {_FORMAT_HINT}.")
            label_ids.extend(point_labels)
            label_counts.append(len(point_labels))
            pairs.append(numbers)
            feature_counts.append(len(parts))
    flat = np.concatenate(pairs) if pairs else np.empty(0)
    ids, values = flat[0::2], flat[1::2]
    if not np.array_equal(ids, np.round(ids)):
        raise XMCFileError(f"{path}: a feature id is not an integer. HINT: {_FORMAT_HINT}.")
    if len(feature_counts) != header.num_points:
        _raise_count_mismatch(path, header, len(feature_counts))
    return _Rows(
        feature_ptr=_pointers(np.asarray(feature_counts, dtype=np.int64)),
        feature_ids=ids.astype(np.int64),
        feature_values=values.astype(np.float32),
        label_ptr=_pointers(np.asarray(label_counts, dtype=np.int64)),
        label_ids=np.asarray(label_ids, dtype=np.int64),
    )


def _pointers(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts, dtype=np.int64)])


def _raise_count_mismatch(path: Path, header: XMCHeader, found: int) -> None:
    raise XMCFileError(
        f"{path}: the header declares {header.num_points} points but the file holds {found}. HINT: fix the first "
        "number of the header, or restore the missing lines (a truncated download?)."
    )


def _assemble(rows: _Rows, header: XMCHeader, path: Path) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Check every id against the header and build the CSR matrices."""
    num_points = rows.feature_ptr.size - 1
    if num_points != header.num_points:
        _raise_count_mismatch(path, header, num_points)
    for name, ids, bound in (
        ("feature", rows.feature_ids, header.num_features),
        ("label", rows.label_ids, header.num_labels),
    ):
        outside = (ids < 0) | (ids >= bound)
        if outside.any():
            bad = int(ids[np.argmax(outside)])
            row_ptr = rows.feature_ptr if name == "feature" else rows.label_ptr
            point = int(np.searchsorted(row_ptr, np.argmax(outside), side="right")) - 1
            raise XMCFileError(
                f"{path}: point {point} (line {point + 2}) has {name} id {bad}, outside [0, {bound}) that the header "
                f"declares (num_{name}s={bound}). HINT: ids are 0-based; fix the header's num_{name}s, or convert "
                "1-based ids by subtracting 1."
            )
    features = sp.csr_matrix(
        (rows.feature_values, rows.feature_ids, rows.feature_ptr), shape=(num_points, header.num_features)
    )
    features.sort_indices()
    row_of_entry = np.repeat(np.arange(num_points), np.diff(features.indptr))
    repeated = (np.diff(features.indices) == 0) & (np.diff(row_of_entry) == 0)
    if repeated.any():
        point = int(row_of_entry[np.argmax(repeated)])
        raise XMCFileError(
            f"{path}: point {point} (line {point + 2}) lists feature {int(features.indices[np.argmax(repeated)])} "
            "twice. HINT: each feature appears at most once per point; merge the repeated entries."
        )
    labels = sp.csr_matrix(
        (np.ones(rows.label_ids.size, dtype=np.float32), rows.label_ids, rows.label_ptr),
        shape=(num_points, header.num_labels),
    )
    labels.sum_duplicates()
    labels.data[:] = 1.0
    return features.astype(np.float32), labels


class XMCFilesDataModule(SplitDataModule[SparseXMCDataset]):
    """Serves a real XMC data set from its train and test files, as :class:`XMCDataModule` serves a generated one.

    The headers are read (and checked) at construction, so the model can be sized before anything else is
    read; the points are read in :meth:`setup`, by every process of a distributed run from the same files.
    A seeded random ``val_fraction`` of the training file is held out for validation; the test file is never
    used for model selection. The repository's BoW features are already TF-IDF weighted, so values are kept
    as they are unless ``normalize`` asks for unit rows.

    Args:
        path: The directory holding ``train.txt`` and ``test.txt``, or the training file itself.
        test_path: The test file; needed where ``path`` is a file, and overrides ``test.txt`` otherwise.
        batch_size: Rows per batch of every loader.
        num_workers: DataLoader worker processes.
        val_fraction: Fraction of the training points held out for validation, in ``(0, 1)``.
        seed: Seed of the validation hold-out.
        normalize: L2-normalise every point's features.

    Raises:
        XMCFileError: If a file is missing or its header is malformed, or the two files disagree on the
            numbers of features and labels.
        ValueError: If ``val_fraction`` leaves no training or no validation point.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        test_path: str | os.PathLike[str] | None = None,
        batch_size: int = 256,
        num_workers: int = 0,
        val_fraction: float = 0.1,
        seed: int = 0,
        normalize: bool = False,
    ) -> None:
        super().__init__(batch_size, num_workers, collate_fn=collate_sparse, drop_last=True)
        self.save_hyperparameters()
        self.train_path, self.test_path = _resolve_paths(Path(path).expanduser(), test_path)
        self.header = read_header(self.train_path)
        test_header = read_header(self.test_path)
        if test_header[1:] != self.header[1:]:
            raise XMCFileError(
                f"{self.train_path} declares {self.header.num_features} features and {self.header.num_labels} labels "
                f"but {self.test_path} declares {test_header.num_features} and {test_header.num_labels}. HINT: "
                "train and test files of one data set share their feature and label spaces; pass the matching pair."
            )
        self.num_val = round(val_fraction * self.header.num_points)
        if not 0 < self.num_val < self.header.num_points:
            raise ValueError(
                f"val_fraction={val_fraction} holds out {self.num_val} of {self.header.num_points} training points; "
                "HINT: choose a fraction that leaves at least one point on each side."
            )
        self.seed = seed
        self.normalize = normalize

    @property
    def num_features(self) -> int:
        """Input dimension, from the header."""
        return self.header.num_features

    @property
    def num_labels(self) -> int:
        """Number of labels, from the header."""
        return self.header.num_labels

    def model_dimensions(self) -> dict[str, Any]:
        """The arguments that size a model for this data: ``num_features`` and ``num_labels``."""
        return {"num_features": self.num_features, "num_labels": self.num_labels}

    @cached_property
    def data(self) -> tuple[sp.csr_matrix, sp.csr_matrix, sp.csr_matrix, sp.csr_matrix]:
        """``(X_train, Y_train, X_test, Y_test)`` as read from the files (read on first access)."""
        X_train, Y_train = read_xmc_file(self.train_path)
        X_test, Y_test = read_xmc_file(self.test_path, self.num_features, self.num_labels)
        if self.normalize:
            X_train, X_test = _unit_rows(X_train), _unit_rows(X_test)
        return X_train, Y_train, X_test, Y_test

    def build_splits(self) -> Splits[SparseXMCDataset]:
        """Reads the files; a seeded random ``val_fraction`` of the training points is held out for validation."""
        X_train, Y_train, X_test, Y_test = self.data
        order = np.random.default_rng(self.seed).permutation(X_train.shape[0])
        fit, val = np.sort(order[self.num_val :]), np.sort(order[: self.num_val])
        return Splits(
            train=SparseXMCDataset(X_train[fit], Y_train[fit]),
            val=SparseXMCDataset(X_train[val], Y_train[val]),
            test=SparseXMCDataset(X_test, Y_test),
        )

    @property
    def train_costs(self) -> Tensor:
        """Non-zeros of every training point, in dataset order (for cost-aware routing)."""
        return self.splits.train.sample_costs


def _resolve_paths(path: Path, test_path: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    if path.is_dir():
        return path / "train.txt", Path(test_path).expanduser() if test_path is not None else path / "test.txt"
    if test_path is None:
        _existing(path)
        raise XMCFileError(
            f"data.path={path} is a file, so the test file is unknown. HINT: set data.test_path to the test file, or "
            "set data.path to the directory holding train.txt and test.txt."
        )
    return path, Path(test_path).expanduser()


def _unit_rows(features: sp.csr_matrix) -> sp.csr_matrix:
    norms = np.sqrt(np.asarray(features.multiply(features).sum(axis=1)).ravel())
    scale = np.divide(1.0, norms, out=np.ones_like(norms), where=norms > 0)
    return sp.csr_matrix(sp.diags(scale.astype(np.float32)) @ features, dtype=np.float32)
