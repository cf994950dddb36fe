"""Lightning's per-step SIGTERM check, answered from the replicas' reports instead of a broadcast of its own."""

from __future__ import annotations

import sys
from typing import Any, Protocol


class _StopOutcome(Protocol):
    @property
    def stop_requested(self) -> bool: ...


class StopCheck:
    """Stands in for the training epoch loop's ``_broadcast_sigterm_tensor``: no collective at all.

    Lightning's training epoch loop broadcasts rank zero's "received SIGTERM" flag at the start of every step (then
    reads it back, a host synchronisation on a GPU): a collective per step, and a synchronisation point where fast
    replicas would wait for slow ones between merges, which is what local steps exist to avoid, and which hides what
    the arrival sensing must see. Every replica's flag travels in the reports instead (the merges' under model
    merging, the last gradient bucket's about every quarter second under gradient sums); once any replica asked to
    stop, every replica raises Lightning's ``SIGTERMException`` before the same next step, as every rank reads the
    same reports at the same step. A stop is so honoured at the next merge (``period`` steps at most, or
    ``MAX_STEPS_ALONE`` while one replica trains alone), where DDP honours it at the next step.
    """

    def __init__(self, loop: Any, outcome: _StopOutcome) -> None:
        self.loop = loop
        self.outcome = outcome
        # The loop's own module imports the exception of whichever Lightning namespace is running.
        self.exception = sys.modules[type(loop).__module__].SIGTERMException
        loop._broadcast_sigterm_tensor = self

    def __call__(self) -> None:  # noqa: D102
        if self.outcome.stop_requested:
            raise self.exception()

    def restore(self) -> None:
        """Give the loop back its own method."""
        if self.loop.__dict__.get("_broadcast_sigterm_tensor") is self:
            del self.loop._broadcast_sigterm_tensor


def replace_stop_broadcast(trainer: Any, outcome: _StopOutcome) -> StopCheck | None:
    """Install a :class:`StopCheck` on the trainer's training epoch loop; ``None`` where the loop has no such check."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    module = sys.modules.get(type(loop).__module__) if loop is not None else None
    if not hasattr(loop, "_broadcast_sigterm_tensor") or not hasattr(module, "SIGTERMException"):
        return None  # another Lightning version: keep its check, and its collective
    return StopCheck(loop, outcome)
