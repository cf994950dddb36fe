"""Lightning's per-step SIGTERM check, answered from the replicas' reports instead of a broadcast of its own."""

from __future__ import annotations

import logging
import sys
from typing import Any, Protocol

log = logging.getLogger(__name__)


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

    def __init__(self, loop: Any, outcome: _StopOutcome, signals: Any = None) -> None:
        self.loop = loop
        self.outcome = outcome
        # The loop's own module imports the exception of whichever Lightning namespace is running.
        self.exception = sys.modules[type(loop).__module__].SIGTERMException
        loop._broadcast_sigterm_tensor = self
        self.signals = signals
        self.received = False  # whether this process received SIGTERM: its flag in the next reports
        if signals is not None:  # before the Trainer registers its handlers, which take this one
            signals._sigterm_notifier_fn = self.note_sigterm

    def __call__(self) -> None:  # noqa: D102
        if self.outcome.stop_requested:
            raise self.exception()

    def note_sigterm(self, signum: int, frame: Any) -> None:
        """Stands in for Lightning's SIGTERM handler: record the signal for the reports, and pass it on.

        Lightning's own broadcasts the flag from the handler (to meet the per-step broadcast on the others, which
        no longer runs: it would wait until the timeout) and marks the Trainer, whose loop then leaves at the end
        of this replica's step, alone (the others would wait in the next merge). The signal still reaches the
        launched processes, as Lightning forwards it.
        """
        log.info("Replica received SIGTERM (%s): every replica stops after the next reports.", signum)
        if not self.received:
            launcher = getattr(getattr(self.signals, "trainer", None), "strategy", None)
            launcher = getattr(launcher, "launcher", None)
            if launcher is not None:
                launcher.kill(signum)
        self.received = True

    def restore(self) -> None:
        """Give the loop back its own method, and the Trainer its own SIGTERM handler."""
        if self.loop.__dict__.get("_broadcast_sigterm_tensor") is self:
            del self.loop._broadcast_sigterm_tensor
        if self.signals is not None and self.signals.__dict__.get("_sigterm_notifier_fn") == self.note_sigterm:
            del self.signals._sigterm_notifier_fn


def replace_stop_broadcast(trainer: Any, outcome: _StopOutcome) -> StopCheck | None:
    """Install a :class:`StopCheck` on the trainer's training epoch loop; ``None`` where the loop has no such check."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    module = sys.modules.get(type(loop).__module__) if loop is not None else None
    if not hasattr(loop, "_broadcast_sigterm_tensor") or not hasattr(module, "SIGTERMException"):
        return None  # another Lightning version: keep its check, and its collective
    return StopCheck(loop, outcome, getattr(trainer, "_signal_connector", None))
