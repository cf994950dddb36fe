"""The seed papers' claims: each a small race (entrants, workload, devices, target), the paper's statement and a rule.

Adding a claim is one entry of :data:`CLAIMS`. An entrant is a name and the Hydra overrides that stand for
``algorithm=<name>`` in the race (:class:`~lightning_aesgd.bench.race.benchmark.BenchSettings` ``variants``), so a
claim can race one algorithm in two settings (Adaptive SGD with its planner and with static equal shares; SMA at
small batches against DDP at large ones). A claim whose ``requires`` names an algorithm config that does not
exist is reported as not run, and an optional entrant whose config is missing is left out, so that a claim lights
up as soon as its algorithm is merged, without a change here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_aesgd.bench.seeds.verdicts import Pace
from lightning_aesgd.train import config_dir

__all__ = ["CLAIMS", "Claim", "Entrant", "algorithm_exists", "get_claims"]


@dataclass(frozen=True)
class Entrant:
    """One contestant of a claim's race.

    Args:
        name: the name in tables (and the race's algorithm column).
        overrides: Hydra overrides that select it; ``algorithm=<name>`` when empty.
        optional: left out, with a note, where its algorithm config does not exist.
        tiny: overrides added in ``--tiny`` runs (e.g. a batch that fits the tiny data set).
    """

    name: str
    overrides: tuple[str, ...] = ()
    optional: bool = False
    tiny: tuple[str, ...] = ()

    def selection(self, tiny: bool = False) -> list[str]:
        """The overrides standing for ``algorithm=<name>`` in the race."""
        return [*(self.overrides or [f"algorithm={self.name}"]), *(self.tiny if tiny else ())]

    @property
    def algorithm(self) -> str:
        """The ``configs/algorithm`` name it runs.

        Example:
            >>> Entrant("equal", ("algorithm=adaptive_sgd", "algorithm.planner=static")).algorithm
            'adaptive_sgd'
        """
        chosen = [o.split("=", 1)[1] for o in self.selection() if o.startswith("algorithm=")]
        return chosen[-1] if chosen else self.name


@dataclass(frozen=True)
class Claim:
    """A paper's statement and the race that tests it.

    Args:
        key: short name (``--claims``, the output folder).
        title: one line for the table.
        source: the paper.
        statement: what the paper says, paraphrased.
        workload: a race workload (:data:`lightning_aesgd.bench.race.suites.WORKLOADS`).
        profile: a ``configs/devices`` profile.
        candidate: the entrant the paper advocates.
        rivals: the entrants it is judged against; any other entrant is a control, shown but not judged.
        entrants: every contestant, candidate and rivals included.
        pace: compare ``"time"`` (training clock) or ``"epochs"`` (statistical efficiency) to the target.
        repeats: repeats of the race (medians); ``--quick`` runs one.
        epochs: epochs of every run (the workload's when ``None``).
        target: the target ``"<metric>=<value>"`` (the workload's when ``None``).
        tolerance: how far below the best rival the candidate's final metric may end.
        requires: algorithm configs without which the claim is not run.
        overrides: further Hydra overrides for every run.
    """

    key: str
    title: str
    source: str
    statement: str
    workload: str
    profile: str
    candidate: str
    rivals: tuple[str, ...]
    entrants: tuple[Entrant, ...]
    pace: Pace = "time"
    repeats: int = 1
    epochs: int | None = None
    target: str | None = None
    tolerance: float = 0.01
    requires: tuple[str, ...] = ()
    overrides: tuple[str, ...] = field(default_factory=tuple)

    def missing(self, configs: str | Path | None = None) -> list[str]:
        """The required algorithm configs that do not exist."""
        return [name for name in self.requires if not algorithm_exists(name, configs)]

    def present_entrants(self, configs: str | Path | None = None) -> tuple[list[Entrant], list[Entrant]]:
        """The entrants to race, and the optional ones left out because their algorithm config is missing."""
        kept = [e for e in self.entrants if not e.optional or algorithm_exists(e.algorithm, configs)]
        return kept, [e for e in self.entrants if e not in kept]


def algorithm_exists(name: str, configs: str | Path | None = None) -> bool:
    """Whether ``configs/algorithm/<name>.yaml`` exists (in the package's config directory by default)."""
    return (Path(configs or config_dir()) / "algorithm" / f"{name}.yaml").is_file()


_EQUAL = Entrant("adaptive_sgd_equal", ("algorithm=adaptive_sgd", "algorithm.planner=static"))
# Crossbow's regime: 64 rows per replica (256 per step on 4 replicas) against the race's 512 (2,048 per step);
# 8 against 64 in the tiny data set (400 rows, 2 replicas).
_SMALL, _LARGE = 64, 512
_TINY_SMALL, _TINY_LARGE = (f"data.batch_size={size}" for size in (8, 64))
# ABS-SGD overlaps each step's sum with the next step. The race validates XMC mini after every step (its epochs
# are 7 steps), and a validation flushes the sum in flight: every step would run synchronously. Once per epoch,
# for every entrant alike, as the papers evaluate.
_EPOCH_VALIDATION = ("++trainer.val_check_interval=1.0",)

CLAIMS: tuple[Claim, ...] = (
    Claim(
        key="adaptive_sgd",
        title="Adaptive SGD against equal batches, SMA and DDP (the headline)",
        source="Ma, Rusu, Wu, Sim, arXiv 2110.07029, 2021",
        statement='"Adaptive SGD outperforms four state-of-the-art solutions in time-to-accuracy" (abstract), on '
        "sparse extreme classification over heterogeneous GPUs; here against equal-batch elastic averaging, "
        "Crossbow's SMA and DDP, at no loss of final accuracy.",
        workload="xmc_mini",
        profile="strong",
        candidate="adaptive_sgd",
        rivals=("adaptive_sgd_equal", "sma", "ddp"),
        entrants=(Entrant("adaptive_sgd"), _EQUAL, Entrant("sma"), Entrant("ddp")),
        repeats=3,
    ),
    Claim(
        key="crossbow",
        title="Crossbow: SMA at small batches keeps statistical efficiency",
        source="Koliousis et al., PVLDB 12(11), 2019",
        statement="(paraphrased) Synchronous model averaging lets many learners train with small batches and "
        "keep the statistical efficiency of small-batch training, which synchronous SGD loses at the large "
        "global batch it needs to scale: fewer epochs to a target accuracy.",
        workload="xmc_mini",
        profile="homogeneous",
        candidate=f"sma_b{_SMALL}",
        rivals=(f"ddp_b{_LARGE}",),
        entrants=(
            Entrant(f"sma_b{_SMALL}", ("algorithm=sma", f"data.batch_size={_SMALL}"), tiny=(_TINY_SMALL,)),
            Entrant(f"ddp_b{_LARGE}", ("algorithm=ddp", f"data.batch_size={_LARGE}"), tiny=(_TINY_LARGE,)),
            # The control: synchronous SGD at the same small batch separates the batch's effect from SMA's.
            Entrant(f"ddp_b{_SMALL}", ("algorithm=ddp", f"data.batch_size={_SMALL}"), tiny=(_TINY_SMALL,)),
        ),
        pace="epochs",
        repeats=2,
    ),
    Claim(
        key="abs_sgd",
        title="ABS-SGD against the best synchronous baseline",
        source="Zhou, Chen, Wu, ABS-SGD, arXiv 2308.15164, 2023",
        statement='On heterogeneous GPU clusters, ABS-SGD "increases the convergence speed by 1.30x on average '
        'compared with the best baseline algorithm" (abstract; ResNet18, 4 workers); here against DDP and '
        "synchronous adaptive batches.",
        workload="xmc_mini",
        profile="strong",
        candidate="abs_sgd",
        rivals=("ddp", "sync_adaptive"),
        entrants=(
            Entrant("abs_sgd", ("algorithm=abs_sgd", *_EPOCH_VALIDATION)),
            Entrant("ddp", ("algorithm=ddp", *_EPOCH_VALIDATION)),
            Entrant("sync_adaptive", ("algorithm=sync_adaptive", *_EPOCH_VALIDATION), optional=True),
        ),
        repeats=3,
        requires=("abs_sgd",),
    ),
)
"""The claims ``python -m lightning_aesgd.bench seeds`` measures, in table order."""


def get_claims(keys: Sequence[str] | None = None) -> list[Claim]:
    """The claims named by ``keys`` (all when ``None``), in table order."""
    if keys is None:
        return list(CLAIMS)
    known = {claim.key: claim for claim in CLAIMS}
    unknown = [key for key in keys if key not in known]
    if unknown:
        raise KeyError(f"Unknown claim(s) {', '.join(unknown)}; choose from {', '.join(known)}.")
    return [claim for claim in CLAIMS if claim.key in keys]
