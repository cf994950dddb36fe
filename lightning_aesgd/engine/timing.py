"""Clocks of one replica: the timeline its arrivals are stamped on, and the spans where its device computes.

A :class:`Timeline` stamps moments of this replica's work: :class:`HostTimeline` reads the host's clock, whose
readings are known at once; :class:`CudaTimeline` records an event on the device's current stream, whose
reading is known only once the device has run everything queued before it. A :class:`SpanLedger` sums the
seconds between pairs of stamps as they become readable, without waiting for the device. :class:`ComputeSpans`
is told where a step's compute begins and ends, for whoever measures it (an emulation of slower devices).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch


class Timeline(ABC):
    """Where a replica's moments are stamped; the seconds between two stamps are read once both are readable.

    Attributes:
        deferred: whether stamps become readable only later (a device's queue runs behind the host).
    """

    deferred: ClassVar[bool] = False

    @abstractmethod
    def stamp(self) -> Any:
        """A stamp of this moment of the replica's work."""

    @abstractmethod
    def ready(self, stamp: Any) -> bool:
        """Whether ``stamp`` can be read now; never blocks."""

    @abstractmethod
    def wait(self, stamp: Any) -> None:
        """Block the host until ``stamp`` can be read (a host synchronisation where the timeline is deferred)."""

    @abstractmethod
    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``, both readable."""


class HostTimeline(Timeline):
    """The host's clock: a stamp is a reading, readable at once.

    Args:
        clock: seconds on a monotonic clock (tests pass a scripted one); ``time.perf_counter`` when omitted.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock if clock is not None else time.perf_counter

    def stamp(self) -> float:  # noqa: D102
        return self.clock()

    def ready(self, stamp: Any) -> bool:  # noqa: D102
        return True

    def wait(self, stamp: Any) -> None:  # noqa: D102
        pass

    def seconds(self, start: Any, end: Any) -> float:  # noqa: D102
        return float(end - start)


class CudaTimeline(Timeline):
    """A CUDA device's own clock: each stamp is an event recorded on the device's current stream.

    The host queues kernels ahead of the device, so a host reading says when work was queued, not when it ran;
    an event says when the device reached it. The seconds between two events count the time the device spent
    between them, idle included (a host stall that starves it), and not the time a stream after them waits for
    a collective that has not begun. A stamp is readable once the device has passed it (``Event.query()``).

    Args:
        device: the CUDA device.

    Raises:
        ValueError: If CUDA is not available.
    """

    deferred: ClassVar[bool] = True

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise ValueError(f"cannot time {device}: CUDA is not available")
        self.device = device

    def stamp(self) -> torch.cuda.Event:  # noqa: D102
        # torch leaves Event.__new__, query and synchronize unannotated, hence the ignores.
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ready(self, stamp: Any) -> bool:  # noqa: D102
        return bool(stamp.query())

    def wait(self, stamp: Any) -> None:  # noqa: D102
        stamp.synchronize()

    def seconds(self, start: Any, end: Any) -> float:  # noqa: D102
        return float(start.elapsed_time(end)) / 1000.0  # elapsed_time is in milliseconds


def timeline_for(device: torch.device, clock: Callable[[], float] | None = None) -> Timeline:
    """The timeline that stamps the work of ``device``: its own clock for CUDA, the host's (``clock``) otherwise."""
    return CudaTimeline(device) if device.type == "cuda" else HostTimeline(clock)


class SpanLedger:
    """Seconds between pairs of stamps of one timeline, totalled per account as the stamps become readable.

    Spans are read in the order they were added; :meth:`fold` reads those already readable and never blocks,
    :meth:`settle` reads them all, blocking the host at most once where the stamps lie on one stream.

    Args:
        timeline: the timeline the stamps come from.

    Example:
        >>> ledger = SpanLedger(HostTimeline())
        >>> ledger.add("active", 1.0, 1.5)
        >>> ledger.add("active", 2.0, 2.25)
        >>> ledger.total("active")
        0.75
    """

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self._totals: dict[str, float] = {}
        self._pending: deque[tuple[str, Any, Any]] = deque()

    @property
    def complete(self) -> bool:
        """Whether every span added has been read."""
        return not self._pending

    def add(self, account: str, start: Any, end: Any) -> None:
        """Count the span from ``start`` to ``end`` (stamped now or earlier) in ``account``."""
        self._pending.append((account, start, end))
        self.fold()

    def fold(self) -> None:
        """Read the spans whose stamps are readable, oldest first; never blocks."""
        timeline = self.timeline
        while self._pending and timeline.ready(self._pending[0][2]) and timeline.ready(self._pending[0][1]):
            account, start, end = self._pending.popleft()
            self._totals[account] = self._totals.get(account, 0.0) + timeline.seconds(start, end)

    def settle(self) -> None:
        """Read every span: block, if any is still unreadable, until the latest stamp is (then all are, on a stream)."""
        self.fold()
        if not self._pending:
            return
        self.timeline.wait(self._pending[-1][2])
        self.fold()
        # Stamps recorded on another stream (a thread with a stream of its own) need their own waits.
        for _, start, end in self._pending:
            self.timeline.wait(start)
            self.timeline.wait(end)
        self.fold()

    def absorb(self, later: SpanLedger) -> None:
        """Take over the spans of ``later``, a ledger of the same timeline whose spans all follow this one's."""
        for account, seconds in later._totals.items():
            self._totals[account] = self._totals.get(account, 0.0) + seconds
        self._pending.extend(later._pending)

    def total(self, account: str) -> float:
        """Seconds of the spans of ``account`` read so far."""
        return self._totals.get(account, 0.0)


class ComputeSpans(Protocol):
    """Told where, within a step, the replica's device computes.

    The spans: the forward and backward up to the arrival, the update after the release, a flushed update. The
    engine calls :meth:`begin` and :meth:`end` around each; a listener may measure them (an emulation of slower
    devices stretches them).
    """

    def begin(self) -> None:
        """A compute span starts."""
        ...

    def end(self, rank: int, global_step: int) -> None:
        """The compute span begun last ends (``rank``'s span of step ``global_step``)."""
        ...


class NoComputeSpans:
    """The default listener: spans are not observed."""

    def begin(self) -> None:  # noqa: D102
        return None

    def end(self, rank: int, global_step: int) -> None:  # noqa: D102
        return None
