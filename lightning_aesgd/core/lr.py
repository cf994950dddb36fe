"""Learning-rate factors: Adaptive SGD's warm-up ramp and inverse-time decay by step, and stale updates' scale.

The authors' code (YMA33/HeteroGPU, ``Scheduler/source/GPUGDScheduler.cu``) sets every GPU's rate at each merge
as ``η0·b_warm/B·(0.01 + 0.99·seen/(10·N))`` during a 10-epoch warm-up (``seen`` examples of ``N`` per epoch),
then ``η0·bᵢ/B / (1 + decay·(epoch − 10))``. :class:`InverseTimeDecay` is the factor of that schedule on ``η0``
(the ``bᵢ/B`` part is ``lr_scaling``), counted in steps. Method card: ``docs/methods/adaptive_sgd.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_aesgd.core.values import is_real, is_whole

__all__ = ["InverseTimeDecay", "stale_update_scale"]


@dataclass(frozen=True)
class InverseTimeDecay:
    """``f(t)``: a linear ramp over the warm-up, then ``1/(1 + decay·(t − w))``; ``t`` the 0-based step.

    Adaptive SGD's schedule (Ma, Rusu, Wu, Sim, arXiv:2110.07029, 2021, and the authors' code above).

    ::

        f(t) = s + (1 − s)·t/w            for t < w       (ramp from s to 1, the paper's s = 0.01)
        f(t) = 1 / (1 + decay·(t − w))    for t ≥ w       (the paper counts t in epochs)

    A callable of the step, so that it serves both the strategy's ``lr_schedule`` (applied to each replica's
    rate during its step) and ``torch.optim.lr_scheduler.LambdaLR(optimizer, InverseTimeDecay(...))``.

    Args:
        decay: decay per step after the warm-up, ``≥ 0`` (0: constant).
        warmup_steps: length ``w`` of the ramp, ``≥ 0`` (0: no ramp).
        warmup_start: the ramp's first factor ``s``, in ``(0, 1]``.

    Raises:
        ValueError: for a negative decay or warm-up, or ``s`` outside ``(0, 1]``.

    Example:
        >>> schedule = InverseTimeDecay(decay=0.5, warmup_steps=4, warmup_start=0.2)
        >>> [round(schedule(t), 2) for t in range(7)]
        [0.2, 0.4, 0.6, 0.8, 1.0, 0.67, 0.5]
    """

    decay: float
    warmup_steps: int = 0
    warmup_start: float = 0.01

    def __post_init__(self) -> None:
        if not (is_real(self.decay) and math.isfinite(self.decay) and self.decay >= 0):
            raise ValueError(f"`decay` must be a finite number >= 0, got {self.decay!r}. HINT: 0 keeps the rate.")
        if not is_whole(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"`warmup_steps` counts steps, got {self.warmup_steps!r}. HINT: pass a whole number >= 0.")
        if not (is_real(self.warmup_start) and 0.0 < self.warmup_start <= 1.0):
            raise ValueError(
                f"`warmup_start` is the ramp's first factor, got {self.warmup_start!r}. HINT: pass a value in (0, 1]."
            )

    def __call__(self, step: int) -> float:
        """The factor on the base learning rate at the 0-based ``step``; raises ``ValueError`` if it is negative."""
        if step < 0:
            raise ValueError(f"`step` is 0-based and must be >= 0, got {step}.")
        if step < self.warmup_steps:
            return self.warmup_start + (1.0 - self.warmup_start) * step / self.warmup_steps
        return 1.0 / (1.0 + self.decay * (step - self.warmup_steps))


def stale_update_scale(delay: int) -> float:
    """The factor on the step size that keeps a ``delay``-step-stale update as stable as a synchronous one.

    On a quadratic of curvature ``λ``, gradient descent whose update uses the gradient of ``τ`` steps ago,
    ``x_{k+1} = x_k − η·λ·x_{k−τ}``, converges iff ``η·λ < 2·sin(π / (2·(2τ + 1)))``: ``η·λ < 2`` in sync,
    ``η·λ < 1`` for ABS-SGD's one-step delay. The ratio of the two limits,

    ::

        s(τ) = sin(π / (4τ + 2))            s(0) = 1,  s(1) = 1/2

    scales a step size that is stable (with the same margin) in sync to one that is stable under the delay. The
    bound is exact for plain gradient descent; for adaptive or momentum optimizers it is a heuristic (their
    effective step differs per coordinate and over time), which the one-process replays bear out: a rate tuned
    close to the edge of stability for DDP (on XMC mini, Adagrad at 0.1) oscillates once the delay starts, and
    half of it does not. The ``abs_sgd`` config's departure from the paper, which keeps ``η`` (method card
    ``docs/methods/abs_sgd.md``).

    Args:
        delay: steps ``τ ≥ 0`` between computing a gradient and applying it.

    Raises:
        ValueError: for a negative or non-integer delay.

    Example:
        >>> [round(stale_update_scale(t), 3) for t in range(3)]
        [1.0, 0.5, 0.309]
    """
    if not is_whole(delay) or delay < 0:
        raise ValueError(f"delay={delay!r} counts steps: a whole number >= 0")
    return math.sin(math.pi / (4 * delay + 2))
