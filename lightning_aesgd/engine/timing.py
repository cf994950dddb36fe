"""Clocks of one replica: the busy time the routing measures and the compute time the emulation scales.

:class:`BusyTimer` times a replica's busy region without forcing a device synchronisation; :class:`ComputeClock`
and :func:`emulated_slowdown` make a step take ``f`` times its compute time (the ``step`` emulation mode of
:class:`~lightning_aesgd.core.slowdown.SlowdownProfile`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class BusyTimer:
    """Busy seconds of a code region, one measurement per ``start()``/``stop()`` pair.

    On CPU the region is timed with ``time.perf_counter`` and completes at ``stop()``. On CUDA, kernels run
    asynchronously, so each region records a pair of ``torch.cuda.Event(enable_timing=True)`` on the current
    stream and :meth:`pop_completed` only reads pairs whose end event has already happened (``query()``):
    the speed estimate lags a step or two instead of forcing a device synchronisation every step.

    Args:
        device: The device doing the work; CUDA devices are timed with events.

    Example:
        >>> timer = BusyTimer(torch.device("cpu"))
        >>> timer.start()
        >>> timer.stop()
        >>> len(timer.pop_completed())
        1
    """

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"cannot time {device}: CUDA is not available")
        self.device = device
        self._uses_events = device.type == "cuda"
        self._start_time: float | None = None
        self._start_event: torch.cuda.Event | None = None
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._completed: list[float] = []

    @property
    def is_running(self) -> bool:
        """Whether a region has started and not yet stopped."""
        return self._start_time is not None or self._start_event is not None

    def start(self) -> None:
        """Mark the beginning of a busy region.

        Raises:
            RuntimeError: If a region is already running.
        """
        if self.is_running:
            raise RuntimeError("BusyTimer.start() called twice: call stop() to end the running region first")
        if self._uses_events:
            self._start_event = self._record_event()
        else:
            self._start_time = time.perf_counter()

    def stop(self) -> None:
        """Mark the end of the running busy region.

        Raises:
            RuntimeError: If no region is running.
        """
        if self._start_event is not None:
            self._pending.append((self._start_event, self._record_event()))
            self._start_event = None
        elif self._start_time is not None:
            self._completed.append(time.perf_counter() - self._start_time)
            self._start_time = None
        else:
            raise RuntimeError("BusyTimer.stop() called without start(): call start() before the region")

    def pop_completed(self) -> list[float]:
        """Return the seconds of regions finished since the last call, oldest first; never synchronises.

        A region can measure ``0.0`` at the clock's resolution (a CUDA region that launched no kernel), which
        :meth:`SpeedEstimator.update` rejects: callers drop such a measurement together with its work.
        """
        # torch leaves Event.query and Event.__new__ unannotated, hence the ignores.
        while self._pending and all(event.query() for event in self._pending[0]):  # type: ignore[no-untyped-call]
            start, end = self._pending.popleft()
            self._completed.append(start.elapsed_time(end) / 1000.0)  # elapsed_time is in milliseconds
        completed, self._completed = self._completed, []
        return completed

    def _record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event


class ComputeClock:
    """Measures a step's compute time as the slowdown emulation defines it (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        """A reading; differences of two readings are compute seconds.

        On CPU with one intra-op thread (each emulated replica's case), the calling thread's CPU time: forward,
        backward (CPU autograd runs on the calling thread) and the update, but not the work of gloo's own threads
        on a collective in flight meanwhile (DDP's earlier buckets, ABS-SGD's delayed sum), which a slower device
        would not slow down. With several intra-op threads, the process's CPU time.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.thread_time() if torch.get_num_threads() == 1 else time.process_time()


def stretch(clock: ComputeClock, started: float, factor: float) -> None:
    """Sleep ``(factor − 1) ×`` the compute time since the reading ``started``: the region takes ``factor`` times it."""
    if factor > 1:
        time.sleep((factor - 1) * (clock.now() - started))


@contextmanager
def emulated_slowdown(clock: ComputeClock, factor: float) -> Iterator[None]:
    """Run the body, then sleep ``(factor − 1) ×`` its compute time."""
    if factor <= 1:
        yield
        return
    started = clock.now()
    yield
    stretch(clock, started, factor)
