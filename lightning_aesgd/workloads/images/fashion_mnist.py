"""Fashion-MNIST (Xiao et al., 2017) read offline from the IDX files of Debian's ``dataset-fashion-mnist``.

Nothing is downloaded: the four files come from ``apt-get install dataset-fashion-mnist`` (installed under
:data:`DEBIAN_DIR`), or from any folder named by the ``data_dir`` argument or by the environment variable
:data:`ENV_VAR`, e.g. a copy carried to a machine without network access.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_aesgd.workloads.datamodule import Splits
from lightning_aesgd.workloads.images.data import ClassificationDataModule, NormalizedImages, Sample, split_holdout

Split = Literal["train", "test"]
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where the Debian package ``dataset-fashion-mnist`` installs the files."""
ENV_VAR = "AESGD_FASHION_MNIST_DIR"
"""Environment variable naming a folder with the four files; overrides :data:`DEBIAN_DIR`."""
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
"""Image and label file names (without ``.gz``) of each split."""
MEAN = 0.2860
"""Mean pixel of the 60,000 training images, scaled to ``[0, 1]``."""
STD = 0.3530
"""Standard deviation of the training pixels, scaled to ``[0, 1]``."""

_UBYTE = 0x08  # IDX type code of unsigned bytes, the only type Fashion-MNIST uses
_HINT = f"HINT: run `apt-get install dataset-fashion-mnist`, or set {ENV_VAR} to a folder holding the four files."


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Reads an IDX file of unsigned bytes (gzip-compressed if its name ends in ``.gz``).

    The format (LeCun et al.) is a big-endian header, ``0x00 0x00 <type> <ndim>`` followed by ``ndim`` uint32
    sizes, then the data in C order.

    Args:
        path: The file.

    Returns:
        A ``uint8`` array of the shape the header declares.

    Raises:
        ValueError: If the magic number is not that of unsigned bytes, or the data does not match the header.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as file:
        raw = file.read()
    offset, shape = _parse_header(raw, path)
    if len(raw) - offset != int(np.prod(shape)):
        raise ValueError(f"{path}: header declares shape {shape} but holds {len(raw) - offset} data bytes.")
    # A copy, because arrays over the immutable ``bytes`` are read-only and torch warns about those.
    array: np.ndarray = np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(shape).copy()
    return array


def _parse_header(raw: bytes, path: str | os.PathLike[str]) -> tuple[int, tuple[int, ...]]:
    """The data offset and the shape from an IDX header of unsigned bytes."""
    if len(raw) < 4 or raw[:3] != bytes([0, 0, _UBYTE]) or raw[3] == 0:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes (magic number {raw[:4].hex() or 'missing'}).")
    ndim = raw[3]
    offset = 4 + 4 * ndim
    if len(raw) < offset:
        raise ValueError(f"{path}: header declares {ndim} dimensions but the file ends after {len(raw)} bytes.")
    return offset, tuple(int(size) for size in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder to read: ``data_dir`` if given, else ``$AESGD_FASHION_MNIST_DIR`` if set, else :data:`DEBIAN_DIR`."""
    if data_dir is not None:
        return Path(data_dir)
    return Path(os.environ.get(ENV_VAR) or DEBIAN_DIR)


def _find(folder: Path, stem: str) -> Path | None:
    # Debian ships the files gzip-compressed; other copies (torchvision's ``raw`` folder) may be unpacked.
    for path in (folder / f"{stem}.gz", folder / stem):
        if path.is_file():
            return path
    return None


def is_available(data_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether all four files exist in the folder :func:`resolve_data_dir` picks (without reading them)."""
    folder = resolve_data_dir(data_dir)
    return all(_find(folder, stem) is not None for stems in FILES.values() for stem in stems)


def check_files(folder: Path, splits: tuple[Split, ...] = ("train", "test")) -> None:
    """Raise unless ``folder`` holds the files of ``splits`` (plain or gzipped), without reading them.

    Raises:
        FileNotFoundError: naming the missing files and the fix.
    """
    missing = [stem for split in splits for stem in FILES[split] if _find(folder, stem) is None]
    if missing:
        raise FileNotFoundError(f"Fashion-MNIST not found in {folder} (missing {', '.join(missing)}[.gz]). {_HINT}")


def load_split(split: Split, data_dir: str | os.PathLike[str] | None = None) -> tuple[Tensor, Tensor]:
    """Reads one split.

    Args:
        split: ``"train"`` (60,000 samples) or ``"test"`` (10,000).
        data_dir: Folder of the files; see :func:`resolve_data_dir`.

    Returns:
        ``(images, labels)``: ``uint8`` tensors of shapes ``(n, 28, 28)`` and ``(n,)``.

    Raises:
        FileNotFoundError: If a file is missing; the message names the fix.
        ValueError: If a file is malformed, the shapes disagree, or a label is not in ``0..9``.
    """
    folder = resolve_data_dir(data_dir)
    check_files(folder, (split,))
    paths = [_find(folder, stem) for stem in FILES[split]]
    images, labels = (read_idx(path) for path in paths if path is not None)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or labels.shape != (len(images),):
        raise ValueError(f"Fashion-MNIST {split} split has images {images.shape} and labels {labels.shape}.")
    if labels.size and labels.max() >= 10:
        raise ValueError(f"Fashion-MNIST {split} labels must lie in 0..9, found {labels.max()}.")
    return torch.from_numpy(images), torch.from_numpy(labels)


class FashionMNISTDataModule(ClassificationDataModule):
    """Fashion-MNIST as standardised ``(1, 28, 28)`` float images, with a validation set held out of training.

    The validation set is ``val_size`` training samples drawn by ``seed``; the test split is never used for
    model selection. ``subset`` keeps only the first samples of the remaining training set (in file order), so
    a quick run trains on less while its validation set stays the same.

    Args:
        data_dir: Folder of the four IDX files; ``None`` means ``$AESGD_FASHION_MNIST_DIR`` or :data:`DEBIAN_DIR`.
        batch_size: Samples per batch of every loader.
        num_workers: DataLoader worker processes.
        val_size: Training samples held out for validation.
        seed: Seed of the validation draw.
        subset: If given, train on only this many samples.

    Raises:
        ValueError: If ``subset`` < 1, or (when the data is loaded) ``val_size`` or ``subset`` exceed the data.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        batch_size: int = 64,
        num_workers: int = 0,
        val_size: int = 5000,
        seed: int = 0,
        subset: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers)
        if subset is not None and subset < 1:
            raise ValueError(f"subset must be >= 1 (or None for all samples), got {subset}.")
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.val_size = val_size
        self.seed = seed
        self.subset = subset

    def check_data(self) -> None:
        """Raise, naming the fix, unless the files are there (before any replica starts: the Hydra job asks).

        Raises:
            FileNotFoundError: naming the missing files.
        """
        check_files(resolve_data_dir(self.data_dir))

    def build_splits(self) -> Splits[Dataset[Sample]]:
        """Reads the files and splits the training set."""
        images, labels = load_split("train", self.data_dir)
        fit, val = split_holdout(len(labels), self.val_size, self.seed)
        if self.subset is not None:
            if self.subset > len(fit):
                raise ValueError(f"subset={self.subset} exceeds the {len(fit)} training samples left after validation.")
            fit = fit[: self.subset]
        test_images, test_labels = load_split("test", self.data_dir)
        return Splits(
            train=NormalizedImages(images[fit], labels[fit], MEAN, STD),
            val=NormalizedImages(images[val], labels[val], MEAN, STD),
            test=NormalizedImages(test_images, test_labels, MEAN, STD),
        )
