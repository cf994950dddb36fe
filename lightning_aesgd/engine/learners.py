"""Several learners of one model in one process (Crossbow's learners per device), as one batched step.

Crossbow (Koliousis et al., PVLDB 2019) trains several small-batch learners on each GPU: small batches keep
their statistical efficiency, and together the learners keep the device busy. Here the ``k`` learners of a
replica are one module whose trainable parameters and floating buffers hold a row per learner (``k × shape``,
bound by :class:`~lightning_aesgd.engine.flat.FlatView`). One Lightning step runs the user's ``training_step``
once under :func:`torch.func.vmap`: every layer is one batched kernel over the ``k`` learners, each with its
own parameters, buffers and a ``1/k`` slice of the replica's batch. The learners' losses are summed, so one
backward gives each learner the gradient of its own loss, and one step of the user's optimizer (elementwise:
SGD, Adam, Adagrad, ...) updates each learner as its own optimizer would.

What the user's ``training_step`` may do under the batched step:

* log with ``self.log`` / ``self.log_dict``: each value is logged once, the mean over the learners;
* use BatchNorm in training mode (each learner keeps its own statistics), dropout (drawn per learner);
* return a loss, or a dict holding ``"loss"``; other returned tensors come back with a leading learner axis.

It may not read values to the host (``.item()``, ``float(tensor)``, data-dependent Python control flow),
return ``None`` to skip a step, or run collectives; the first step then fails with a HINT.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

UNSUPPORTED_STEP_HINT = (
    "HINT: with learners_per_device > 1 the training step runs once for all learners, batched by torch.func.vmap: "
    "it may not read tensors to the host (.item(), float(), data-dependent `if`), return None, run "
    "collectives, or use a memory format other than the contiguous one (channels_last). Keep such code out of "
    "training_step, or use learners_per_device=1."
)


IN_PLACE_ERRORS = ("inplace", "in-place", "doesn't match the broadcast shape")
"""What torch's errors say when a tensor shared by the learners is updated in place with a value of each."""

BATCHING_ERRORS = ("vmap", "doesn't have storage", "BatchedTensor", *IN_PLACE_ERRORS)
"""What torch's errors say when code cannot run batched (``.item()``; ``.tolist()`` reads a storage that a batched
tensor does not have; an in-place update of a shared tensor)."""


class LearnerStepError(RuntimeError):
    """The user's training step cannot run batched over several learners."""


class _Call(nn.Module):
    """A module whose forward is ``run(*args)``, around any code such as Lightning's training step.

    :func:`~torch.func.functional_call` of it swaps in a learner's tensors of ``module`` (``module.<name>``).
    """

    def __init__(self, module: nn.Module, run: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self._run = run

    def forward(self, *args: Any) -> Any:
        return self._run(*args)


def learner_rows(batch_rows: int, learners: int) -> list[tuple[int, int, int]]:
    """How a replica's batch of ``batch_rows`` samples is dealt to its learners, as equally as possible.

    Returns:
        Groups ``(first learner, end learner, rows each)``: one group when the batch is a multiple of
        ``learners`` (every full step: plans are), two in the epoch's last, shorter step, where the first
        ``batch_rows mod k`` learners take one sample more. Learners without a sample are in no group.

    Example:
        >>> learner_rows(8, 4), learner_rows(10, 4)
        ([(0, 4, 2)], [(0, 2, 3), (2, 4, 2)])
    """
    each, extra = divmod(batch_rows, learners)
    groups = [(0, extra, each + 1), (extra, learners, each)]
    return [(first, end, rows) for first, end, rows in groups if end > first and rows > 0]


PLAIN_VALUES = (str, bytes, int, float, complex, type(None))
"""Values a batch may hold beside its tensors: every learner sees them whole (ids, flags, counts)."""


def batch_rows(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its tensors, which must all agree.

    Learners are dealt the batch as :func:`torch.func.vmap` splits it: the tensors inside lists, tuples, dicts
    and namedtuples (torch's pytrees), along their first dimension.

    Raises:
        LearnerStepError: for a batch that cannot be dealt that way: its tensors disagree on their rows, it has
            none, or it holds an object that vmap would pass whole to every learner (a dataclass, a sparse batch
            class, a NumPy array).
    """
    leaves = tree_flatten(batch)[0]
    opaque = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, (Tensor, *PLAIN_VALUES))})
    if opaque:
        raise LearnerStepError(
            f"A batch holding {', '.join(opaque)} cannot be dealt to learners: torch.func.vmap splits the tensors "
            "inside lists, tuples, dicts and namedtuples only, and would give every learner the whole of the rest. "
            "HINT: let the collate function return a tuple or dict of tensors with one row per sample, or use "
            "learners_per_device=1."
        )
    rows = {leaf.shape[0] for leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() > 0}
    if len(rows) != 1:
        raise LearnerStepError(
            f"A batch whose tensors hold {sorted(rows) or 'no'} rows cannot be split among learners. HINT: every "
            "tensor of a batch must hold one row per sample (the collate function's default)."
        )
    return rows.pop()


def _rows_of(batch: Any, begin: int, learners: int, rows: int) -> Any:
    """Rows ``begin ..`` of every tensor in ``batch``, ``rows`` per learner, with a leading learner axis."""

    def take(tensor: Tensor) -> Tensor:
        if tensor.dim() == 0:
            return tensor
        part = tensor[begin : begin + learners * rows]
        return part.reshape(learners, rows, *tensor.shape[1:])

    return tree_map_only(Tensor, take, batch)


class LearnerStep:
    """Runs a LightningModule's training step for ``k`` learners at once.

    Args:
        module: the LightningModule whose tensors in ``stacked`` hold a row per learner (bound by the averager).
        stacked: the module's tensors with a leading learner axis (trainable parameters, floating buffers).
        learners: the number of learners ``k``.
    """

    def __init__(self, module: Any, stacked: Sequence[Tensor], learners: int) -> None:
        self.module = module
        self.learners = learners
        # The tensor objects stay (their `.data` is rebound), so they are looked up once, not at every step.
        self._stacked = [(f"module.{name}", tensor) for name, tensor in _slots_of(module, stacked)]

    def __call__(self, run_step: Callable[..., Any], batch: Any, *rest: Any) -> Any:
        """Run ``run_step(batch_j, *rest)`` for every learner ``j`` batched, in one call (two in a short step).

        Returns:
            The step's output with its loss the learners' mean (one backward of it, times ``k``, gives each
            learner its own gradient: the strategy's backward applies the factor), other tensors with a leading
            learner axis.
        """
        call = _Call(self.module, run_step)
        outputs, logged = [], _LogRecorder(self.module)
        begin = 0
        with logged:
            for first, end, rows in learner_rows(batch_rows(batch), self.learners):
                own = {
                    name: tensor if end - first == self.learners else tensor[first:end]
                    for name, tensor in self._stacked
                }
                part = _rows_of(batch, begin, end - first, rows)
                outputs.append(self._batched(call, own, part, rest, logged))
                begin += (end - first) * rows
        logged.replay([values for _, values in outputs])
        return _mean_loss([output for output, _ in outputs], self.learners)

    def _batched(
        self, call: _Call, own: dict[str, Tensor], batch: Any, rest: tuple[Any, ...], logged: _LogRecorder
    ) -> tuple[Any, tuple[Tensor, ...]]:
        structure: list[Any] = []  # the output's leaves, its other values (strings, numbers) among them

        def one_learner(learner: dict[str, Tensor], learner_batch: Any) -> tuple[list[Tensor], tuple[Tensor, ...]]:
            logged.start()
            output = functional_call(call, learner, (learner_batch, *rest), strict=False, tie_weights=False)
            leaves, spec = tree_flatten(output)
            structure[:] = [spec, leaves]
            # vmap returns tensors only: other values leave through `structure` (the step runs once, batched).
            return [leaf for leaf in leaves if isinstance(leaf, Tensor)], logged.tensors()

        leaves, spec = tree_flatten(batch)
        in_dims = tree_unflatten([0 if isinstance(leaf, Tensor) and leaf.dim() else None for leaf in leaves], spec)
        failure: str | None = None
        try:
            tensors, logs = vmap(one_learner, in_dims=(0, in_dims), randomness="different")(own, batch)
        except (RuntimeError, ValueError) as error:
            if not any(sign in str(error) for sign in BATCHING_ERRORS):  # the user's own error, not one of batching
                raise
            failure = f"The training step failed batched over {self.learners} learners: {error} {_hint_for(error)}"
        if failure is not None:
            # Raised outside the `except`, so that it holds no traceback of the batched call: its frames hold the
            # graph, whose gradient accumulators have the learners' shapes, and the module could not train again
            # (with one learner) while the error is kept (a notebook, a test).
            raise LearnerStepError(failure)
        output_spec, output_leaves = structure
        batched = iter(tensors)
        output = [next(batched) if isinstance(leaf, Tensor) else leaf for leaf in output_leaves]
        return tree_unflatten(output, output_spec), logs


IN_PLACE_HINT = (
    "HINT: if the step updates in place a tensor that is not a floating parameter or buffer (an integer buffer, a "
    "plain tensor attribute), that tensor is one for all learners and cannot take each learner's value. Make it a "
    "floating buffer (each learner keeps its own), update it outside training_step, or use learners_per_device=1."
)


def _slots_of(module: nn.Module, stacked: Sequence[Tensor]) -> list[tuple[str, Tensor]]:
    """A name for every place that holds one of ``stacked`` in ``module``: each attribute of a module object, once.

    A tensor tied across modules (an embedding and the output layer) is held in two places, and each must take the
    learner's tensor. A module registered under two names (``self.b = self.a``) holds it in one place: naming it
    twice would make :func:`~torch.func.functional_call` swap it in twice, and, restoring in the same order, leave
    the batched tensor in the module after the step (torch's ``tie_weights`` does exactly that).
    """
    ids = {id(tensor) for tensor in stacked}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    seen: set[tuple[int, str]] = set()
    slots = []
    for name, tensor in named:
        owner_name, _, attribute = name.rpartition(".")
        place = (id(module.get_submodule(owner_name)), attribute)
        if id(tensor) in ids and place not in seen:
            seen.add(place)
            slots.append((name, tensor))
    return slots


def _hint_for(error: Exception) -> str:
    """The HINT for a batching error: an in-place update of a shared tensor, or the rest (a read to the host)."""
    return IN_PLACE_HINT if any(sign in str(error) for sign in IN_PLACE_ERRORS) else UNSUPPORTED_STEP_HINT


def _mean_loss(outputs: list[Any], learners: int) -> Any:
    """The learners' mean loss; the other outputs of the first group (all learners in a full step)."""
    losses = []
    for output in outputs:
        loss = output.get("loss") if isinstance(output, dict) else output
        if not isinstance(loss, Tensor):
            raise LearnerStepError(
                f"The training step returned {type(output).__name__}; batched learners need a loss tensor or a "
                f"dict holding 'loss'. {UNSUPPORTED_STEP_HINT}"
            )
        losses.append(loss.reshape(-1))
    mean = torch.cat(losses).sum() / learners
    return {**outputs[0], "loss": mean} if isinstance(outputs[0], dict) else mean


class _LogRecorder:
    """Holds back ``self.log`` calls made inside the batched step and replays them with the learners' mean.

    A value logged inside :func:`~torch.func.vmap` is batched: Lightning could not keep it past the call. So the
    tensors leave the call as outputs (one row per learner) and are logged after it.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []
        self._log: Any = None
        self._set_on_instance = False

    def __enter__(self) -> _LogRecorder:
        self._log = getattr(self.module, "log", None)
        self._set_on_instance = "log" in vars(self.module)  # replaced already (e.g. while learners are measured)
        if self._log is not None:  # a LightningModule (a plain module has nothing to log with)
            self.module.log = self._record
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.calls.clear()  # batched values of a failed step: an error kept with its frames would hold them
        if self._set_on_instance:
            self.module.log = self._log
        elif self._log is not None:
            del self.module.log  # the instance attribute: the class's method shows again

    def start(self) -> None:
        self.calls.clear()

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise LearnerStepError(
                f"self.log({name!r}, ...) got positional options; batched learners record keyword options only. "
                "HINT: pass them by name, e.g. self.log(name, value, prog_bar=True)."
            )
        self.calls.append((name, value, kwargs))

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(value for _, value, _ in self.calls if isinstance(value, Tensor))

    def replay(self, groups: list[tuple[Tensor, ...]]) -> None:
        """Log each recorded value once: its mean over every learner of every group."""
        for index, (name, value, kwargs) in self.calls_with_tensor_index():
            if index is not None:
                rows = [group[index].detach().reshape(len(group[index]), -1).to(torch.float32) for group in groups]
                value = torch.cat(rows).mean()
            self._log(name, value, **kwargs)
        self.calls.clear()

    def calls_with_tensor_index(self) -> list[tuple[int | None, tuple[str, Any, dict[str, Any]]]]:
        """Every recorded call with the index of its value among the returned tensors (None for a number)."""
        indexed: list[tuple[int | None, tuple[str, Any, dict[str, Any]]]] = []
        count = 0
        for call in self.calls:
            if isinstance(call[1], Tensor):
                indexed.append((count, call))
                count += 1
            else:
                indexed.append((None, call))
        return indexed


__all__ = ["LearnerStep", "LearnerStepError", "batch_rows", "learner_rows"]
