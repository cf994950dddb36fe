"""The compute time the ``step`` emulation scales, and the stretcher that makes a span take ``f`` times it."""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_aesgd.emulation.profiles import SlowdownProfile
from lightning_aesgd.engine.timing import Timeline, timeline_for


class ComputeClock:
    """Measures a span's compute time as the slowdown emulation defines it.

    A span starts at :meth:`mark` and is read by :meth:`seconds_since`. Only the reading may block, so a span that
    is never read (a replica at factor 1) costs nothing.

    On CPU with one intra-op thread (each emulated replica's case), the calling thread's CPU time: forward,
    backward (CPU autograd runs on the calling thread) and the update, but not the work of gloo's own threads on a
    collective in flight meanwhile (DDP's earlier buckets, ABS-SGD's delayed sum), which a slower device would not
    slow down. With several intra-op threads, the process's CPU time.

    On CUDA, the device's clock between events recorded on the current stream: from where the device finished the
    work queued before the mark to where it finished the span's, idle gaps the host left included (and, on a GPU
    that several processes share, the time it ran the others' work meanwhile). Reading
    waits for the span's end event alone, never for the whole device, whose collectives' streams would add the
    wait for peers; and a mark does not wait at all. Where several processes share one GPU a host
    synchronisation also waits while the device runs the others' work, so the emulation makes as few as it can:
    one per span it stretches, none for a replica at factor 1.

    Args:
        device: the replica's device.
        timeline: where spans are stamped (tests pass a scripted one); by default the device's.
    """

    def __init__(self, device: torch.device, timeline: Timeline | None = None) -> None:
        self.device = device
        self.timeline = timeline if timeline is not None else timeline_for(device, _cpu_seconds)

    def mark(self) -> Any:
        """The start of a span; never blocks."""
        return self.timeline.stamp()

    def seconds_since(self, mark: Any) -> float:
        """Compute seconds from ``mark`` to now: on a device, once it has run what was queued until now."""
        end = self.timeline.stamp()
        self.timeline.wait(end)
        self.timeline.wait(mark)  # done already where both lie on one stream; a mark on another may not be
        return self.timeline.seconds(mark, end)


def _cpu_seconds() -> float:
    """The computing thread's CPU time with one intra-op thread, the process's with several.

    Chosen per reading: the thread count may change after the clock is made.
    """
    return time.thread_time() if torch.get_num_threads() == 1 else time.process_time()


def stretch(clock: ComputeClock, started: Any, factor: float) -> None:
    """Sleep ``(factor − 1) ×`` the compute time since the mark ``started``: the span takes ``factor`` times it.

    At factor 1 the span is not read, so it costs no synchronisation with the device.
    """
    if factor > 1:
        time.sleep((factor - 1) * clock.seconds_since(started))


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
        self._started: Any = None

    def begin(self) -> None:  # noqa: D102
        self._started = self.clock.mark()

    def end(self, rank: int, global_step: int) -> None:  # noqa: D102
        if self._started is not None:
            stretch(self.clock, self._started, self.profile.factor(rank, global_step))
            self._started = None
