"""What the benchmark trains: workloads as Hydra overrides, and the target metric that ends a race.

Adding a workload is one entry of :data:`WORKLOADS` (plus its ``configs/data`` and ``configs/model`` files).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lightning_aesgd.train import config_dir


@dataclass(frozen=True)
class Target:
    """A validation metric value to reach; lower is better for losses, higher for everything else.

    Example:
        >>> Target.parse("val/p@1=0.6")
        Target(metric='val/p@1', value=0.6)
        >>> Target.parse("val/loss=2.5").reached(2.4)
        True
    """

    metric: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Target:
        """Read ``"<metric>=<value>"``, e.g. ``"val/p@1=0.6"``."""
        metric, separator, value = text.rpartition("=")
        if not separator or not metric:
            raise ValueError(f"A target reads '<metric>=<value>', e.g. 'val/p@1=0.6'; got {text!r}.")
        return cls(metric.strip(), float(value))

    @property
    def lower_is_better(self) -> bool:
        """Whether smaller values are better (losses and errors)."""
        return "loss" in self.metric or "error" in self.metric

    def reached(self, value: float) -> bool:
        """Whether ``value`` meets the target."""
        return value <= self.value if self.lower_is_better else value >= self.value

    def __str__(self) -> str:
        return f"{self.metric}={self.value:g}"


@dataclass(frozen=True)
class Workload:
    """A data set and a model, given as the names of their Hydra configs.

    Args:
        data: name of a ``configs/data`` file.
        model: name of a ``configs/model`` file.
        epochs: epochs of every run unless ``--epochs`` says otherwise.
        target: default target metric.
        extra: further overrides that belong to the workload.
        tiny: overrides that shrink the workload to seconds for ``--tiny`` (tests).
    """

    data: str
    model: str
    epochs: int
    target: str
    extra: tuple[str, ...] = ()
    tiny: tuple[str, ...] = ()

    def overrides(self, tiny: bool = False) -> list[str]:
        """Hydra overrides selecting this workload; raises if one of its config files is missing."""
        for group, name in (("data", self.data), ("model", self.model)):
            path = Path(config_dir()) / group / f"{name}.yaml"
            if not path.is_file():
                raise FileNotFoundError(
                    f"The workload needs configs/{group}/{name}.yaml, which does not exist. HINT: add the config, "
                    "or correct the entry in lightning_aesgd.bench.race.suites.WORKLOADS."
                )
        return [f"data={self.data}", f"model={self.model}", *self.extra, *(self.tiny if tiny else ())]


# The XMC datasets take `overrides` of their generator spec: the tiny one has a few hundred rows.
_TINY_XMC = ("++data.overrides={n_train:400,n_test:64}", "data.batch_size=32")
# Validation is off the training clock; validating four times per epoch sharpens time to target.
_QUARTER_EPOCH_VALIDATION = ("++trainer.val_check_interval=0.25",)
# 512 rows per replica and step (2,048 per step): per-sample work dominates each step, as on GPUs.
_LARGE_STEPS = ("data.batch_size=512",)

WORKLOADS: dict[str, Workload] = {
    "xmc_mini": Workload("xmc_mini", "xmc", 4, "val/p@1=0.9", (*_LARGE_STEPS, *_QUARTER_EPOCH_VALIDATION), _TINY_XMC),
    "xmc_eurlex": Workload("xmc_eurlex", "xmc", 3, "val/p@1=0.8", _QUARTER_EPOCH_VALIDATION, _TINY_XMC),
    # The CNN's SGD has momentum 0.9: adaptive_sgd's outer momentum stays off, as in experiment=fashion_mnist.
    "fashion_mnist": Workload("fashion_mnist", "fashion_cnn", 3, "val/acc=0.85", ("++outer_momentum=0.0",)),
    # scikit-learn's digits with the MLP (dense, seconds per run): where batched learners apply (not XMC's bags).
    "digits": Workload("digits", "digits_mlp", 8, "val/acc=0.9", ("++outer_momentum=0.0",), ("trainer.max_epochs=2",)),
}
"""The benchmark's workloads by ``--workload`` name."""


def get_workload(name: str) -> Workload:
    """The workload called ``name``."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(f"Unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}.") from None
