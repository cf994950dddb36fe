"""The step of a replica the plan leaves out: no forward over data, and still its part in the sync.

A replica planned a batch of 0 (:mod:`lightning_aesgd.engine.admission`) draws an
:class:`~lightning_aesgd.engine.loading.IdleBatch`. Lightning's loop runs the step as any other, so that the
replica joins the step's sync point (DDP's reducer under gradient sums, the merge under model merges), but the
user's ``training_step`` is replaced, for that step only, by a zero loss that touches every trainable parameter:
its backward gives each a zero gradient, which enters the weighted sum with the replica's share, 0. Under model
merges nothing needs a gradient: the loss is then a bare zero (its backward costs nothing), so that an idle step,
which the replica still runs in step with the others' loops, stays far shorter than theirs.

A ``training_step`` that itself communicates cannot be skipped on one replica: the others would wait in its
collective. :func:`collectives_in_training` finds the usual ones (``self.log(..., sync_dist=True)``, SyncBatchNorm,
a torchmetrics metric logged for the epoch) after the first step, and
:class:`~lightning_aesgd.user_collectives.StepCollectives` the strategy's collectives that step called; the
strategy then keeps every replica in the steps. So it does where the user's batch hooks would receive the idle
batch (:func:`batch_hooks_in_training`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional


def zero_loss(module: nn.Module) -> Tensor:
    """A loss of 0 whose gradient is 0 for every trainable parameter of ``module``, in each one's layout.

    A sparse embedding's weight gets a sparse zero gradient (one looked-up row), as its own backward would give;
    every other parameter a dense one. It costs a pass over the parameters, not a forward over data.
    """
    terms: list[Tensor] = []
    sparse: set[int] = set()
    for layer in module.modules():
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.sparse and layer.weight.requires_grad:
            first_row = torch.zeros(1, dtype=torch.long, device=layer.weight.device)
            terms.append(functional.embedding(first_row, layer.weight, sparse=True).sum(dtype=torch.float32))
            sparse.add(id(layer.weight))
    terms += [p.sum(dtype=torch.float32) for p in module.parameters() if p.requires_grad and id(p) not in sparse]
    if not terms:
        raise RuntimeError("The module has no trainable parameters: nothing to train.")
    return torch.stack(terms).sum() * 0.0  # summed in float32: half-precision sums of large layers overflow


def bare_zero(module: nn.Module) -> Tensor:
    """A loss of 0 that reaches no parameter: its backward gives no gradient and costs nothing."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return torch.zeros((), device=device, requires_grad=True)


@contextmanager
def idle_training_step(module: Any, every_parameter: bool = True) -> Iterator[None]:
    """Within it, ``module.training_step`` returns a zero loss; whatever was there before comes back.

    Args:
        module: the LightningModule.
        every_parameter: :func:`zero_loss` (a zero gradient for every parameter, for a gradient sum or a grad
            scaler's inf checks), else :func:`bare_zero`.
    """
    own = vars(module).get("training_step")  # e.g. a callback's wrapper, set on the instance
    loss = zero_loss if every_parameter else bare_zero

    def idle_step(*args: Any, **kwargs: Any) -> Tensor:
        return loss(module)

    module.training_step = idle_step
    try:
        yield
    finally:
        if own is not None:
            module.training_step = own
        else:
            del module.training_step


BATCH_HOOKS = ("on_before_batch_transfer", "on_train_batch_start", "on_train_batch_end")
"""The module's hooks that receive a training batch (a callback's: the last two), an idle one too."""
CALLBACK_BATCH_POSITION = {"on_train_batch_start": 2, "on_train_batch_end": 3}
"""Where a callback's batch hook takes the batch: after the trainer and module (and the step's outputs)."""
_LIGHTNING_PACKAGES = ("pytorch_lightning", "lightning", "lightning_aesgd")


def batch_hooks_in_training(trainer: Any, module: nn.Module) -> str | None:
    """Why a replica left out of a step may not be (its idle batch would reach the user's code), or ``None``.

    A replica left out draws an idle batch, which the training loop hands to the module's (or the DataModule's)
    batch hooks and to the callbacks' batch-start and batch-end hooks as to any batch: a hook that reads it
    (``x, y = batch``) fails there. So every replica stays in the steps where the user's module overrides one, the
    user's DataModule overrides ``on_before_batch_transfer``, one of the user's callbacks (not Lightning's own)
    overrides one with a parameter where the batch goes (one that takes ``*args``, as counting callbacks do, is
    trusted not to read it), or a callback has a ``batch_size_fn`` (Lightning's ThroughputMonitor calls it).
    """
    for hook in BATCH_HOOKS:
        if _user_defined(type(module), hook):
            return f"the module overrides {hook}(), which would receive a left-out replica's idle batch"
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and _user_defined(type(datamodule), BATCH_HOOKS[0]):
        return f"the DataModule overrides {BATCH_HOOKS[0]}(), which would receive a left-out replica's idle batch"
    for callback in getattr(trainer, "callbacks", None) or []:
        name = type(callback).__name__
        if getattr(callback, "batch_size_fn", None) is not None:
            return f"the callback {name} calls its batch_size_fn on each batch, a left-out replica's idle one too"
        for hook, position in CALLBACK_BATCH_POSITION.items():
            if _user_defined(type(callback), hook) and _takes_positional(getattr(callback, hook), position):
                return f"the callback {name} overrides {hook}(), which would receive a left-out replica's idle batch"
    return None


def _takes_positional(method: Any, position: int) -> bool:
    """Whether ``method`` names a parameter at positional ``position`` (0-based, ``self`` bound)."""
    named = [
        parameter
        for parameter in inspect.signature(method).parameters.values()
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return len(named) > position


def _user_defined(cls: type, name: str) -> bool:
    """Whether the class that defines ``name`` for ``cls`` is the user's, not Lightning's or this package's."""
    for owner in cls.__mro__:
        if name in vars(owner):
            return owner.__module__.split(".")[0] not in _LIGHTNING_PACKAGES
    return False


def collectives_in_training(trainer: Any, module: nn.Module) -> str | None:
    """Why the user's training step communicates (so an idle replica may not skip it), or ``None``.

    Read after a training step, on every rank alike: SyncBatchNorm layers all-gather in every forward, a value
    logged with ``sync_dist=True`` is all-reduced where it is logged (and at the epoch's end), and a torchmetrics
    metric logged for the epoch gathers its states at the epoch's end, where a replica that made no update all
    epoch (left out throughout) would not join.
    """
    if any(isinstance(layer, nn.SyncBatchNorm) for layer in module.modules()):
        return "the model has SyncBatchNorm layers, which communicate in every forward"
    results = getattr(trainer, "_results", None) or {}
    for key, result in results.items():
        meta = getattr(result, "meta", None)
        sync = getattr(meta, "sync", None)
        if sync is not None and sync.should and not sync.rank_zero_only:
            return f"the training step logs {key!r} with sync_dist=True, which is all-reduced where it is logged"
        if getattr(result, "is_tensor", True):
            continue
        metric = getattr(result, "value", None)
        if getattr(metric, "dist_sync_on_step", False):
            return f"the training step logs the torchmetrics metric {key!r}, made with dist_sync_on_step=True"
        if getattr(meta, "on_epoch", False) and getattr(metric, "sync_on_compute", True):
            return (
                f"the training step logs the torchmetrics metric {key!r} for the epoch, whose compute gathers from "
                "every replica (a metric made with sync_on_compute=False logs each replica's own value and lets a "
                "slow replica be left out)"
            )
    return None
