"""Choosing ``learners_per_device="auto"``: measure the batched step of 1, 2, ... learners, keep what pays.

Before the first training step, each replica times the forward and backward of its training step on one real
batch per learner (the loader's first batch, repeated), for ``k = 1, 2, ...`` learners. The replicas sum their
rates at each ``k`` on the host group, so every replica takes the same decision
(:func:`~lightning_aesgd.core.tuning.learners_to_keep`). Measuring leaves the module as it was: its tensors,
values and gradients are put back, and nothing is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only

from lightning_aesgd.core.tuning import learners_to_keep, measures_more
from lightning_aesgd.core.values import is_real, is_whole
from lightning_aesgd.engine.comm import Communicator
from lightning_aesgd.engine.flat import FlatView, floating_buffers, module_device, trainable_parameters
from lightning_aesgd.engine.learners import LearnerStep, LearnerStepError, batch_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearnerTuning:
    """How ``learners_per_device="auto"`` chooses.

    Args:
        max_learners: the most learners per replica (Crossbow's bound is the device's memory; a learner that does
            not fit also ends the search).
        min_gain: the smallest rise of throughput, as a fraction, that a learner more must bring.
        repeats: timed steps per measurement, after one untimed.
    """

    max_learners: int = 8
    min_gain: float = 0.1
    repeats: int = 3

    def __post_init__(self) -> None:
        if not is_whole(self.max_learners) or self.max_learners < 1:
            raise ValueError(f"`max_learners` is a whole number >= 1, got {self.max_learners!r}. HINT: e.g. 8.")
        if not is_real(self.min_gain) or not self.min_gain >= 0:
            raise ValueError(
                f"`learner_min_gain` is a fraction of throughput >= 0, got {self.min_gain!r}. HINT: e.g. 0.1 (a "
                "learner more must add 10%)."
            )


def tune_learners(
    measure: Callable[[int], float], comm: Communicator, tuning: LearnerTuning
) -> tuple[int, list[float]]:
    """Measure ``k = 1, 2, ...`` learners (``measure(k)``: this replica's samples per second) and choose.

    A collective: every replica measures the same ``k`` and sums its rate into the job's, on the host group. A
    replica where ``k`` learners do not fit (rate 0: out of memory, or a step that cannot run batched) makes the
    job's rate 0, which ends the search.

    Returns:
        The number of learners to keep, and the job's rate at each ``k`` measured.

    Raises:
        Exception: the error of a measurement that raised on this replica, and RuntimeError on the others, after
            the collective (so that no replica waits for one that failed).
    """
    rates: list[float] = []
    while not rates or measures_more(rates, tuning.min_gain, tuning.max_learners):
        learners = len(rates) + 1
        error: Exception | None = None
        try:
            rate = measure(learners)
        except Exception as caught:  # raised after the collective, which the peers are waiting in
            rate, error = 0.0, caught
        job = torch.tensor([rate, float(rate <= 0.0), float(error is not None)], dtype=torch.float64)
        comm.host_all_reduce_sum_(job)
        total, failed, errors = job.tolist()
        if error is not None:
            raise error
        if errors:
            raise RuntimeError(
                f"{int(errors)} replica(s) failed while measuring {learners} learners (learners_per_device='auto'): "
                "their own errors say why."
            )
        rates.append(0.0 if failed else total)
    return learners_to_keep(rates, tuning.min_gain), rates


MEMORY_FRACTION = 0.9
"""The share of a GPU's memory that the learners may fill, their optimizer state included."""


def fits_in_memory(peak_bytes: int, parameter_bytes: int, learners: int, total_bytes: int) -> bool:
    """Whether ``learners`` learners fit ``total_bytes`` of device memory (at most :data:`MEMORY_FRACTION` of it).

    They need the measured step's peak (which holds their parameters and gradients already) plus room for two
    moments per parameter of each learner (Adam's).

    Example:
        >>> fits_in_memory(peak_bytes=6 * 2**30, parameter_bytes=2**30, learners=2, total_bytes=16 * 2**30)
        True
    """
    return peak_bytes + 2 * learners * parameter_bytes <= MEMORY_FRACTION * total_bytes


def measure_learners(
    module: nn.Module,
    run_step: Callable[..., Any],
    batch: Any,
    learners: int,
    repeats: int = 3,
    quiet: bool = False,
    sharers: int = 1,
) -> float:
    """Samples per second of ``learners`` learners' forward and backward, each on ``batch``; 0 where they do not fit.

    They do not fit when the device runs out of memory, or leaves no room for their optimizer state
    (:func:`fits_in_memory`) in this replica's part of it (one of ``sharers`` replicas on the device). One learner
    runs the step as it is (no batching), as ``learners_per_device=1`` trains. A step that cannot run batched is a
    warning, or with ``quiet`` (every replica but one) a debug message; so is a batch that cannot be dealt to
    learners (:func:`~lightning_aesgd.engine.learners.batch_rows`), already at one learner, which ends the search
    there.
    """
    device = module_device(module)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with _module_kept(module):
        try:
            step = _stacked_step(module, learners) if learners > 1 else None
            rows_each, stacked = batch_rows(batch), _repeated(batch, learners)
            for index in range(repeats + 1):
                if index == 1:  # the first step warms caches and kernels up; the others are timed
                    _synchronize(device)
                    start = time.perf_counter()
                output = step(run_step, stacked, 0) if step is not None else run_step(batch, 0)
                loss = output["loss"] if isinstance(output, dict) else output
                (loss * learners).backward()
                module.zero_grad(set_to_none=True)
            _synchronize(device)
        except LearnerStepError as error:  # "auto" keeps the learners that can run: one, unbatched
            level = logging.DEBUG if quiet else logging.WARNING
            log.log(level, "learners_per_device='auto' keeps 1 learner: %s", error)
            return 0.0
        except RuntimeError as error:  # torch.cuda.OutOfMemoryError is one
            if not out_of_memory(error):
                raise
            torch.cuda.empty_cache()
            return 0.0
    rate = learners * rows_each * repeats / max(time.perf_counter() - start, 1e-9)
    if device.type == "cuda" and not _fits_device(module, device, learners, sharers):
        return 0.0
    return rate


OUT_OF_MEMORY_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
"""What the errors of a device that ran out of memory say: torch's allocator's, and cuBLAS's or cuDNN's own."""


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says the device ran out of memory: the caching allocator's or a CUDA library's allocation.

    Example:
        >>> out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
        True
    """
    return isinstance(error, torch.cuda.OutOfMemoryError) or any(
        marker in str(error) for marker in OUT_OF_MEMORY_MARKERS
    )


def _fits_device(module: nn.Module, device: torch.device, learners: int, sharers: int = 1) -> bool:
    """Whether the learners fit what this process may use: what it holds, and its part of the device's free memory.

    Not the device's total: the ``sharers`` replicas on one GPU each hold part of it, and measure at once.
    """
    parameter_bytes = sum(p.numel() * p.element_size() for p in trainable_parameters(module))
    peak = torch.cuda.max_memory_allocated(device)
    free, _total = torch.cuda.mem_get_info(device)
    return fits_in_memory(peak, parameter_bytes, learners, free // sharers + torch.cuda.memory_reserved(device))


def _stacked_step(module: nn.Module, learners: int) -> LearnerStep:
    params = FlatView(trainable_parameters(module), bind=True, learners=learners)
    buffers = FlatView(floating_buffers(module), learners=learners)
    return LearnerStep(module, [*params.tensors, *buffers.tensors], learners)


@contextmanager
def _module_kept(module: nn.Module) -> Iterator[None]:
    """Put every parameter and buffer back as it was (its storage, its values, no gradient), and log nothing."""
    tensors = [*module.parameters(), *module.buffers()]
    kept = [(tensor, tensor.data, tensor.data.clone()) for tensor in tensors]
    has_log = hasattr(module, "log")
    if has_log:
        module.log = _no_log  # type: ignore[assignment]  # a measurement is not training
    try:
        yield
    finally:
        if has_log:
            del module.log
        with torch.no_grad():
            for tensor, data, values in kept:
                tensor.data = data
                data.copy_(values)
        module.zero_grad(set_to_none=True)


def _no_log(*args: Any, **kwargs: Any) -> None:
    """What ``self.log`` does while the learners are measured."""


def _repeated(batch: Any, learners: int) -> Any:
    """The batch once per learner, along the first dimension."""
    return tree_map_only(Tensor, lambda t: t.repeat(learners, *[1] * (t.dim() - 1)) if t.dim() else t, batch)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
