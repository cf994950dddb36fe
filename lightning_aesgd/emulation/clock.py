"""The compute time the ``step`` emulation scales, and the stretcher that makes a span take ``f`` times it."""

from __future__ import annotations

import time

import torch

from lightning_aesgd.emulation.profiles import SlowdownProfile


class ComputeClock:
    """Measures a span's compute time as the slowdown emulation defines it.

    Args:
        device: the replica's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        """A reading; differences of two readings are compute seconds.

        On CPU with one intra-op thread (each emulated replica's case), the calling thread's CPU time: forward,
        backward (CPU autograd runs on the calling thread) and the update, but not the work of gloo's own threads
        on a collective in flight meanwhile (DDP's earlier buckets, ABS-SGD's delayed sum), which a slower device
        would not slow down. With several intra-op threads, the process's CPU time.

        On CUDA, the host's clock once the current stream has run what was queued on it: a synchronisation of
        the whole device would also wait for the collectives' streams, so compute would include the wait for peers.
        """
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            return time.perf_counter()
        return time.thread_time() if torch.get_num_threads() == 1 else time.process_time()


def stretch(clock: ComputeClock, started: float, factor: float) -> None:
    """Sleep ``(factor − 1) ×`` the compute time since the reading ``started``: the region takes ``factor`` times it."""
    if factor > 1:
        time.sleep((factor - 1) * (clock.now() - started))


class StepStretcher:
    """The ``step`` mode as a :class:`~lightning_aesgd.engine.timing.ComputeSpans` listener of the engine.

    Every compute span the engine reports (the forward and backward up to the arrival, the update after the
    release, a flushed update) takes ``fᵣ`` times its compute time: replica ``r`` sleeps ``(fᵣ − 1) ×`` the span's
    compute at its end. Waiting for peers lies outside the spans, so it is never stretched.

    Args:
        profile: the slowdown profile (its ``step`` mode).
        device: the replica's device.
    """

    def __init__(self, profile: SlowdownProfile, device: torch.device) -> None:
        self.profile = profile
        self.clock = ComputeClock(device)
        self._started: float | None = None

    def begin(self) -> None:  # noqa: D102
        self._started = self.clock.now()

    def end(self, rank: int, global_step: int) -> None:  # noqa: D102
        if self._started is not None:
            stretch(self.clock, self._started, self.profile.factor(rank, global_step))
            self._started = None
