"""A watch over device collectives that the host does not wait for: NCCL's stalls named as gloo's are.

On gloo the host waits in each collective, and one that times out raises in the training thread, where the
communicator turns it into a :class:`~lightning_aesgd.engine.stalls.ReplicaStalledError` naming the late and the
absent. On NCCL a collective returns once it is queued on the device. A replica that never arrives leaves the
others' device waiting while their host runs on until some read of a device tensor blocks it; at the group's
timeout NCCL's watchdog thread ends the process, with no word of which replica was missing.

So the communicator hands every device collective's work to a :class:`CollectiveWatch`. Its daemon thread looks at
the oldest unfinished one every :data:`POLL_SECONDS`; once that one has waited the watch's timeout, it holds the same
roll call as gloo's failures (:func:`~lightning_aesgd.engine.stalls.stalled_error`), logs the error, and keeps it.
The communicator raises it in the training thread at the next collective, where the host gets there. The strategy
watches at its ``timeout`` and creates NCCL groups with ``timeout`` plus :data:`GRACE_SECONDS`, so that the roll
call ends before the watchdog's own.

Finished work is dropped at the next collective and at each poll: a work holds its tensors, which would otherwise
outlive their step. The cost is an ``is_completed()`` query (an event query on CUDA, which never waits for the
device) per finished collective.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from lightning_aesgd.engine.stalls import PATIENCE_MAX_SECONDS, ReplicaStalledError, stalled_error

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
"""How often the watch looks at the oldest unfinished collective."""
GRACE_SECONDS = PATIENCE_MAX_SECONDS + 30.0
"""How much longer than the watch a device group waits before its own watchdog ends the process: the longest roll
call, and time to log its outcome."""


def device_group_timeout(timeout: timedelta) -> timedelta:
    """The timeout to create a watched (NCCL) group with, so that the watch fires at ``timeout``, before the group.

    >>> device_group_timeout(timedelta(minutes=30)).total_seconds()
    1890.0
    """
    return timeout + timedelta(seconds=GRACE_SECONDS)


def watch_timeout(group_timeout: float) -> float:
    """Seconds a device collective may wait before the watch reports it, in a group the strategy did not create.

    :data:`GRACE_SECONDS` before the group's own timeout; half of it for a group too short for that, so that the
    roll call still comes first. (The strategy's own groups are watched at its ``timeout``.)

    >>> watch_timeout(1890.0), watch_timeout(600.0), watch_timeout(60.0)
    (1800.0, 510.0, 30.0)
    """
    return max(group_timeout - GRACE_SECONDS, group_timeout / 2)


@dataclass(frozen=True)
class _InFlight:
    """A device collective the watch waits on: its work, its name and roll-call key, and when the host issued it."""

    work: Any
    name: str
    key: str
    issued: float
    where: str | None


class CollectiveWatch:
    """Reports the first device collective that waits longer than ``timeout`` seconds, with its roll call.

    Args:
        timeout: seconds a collective may wait, from the moment the host issued it.
        rank: this replica's rank in the collectives' group.
        world_size: the group's size.
        members: the world rank of each group rank (whose heartbeats the roll call reads); ``None`` for the world.
        poll: seconds between two looks at the oldest unfinished collective.
        clock: the monotonic clock the issue times come from (tests pass their own, with :meth:`check`).
    """

    def __init__(
        self,
        timeout: float,
        rank: int,
        world_size: int,
        members: Sequence[int] | None = None,
        *,
        poll: float = POLL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout, self.rank, self.world_size = timeout, rank, world_size
        self.members = None if members is None else list(members)
        self.poll, self.clock = poll, clock
        self.stalled: ReplicaStalledError | None = None
        self._in_flight: deque[_InFlight] = deque()
        self._lock = threading.Lock()
        self._over = threading.Event()  # stopped, or reported: nothing more to watch
        self._thread: threading.Thread | None = None

    def watch(self, work: Any, name: str, key: str, issued: float, where: str | None = None) -> None:
        """Wait on ``work`` (a ``torch.distributed`` work, or anything with ``is_completed()``) in the background.

        Args:
            work: the collective's work, as an ``async_op=True`` call returns it.
            name: the collective, numbered in call order (``"all-reduce #12"``).
            key: its roll-call key, the same on every replica.
            issued: when the host issued it, on :attr:`clock`.
            where: what the replica was doing, where the caller knows (``"the gradient sum of global step 12"``).
        """
        if self._over.is_set():
            return  # one report: the collectives after a stall wait behind it
        with self._lock:
            self._drop_finished()
            self._in_flight.append(_InFlight(work, name, key, issued, where))
            if self._thread is None:
                thread_name = f"aesgd-collective-watch-{self.rank}"
                device = _current_cuda_device()
                self._thread = threading.Thread(target=self._run, args=(device,), name=thread_name, daemon=True)
                self._thread.start()

    def check(self) -> ReplicaStalledError | None:
        """Drop the finished collectives at the front; report the oldest unfinished one if it waited too long.

        The report holds the roll call, which waits up to about as long as the collective did for the others'
        answers (:func:`~lightning_aesgd.engine.stalls.patience_for`). Returns the report, kept in
        :attr:`stalled`, or ``None`` while every collective is within its time.
        """
        with self._lock:
            self._drop_finished()
            oldest = self._in_flight[0] if self._in_flight else None
        if oldest is None or self._over.is_set() or self.clock() - oldest.issued < self.timeout:
            return None
        cause = (
            f"Timed out: the device collective had not completed after {self.timeout:.0f} s (seen by the host's "
            f"watch; the group's own watchdog ends the process {GRACE_SECONDS:.0f} s later)"
        )
        error = stalled_error(
            RuntimeError(cause),
            oldest.name,
            oldest.key,
            self.rank,
            self.world_size,
            oldest.issued,
            members=self.members,
            clock=self.clock,
        )
        self.stalled = error if oldest.where is None else error.during(oldest.where)
        self.stop()
        log.error("%s", self.stalled)
        return self.stalled

    def stop(self) -> None:
        """Stop watching (the communicator is closed, the fit is over, a stall was reported); work is let go."""
        self._over.set()
        with self._lock:
            self._in_flight.clear()

    def _drop_finished(self) -> None:
        """Let go of the finished collectives at the front (under the lock): their works hold their tensors.

        A work that cannot say (its group aborted) is let go too: the watch cannot judge it, and must not raise.
        """
        while self._in_flight and _finished(self._in_flight[0].work):
            self._in_flight.popleft()

    def _run(self, cuda_device: int | None = None) -> None:
        try:
            # A new thread's current device is the first GPU: its queries of the works would open a context
            # there, on every rank of a multi-GPU node.
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            while not self._over.wait(self.poll):
                if self.check() is not None:
                    return
                with self._lock:
                    if not self._in_flight:  # nothing to wait on: the next collective starts a thread again
                        self._thread = None
                        return
        except Exception as error:  # the watch never raises into training; without it NCCL's watchdog remains
            log.warning("The collective watch of replica %d stopped: %s", self.rank, error)
            self.stop()


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device, where CUDA is in use in this process; ``None`` otherwise."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]


def _finished(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:
        return True
