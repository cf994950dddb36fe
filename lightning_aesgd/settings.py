"""The ``adaptive_elastic`` strategy's training options in one place, each checked when the settings are built.

The strategy keeps flat keyword arguments, as Lightning's own strategies do (LightningCLI and Hydra configs set
them by name), and forwards its training options to :class:`StrategySettings`: one frozen object that documents
them, checks them before any process starts, and derives what the engine takes from them (the merge and plan
settings, DistributedDataParallel's options, the engine itself). It imports no Lightning (``tests/test_settings.py``
checks): settings are built, checked and turned into an engine without a Trainer.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal

from torch.nn.parallel import DistributedDataParallel

from lightning_aesgd.core.apportion import High, Low
from lightning_aesgd.core.merge import MergeRule, as_merge_rule
from lightning_aesgd.core.planners import Planner
from lightning_aesgd.core.values import is_real, is_whole, plain
from lightning_aesgd.core.weights import MergeWeights
from lightning_aesgd.emulation import SlowdownProfile, as_profile
from lightning_aesgd.engine.averager import MergeSettings, OptimizerStateMode
from lightning_aesgd.engine.gradient_sync import GradientSync
from lightning_aesgd.engine.learner_tuning import LearnerTuning
from lightning_aesgd.engine.loading import SampleCosts, check_sample_costs, check_step_options
from lightning_aesgd.engine.model_merge import ModelMerge
from lightning_aesgd.engine.pipeline import StepPipeline, check_lr_schedule
from lightning_aesgd.engine.plan_settings import PlanSettings

NO_BUFFER_SYNC_AT_FORWARD: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)
"""DistributedDataParallel's arguments that skip its per-forward broadcast of the buffers (BatchNorm statistics)
from rank zero, which torch 2.13 renamed (``broadcast_buffers`` to ``forward_sync_buffers``); both keep the
broadcast at wrapping."""

MERGE_OPTIONS = (
    "period",
    "merge_rule",
    "merge_weights",
    "l2_nudge",
    "merge_buffers",
    "optimizer_state",
    "lr_scaling",
    "learners_per_device",
    "max_learners",
    "learner_min_gain",
)
"""The options only model merging uses: ``sync="gradients"`` refuses each one given a value other than its default."""

_SWITCHES = (
    "l2_nudge",
    "lr_scaling",
    "plan_after_warmup",
    "leave_out_stragglers",
    "checkpoint_replicas",
    "telemetry",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "compensate_momentum",
)
"""The on/off options checked here; ``merge_buffers`` is checked, with its own message, by MergeSettings."""


@dataclass(frozen=True, kw_only=True)
class StrategySettings:
    """Every training option of the ``adaptive_elastic`` strategy, checked when built. The defaults are the strategy's.

    Args:
        sync: what the replicas synchronise. ``"gradients"`` (the default): DDP's reducer with each replica's
            gradient weighted by its share of the step's samples, ``Σᵢ (bᵢ/M)·gᵢ``, the gradient of the whole step
            batch: DDP's update for any optimizer, at speed-proportional batches (see
            :mod:`lightning_aesgd.engine.gradients`); the merge options (period, merge_rule, merge_weights,
            l2_nudge, merge_buffers, optimizer_state, lr_scaling) do not apply to it. ``"models"``: local steps and
            elastic model merges (the merge options below): Adaptive SGD, SMA, EASGD, local SGD.
        period: local steps between merges after warm-up (torch's ``PeriodicModelAverager`` semantics).
        warmup_steps: steps at the start that each end with a merge.
        merge_rule: a :class:`~lightning_aesgd.core.merge.MergeRule` object (``ElasticAverage(alpha, momentum)``,
            ``SMA(...)``, ``EASGD(...)``), or the name of one with its defaults (``"elastic_average"``, ``"sma"``,
            ``"easgd"``).
        merge_weights: each replica's merge weight: ``"samples"`` since the last merge, ``"updates"`` or
            ``"uniform"``.
        l2_nudge: Adaptive SGD's "adaptive normalization": after warm-up, while the merged model's L2 norm keeps
            growing, the largest merge weight is raised by 10% and the smallest lowered by 10% (weights then
            renormalised; the authors' code does not renormalise).
        merge_buffers: average floating buffers (BatchNorm statistics) too; otherwise they stay local, and each
            replica validates the merged parameters with its own statistics while checkpoints hold rank zero's.
        optimizer_state: at a merge, ``"keep"``, ``"reset"`` or ``"average"`` the local optimizer's state.
        planner: how per-replica batch sizes follow measurements: ``"proportional"`` (share ∝ speed),
            ``"balanced"`` (equal predicted step times, fixed per-step costs included), ``"additive"`` (the paper's
            ±step rule), ``"static"`` (fixed ``shares``), or a :class:`~lightning_aesgd.core.planners.Planner`.
        shares: fixed shares of the step batch for the ``"static"`` planner (equal when omitted).
        min_batch: smallest batch a replica may get; a list gives one per replica, in rank order (e.g. a GPU's and
            the CPU replicas' beside it under ``replica_devices``).
        min_share: adaptive plans give every replica at least this fraction of the equal share ``M/n``, so that a
            slow replica is never starved to a useless batch while the others wait for it; or one per replica.
        max_batch: largest batch a replica may get (``None``: no limit), or one per replica (a device's memory).
        step_batch_size: indices consumed per step by all replicas together; by default the DataLoader's batch
            size times the number of replicas, so that an equal plan means what DDP means.
        plan_lag: steps between deciding a plan and applying it; by default just above the prefetch depth.
        speed_smoothing: smoothing β of the speed moving averages, per report of up to ``plan_lag + 1`` steps (a
            longer report weighs as that many reports); 0.8 follows a 4× slowdown within about 16 steps while
            averaging out single noisy steps.
        plan_gain: fraction γ of the way to the planner's target that each new plan moves (damping); the first
            plan, from the initial split, moves all the way.
        plan_after_warmup: keep the initial plan through the ``warmup_steps`` (speeds are still measured) and
            adapt only after them, as the authors' code does; otherwise plans adapt from the first measurements.
        leave_out_stragglers: a replica whose step at the smallest batch outlasts the others' whole step gets no
            work (batch 0: it skips its forward and backward and joins the sync points with nothing to add), and
            is probed now and then at the smallest batch, re-admitted when it would help
            (:mod:`~lightning_aesgd.engine.admission`); adaptive planners by name only.
        sample_costs: per-sample cost for cost-aware splitting: ``None`` (count samples), ``"dataset"`` (the
            dataset's ``sample_costs`` attribute), ``"auto"`` (those where the dataset has them) or a function of
            the dataset.
        lr_scaling: scale each replica's learning rate by its batch size over the nominal one during its step
            (the paper's ``lrᵢ = η·bᵢ/B``). With ``merge_weights="updates"`` this weighs every sample equally, as
            ``merge_weights="samples"`` does without scaling.
        lr_schedule: a factor on each replica's learning rate during its step, a function of the global step
            (e.g. :class:`~lightning_aesgd.core.lr.InverseTimeDecay`, the paper's warm-up ramp and ``1/(1 + decay·t)``);
            it multiplies ``lr_scaling``'s factor and, like it, leaves the optimizer's own rate (and the user's
            schedulers) alone between steps.
        gradient_delay: with ``sync="gradients"``, 1 applies each step's sum one step later while the next step
            computes (ABS-SGD); 0 applies it at once.
        compensate_momentum: with ``gradient_delay=1``, give parameters whose optimizer group has a momentum
            ``μ > 0`` (SGD) ``(1 + μ)·Ĝ_{t−1} − μ·Ĝ_{t−2}`` in place of the stale sum ``Ĝ_{t−1}`` (spike compensation,
            Kosson et al., MLSys 2021): a one-step-stale gradient under momentum 0.9 otherwise overshoots.
        gradient_delay_warmup: with ``gradient_delay=1``, the first this many global steps apply their own sum at
            once (synchronous); the delay starts after them. The first steps, where the gradient changes fastest,
            suffer most from staleness.
        gradient_delay_lr_scale: with ``gradient_delay=1``, a factor on the learning rate of every update that
            applies a stale sum, one computed before the latest update (the optimizer's own rate and schedulers are
            left alone; a sum whose step applied nothing, the first after a start or a flush, is fresh). 1 is the
            paper's rule; ½ (``algorithm=abs_sgd``) keeps the stability margin of the synchronous step size, which
            a stale update halves (:func:`~lightning_aesgd.core.lr.stale_update_scale`).
        find_unused_parameters: with ``sync="gradients"``, DistributedDataParallel's option of that name.
        gradient_as_bucket_view: with ``sync="gradients"``, DistributedDataParallel's option of that name, on by
            default (Lightning's DDP leaves it off): the gradients are views into DDP's communication buckets, so
            a large host bucket summed in place is its gradients' sum, with no copy back into them
            (docs/results/large_model; smaller, delayed or device buckets are summed on a copy, copied back). Off
            for user code that calls ``param.grad.detach_()`` (which a view refuses) or keeps a step's
            ``param.grad`` without cloning it (the next backward overwrites a view).
        slowdown: emulate slower devices by a factor per replica, in the ``step`` mode: the spans where each
            replica's device computes take ``fᵣ`` times as long (see :mod:`lightning_aesgd.emulation`; the other
            modes come from :class:`~lightning_aesgd.callbacks.SlowdownCallback`).
        checkpoint_replicas: save every replica's own model and optimizer state, so that resuming continues
            exactly; otherwise every replica resumes from the merged model.
        telemetry: log ``aesgd/...`` metrics at every merge and print a per-replica summary when fit ends.
        learners_per_device: models each replica trains side by side, as Crossbow's learners: the replica's batch
            is split equally among them, one batched step (``torch.func.vmap``) runs them all, and the merge
            rule counts every learner (``sync="models"`` only; see :mod:`~lightning_aesgd.engine.learners`).
            ``"auto"``: Crossbow's tuner measures 1, 2, ... learners before the first step and keeps each one that
            raises the throughput by ``learner_min_gain``, up to ``max_learners`` or the device's memory
            (:mod:`~lightning_aesgd.engine.learner_tuning`).
        max_learners: with ``learners_per_device="auto"``, the most learners per replica.
        learner_min_gain: with ``learners_per_device="auto"``, the smallest rise of throughput (a fraction) that a
            learner more must bring.

    Raises:
        ValueError: for a value out of range, or an option that does not apply to the chosen ``sync``; the message
            names the option and the fix (``HINT:``).
        TypeError: for a value of the wrong kind (a string for a switch or a number, a class for an object).
    """

    sync: Literal["models", "gradients"] = "gradients"
    period: int = MergeSettings.period
    warmup_steps: int = MergeSettings.warmup_steps
    merge_rule: MergeRule | str = "elastic_average"
    merge_weights: MergeWeights = MergeSettings.weights
    l2_nudge: bool = False
    merge_buffers: bool = MergeSettings.merge_buffers
    optimizer_state: OptimizerStateMode = MergeSettings.optimizer_state
    planner: str | Planner = PlanSettings.planner
    shares: Sequence[float] | None = PlanSettings.shares
    min_batch: Low = PlanSettings.min_batch
    min_share: float | Sequence[float] = PlanSettings.min_share
    max_batch: High = PlanSettings.max_batch
    step_batch_size: int | None = None
    plan_lag: int | None = None
    speed_smoothing: float = PlanSettings.speed_smoothing
    plan_gain: float = PlanSettings.plan_gain
    plan_after_warmup: bool = False
    leave_out_stragglers: bool = PlanSettings.leave_out_stragglers
    sample_costs: SampleCosts = None
    lr_scaling: bool = False
    lr_schedule: Callable[[int], float] | None = None
    gradient_delay: int = 0
    compensate_momentum: bool = True
    gradient_delay_warmup: int = 0
    gradient_delay_lr_scale: float = 1.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    slowdown: SlowdownProfile | Sequence[float] | Mapping[str, Any] | None = None
    checkpoint_replicas: bool = True
    telemetry: bool = True
    learners_per_device: int | Literal["auto"] = 1
    max_learners: int = LearnerTuning.max_learners
    learner_min_gain: float = LearnerTuning.min_gain

    # Derived from the options above when the settings are built (their checks run then).
    merging: MergeSettings = field(init=False, repr=False, compare=False)
    """Model merging's settings; built and checked in either sync mode."""
    planning: PlanSettings = field(init=False, repr=False, compare=False)
    """How batch sizes follow the measurements."""
    learner_tuning: LearnerTuning = field(init=False, repr=False, compare=False)
    """How ``learners_per_device="auto"`` chooses."""
    step_slowdown: SlowdownProfile | None = field(init=False, repr=False, compare=False)
    """The slowdown profile the strategy applies itself: ``slowdown`` in the ``step`` mode, otherwise None (the
    other modes are :class:`~lightning_aesgd.callbacks.SlowdownCallback`'s)."""

    def __post_init__(self) -> None:
        for option in fields(self):  # NumPy numbers (a sweep's) become Python's: checkpoints load without NumPy
            if option.init:
                object.__setattr__(self, option.name, plain(getattr(self, option.name)))
        check_switches(**{name: getattr(self, name) for name in _SWITCHES})
        # Checked in either mode, so that a wrong value is named as such before sync='gradients' refuses the option.
        self._derive(
            "merging",
            MergeSettings(
                as_merge_rule(self.merge_rule),
                self.period,
                self.warmup_steps,
                self.merge_weights,
                self.merge_buffers,
                self.optimizer_state,
            ),
        )
        check_sync(
            self.sync,
            self.gradient_delay,
            self.gradient_delay_warmup,
            self.gradient_delay_lr_scale,
            self.find_unused_parameters,
        )
        if self.sync == "gradients":
            _refuse_merge_options(self.merge_options_given())
        profile = as_profile(self.slowdown)
        self._derive("step_slowdown", profile if profile is not None and profile.mode == "step" else None)
        hold_steps = self.warmup_steps if self.plan_after_warmup else 0
        self._derive(
            "planning",
            PlanSettings(
                self.planner,
                self.shares,
                self.min_batch,
                self.max_batch,
                self.min_share,
                self.speed_smoothing,
                self.plan_gain,
                hold_steps=hold_steps,
                leave_out_stragglers=self.leave_out_stragglers,
            ),
        )
        # What the engine checks when built, checked here too: settings that exist can build an engine.
        check_step_options(self.step_batch_size, self.plan_lag)
        check_sample_costs(self.sample_costs)
        check_lr_schedule(self.lr_schedule)
        check_learners(self.learners_per_device, self.sample_costs, self.optimizer_state, self.merge_buffers)
        self._derive("learner_tuning", LearnerTuning(self.max_learners, self.learner_min_gain))

    def _derive(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: derived fields are set once, here

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The names of the options, in order (the derived fields left out)."""
        return tuple(option.name for option in fields(cls) if option.init)

    def check_replicas(self, num_replicas: int) -> None:
        """Raise, naming the option, unless the per-replica options and emulated devices fit ``num_replicas``.

        Known once the Trainer knows its devices, before any replica starts.
        """
        profile = as_profile(self.slowdown)
        if profile is not None:
            profile.check_replicas(num_replicas)
        self.planning.check_replicas(num_replicas)

    def merge_options_given(self) -> list[str]:
        """The merge options (:data:`MERGE_OPTIONS`) set to anything but their defaults, sorted."""
        defaults = {option.name: option.default for option in fields(self)}
        return sorted(name for name in MERGE_OPTIONS if _differs(getattr(self, name), defaults[name]))

    def ddp_options(self) -> dict[str, Any]:
        """DistributedDataParallel's keyword options: those of ``sync="gradients"``; none for model merging."""
        if self.sync != "gradients":
            return {}
        # Buffers (BatchNorm statistics) go from rank zero at evaluation, checkpoints and the end of fit instead of
        # at every forward: DDP's per-forward broadcast would be a second synchronisation point per step, which
        # arrival sensing would count as work and which the delayed sum could not overlap (see GradientSync).
        return {
            "find_unused_parameters": self.find_unused_parameters,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            **NO_BUFFER_SYNC_AT_FORWARD,
        }

    def build_engine(self) -> StepPipeline:
        """A new engine of these settings: :class:`GradientSync` or :class:`ModelMerge`, by ``sync``."""
        if self.sync == "gradients":
            return GradientSync(
                self.planning,
                delay=self.gradient_delay,
                compensate_momentum=self.compensate_momentum,
                delay_warmup=self.gradient_delay_warmup,
                delay_lr_scale=float(self.gradient_delay_lr_scale),
                lr_schedule=self.lr_schedule,
                step_batch_size=self.step_batch_size,
                plan_lag=self.plan_lag,
                sample_costs=self.sample_costs,
            )
        return ModelMerge(
            self.merging,
            self.planning,
            l2_nudge=self.l2_nudge,
            lr_scaling=self.lr_scaling,
            lr_schedule=self.lr_schedule,
            step_batch_size=self.step_batch_size,
            plan_lag=self.plan_lag,
            sample_costs=self.sample_costs,
            checkpoint_replicas=self.checkpoint_replicas,
            learners=self.learners_per_device,
            learner_tuning=self.learner_tuning,
        )


# --- checks ---------------------------------------------------------------------------------------------------


DDP_ONLY_OPTIONS = frozenset(
    set(inspect.signature(DistributedDataParallel.__init__).parameters)
    - {"self", "module", "find_unused_parameters", "gradient_as_bucket_view"}
    | {"ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period"}  # DDPStrategy's own
)
"""DistributedDataParallel's and DDPStrategy's own options: the strategy sums gradients its own way."""


def refuse_unknown_options(owner: str, unknown: Mapping[str, Any], known: Sequence[str] = ()) -> None:
    """Raise for keyword arguments ``owner`` (the strategy's class name) does not take, naming the fix.

    DDPStrategy would pass them to DistributedDataParallel, which the strategy may never build: a typo would vanish
    silently.

    Args:
        owner: the strategy's class name.
        unknown: the arguments it does not take.
        known: the options it takes, for a likely spelling.

    Raises:
        TypeError: for any: the merge rule's own options (``alpha``, ``momentum``) and DDP's named as such, others
            with the closest option names.
    """
    names = sorted(unknown)
    if {"alpha", "momentum"} & set(names):
        raise TypeError(
            f"{owner} takes no {sorted({'alpha', 'momentum'} & set(names))}: they belong to the "
            "merge rule. HINT: pass merge_rule=ElasticAverage(alpha=..., momentum=...) (or SMA(...), EASGD(...))."
        )
    ddp = sorted(DDP_ONLY_OPTIONS & set(names))
    others = [name for name in names if name not in DDP_ONLY_OPTIONS]
    problems = []
    if ddp:
        problems.append(
            f"{owner} takes no {ddp}: they are DistributedDataParallel's (or DDPStrategy's) options, and the strategy "
            "sums gradients its own way (it takes find_unused_parameters and gradient_as_bucket_view). HINT: drop "
            "them; keep them for strategy='ddp'."
        )
    if others:
        guesses = {name: difflib.get_close_matches(name, known, n=2) for name in others}
        said = "; ".join(f"{name}: did you mean {' or '.join(g)}?" for name, g in guesses.items() if g)
        problems.append(
            f"{owner} got unexpected arguments {others}{f' ({said})' if said else ''}. HINT: check the spelling "
            f"against its options: {', '.join(sorted(known)) or 'see its docstring'}."
        )
    if problems:
        raise TypeError("\n".join(problems))


def check_switches(**switches: Any) -> None:
    """Raise unless every on/off option is a bool: a string such as ``"no"`` from a config file is truthy.

    Raises:
        TypeError: naming the option.
    """
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"`{name}` is a switch, got {value!r}. HINT: pass {name}=True or {name}=False.")


START_METHODS = ("popen", "spawn", "fork", "forkserver")
"""How Lightning's launchers start the replicas: re-running the script, or multiprocessing's start methods."""


def check_launch(timeout: Any, start_method: Any) -> None:
    """Raise unless the collectives' ``timeout`` and the ``start_method`` are valid, before any process starts.

    Raises:
        TypeError: for a timeout that is not a ``datetime.timedelta`` (or None).
        ValueError: for a timeout of zero or less, or an unknown start method.
    """
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"`timeout` is the time collectives may wait, got {timeout!r}. HINT: pass a datetime.timedelta, e.g. "
            "timeout=timedelta(minutes=30) (from Hydra: "
            "'+algorithm.timeout={_target_:datetime.timedelta,minutes:30}'), or leave it unset."
        )
    if timeout is not None and timeout <= timedelta(0):
        raise ValueError(
            f"`timeout` is the time collectives may wait, got {timeout}: every collective would fail at once. "
            "HINT: pass a positive datetime.timedelta, e.g. timeout=timedelta(minutes=30), or leave it unset."
        )
    if start_method not in START_METHODS:
        raise ValueError(
            f"`start_method` is how the replicas are started, got {start_method!r}. HINT: use one of "
            f"{', '.join(START_METHODS)} (popen by default; spawn where CUDA was used before the fit)."
        )


def check_sync(sync: Any, gradient_delay: Any, delay_warmup: Any, delay_lr_scale: Any, find_unused: Any) -> None:
    """Raise unless ``sync`` and the gradient options are valid and apply to the chosen ``sync``.

    Args:
        sync: ``"models"`` or ``"gradients"``.
        gradient_delay: 0 or 1.
        delay_warmup: synchronous steps before the delay starts: a whole number >= 0, > 0 only with the delay.
        delay_lr_scale: the factor on stale updates' learning rate: a finite number > 0, other than 1 only with the
            delay.
        find_unused: DistributedDataParallel's ``find_unused_parameters``: only with ``sync="gradients"`` and no
            delay.

    Raises:
        ValueError: naming the option and the fix.
    """
    if sync not in ("models", "gradients"):
        raise ValueError(f"sync={sync!r} is not one of 'models', 'gradients'. HINT: pick one of them.")
    if gradient_delay not in (0, 1) or isinstance(gradient_delay, bool):
        raise ValueError(
            f"gradient_delay={gradient_delay!r}: 0 (synchronous) or 1 (ABS-SGD) only. HINT: pass gradient_delay=0, or "
            "gradient_delay=1 with sync='gradients'."
        )
    if not is_whole(delay_warmup) or delay_warmup < 0:
        raise ValueError(
            f"gradient_delay_warmup={delay_warmup!r} counts steps. HINT: pass a whole number >= 0 (0: delay from the "
            "first step)."
        )
    if delay_warmup and not gradient_delay:
        raise ValueError(
            "gradient_delay_warmup delays the start of gradient_delay=1, which is not set. HINT: add "
            "sync='gradients', gradient_delay=1 (ABS-SGD), or remove gradient_delay_warmup."
        )
    _check_delay_lr_scale(delay_lr_scale, gradient_delay)
    if sync == "models":
        if gradient_delay:
            raise ValueError(
                "gradient_delay applies to gradient synchronisation only. HINT: add sync='gradients' (ABS-SGD)."
            )
        if find_unused:
            raise ValueError(
                "find_unused_parameters is DistributedDataParallel's option, used with sync='gradients' only; "
                "model merging needs no such search. HINT: remove it, or add sync='gradients'."
            )
    elif gradient_delay and find_unused:
        raise ValueError(
            "gradient_delay=1 with find_unused_parameters=True: DDP writes no gradient for a parameter unused in a "
            "step, which would drop the delayed sum it should apply there. HINT: use gradient_delay=0, or make "
            "every parameter take part in every step."
        )


def _check_delay_lr_scale(delay_lr_scale: Any, gradient_delay: Any) -> None:
    if not is_real(delay_lr_scale):
        raise ValueError(f"gradient_delay_lr_scale={delay_lr_scale!r} is a factor. HINT: pass a number > 0 (e.g. 0.5).")
    if not math.isfinite(delay_lr_scale):
        raise ValueError(
            f"gradient_delay_lr_scale={delay_lr_scale!r} is not a finite number. HINT: pass a finite number > 0 "
            "(1: the paper's rule; 0.5, the abs_sgd config's, halves the rate of stale updates)."
        )
    if delay_lr_scale <= 0:
        raise ValueError(
            f"gradient_delay_lr_scale={delay_lr_scale!r} would stop or reverse the stale updates. HINT: pass a "
            "number > 0 (1: the paper's rule; 0.5, the abs_sgd config's, halves the rate of stale updates)."
        )
    if delay_lr_scale != 1 and not gradient_delay:
        raise ValueError(
            "gradient_delay_lr_scale scales the stale updates of gradient_delay=1, which is not set. HINT: add "
            "sync='gradients', gradient_delay=1 (ABS-SGD), or remove gradient_delay_lr_scale."
        )


def check_learners(learners: Any, sample_costs: Any, optimizer_state: str, merge_buffers: bool) -> None:
    """Raise, naming the fix, unless ``learners_per_device`` is a whole number >= 1 that the other options allow."""
    if learners != "auto" and not (is_whole(learners) and learners >= 1):
        raise ValueError(
            f"`learners_per_device` counts models per replica, got {learners!r}. HINT: pass a whole number >= 1, "
            "or 'auto'."
        )
    if learners == 1:
        return
    # Each learner trains on an equal slice of its replica's batch, with its own optimizer state and statistics.
    refused = {
        "sample_costs": (sample_costs is not None, "cost-aware slices differ in length, learners need equal ones"),
        "optimizer_state='average'": (optimizer_state == "average", "use optimizer_state='keep' or 'reset'"),
        "merge_buffers=False": (not merge_buffers, "each learner's buffers are merged with its parameters"),
    }
    for option, (given, why) in refused.items():
        if given:
            raise ValueError(
                f"learners_per_device={learners} does not support {option}: {why}. HINT: remove {option.split('=')[0]}"
                f" or use learners_per_device=1."
            )


def _refuse_merge_options(given: list[str]) -> None:
    if given:
        raise ValueError(
            f"{given} configure model merging, which sync='gradients' does not do (every step applies the sum "
            "of the replicas' weighted gradients). HINT: remove them, or use sync='models'."
        )


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:  # an object without equality (a merge rule instance): it was given
        return True
