"""Lightning's per-step SIGTERM check, answered from the merge that just ran instead of a broadcast of its own."""

from __future__ import annotations

import sys
from typing import Any, Protocol


class _MergeOutcome(Protocol):
    @property
    def synced_last_step(self) -> bool: ...

    @property
    def stop_requested(self) -> bool: ...

    @property
    def waited_last_step(self) -> bool: ...


class StopCheck:
    """Stands in for the training epoch loop's ``_broadcast_sigterm_tensor``.

    Lightning's training epoch loop broadcasts rank zero's "received SIGTERM" flag at the start of every step:
    a collective per step, and a synchronisation point where fast replicas would wait for slow ones outside
    the merge, hiding what the arrival sensing must see. Every replica's flag travels in the merge's report
    instead: after a step that merged, once any replica asked to stop, every replica stops before the next
    step. After a step without a merge (``period > 1``) Lightning's own broadcast runs, as under DDP, except
    where a due merge waited while one replica trains alone: every rank skipped it alike, and the flag travels
    with the next merge's reports (at most ``MAX_STEPS_ALONE`` steps later), so that replica runs no collective.
    """

    def __init__(self, loop: Any, outcome: _MergeOutcome) -> None:
        self.loop = loop
        self.outcome = outcome
        self.broadcast = loop._broadcast_sigterm_tensor
        # The loop's own module imports the exception of whichever Lightning namespace is running.
        self.exception = sys.modules[type(loop).__module__].SIGTERMException
        loop._broadcast_sigterm_tensor = self

    def __call__(self) -> None:  # noqa: D102
        if self.outcome.waited_last_step:
            return
        if not self.outcome.synced_last_step:
            self.broadcast()
        elif self.outcome.stop_requested:
            raise self.exception()

    def restore(self) -> None:
        """Give the loop back its own method."""
        if self.loop.__dict__.get("_broadcast_sigterm_tensor") is self:
            del self.loop._broadcast_sigterm_tensor


def replace_stop_broadcast(trainer: Any, outcome: _MergeOutcome) -> StopCheck | None:
    """Install a :class:`StopCheck` on the trainer's training epoch loop; ``None`` where the loop has no such check."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    module = sys.modules.get(type(loop).__module__) if loop is not None else None
    if not hasattr(loop, "_broadcast_sigterm_tensor") or not hasattr(module, "SIGTERMException"):
        return None  # another Lightning version: keep its check, and its collective
    return StopCheck(loop, outcome)
