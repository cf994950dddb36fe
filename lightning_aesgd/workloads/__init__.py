"""Built-in workloads: datasets, models and metrics used by the main job, the examples and the benchmark.

Each workload is a subpackage; both build on two shared modules: :mod:`~lightning_aesgd.workloads.training`
(the optimizer registry and the validation and test steps of their LightningModules) and
:mod:`~lightning_aesgd.workloads.datamodule` (a DataModule serving three splits in batches).

Sparse extreme multi-label classification (XMC), the Adaptive SGD paper's workload, in ``xmc/``:

* generator: :func:`generate_xmc` from an :class:`XMCSpec` (:func:`get_preset` names ``mini``, ``eurlex4k``,
  ``wiki10_31k``, ``delicious200k``, ``amazon670k``), checked with :func:`dataset_statistics` and
  :func:`compare_to_targets`;
* torch side: :class:`SparseXMCDataset`, :func:`collate_sparse` → :class:`SparseBatch`, :class:`XMCNet`,
  :class:`XMCModule`, :class:`XMCDataModule`, and the metrics :class:`PrecisionAtK` and :class:`NDCGAtK`;
* real data the user has: :func:`read_xmc_file` reads the Extreme Classification Repository's BoW files and
  :class:`XMCFilesDataModule` serves them (``data=xmc_files data.path=...``); nothing is downloaded.

Dense image classification, in ``images/``: :class:`FashionMNISTDataModule` (Debian's
``dataset-fashion-mnist``, read from disk) with :class:`FashionCNN`, and :class:`DigitsDataModule`
(scikit-learn's bundled digits) with :class:`DigitsMLP`, both trained by :class:`ImageClassifier`.
"""

from lightning_aesgd.workloads.images.data import NormalizedImages, split_holdout
from lightning_aesgd.workloads.images.digits import DigitsDataModule
from lightning_aesgd.workloads.images.fashion_mnist import FashionMNISTDataModule
from lightning_aesgd.workloads.images.models import DigitsMLP, FashionCNN, ImageClassifier
from lightning_aesgd.workloads.xmc.batch import SparseBatch, SparseSample, SparseXMCDataset, collate_sparse
from lightning_aesgd.workloads.xmc.data import XMCData, generate_xmc, per_sample_cost
from lightning_aesgd.workloads.xmc.datamodule import XMCDataModule
from lightning_aesgd.workloads.xmc.files import XMCFileError, XMCFilesDataModule, read_xmc_file
from lightning_aesgd.workloads.xmc.metrics import NDCGAtK, PrecisionAtK, ndcg_at_k, precision_at_k
from lightning_aesgd.workloads.xmc.model import XMCModule, XMCNet
from lightning_aesgd.workloads.xmc.spec import PRESETS, XMCSpec, get_preset
from lightning_aesgd.workloads.xmc.stats import (
    XMCStatistics,
    compare_to_targets,
    dataset_statistics,
    popularity_precision,
    statistics,
)

__all__ = [
    "PRESETS",
    "DigitsDataModule",
    "DigitsMLP",
    "FashionCNN",
    "FashionMNISTDataModule",
    "ImageClassifier",
    "NDCGAtK",
    "NormalizedImages",
    "PrecisionAtK",
    "SparseBatch",
    "SparseSample",
    "SparseXMCDataset",
    "XMCData",
    "XMCDataModule",
    "XMCFileError",
    "XMCFilesDataModule",
    "XMCModule",
    "XMCNet",
    "XMCSpec",
    "XMCStatistics",
    "collate_sparse",
    "compare_to_targets",
    "dataset_statistics",
    "generate_xmc",
    "get_preset",
    "ndcg_at_k",
    "per_sample_cost",
    "popularity_precision",
    "precision_at_k",
    "read_xmc_file",
    "split_holdout",
    "statistics",
]
