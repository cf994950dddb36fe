"""Everything one replica does at merge points, independent of Lightning.

:class:`ElasticAverager` owns a replica's merge state: the schedule position, the merge rule's buffers
(previous merged models, central model, velocity) and the counters behind merge weights. It composes the pure
rules of :mod:`lightning_aesgd.core` with the communication layer; the strategy only tells it when a local
step happened.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_aesgd.core.merge import CentralElastic, MergeRule
from lightning_aesgd.core.schedule import merge_due, validate_schedule
from lightning_aesgd.core.weights import MergeWeights, check_merge_weights, replica_weight
from lightning_aesgd.engine.comm import Communicator, Number, WeightedAllReduce
from lightning_aesgd.engine.flat import (
    FlatView,
    floating_buffers,
    module_device,
    optimizer_state_tensors,
    rows_mean,
    to_host,
    trainable_parameters,
)

OptimizerStateMode = Literal["keep", "reset", "average"]
OPTIMIZER_STATE_MODES = ("keep", "reset", "average")


@dataclass(frozen=True)
class MergeSettings:
    """How and when replicas merge; checked once, when built.

    Args:
        rule: how the merged model and the write-back are computed.
        period: local steps between merges after warm-up.
        warmup_steps: steps at the start during which every step merges.
        weights: how a replica's merge weight is measured (samples, updates or uniform).
        merge_buffers: average floating buffers (BatchNorm statistics) with the same weights; otherwise they stay
            local. Buffers are plainly averaged: momentum and elastic pulls apply to parameters only.
        optimizer_state: what happens to the local optimizer's state at a merge: ``keep`` it, ``reset`` it, or
            ``average`` its moments with the same weights.
    """

    rule: MergeRule
    period: int = 1
    warmup_steps: int = 0
    weights: MergeWeights = "samples"
    merge_buffers: bool = True
    optimizer_state: OptimizerStateMode = "keep"

    def __post_init__(self) -> None:
        check_merge_rule(self.rule)
        validate_schedule(self.period, self.warmup_steps)
        check_merge_weights(self.weights)
        if getattr(self.rule, "alpha", None) == 0 or getattr(self.rule, "beta", None) == 0:
            warnings.warn(
                f"{self.rule!r} never pulls the replicas together: each trains alone, and only the merged model "
                "that validation and checkpoints see moves. HINT: use a coefficient in (0, 1] (1: replicas take "
                "the merged model).",
                stacklevel=3,
            )
        if not isinstance(self.merge_buffers, bool):
            raise TypeError(f"`merge_buffers` is a switch, got {self.merge_buffers!r}. HINT: pass True or False.")
        if self.optimizer_state not in OPTIMIZER_STATE_MODES:
            raise ValueError(
                f"Unknown optimizer_state {self.optimizer_state!r}. HINT: set optimizer_state to one of "
                f"{OPTIMIZER_STATE_MODES}."
            )


def check_merge_rule(rule: Any) -> None:
    """Raise, naming the fix, unless ``rule`` is a merge rule object (names are resolved before this).

    Raises:
        TypeError: for anything without the :class:`~lightning_aesgd.core.merge.MergeRule` methods (``None``, a
            number, a rule's class instead of an instance), which would otherwise fail only when a fit starts.
    """
    if isinstance(rule, type) or not all(callable(getattr(rule, name, None)) for name in _RULE_METHODS):
        raise TypeError(
            f"`merge_rule` must be a MergeRule object or a rule's name, got {rule!r}. HINT: pass 'elastic_average', "
            "'sma', 'easgd' or an instance such as ElasticAverage(alpha=1.0) (not the class)."
        )


_RULE_METHODS = ("init_state", "merge_", "center")


@dataclass
class ReducedMerge:
    """A merge whose collective is done and whose write-back is not (:meth:`ElasticAverager.reduce`).

    Attributes:
        means: the weighted means: parameters, buffers, then optimizer moments where those are averaged.
        rows: every replica's report row, in rank order.
        local: the replica's own parameters (a row per learner), which the rule writes back into.
        contributed: what the replica contributed (its pre-step snapshot, for SMA and EASGD).
        moments: the optimizer state averaged with the models (empty unless ``optimizer_state="average"``).
    """

    means: list[Tensor]
    rows: list[list[float]]
    local: Tensor
    contributed: Tensor
    moments: FlatView


class ElasticAverager:
    """Merges one replica's model with its peers every ``period`` local steps.

    Args:
        module: the replica's model; its trainable parameters (and floating buffers) are merged.
        comm: the collectives.
        settings: the rule, schedule, weights and what else is merged.
        learners: models of this replica trained side by side in this process (``learners_per_device``): the
            parameters and floating buffers become a row per learner (:class:`~lightning_aesgd.engine.flat.FlatView`),
            each replica contributes its learners' mean, and the rule counts every learner of every replica.
    """

    def __init__(self, module: nn.Module, comm: Communicator, settings: MergeSettings, learners: int = 1) -> None:
        self.rule = settings.rule
        self.comm = comm
        self.learners = learners
        self.num_models = comm.world_size * learners  # the rule's n: every learner is a model that merges
        overshoot = self.rule.overshoot_warning(self.num_models) if isinstance(self.rule, CentralElastic) else None
        if overshoot is not None and comm.rank == 0:
            warnings.warn(overshoot, stacklevel=2)
        self.period = settings.period
        self.warmup_steps = settings.warmup_steps
        self.weights = settings.weights
        self.optimizer_state = settings.optimizer_state
        # Every flat lives on the model's device, an empty one too (a model without buffers, or none merged).
        self.device = module_device(module)
        # Parameters become views of one flat buffer: merges then work on the model in place.
        self.params = FlatView(trainable_parameters(module), bind=True, device=self.device, learners=learners)
        # Learners keep buffers of their own (BatchNorm statistics): a block per buffer (FlatView says why).
        buffers = floating_buffers(module) if settings.merge_buffers else []
        self.buffers = FlatView(buffers, device=self.device, learners=learners)
        self._module = module
        # Where each merged buffer sits, to see one assigned anew; and the frozen parameters, to see one unfrozen.
        self._buffer_slots = _floating_buffer_slots(module) if settings.merge_buffers else []
        self._frozen = [p for p in module.parameters() if not p.requires_grad]
        self._told_of_trainable = False  # whether a change of the trainable parameters was warned of
        self._told_of_buffers = False  # whether buffers that changed shape were warned of
        self._mean = WeightedAllReduce(comm, self.device)
        self.rule_state = self.rule.init_state(_learner_mean(self.params.read()))
        self.local_steps = 0
        self.merges = 0
        self.samples_since_merge = 0.0
        self.updates_since_merge = 0
        self.skipped_since_merge = 0
        self.last_weight = 1.0
        self._snapshot: Tensor | None = None
        self._snapshot_buffer: Tensor | None = None
        self._stash: tuple[Tensor, Tensor] | None = None

    @property
    def merge_due_after_this_step(self) -> bool:
        """Whether the local step about to run is followed by a merge."""
        return merge_due(self.local_steps, self.period, self.warmup_steps)

    def before_local_step(self) -> None:
        """Keep the pre-step model when the coming merge averages pre-step models (SMA, EASGD)."""
        if self.rule.needs_snapshot and self.merge_due_after_this_step:
            if self._snapshot_buffer is None:
                self._snapshot_buffer = self.params.read()
            self._snapshot = self.params.read_into(self._snapshot_buffer)

    def after_local_step(self, num_samples: float) -> bool:
        """Count a finished local step; returns whether a merge is due now."""
        due = self.merge_due_after_this_step
        self.local_steps += 1
        self.samples_since_merge += num_samples
        self.updates_since_merge += 1
        return due

    def take_back_step(self, num_samples: float) -> None:
        """Take back a finished local step that applied no update: it then counts for nothing in the merge weight.

        The strategy takes back an idle step here (no samples). Steps a GradScaler skipped are taken back on the
        device instead, at the merge (:meth:`own_weight_less`, which equals taking each back here), so that the
        host never waits to read a flag.
        """
        self.samples_since_merge -= num_samples
        self.updates_since_merge -= 1
        self.skipped_since_merge += 1

    def skip_merge(self) -> None:
        """No replica updated its model since the last merge (every step skipped): nothing to merge, start anew."""
        self.samples_since_merge, self.updates_since_merge, self.skipped_since_merge = 0.0, 0, 0
        self._snapshot = None

    def own_weight(self) -> float:
        """This replica's merge weight for the work done since the last merge (0 if every update was skipped)."""
        if self.updates_since_merge == 0:
            return 0.0 if self.skipped_since_merge else self.last_weight
        return replica_weight(self.weights, self.samples_since_merge, self.updates_since_merge)

    def own_weight_less(self, skipped_samples: Tensor, skipped_updates: Tensor) -> Number:
        """:meth:`own_weight` less the steps the device may have skipped, computed there (the host reads nothing).

        Args:
            skipped_samples: the samples of the steps since the last merge that a GradScaler skipped (a
                one-element tensor on the device: a sum of its flags times the steps' samples).
            skipped_updates: how many steps it skipped, likewise.

        Returns:
            What :meth:`own_weight` returns once :meth:`take_back_step` took each skipped step back.
        """
        if self.updates_since_merge == 0:  # no update the device could have skipped (idle steps taken back)
            return self.own_weight()
        # The counts cannot fall below 0 (replica_weight's check): a skipped step is a step counted here, and an
        # idle step, taken back on the host, is never flagged.
        samples = self.samples_since_merge - skipped_samples
        updates = self.updates_since_merge - skipped_updates
        if self.weights == "samples":
            return samples
        if self.weights == "updates":
            return updates
        return (updates > 0).to(samples.dtype)  # uniform: 1, or 0 where every update was skipped

    @torch.no_grad()
    def merge(
        self, weight: float, optimizer: torch.optim.Optimizer | None = None, report: Sequence[float] = ()
    ) -> tuple[Tensor, list[list[float]]]:
        """Merge with all replicas (a collective) using this replica's ``weight``.

        ``report`` (a short row of numbers) travels in the same collective; returns the new global model and
        every replica's report, in rank order.
        """
        reduced = self.reduce(weight, optimizer, report)
        return self.apply(reduced, weight, optimizer), reduced.rows

    @torch.no_grad()
    def reduce(
        self, weight: Number, optimizer: torch.optim.Optimizer | None = None, report: Sequence[Number] = ()
    ) -> ReducedMerge:
        """A merge's collective alone: every replica's weighted means and ``report`` rows; no model changes yet.

        ``weight`` and numbers of ``report`` may be one-element tensors on the device
        (:class:`~lightning_aesgd.engine.comm.WeightedAllReduce`): the host then reads the device once, after
        the collective. :meth:`apply` finishes the merge, or the caller reduces again (a replica whose row says
        its model is not finite).

        Raises:
            NoMergeWeightError: if the weights of all replicas sum to zero (with every replica's row).
        """
        self._follow_module()
        local = self.params.current()
        contributed = local if self._snapshot is None else self._snapshot
        # A replica's learners trained on equal batches: its contribution is their plain mean.
        flats = [_learner_mean(contributed), _learner_mean(self.buffers.read())]
        moments = optimizer_state_tensors(optimizer) if optimizer and self.optimizer_state == "average" else []
        moment_view = FlatView(moments, device=self.device)
        if self.optimizer_state == "average":
            _check_same_moment_count(self.comm, moment_view.numel)
        if moment_view:
            flats.append(moment_view.read())
        means, rows = self._mean(flats, weight, report)
        return ReducedMerge(means, rows, local, contributed, moment_view)

    def _follow_module(self) -> None:
        """Merge what the model holds now: buffers it assigned anew; a warning where it cannot, or trainability changed.

        It decides on this replica alone, so it never raises: a replica raising before a collective would leave
        the others waiting in it. Buffers that changed in number, shape or dtype are merged no more (the view keeps
        their old tensors, the same size on every replica) and named in a warning.
        """
        # A dict lookup each, so merges stay cheap; `.get`: a buffer deleted since (`del module.buf`) reads as gone.
        now = [owner._buffers.get(name) for owner, name in self._buffer_slots]
        if self.buffers and not self.buffers.follow([b for b in now if b is not None]) and not self._told_of_buffers:
            self._told_of_buffers = True
            warnings.warn(
                f"{type(self._module).__name__}'s floating buffers changed in number, shape or dtype during the fit: "
                "sync='models' no longer averages them, and they drift apart between replicas. HINT: register every "
                "buffer before the fit with its final shape and dtype (assigning a new tensor of the same shape is "
                "fine), or pass merge_buffers=False to keep buffers local to each replica.",
                stacklevel=2,
            )
        if self._told_of_trainable:
            return
        if any(p.requires_grad for p in self._frozen) or not all(t.requires_grad for t in self.params.tensors):
            self._told_of_trainable = True
            if self.comm.rank == 0:
                warnings.warn(
                    "Parameters became trainable (or frozen) after the fit began, e.g. by BackboneFinetuning: "
                    "sync='models' merges those trainable at its start, so the replicas' copies of the others drift "
                    "apart, and validation and checkpoints see rank zero's (as DDP's buckets, and sync='gradients', "
                    "sum only those trainable at their start). HINT: make them trainable from the start, with a "
                    "learning rate of 0 in a parameter group of their own until they should move.",
                    stacklevel=2,
                )

    @torch.no_grad()
    def apply(self, reduced: ReducedMerge, weight: float, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        """Write back the merge that :meth:`reduce` summed (the rule's step); returns the new global model.

        Args:
            reduced: what :meth:`reduce` returned.
            weight: this replica's merge weight, as the host reads it (its row's): the weight of the merged model
                at an evaluation before the next local step.
            optimizer: the local optimizer, whose state the merge keeps, resets or averages.
        """
        means, local = reduced.means, reduced.local
        center = self.rule.merge_(local, reduced.contributed, means[0], self.num_models, self.rule_state)
        self.params.write_(local)  # a no-op when the parameters are views of `local`
        self.buffers.write_(means[1])
        if reduced.moments:
            reduced.moments.write_(means[2])
        if optimizer is not None and self.optimizer_state == "reset":
            optimizer.state.clear()
        self._snapshot = None
        self.merges += 1
        self.last_weight = weight
        self.samples_since_merge, self.updates_since_merge, self.skipped_since_merge = 0.0, 0, 0
        return center

    @torch.no_grad()
    def global_model(self) -> tuple[Tensor, Tensor]:
        """The model to evaluate or save now (a collective): the rule's center of the current replicas.

        Nothing changes: training continues from the replicas as they were.
        """
        self._follow_module()
        flats = [self.params.learner_mean(), _learner_mean(self.buffers.read())]
        means, _ = self._mean(flats, self.own_weight())
        return self.rule.center(means[0], self.rule_state), means[1].clone()

    def swap_in_global_model(self) -> None:
        """Load the global model into the module (a collective); :meth:`swap_out` restores the replica."""
        if self._stash is not None:
            return
        params, buffers = self.global_model()
        self._stash = (self.params.read(), self.buffers.read())
        self._show(params, buffers)

    def _show(self, params: Tensor, buffers: Tensor) -> None:
        """Put one model in the module: into its tensors, or, with several learners, as its tensors (unstacked)."""
        if self.learners == 1:
            self.params.write_(params)
            self.buffers.write_(buffers)
            return
        self.params.show_(params)
        if self.buffers:
            self.buffers.show_(buffers)

    def swap_out(self) -> None:
        """Restore the replica's own model after :meth:`swap_in_global_model`."""
        if self._stash is None:
            return
        params, buffers = self._stash
        if self.learners > 1:  # the learners' rows were never written: the module only showed another model
            self.params.restack_()
            if self.buffers:
                self.buffers.restack_()
        else:
            self.params.write_(params)
            self.buffers.write_(buffers)
        self._stash = None

    @property
    def swapped_in(self) -> bool:
        """Whether the module holds the global model rather than the replica's own."""
        return self._stash is not None

    def local_model(self) -> tuple[Tensor, Tensor]:
        """The replica's own flat parameters and buffers, even while the global model is swapped in."""
        if self._stash is not None:
            return self._stash
        self._follow_module()
        return self.params.read(), self.buffers.read()

    def load_local_model(self, params: Tensor, buffers: Tensor) -> None:
        """Overwrite the replica's own model (used when resuming)."""
        self._follow_module()
        self.params.write_(params)
        self.buffers.write_(buffers)

    def finite_probe(self) -> Tensor:
        """A scalar on the device that is finite when the replica's own parameters and buffers all are.

        A sum reads the model once without a temporary, and leaves the host free: a merge turns it into a flag
        on the device and sends it in its collective. It is not finite when an element is not, but also when finite
        elements overflow it; :meth:`is_finite` tells the two apart.
        """
        self._follow_module()
        return self.params.current().sum() + self.buffers.read().sum()

    def is_finite(self) -> bool:
        """Whether the replica's own parameters and buffers are all finite (one pass over the model, a host read)."""
        probe = to_host(self.finite_probe())[0]
        if math.isfinite(probe):
            return True
        # Rare: only a sum that is not finite needs the elementwise check, to tell an overflow from a NaN.
        flags = torch.stack([torch.isfinite(flat).all() for flat in (self.params.current(), self.buffers.read())])
        return all(flag == 1.0 for flag in to_host(flags.to(torch.float64)))

    def restore_from(self, center: Tensor, optimizer: torch.optim.Optimizer | None) -> None:
        """Replace the replica's parameters by ``center`` (buffers were merged already) and reset its optimizer."""
        self.params.write_(center)
        if optimizer is not None:
            optimizer.state.clear()

    def reset_to_center(self) -> None:
        """Reset the replica to the rule's stored central model (Crossbow does this when the learning rate drops)."""
        center = self.rule.center(self.params.learner_mean(), self.rule_state)
        self.params.write_(center)

    def adopt_global_model(self) -> None:
        """Make the global model the replica's own (a collective); used when training ends.

        With several learners the module keeps one model from then on: the global one, unstacked.
        """
        if self._stash is None:
            self._show(*self.global_model())
        self._stash = None  # the module holds the global model now
        self._drop_stacked_gradients()

    def _drop_stacked_gradients(self) -> None:
        """Gradients of the learners (``k × shape``) do not fit one model's parameters: drop them."""
        if self.learners > 1:
            for tensor in self.params.tensors:
                tensor.grad = None

    def one_model_shapes(self) -> dict[int, torch.Size]:
        """One model's shape of each parameter holding a row per learner, by ``id`` (none with one learner)."""
        if self.learners == 1:
            return {}
        return {id(tensor): shape for tensor, shape in zip(self.params.tensors, self.params.shapes, strict=True)}

    def unstack(self) -> None:
        """Leave the module one model, the mean of this replica's learners, unless it holds one already.

        For a fit that ends without :meth:`adopt_global_model` (it failed): before any step that is the model
        the fit started from. Local: no collective, as the peers may be gone.
        """
        if self.learners == 1 or self.params.showing:
            return
        self._show(self.params.learner_mean(), _learner_mean(self.buffers.read()))
        self._drop_stacked_gradients()

    def shared_state(self) -> dict[str, Any]:
        """State that is identical on every replica: the schedule position and the rule's buffers."""
        return {
            "local_steps": self.local_steps,
            "merges": self.merges,
            "rule_state": {name: tensor.cpu() for name, tensor in self.rule_state.items()},
        }

    def local_state(self) -> dict[str, Any]:
        """State of this replica alone: the work behind its next merge weight."""
        return {
            "samples_since_merge": self.samples_since_merge,
            "updates_since_merge": self.updates_since_merge,
            "last_weight": self.last_weight,
        }

    def load_shared_state(self, state: dict[str, Any]) -> None:  # noqa: D102
        self.local_steps = state["local_steps"]
        self.merges = state["merges"]
        self.rule_state = {name: tensor.to(self.device) for name, tensor in state["rule_state"].items()}

    def load_local_state(self, state: dict[str, Any]) -> None:  # noqa: D102
        self.samples_since_merge = state["samples_since_merge"]
        self.updates_since_merge = state["updates_since_merge"]
        self.last_weight = state["last_weight"]


def _floating_buffer_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(owner, name)`` of each floating buffer of ``module``, in :func:`floating_buffers`'s order."""
    slots = []
    for path, buffer in module.named_buffers():
        if buffer.is_floating_point():
            owner, _, name = path.rpartition(".")
            slots.append((module.get_submodule(owner), name))
    return slots


def _learner_mean(flat: Tensor) -> Tensor:
    """One flat model from a flat that holds a row per learner; a flat of one model as it is."""
    return flat if flat.dim() == 1 else rows_mean(flat)


class MomentLayoutError(ValueError):
    """Replicas hold optimizer state for different parameters, so their moments cannot be averaged."""


def _check_same_moment_count(comm: Communicator, count: int) -> None:
    """Raise on every replica alike unless all hold the same number of optimizer moment elements.

    One small all-reduce of ``(c, −c)`` with MAX gives every replica the largest and the smallest count, so all
    raise or none does, before the merge's collective, whose buckets would otherwise differ in size (a hang or a
    crash). Exact at any count (a sum of squares would overflow 64 bits past about 3e9 elements). The counts are
    host numbers, reduced on the host group: the host need not wait for the device.
    """
    extremes = torch.tensor([count, -count], dtype=torch.int64)
    comm.host_all_reduce_max_(extremes)
    largest, negated_smallest = extremes.tolist()
    if largest != -negated_smallest:
        raise MomentLayoutError(
            f"optimizer_state='average' needs optimizer state for the same parameters on every replica; this one "
            f"holds {count} moment values, the replicas between {-negated_smallest} and {largest}. A parameter "
            "that got no gradient on some replica has no state there. HINT: use optimizer_state='keep' (the "
            "default) or 'reset', or make every parameter take part in every replica's loss."
        )
