"""Built-in workloads: datasets, models and metrics used by the main job, the examples and the benchmark.

Sparse extreme multi-label classification (XMC), the Adaptive SGD paper's workload:

* generator: :func:`generate_xmc` from an :class:`XMCSpec` (:func:`get_preset` names ``mini``, ``eurlex4k``,
  ``wiki10_31k``, ``delicious200k``, ``amazon670k``), checked with :func:`dataset_statistics` and
  :func:`compare_to_targets`;
* torch side: :class:`SparseXMCDataset`, :func:`collate_sparse` → :class:`SparseBatch`, :class:`XMCNet`,
  :class:`XMCModule`, :class:`XMCDataModule`, and the metrics :class:`PrecisionAtK` and :class:`NDCGAtK`.

Dense image classification: :class:`FashionMNISTDataModule` (Debian's ``dataset-fashion-mnist``, read from
disk) with :class:`FashionCNN`, and :class:`DigitsDataModule` (scikit-learn's bundled digits) with
:class:`DigitsMLP`, both trained by :class:`ImageClassifier`.
"""

from lightning_aesgd.workloads.digits import DigitsDataModule
from lightning_aesgd.workloads.fashion_mnist import FashionMNISTDataModule
from lightning_aesgd.workloads.images import DigitsMLP, FashionCNN, ImageClassifier
from lightning_aesgd.workloads.images_data import NormalizedImages, split_holdout
from lightning_aesgd.workloads.xmc_batch import SparseBatch, SparseSample, SparseXMCDataset, collate_sparse
from lightning_aesgd.workloads.xmc_data import XMCData, generate_xmc, per_sample_cost
from lightning_aesgd.workloads.xmc_datamodule import XMCDataModule
from lightning_aesgd.workloads.xmc_metrics import NDCGAtK, PrecisionAtK, ndcg_at_k, precision_at_k
from lightning_aesgd.workloads.xmc_model import XMCModule, XMCNet
from lightning_aesgd.workloads.xmc_spec import PRESETS, XMCSpec, get_preset
from lightning_aesgd.workloads.xmc_stats import (
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
    "split_holdout",
    "statistics",
]
