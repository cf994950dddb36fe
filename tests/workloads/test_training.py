"""What the workloads share: the optimizer registry, the evaluation steps' metric names, the split DataModule."""

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_aesgd.workloads import ImageClassifier, XMCDataModule, XMCModule
from lightning_aesgd.workloads.datamodule import SplitDataModule, Splits
from lightning_aesgd.workloads.training import EvaluatedModule, build_optimizer, check_optimizer


def test_an_unknown_optimizer_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"Unknown optimizer 'lion'; choose one of \['adam', 'sgd'\]"):
        check_optimizer("lion", ("sgd", "adam"))
    with pytest.raises(ValueError, match=r"choose one of \['adam', 'sgd'\]"):
        ImageClassifier("digits_mlp", optimizer="adagrad")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"choose one of \['adagrad', 'adam', 'sgd'\]"):
        XMCModule(10, 5, optimizer="lion")  # type: ignore[arg-type]


def test_sparse_gradients_need_an_optimizer_that_takes_them() -> None:
    with pytest.raises(ValueError, match=r"'adam' cannot take sparse gradients\. HINT: use 'sgd' or 'adagrad'\."):
        check_optimizer("adam", ("sgd", "adam", "adagrad"), sparse_gradients=True)
    check_optimizer("adagrad", ("adagrad",), sparse_gradients=True)
    check_optimizer("adam", ("adam",))


def test_momentum_reaches_sgd_only() -> None:
    parameters = [torch.zeros(2, requires_grad=True)]
    assert build_optimizer("sgd", parameters, lr=0.1, momentum=0.9).defaults["momentum"] == 0.9
    assert "momentum" not in build_optimizer("adam", parameters, lr=0.1, momentum=0.9).defaults


@pytest.mark.parametrize(
    ("module", "names"),
    [(ImageClassifier("digits_mlp"), ["val/acc"]), (XMCModule(10, 5), ["val/p@1", "val/p@3", "val/p@5", "val/ndcg@5"])],
)
def test_the_metric_names_are_those_the_configs_and_benchmark_read(module: EvaluatedModule, names: list[str]) -> None:
    assert set(module.val_metrics.keys(keep_base=False)) == set(names)


class _Numbers(SplitDataModule[TensorDataset]):
    builds = 0

    def model_dimensions(self) -> dict[str, Any]:
        return {}

    def build_splits(self) -> Splits[TensorDataset]:
        self.builds += 1
        return Splits(*(TensorDataset(torch.arange(size)) for size in (10, 6, 3)))


def test_split_datamodule_builds_once_and_drops_only_the_last_training_batch() -> None:
    module = _Numbers(batch_size=4, num_workers=0, drop_last=True)
    module.setup("fit")
    module.setup("test")
    assert module.builds == 1
    assert sorted(len(batch) for (batch,) in module.train_dataloader()) == [4, 4]
    assert [batch.tolist() for (batch,) in module.val_dataloader()] == [[0, 1, 2, 3], [4, 5]]
    assert [batch.tolist() for (batch,) in module.test_dataloader()] == [[0, 1, 2]]


@pytest.mark.parametrize("sizes", [{"batch_size": 0}, {"num_workers": -1}])
def test_split_datamodules_reject_bad_loader_sizes(sizes: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="batch_size >= 1 and num_workers >= 0"):
        XMCDataModule("mini", **sizes)  # type: ignore[arg-type]
