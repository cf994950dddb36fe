"""Merge rules: how a replica's flat model and the rule's state change at a merge.

A strategy flattens each replica's parameters into one flat tensor. At a merge its communication layer
computes, across the ``n`` replicas, the weighted mean of what each replica contributes,

    mean = Σ_i w_i·x̂_i / Σ_i w_i,

and hands it to a :class:`MergeRule`, which writes the merged result back into the local replica (in place)
and updates its own state. Every rule is an optional outer (central) update with Polyak momentum followed by
an elastic pull of each replica towards the global model.

Rules:
    * :class:`ElasticAverage` — average, extrapolate with outer momentum, pull (or hard-reset) the replicas:
      Adaptive SGD and local SGD.
    * :class:`CentralElastic` — a stored central model moved by the replicas' elastic corrections;
      :class:`SMA` and :class:`EASGD` are its presets.

Method cards: ``docs/methods/adaptive_sgd.md``, ``sma.md``, ``easgd.md``, ``local_sgd.md``.

The module imports torch only (never Lightning or ``torch.distributed``), so every rule can be exercised in
one process by simulating the replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_aesgd.core.weights import checked_weights

__all__ = [
    "EASGD",
    "SMA",
    "CentralElastic",
    "ElasticAverage",
    "MergeRule",
    "available_merge_rules",
    "elastic_pull_",
    "extrapolate_",
    "get_merge_rule",
    "weighted_mean",
]


@runtime_checkable
class MergeRule(Protocol):
    """What the strategy needs from a merge rule.

    Attributes:
        needs_snapshot: ``True`` if the mean must be taken over each replica's model as it was *before* the
            local step of the merge step (gradient and correction both computed at ``x_t``); ``False`` if it is
            taken over the model after the local step.
        resets_on_lr_drop: ``True`` if replicas are to be reset to the central model whenever the learning
            rate drops.
    """

    needs_snapshot: bool
    resets_on_lr_drop: bool

    def init_state(self, initial: Tensor) -> dict[str, Tensor]:
        """Create the rule's state from the flat initial model, which is identical on every replica.

        Args:
            initial: The flat initial model.

        Returns:
            Fresh tensors (never aliases of ``initial``), keyed by name.
        """
        ...

    def merge_(
        self, local: Tensor, contributed: Tensor, mean: Tensor, num_replicas: int, state: dict[str, Tensor]
    ) -> Tensor:
        """Apply one merge: write back into ``local`` and update ``state``, both in place.

        Rules work in place and allocate nothing model-sized, because a merge sits on the training path and a
        fresh model-sized tensor costs as much as copying it (its pages must be touched first).

        Args:
            local: This replica's current flat model; updated in place.
            contributed: What this replica contributed to the mean: its pre-step snapshot if
                ``needs_snapshot``, otherwise the very tensor ``local``. Never written.
            mean: The weighted mean over all replicas of their ``contributed`` tensors: scratch space the
                caller hands over for this call (never ``local``); the rule may overwrite it.
            num_replicas: The number of replicas ``n`` that took part.
            state: The rule's state, as returned by :meth:`init_state`; updated in place.

        Returns:
            The new global model. It may share memory with ``mean`` or ``state``: read it (e.g. its norm)
            before the next merge, and copy it to keep it.
        """
        ...

    def center(self, mean: Tensor, state: dict[str, Tensor]) -> Tensor:
        """Return the global model to evaluate or checkpoint now, changing nothing.

        Args:
            mean: The current mean of the replicas' models.
            state: The rule's state.

        Returns:
            A new tensor holding the global model.
        """
        ...


def weighted_mean(tensors: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Reference weighted mean ``Σ_i w_i·x_i / Σ_i w_i`` of same-shaped tensors.

    This is what the communication layer computes across replicas; tests and single-process fakes use this
    function as its oracle. It accumulates in float64 and rounds once at the end, so for float32 inputs the
    result lies exactly within the elementwise range of the inputs.

    Args:
        tensors: One tensor per replica, all of the same shape.
        weights: One non-negative weight per replica; at least one must be positive.

    Returns:
        A new tensor with the dtype and shape of ``tensors[0]``.

    Raises:
        ValueError: If the inputs are empty, mismatched, or the weights are invalid.
    """
    _check_mean_inputs(tensors, weights)
    total = math.fsum(weights)
    accumulator = torch.zeros_like(tensors[0], dtype=torch.float64)
    for tensor, weight in zip(tensors, weights, strict=True):
        accumulator.add_(tensor.to(torch.float64), alpha=weight / total)
    return accumulator.to(tensors[0].dtype)


def _check_mean_inputs(tensors: Sequence[Tensor], weights: Sequence[float]) -> None:
    if not tensors:
        raise ValueError("`weighted_mean` needs at least one tensor.")
    if len(tensors) != len(weights):
        raise ValueError(f"Got {len(tensors)} tensors but {len(weights)} weights; pass one weight per tensor.")
    if any(tensor.shape != tensors[0].shape for tensor in tensors):
        raise ValueError("All tensors must have the same shape; flatten every replica the same way.")
    checked_weights(weights)


def extrapolate_(mean: Tensor, history: dict[str, Tensor], momentum: float) -> Tensor:
    """Polyak (heavy-ball) momentum on the merged model, computed into the merge history, which it shifts.

    ``z_t = mean + μ·(z_{t−1} − z_{t−2})``; afterwards ``history["previous"]`` holds ``z_t`` (the returned
    tensor) and ``history["before_previous"]`` holds ``z_{t−1}``; ``mean`` is only read.

    Args:
        mean: The merged model ``Σ_i p_i x_i``.
        history: ``{"previous": z_{t−1}, "before_previous": z_{t−2}}``; shifted in place.
        momentum: ``μ``; 0 gives ``z_t = mean`` exactly.

    Returns:
        ``z_t``, stored in ``history["previous"]``.
    """
    previous, before_previous = history["previous"], history["before_previous"]
    # Two passes over the model, no allocation and no copy: the last move and then z_t are computed where
    # z_{t−2} was (the move is exactly zero when the history stands still), and the history shifts by swapping
    # buffers. A merge is memory-bound, so every pass saved counts.
    last_move = torch.sub(previous, before_previous, out=before_previous)
    center = torch.add(mean, last_move, alpha=momentum, out=last_move)
    history["previous"], history["before_previous"] = center, previous
    return center


def elastic_pull_(x: Tensor, target: Tensor, alpha: float) -> None:
    """Pull ``x`` towards ``target`` in place: ``x ← x − α·(x − target)``.

    ``α = 1`` is a hard reset (``x`` becomes exactly ``target``), ``α = 0`` leaves ``x`` untouched.

    Args:
        x: The tensor to update in place.
        target: The tensor to pull towards.
        alpha: The elastic coefficient ``α`` in [0, 1].
    """
    if alpha == 1.0:
        x.copy_(target)  # the hard reset reads one tensor where lerp reads two
        return
    # lerp computes the start exactly at weight 0, unlike x - α(x - t).
    x.lerp_(target, alpha)


def _check_coefficient(name: str, value: float, hint: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}` must be in [0, 1], got {value}. HINT: {hint}")


def _check_momentum(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(
            f"`{name}` must be in [0, 1), got {value}: at 1 or above, past moves never decay. HINT: use 0 to "
            "disable momentum or a value such as 0.9."
        )


def _check_num_replicas(num_replicas: int) -> None:
    if num_replicas < 1:
        raise ValueError(f"`num_replicas` must be >= 1, got {num_replicas}.")


class ElasticAverage:
    """Average, extrapolate with outer momentum, then pull each replica towards the result.

    Adaptive SGD's merge (Ma, Rusu, Wu, Sim, arXiv:2110.07029, 2021), and local SGD's when ``momentum = 0`` and
    ``alpha = 1`` (Lin, Stich, Patel, Jaggi, *Don't Use Large Mini-Batches, Use Local SGD*, ICLR 2020,
    arXiv:1808.07217); method cards ``docs/methods/adaptive_sgd.md``, ``docs/methods/local_sgd.md``. At a merge
    ``t``, with
    ``mean = Σ_i p_i x_i`` over the models after the local step:

    ::

        z_t = mean + μ·(z_{t−1} − z_{t−2})
        x_i ← x_i − α·(x_i − z_t)

    with ``z_{−1} = z_{−2} = x_0``. Between merges the global model is the plain mean of the replicas.

    Args:
        alpha: Elastic coefficient ``α`` in [0, 1]; 1 resets the replicas to ``z_t``.
        momentum: Outer momentum ``μ`` in [0, 1); 0 gives ``z_t = mean``.
    """

    def __init__(self, alpha: float = 1.0, momentum: float = 0.0) -> None:
        _check_coefficient("alpha", alpha, "use 1.0 for a hard reset to the merged model or e.g. 0.5 to pull halfway.")
        _check_momentum("momentum", momentum)
        self.alpha = alpha
        self.momentum = momentum
        self.needs_snapshot = False
        self.resets_on_lr_drop = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self.alpha}, momentum={self.momentum})"

    def init_state(self, initial: Tensor) -> dict[str, Tensor]:
        """Start the merge history at the initial model; store nothing without momentum."""
        if self.momentum == 0.0:
            return {}
        return {"previous": initial.clone(), "before_previous": initial.clone()}

    @torch.no_grad()
    def merge_(
        self, local: Tensor, contributed: Tensor, mean: Tensor, num_replicas: int, state: dict[str, Tensor]
    ) -> Tensor:
        """Compute ``z_t``, shift the merge history and pull ``local`` towards ``z_t``; see the class."""
        _check_num_replicas(num_replicas)
        center = extrapolate_(mean, state, self.momentum) if self.momentum != 0.0 else mean
        elastic_pull_(local, center, self.alpha)
        return center

    @property
    def replaces_replicas_with_mean(self) -> bool:
        """Whether a merge gives every replica the weighted mean and keeps no state (``α = 1``, ``μ = 0``).

        A merge in which one replica has all the weight then leaves that replica's model as it is, so it may wait
        until another replica needs the model (:meth:`~lightning_aesgd.engine.model_merge.ModelMerge`).
        """
        return self.alpha == 1.0 and self.momentum == 0.0

    def center(self, mean: Tensor, state: dict[str, Tensor]) -> Tensor:
        """The replicas' mean: without a stored central model, that is the global model."""
        return mean.clone()


class CentralElastic:
    """A stored central model ``z`` moved by the replicas' elastic corrections, with central momentum.

    The family of :class:`SMA` (Koliousis et al., *Crossbow*, PVLDB 12(11), 2019, arXiv:1901.02244) and
    :class:`EASGD` (Zhang, Choromanska, LeCun, *Deep learning with Elastic Averaging SGD*, NIPS 2015,
    arXiv:1412.6651). At a merge, with ``x̂_i`` the replica's contribution (its
    pre-step snapshot when ``needs_snapshot``) and ``mean = Σ_i p_i x̂_i``:

    ::

        c_i = α·(x̂_i − z)        # this replica's correction
        x_i ← x_i − c_i
        Δ   = α·n·(mean − z)      # Σ_i c_i for uniform weights
        v   ← Δ + μ_c·v
        z   ← z + v

    For uniform weights ``Δ = Σ_i c_i``: the central model moves by exactly what the replicas gave up.
    With ``μ_c = 0`` no velocity is stored and ``z ← z + Δ``.

    Args:
        alpha: Elastic coefficient ``α`` in [0, 1].
        central_momentum: Polyak momentum ``μ_c`` in [0, 1) on the central model.
        needs_snapshot: Whether corrections use the model from before the local step rather than after it.
        resets_on_lr_drop: Whether replicas are reset to ``z`` when the learning rate drops.
    """

    def __init__(
        self,
        alpha: float,
        central_momentum: float = 0.0,
        needs_snapshot: bool = True,
        resets_on_lr_drop: bool = False,
    ) -> None:
        _check_coefficient("alpha", alpha, "Crossbow's scripts use 0.1, EASGD uses 0.9 / num_replicas.")
        _check_momentum("central_momentum", central_momentum)
        self.alpha = alpha
        self.central_momentum = central_momentum
        self.needs_snapshot = needs_snapshot
        self.resets_on_lr_drop = resets_on_lr_drop

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(alpha={self.alpha}, central_momentum={self.central_momentum}, "
            f"needs_snapshot={self.needs_snapshot}, resets_on_lr_drop={self.resets_on_lr_drop})"
        )

    def alpha_for(self, num_replicas: int) -> float:
        """The elastic coefficient to use at a merge of ``num_replicas`` replicas: ``alpha`` itself."""
        return self.alpha

    def overshoot_warning(self, num_replicas: int) -> str | None:
        """Why these settings misbehave on ``num_replicas`` replicas, or None.

        With ``α·n > 1`` the central model moves past the replicas' mean at every merge (``Δ = α·n·(mean − z)``),
        so it oscillates around them instead of following them.
        """
        pull = self.alpha_for(num_replicas) * num_replicas
        if pull <= 1.0:
            return None
        return (
            f"{type(self).__name__} with alpha={self.alpha_for(num_replicas)} on {num_replicas} replicas moves the "
            f"central model {pull:g}× the distance to the replicas' mean at every merge (α·n > 1): it overshoots. "
            f"HINT: use alpha <= {1 / num_replicas:g} (1 / replicas)."
        )

    def init_state(self, initial: Tensor) -> dict[str, Tensor]:
        """Start the central model at the initial model, at rest."""
        state = {"center": initial.clone()}
        if self.central_momentum != 0.0:
            state["velocity"] = torch.zeros_like(initial)
        return state

    @torch.no_grad()
    def merge_(
        self, local: Tensor, contributed: Tensor, mean: Tensor, num_replicas: int, state: dict[str, Tensor]
    ) -> Tensor:
        """Correct ``local`` and move the central model; see the class for the formulas."""
        _check_num_replicas(num_replicas)
        alpha = self.alpha_for(num_replicas)
        center = state["center"]
        push = mean.sub_(center).mul_(alpha * num_replicas)  # Δ, built in the caller's scratch
        # x ← x − α·x̂ + α·z, which is right even when `contributed` is `local` itself (no snapshot).
        local.add_(contributed, alpha=-alpha).add_(center, alpha=alpha)
        center.add_(self._apply_central_momentum(push, state))
        return center

    def _apply_central_momentum(self, push: Tensor, state: dict[str, Tensor]) -> Tensor:
        if self.central_momentum == 0.0:
            return push
        velocity = state["velocity"]
        velocity.mul_(self.central_momentum).add_(push)
        return velocity

    def center(self, mean: Tensor, state: dict[str, Tensor]) -> Tensor:
        """The stored central model ``z``."""
        return state["center"].clone()


class SMA(CentralElastic):
    """Crossbow's synchronous model averaging (method card: ``docs/methods/sma.md``).

    Koliousis, Watcharapichat, Weidlich, Mai, Costa, Pietzuch, *Crossbow: Scaling Deep Learning with Small Batch
    Sizes on Multi-GPU Servers*, PVLDB 12(11), 2019, arXiv:1901.02244.

    :class:`CentralElastic` with ``α = 0.1``, central momentum ``μ_c = 0.9``, corrections from the pre-step
    model, and replicas reset to the central model whenever the learning rate drops.

    Args:
        alpha: Elastic coefficient ``α`` in [0, 1].
        central_momentum: Polyak momentum ``μ_c`` in [0, 1) on the central model.
        needs_snapshot: Whether corrections use the model from before the local step.
        resets_on_lr_drop: Whether replicas are reset to the central model when the learning rate drops.
    """

    def __init__(
        self,
        alpha: float = 0.1,
        central_momentum: float = 0.9,
        needs_snapshot: bool = True,
        resets_on_lr_drop: bool = True,
    ) -> None:
        super().__init__(alpha, central_momentum, needs_snapshot, resets_on_lr_drop)


class EASGD(CentralElastic):
    """Synchronous elastic averaging SGD (method card: ``docs/methods/easgd.md``).

    Zhang, Choromanska, LeCun, *Deep learning with Elastic Averaging SGD*, NIPS 2015, arXiv:1412.6651.

    ::

        x_i ← x_i − α·(x_i − x̃)
        x̃   ← x̃ + α·Σ_i (x_i − x̃),      α = β / n

    both from the time-``t`` models (the pre-step snapshots, by default). The total coupling ``β = nα`` is
    fixed, so ``α`` follows the number of replicas at merge time (:meth:`alpha_for`); the stored ``alpha``
    attribute is ``β``, the coupling of a lone replica. No central momentum.

    Args:
        beta: Total coupling ``β`` in (0, 1].
        needs_snapshot: Whether corrections use the model from before the local step.
    """

    def __init__(self, beta: float = 0.9, needs_snapshot: bool = True) -> None:
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"`beta` must be in (0, 1], got {beta}. HINT: the EASGD paper recommends 0.9.")
        super().__init__(alpha=beta, central_momentum=0.0, needs_snapshot=needs_snapshot)
        self.beta = beta

    def __repr__(self) -> str:
        return f"{type(self).__name__}(beta={self.beta}, needs_snapshot={self.needs_snapshot})"

    def alpha_for(self, num_replicas: int) -> float:
        """``α = β / n``, so that the central model's total pull ``nα`` stays ``β`` for any ``n``."""
        _check_num_replicas(num_replicas)
        return self.beta / num_replicas


_MERGE_RULES: dict[str, Callable[..., MergeRule]] = {
    "elastic_average": ElasticAverage,
    "sma": SMA,
    "easgd": EASGD,
}


def available_merge_rules() -> list[str]:
    """The names :func:`get_merge_rule` accepts, sorted."""
    return sorted(_MERGE_RULES)


def as_merge_rule(rule: MergeRule | str) -> MergeRule:
    """A merge rule object as it is, or the rule registered under a name with its defaults."""
    return get_merge_rule(rule) if isinstance(rule, str) else rule


def get_merge_rule(name: str, **kwargs: float | bool) -> MergeRule:
    """Build a merge rule by its registry name.

    Args:
        name: One of :func:`available_merge_rules`: ``"elastic_average"``, ``"sma"`` or ``"easgd"``.
        **kwargs: Constructor arguments of the rule's class.

    Returns:
        The configured rule.

    Raises:
        ValueError: If ``name`` is not registered, or the arguments are invalid for the rule.

    Example:
        >>> get_merge_rule("easgd", beta=0.9)
        EASGD(beta=0.9, needs_snapshot=True)
    """
    if name not in _MERGE_RULES:
        raise ValueError(
            f"Unknown merge rule {name!r}; choose one of {available_merge_rules()}. HINT: pass one of these names "
            "or a MergeRule object such as ElasticAverage(alpha=1.0)."
        )
    return _MERGE_RULES[name](**kwargs)
