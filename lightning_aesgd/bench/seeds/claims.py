"""The seed papers' claims: each a small race (entrants, workload, devices, target), the paper's statement and a rule.

Adding a claim is one entry of :data:`CLAIMS`. An entrant is a name and the Hydra overrides that stand for
``algorithm=<name>`` in the race (:class:`~lightning_aesgd.bench.race.benchmark.BenchSettings` ``variants``), so a
claim can race one algorithm in two settings (Adaptive SGD with its planner and with static equal shares; DDP at
SMA's small batch and at the race's large one). A claim whose ``requires`` names an algorithm config that does
not exist is reported as *not implemented* (with the ``capability`` it stands for), and an optional entrant whose
config is missing is left out with a note, so that a claim lights up as soon as its algorithm is merged, without a
change here. A claim about GPUs (``needs_gpu``) is reported *not run* on a machine without one.

Every claim is judged on the training clock against its fair rivals, and DDP at the candidate's own per-replica
batch is always one of them (:func:`same_batch_ddp`): a rival at another batch alone would measure the batch,
not the method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_aesgd.train import config_dir

__all__ = ["CLAIMS", "Claim", "Entrant", "algorithm_exists", "get_claims", "same_batch_ddp"]


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

    def batch_size(self, tiny: bool = False) -> str | None:
        """The per-replica batch its overrides set (the last ``data.batch_size``); ``None``: the workload's.

        Example:
            >>> small = Entrant("sma_b64", ("algorithm=sma", "data.batch_size=64"), tiny=("data.batch_size=8",))
            >>> small.batch_size(), small.batch_size(tiny=True), Entrant("ddp").batch_size()
            ('64', '8', None)
        """
        sizes = [o.split("=", 1)[1] for o in self.selection(tiny) if o.startswith("data.batch_size=")]
        return sizes[-1] if sizes else None


@dataclass(frozen=True)
class Claim:
    """A paper's statement and the race that tests it.

    Args:
        key: short name (``--claims``, the output folder).
        title: one line for the table.
        source: the paper.
        statement: the paper's headline, quoted from its abstract, then what the race makes of it.
        workload: a race workload (:data:`lightning_aesgd.bench.race.suites.WORKLOADS`).
        profile: a ``configs/devices`` profile.
        candidate: the entrant the paper advocates.
        rivals: the fair rivals it is judged against (on the training clock), DDP at the candidate's batch among
            them; any other entrant is a control, shown but not judged.
        entrants: every contestant, candidate and rivals included.
        repeats: repeats of the race; fewer than
            :data:`~lightning_aesgd.bench.seeds.verdicts.MIN_REPEATS` can only give a tie (``--quick`` runs one).
        epochs: epochs of every run (the workload's when ``None``).
        target: the target ``"<metric>=<value>"`` (the workload's when ``None``).
        tolerance: how far below the best rival the candidate's final metric may end.
        requires: algorithm configs without which the claim is not implemented (and not run).
        capability: what ``requires`` stands for, in words, for the *not implemented* verdict.
        show_epochs: add each judged entrant's median epochs to the target to the text (statistical efficiency,
            shown beside the verdict, never judged alone).
        overrides: further Hydra overrides for every run.
        needs_gpu: the claim is about GPUs: on a machine without one it is reported *not run* (and not raced).
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
    repeats: int = 5
    epochs: int | None = None
    target: str | None = None
    tolerance: float = 0.01
    requires: tuple[str, ...] = ()
    capability: str = ""
    show_epochs: bool = False
    overrides: tuple[str, ...] = field(default_factory=tuple)
    needs_gpu: bool = False

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


def same_batch_ddp(claim: Claim, tiny: bool = False) -> list[str]:
    """The claim's rivals that run DDP at the candidate's per-replica batch (the fair control of every claim).

    Example:
        >>> [same_batch_ddp(claim) != [] for claim in CLAIMS]
        [True, True, True, True, True, True]
    """
    entrants = {entrant.name: entrant for entrant in claim.entrants}
    batch = entrants[claim.candidate].batch_size(tiny)
    return [
        name for name in claim.rivals if entrants[name].algorithm == "ddp" and entrants[name].batch_size(tiny) == batch
    ]


_EQUAL = Entrant("adaptive_sgd_equal", ("algorithm=adaptive_sgd", "algorithm.planner=static"))
# Crossbow's regime: 64 rows per replica (256 per step on 4 replicas) against the race's 512 (2,048 per step);
# 8 against 64 in the tiny data set (400 rows, 2 replicas). DDP runs at both: at 64 it is the fair rival (the
# same per-replica batch, so the same updates per epoch), at 512 it is TensorFlow's regime in the paper.
_SMALL, _LARGE = 64, 512
_TINY_SMALL, _TINY_LARGE = (f"data.batch_size={size}" for size in (8, 64))
_SMALL_DDP = Entrant(f"ddp_b{_SMALL}", ("algorithm=ddp", f"data.batch_size={_SMALL}"), tiny=(_TINY_SMALL,))
_LARGE_DDP = Entrant(f"ddp_b{_LARGE}", ("algorithm=ddp", f"data.batch_size={_LARGE}"), tiny=(_TINY_LARGE,))
_SMALL_SMA = Entrant(f"sma_b{_SMALL}", ("algorithm=sma", f"data.batch_size={_SMALL}"), tiny=(_TINY_SMALL,))
# Crossbow's learners on the digits MLP: 16 rows per learner (1,437 training images: 22 steps an epoch on 4
# replicas of one learner), at most 4 learners per replica.
_LEARNER, _MAX_LEARNERS = 16, 4
# Crossbow's own regime, on one GPU: the Fashion-MNIST CNN at 64 rows per learner, up to 8 learners, against one
# learner (DDP on one GPU) at 64 rows and at the batch of 4 and of 8 learners (256 and 512 rows), the same epochs.
_GPU_LEARNER, _GPU_MAX_LEARNERS = 64, 8
_ONE_GPU = ("experiment=gpu", "devices.num_replicas=1")
_GPUS_ALONE = ("launch.replica_devices=null", "trainer.devices=-1")  # under devices=gpu_cpu: DDP on every GPU only
# ABS-SGD's delay has to act before the target for the race to measure it: XMC mini meets P@1 0.9 after 14 to 16
# steps, inside abs_sgd.yaml's 20 synchronous warm-up steps, where abs_sgd runs sync_adaptive's code. Here its
# warm-up is 4 steps, and every entrant validates every 4 steps (across epochs: the target timed to within 4 of 28
# steps). The warm-up ends at the first validation, so up to it the entrants train the same model; from the 5th
# step on abs_sgd's sums are one step stale, 4 to 5 times the warm-up's steps before the target (the rivals meet it
# at step 16, abs_sgd at step 20, in every repeat). A validation flushes the sum in flight (the next step applies
# nothing), so the delay still acts in 3 steps of 4; validating after every step, the workload's rate, would run
# every step synchronously.
_ABS_VALIDATION_STEPS = 4
_ABS_WARMUP = f"algorithm.gradient_delay_warmup={_ABS_VALIDATION_STEPS}"
_STEP_VALIDATION = (f"++trainer.val_check_interval={_ABS_VALIDATION_STEPS}", "++trainer.check_val_every_n_epoch=null")

CLAIMS: tuple[Claim, ...] = (
    Claim(
        key="adaptive_sgd",
        title="Adaptive SGD against equal batches, SMA and DDP (the headline)",
        source="Ma, Rusu, Wu, Sim, arXiv 2110.07029, 2021",
        statement='"We show experimentally that Adaptive SGD outperforms four state-of-the-art solutions in '
        'time-to-accuracy and is scalable with the number of GPUs" (abstract; sparse extreme classification on '
        "heterogeneous GPUs); here against equal-batch elastic averaging, Crossbow's SMA and DDP, at no loss of "
        "final accuracy.",
        workload="xmc_mini",
        profile="strong",
        candidate="adaptive_sgd",
        rivals=("adaptive_sgd_equal", "sma", "ddp"),
        entrants=(Entrant("adaptive_sgd"), _EQUAL, Entrant("sma"), Entrant("ddp")),
    ),
    Claim(
        key="crossbow",
        title="Crossbow: SMA at small batches against DDP at small and large batches",
        source="Koliousis et al., PVLDB 12(11), 2019",
        statement='"Our experiments show that Crossbow improves the training time of deep learning models on an '
        '8-GPU server by 1.3-4x compared to TensorFlow" (abstract); here SMA with one learner per replica at 64 '
        "rows against DDP (synchronous SGD, as TensorFlow) at 64 and at 512 rows per replica, on the training "
        "clock; epochs to the target are shown for the statistical efficiency SMA is meant to keep.",
        workload="xmc_mini",
        profile="homogeneous",
        candidate=_SMALL_SMA.name,
        rivals=(_SMALL_DDP.name, _LARGE_DDP.name),
        entrants=(_SMALL_SMA, _SMALL_DDP, _LARGE_DDP),
        show_epochs=True,
    ),
    Claim(
        key="crossbow_learners",
        title="Crossbow: several learners per device, their number tuned to throughput",
        source="Koliousis et al., PVLDB 12(11), 2019",
        statement='"Crossbow achieves high hardware efficiency with small batch sizes by potentially training '
        'multiple model replicas per GPU, automatically tuning the number of replicas to maximise throughput" '
        f"(abstract); here SMA over auto-tuned learners per replica (at most {_MAX_LEARNERS}) at {_LEARNER} rows of "
        f"the digits MLP against DDP at {_LEARNER} and at {_LEARNER * _MAX_LEARNERS} rows per replica (the batch "
        f"of {_MAX_LEARNERS} learners), one learner per replica (SMA at {_LEARNER}) shown as a control; batched "
        "learners need dense layers and one row per sample, which XMC's sparse bags are not.",
        workload="digits",
        profile="homogeneous",
        candidate=f"crossbow_b{_LEARNER}",
        rivals=(f"ddp_b{_LEARNER}", f"ddp_b{_LEARNER * _MAX_LEARNERS}", f"sma_b{_LEARNER}"),
        entrants=(
            Entrant(
                f"crossbow_b{_LEARNER}",
                ("algorithm=crossbow", f"algorithm.max_learners={_MAX_LEARNERS}", f"data.batch_size={_LEARNER}"),
            ),
            Entrant(f"ddp_b{_LEARNER}", ("algorithm=ddp", f"data.batch_size={_LEARNER}")),
            Entrant(
                f"ddp_b{_LEARNER * _MAX_LEARNERS}", ("algorithm=ddp", f"data.batch_size={_LEARNER * _MAX_LEARNERS}")
            ),
            Entrant(f"sma_b{_LEARNER}", ("algorithm=sma", f"data.batch_size={_LEARNER}")),
        ),
        requires=("crossbow",),
        capability="several SMA learners per device, their number tuned to throughput",
        show_epochs=True,
    ),
    Claim(
        key="crossbow_learners_gpu",
        title="Crossbow on a GPU: learners per device tuned to throughput, at a small batch",
        source="Koliousis et al., PVLDB 12(11), 2019",
        statement='"Crossbow achieves high hardware efficiency with small batch sizes by potentially training '
        'multiple model replicas per GPU, automatically tuning the number of replicas to maximise throughput" '
        f"(abstract); here on one GPU, the Fashion-MNIST CNN at {_GPU_LEARNER} rows per learner, SMA over "
        f"auto-tuned learners (at most {_GPU_MAX_LEARNERS}) against one learner at {_GPU_LEARNER}, "
        f"{4 * _GPU_LEARNER} and {_GPU_MAX_LEARNERS * _GPU_LEARNER} rows (the batch of 4 and of "
        f"{_GPU_MAX_LEARNERS} learners), the same epochs each; the learners chosen and their gain in samples/s "
        "are shown.",
        workload="fashion_mnist",
        profile="real",
        candidate=f"crossbow_b{_GPU_LEARNER}",
        rivals=tuple(f"ddp_b{k * _GPU_LEARNER}" for k in (1, 4, _GPU_MAX_LEARNERS)),
        entrants=(
            Entrant(
                f"crossbow_b{_GPU_LEARNER}",
                (
                    "algorithm=crossbow",
                    f"algorithm.max_learners={_GPU_MAX_LEARNERS}",
                    f"data.batch_size={_GPU_LEARNER}",
                ),
            ),
            *(
                Entrant(f"ddp_b{k * _GPU_LEARNER}", ("algorithm=ddp", f"data.batch_size={k * _GPU_LEARNER}"))
                for k in (1, 4, _GPU_MAX_LEARNERS)
            ),
        ),
        overrides=_ONE_GPU,
        requires=("crossbow",),
        capability="several SMA learners per device, their number tuned to throughput",
        show_epochs=True,
        needs_gpu=True,
    ),
    Claim(
        key="abs_sgd",
        title="ABS-SGD against the best synchronous baseline",
        source="Zhou, Chen, Wu, ABS-SGD, arXiv 2308.15164, 2023",
        statement='"When training ResNet18 network with 4 workers, ABS-SGD increases the convergence speed by '
        '1.30x on average compared with the best baseline algorithm" (abstract; heterogeneous GPU clusters); '
        f"here abs_sgd with a {_ABS_VALIDATION_STEPS}-step synchronous warm-up instead of its config's 20, so that "
        "its delayed steps run from the first validation on, well before the target, against DDP and sync_adaptive "
        "(the same adaptive batches and sums, without the delay), every entrant validated every "
        f"{_ABS_VALIDATION_STEPS} steps.",
        workload="xmc_mini",
        profile="strong",
        candidate="abs_sgd",
        rivals=("ddp", "sync_adaptive"),
        entrants=(
            Entrant("abs_sgd", ("algorithm=abs_sgd", _ABS_WARMUP)),
            Entrant("ddp"),
            Entrant("sync_adaptive", optional=True),
        ),
        overrides=_STEP_VALIDATION,
        requires=("abs_sgd",),
        capability="ABS-SGD",
    ),
    Claim(
        key="adaptive_hogbatch",
        title="Adaptive Hogbatch: CPU replicas beside a GPU, with batches sized to each device's speed",
        source="Ma, Rusu, Heterogeneous CPU+GPU Stochastic Gradient Descent Algorithms, arXiv 2004.08771, 2020",
        statement='"We show that the implementation of these algorithms in the proposed CPU+GPU framework achieves '
        "both faster convergence and higher resource utilization than TensorFlow on several real datasets and on "
        'two computing architectures" (abstract); here the synchronous form (`hogbatch`: samples-weighted model '
        "merges every 2 steps in place of Hogbatch's lock-free shared model) on every GPU plus CPU replicas on the "
        "spare cores (devices=gpu_cpu), against DDP on the GPUs alone.",
        workload="xmc_mini",
        profile="gpu_cpu",
        candidate="hogbatch",
        rivals=("ddp",),
        entrants=(Entrant("hogbatch"), Entrant("ddp", ("algorithm=ddp", *_GPUS_ALONE))),
        requires=("hogbatch",),
        capability="CPU replicas beside GPU replicas, each batch sized to its device's speed",
        needs_gpu=True,
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
