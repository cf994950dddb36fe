"""When a collective fails for want of a replica: who was late, who was stalled, who was gone.

A collective between replicas that times out or loses a peer (:func:`is_peer_failure`) becomes a
:class:`ReplicaStalledError`. Before raising it, each failing replica holds a *roll call* in the process group's
store (:func:`roll_call`): it answers under the collective's key, with how long it waited and when it arrived, and
reads what the others left there.

Waiting a fixed time for the others' answers cannot tell a replica that is merely late from one that is gone: a
late replica answers only once its own collective fails, which may be long after the others gave up. So every
replica also keeps a :class:`Heartbeat` in the store, a stamp rewritten every second by a daemon thread, which
carries the collective it entered last. The roll call then sorts every other replica by what the store shows:

* it *answered*, or its heartbeat shows it inside this collective: it arrived, and is *late* if it arrived after
  a replica had already given up, by how long after the first arrival;
* its heartbeat stopped (or it said it was gone at exit): it is *absent*, decided after a few beats, as a replica
  that exited, crashed or hangs holding the interpreter cannot beat;
* its heartbeat goes on but it never arrives: it is *stalled* (alive elsewhere), decided once the roll call has
  waited about as long as the collective did (:data:`PATIENCE_MIN_SECONDS` to :data:`PATIENCE_MAX_SECONDS`).

Arrival times are wall-clock times of the replicas' own hosts, so lateness between hosts includes their clock
offset (milliseconds under NTP); whether a heartbeat stopped is judged on the reader's own clock alone.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

BEAT_SECONDS = 1.0
"""How often a replica's heartbeat rewrites its stamp in the store."""
STALE_SECONDS = 3 * BEAT_SECONDS
"""A stamp unchanged this long means its replica is absent: a few beats, so that a busy host's late beat is no death."""
PATIENCE_MIN_SECONDS = 5.0
"""The least time the roll call waits for a replica that is alive but has not arrived."""
PATIENCE_MAX_SECONDS = 60.0
"""The most time the roll call waits for a replica that is alive but has not arrived, however long the timeout."""
STORE_SECONDS = 5.0
"""The store's timeout during a roll call and for a heartbeat's writes: the store's host may be the replica gone."""
POLL_SECONDS = 0.1
"""How often the roll call reads the store."""
ALIVE_PREFIX = "aesgd/alive"
"""Where replica ``r``'s heartbeat stamp lives in the store: ``aesgd/alive/<r>`` (``r``: its rank in the world)."""
GONE = "gone"
"""The stamp of a replica whose interpreter exited."""

_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_LOST_PEER = re.compile(r"connection (closed|reset|refused)|(closed|reset) by peer|broken pipe", re.IGNORECASE)


# --- the roll call ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RollCall:
    """What the roll call after a failed collective learnt of the replicas (ranks in the collective's group).

    Attributes:
        waited: the replicas that failed in the same collective and answered, with the seconds each had waited.
        arrived: every replica known to have reached the collective, with the wall time (``time.time()`` on its
            host) it did: those that answered, and those that the heartbeat shows still inside it.
        absent: replicas that never arrived and show no sign of life: they exited, crashed, or hang holding the
            interpreter (their heartbeat stopped).
        stalled: replicas that never arrived although their heartbeat went on until the roll call gave up.
    """

    waited: dict[int, float]
    arrived: dict[int, float]
    absent: tuple[int, ...] = ()
    stalled: tuple[int, ...] = ()

    @property
    def missing(self) -> list[int]:
        """The replicas that never arrived: absent or stalled."""
        return sorted(self.absent + self.stalled)

    @property
    def late(self) -> dict[int, float]:
        """The replicas that arrived after another had already given up, with how long after the first they came.

        >>> RollCall(waited={0: 1.0, 1: 1.0}, arrived={0: 100.0, 1: 100.2, 3: 103.0}).late
        {3: 3.0}
        """
        gave_up = [self.arrived[r] + seconds for r, seconds in self.waited.items() if r in self.arrived]
        if not gave_up:
            return {}
        first, deadline = min(self.arrived.values()), min(gave_up)
        return {r: round(t - first, 3) for r, t in sorted(self.arrived.items()) if t > deadline}


def roll_call(
    store: Any,
    key: str,
    rank: int,
    world_size: int,
    waited: float,
    *,
    patience: float | None = None,
    stale_after: float = STALE_SECONDS,
    members: Sequence[int] | None = None,
) -> RollCall | None:
    """After a failed collective: who had arrived and when, who is absent, who is stalled; ``None`` without a store.

    This replica answers ``key/<rank>`` with how long it waited and when it arrived (wall time), then reads the
    others' answers and heartbeats until each is decided (:class:`RollCall`) or ``patience`` runs out. A replica
    whose heartbeat shows it inside this collective (its position is ``key``) has arrived, even before its own
    collective fails and it answers.

    Args:
        store: the process group's store.
        key: the collective's roll-call key, the same on every replica.
        rank: this replica's rank in the collective's group.
        world_size: the size of that group.
        waited: seconds this replica waited in the collective.
        patience: the most seconds to wait for a replica that is alive but has not arrived; by default about as
            long as this replica waited (:func:`patience_for`).
        stale_after: seconds without a new heartbeat stamp after which a replica is absent.
        members: the world rank of each group rank, whose heartbeats to read; the group is the world when ``None``.
    """
    if store is None:
        return None
    try:
        store.set_timeout(timedelta(seconds=STORE_SECONDS))  # short: its host may be the replica that is gone
        store.set(f"{key}/{rank}", _answer(waited, arrived=time.time() - waited))
        return _attend(
            store,
            key,
            world_size,
            patience=patience_for(waited) if patience is None else patience,
            stale_after=stale_after,
            members=list(members) if members is not None else list(range(world_size)),
        )
    except Exception:  # the store's host is gone: nothing more can be learnt
        return None


def patience_for(waited: float) -> float:
    """How long the roll call waits for a live replica that has not arrived: as long as this one waited, bounded.

    A replica arriving more than one more timeout after the others gave up is as good as stalled; the bounds keep
    a lost connection (which fails at once) from deciding too soon and a long timeout from doubling the wait.

    >>> patience_for(1.0), patience_for(30.0), patience_for(1800.0)
    (5.0, 30.0, 60.0)
    """
    return min(max(waited, PATIENCE_MIN_SECONDS), PATIENCE_MAX_SECONDS)


def _attend(
    store: Any, key: str, world_size: int, *, patience: float, stale_after: float, members: list[int]
) -> RollCall:
    """Read the answers and heartbeats until every replica is decided or ``patience`` runs out.

    A replica seen inside the collective is decided (it arrived); its answer, should it come while the roll call
    waits for others, still adds how long it waited.
    """
    waited: dict[int, float] = {}
    arrived: dict[int, float] = {}
    absent: list[int] = []
    started = time.monotonic()
    watches = {r: _Watch(started) for r in range(world_size)}
    pending = list(range(world_size))
    while True:
        now = time.monotonic()
        for r in range(world_size):
            answer = None if r in waited or r in absent else _read(store, f"{key}/{r}")
            if answer is not None:
                waited[r], arrival = _parse_answer(answer)
                if arrival is not None:
                    arrived[r] = arrival
            elif r in pending:
                watch = watches[r]
                watch.see(_read(store, alive_key(members[r])), now)
                if watch.gone or watch.stale(now, stale_after):
                    absent.append(r)
                elif watch.entered is not None and watch.position == key:  # inside the collective, not failed yet
                    arrived[r] = watch.entered
            if r in pending and (r in waited or r in arrived or r in absent):
                pending.remove(r)
        if not pending or now - started >= patience:
            break
        time.sleep(POLL_SECONDS)
    return RollCall(waited, arrived, absent=tuple(sorted(absent)), stalled=tuple(pending))


class _Watch:
    """One replica's heartbeat as the roll call sees it: the latest stamp, and since when it has not changed."""

    def __init__(self, started: float) -> None:
        self.stamp: str | None = None
        self.changed = started  # a stamp first seen counts as new: how old it was is unknown on this clock
        self.position: str | None = None
        self.entered: float | None = None

    def see(self, stamp: str | None, now: float) -> None:
        if stamp != self.stamp:
            self.stamp, self.changed = stamp, now
            self.entered, self.position = _parse_stamp(stamp)

    @property
    def gone(self) -> bool:
        return self.stamp == GONE

    def stale(self, now: float, stale_after: float) -> bool:
        return now - self.changed > stale_after


def _read(store: Any, key: str) -> str | None:
    """The value at ``key``, or ``None`` where there is none yet (a get would wait for it)."""
    if not store.check([key]):
        return None
    value = store.get(key)
    return value.decode() if isinstance(value, bytes) else str(value)


def _answer(waited: float, arrived: float) -> str:
    return f"{waited:.3f} {arrived:.3f}"


def _parse_answer(answer: str) -> tuple[float, float | None]:
    """Seconds waited and wall time of arrival; the arrival is unknown in a bare number (a replica of old)."""
    fields = answer.split()
    return float(fields[0]), float(fields[1]) if len(fields) > 1 else None


def _stamp(beat: float, position: tuple[str, float] | None) -> str:
    """A heartbeat stamp: the beat's wall time, then when and which collective the replica entered last."""
    if position is None:
        return f"{beat:.3f}"
    key, entered = position
    return f"{beat:.3f} {entered:.3f} {key}"


def _parse_stamp(stamp: str | None) -> tuple[float | None, str | None]:
    """When and which collective a stamp's replica entered last; ``(None, None)`` where it names none."""
    fields = stamp.split(maxsplit=2) if stamp else []
    if len(fields) < 3:
        return None, None
    return float(fields[1]), fields[2]


_roll_call_generation = 0


def new_roll_calls() -> None:
    """Begin a new namespace of roll-call keys: the world's collectives count from 0 again (a new communicator).

    Every process of a job creates its world communicators in the same order (one a fit), so the namespaces agree;
    a second fit in one process group then never reads the first fit's answers under the same collective number.
    """
    global _roll_call_generation
    _roll_call_generation += 1


def roll_call_key(name: str) -> str:
    """The store key of the roll call for the collective ``name`` (a number, or a step's) in the current namespace."""
    return f"aesgd/roll_call/{_roll_call_generation}/{name}"


def alive_key(world_rank: int) -> str:
    """The store key of replica ``world_rank``'s heartbeat stamp."""
    return f"{ALIVE_PREFIX}/{world_rank}"


# --- the error --------------------------------------------------------------------------------------------------


class ReplicaStalledError(RuntimeError):
    """A collective between replicas timed out or lost a peer: some replica did not arrive, or came late.

    Attributes:
        collective: which collective, numbered in call order (``"all-reduce #12"``).
        rank: the replica that raised.
        waited: seconds this replica waited in the collective.
        roll: what the roll call after the failure learnt (:class:`RollCall`); ``None`` where the store could not
            be reached.
        timed_out: whether the collective timed out (``False``: a peer's connection was lost).
        where: what the replica was doing (``"the merge after global step 12"``), when the engine knows.
    """

    def __init__(
        self,
        *,
        collective: str,
        rank: int,
        world_size: int,
        waited: float,
        roll: RollCall | None,
        cause: str,
        where: str | None = None,
    ) -> None:
        self.collective, self.rank, self.world_size, self.waited = collective, rank, world_size, waited
        self.roll, self.cause, self.where = roll, cause, where
        self.timed_out = bool(_TIMEOUT.search(cause))
        super().__init__(self._message())

    @property
    def answers(self) -> dict[int, float] | None:
        """The replicas that answered the roll call, with the seconds each waited; ``None`` without a store."""
        return None if self.roll is None else self.roll.waited

    @property
    def missing(self) -> list[int] | None:
        """The replicas that never arrived (absent or stalled); ``None`` without a store."""
        return None if self.roll is None else self.roll.missing

    @property
    def late(self) -> dict[int, float]:
        """The replicas that arrived late, with how many seconds after the first replica they arrived."""
        return {} if self.roll is None else self.roll.late

    def during(self, where: str) -> ReplicaStalledError:
        """The same error, saying what the replica was doing (the engine knows the step, the communicator not).

        A ``where`` already said stays: it was nearer the collective (a collective watch names the gradient sum it
        found stalled; the merge that later raises the watch's report is another collective).
        """
        if self.where is not None:
            return self
        return ReplicaStalledError(
            collective=self.collective,
            rank=self.rank,
            world_size=self.world_size,
            waited=self.waited,
            roll=self.roll,
            cause=self.cause,
            where=where,
        )

    def _message(self) -> str:
        what = "timed out" if self.timed_out else "lost a peer's connection"
        where = f" during {self.where}" if self.where else ""
        head = f"Replica {self.rank}'s {self.collective}{where} {what} after waiting {self.waited:.1f} s"
        waited = ""
        if self.answers:
            waited = "; waited: " + ", ".join(f"replica {r} {s:.1f} s" for r, s in sorted(self.answers.items()))
        detail = self.cause.strip().splitlines()[0][:300] if self.cause.strip() else ""
        return f"{head}: {self._attendance()}{waited}. Backend: {detail}\n{self._hint()}"

    def _attendance(self) -> str:
        """Who was late, stalled or absent, in words."""
        roll = self.roll
        if roll is None:
            return "which replicas had not arrived is unknown (the store did not answer)"
        clauses = []
        if roll.late:
            lateness = ", ".join(f"replica {r} {s:.1f} s after the first" for r, s in roll.late.items())
            clauses.append(f"replica(s) {list(roll.late)} arrived late ({lateness})")
        # A lost connection may mean this replica is the late one, waking after the others have gone: it does not
        # claim that they had not arrived.
        missed = "had not arrived" if self.timed_out else "did not answer the roll call"
        if roll.stalled:
            clauses.append(
                f"replica(s) {list(roll.stalled)} {missed} although alive (heartbeat beating: stalled elsewhere)"
            )
        if roll.absent:
            clauses.append(
                f"replica(s) {list(roll.absent)} {missed} and show no sign of life (exited, crashed, or hung "
                "holding the interpreter)"
            )
        if not clauses:
            return "every replica answered the roll call afterwards, none late (a connection or the network failed)"
        return "; ".join(clauses)

    def _hint(self) -> str:
        roll = self.roll
        if roll is None:
            suspects = "the other replicas"
        elif roll.missing:
            suspects = f"replica(s) {roll.missing}"
        elif roll.late:
            suspects = f"replica(s) {list(roll.late)}"
        else:
            suspects = "the replicas that waited least"
        above = f" well above the {max(roll.late.values()):.1f} s seen here" if roll is not None and roll.late else ""
        return (
            f"HINT: look at what {suspects} were doing (their own log and traceback, `py-spy dump --pid`); a replica "
            "that exited shows its own error. If such pauses are expected (a long validation or checkpoint on one "
            "replica, a slow data source, a debugger), raise the strategy's `timeout=`"
            f"{above} (AdaptiveElasticStrategy(timeout=timedelta(minutes=...)))."
        )


def is_peer_failure(error: BaseException) -> bool:
    """Whether a collective's error means a peer did not take part: a timeout or a lost connection.

    >>> is_peer_failure(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv"))
    True
    >>> is_peer_failure(RuntimeError("Tensors must be contiguous"))
    False
    """
    message = str(error)
    return bool(_TIMEOUT.search(message) or _LOST_PEER.search(message))


def stalled_error(
    error: BaseException,
    collective: str,
    key: str,
    rank: int,
    world_size: int,
    started: float,
    *,
    members: Sequence[int] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ReplicaStalledError:
    """The :class:`ReplicaStalledError` for a peer failure (:func:`is_peer_failure`) of a collective.

    ``started``: when this replica began waiting (on ``clock``); ``key``: the roll call's, the same on every
    replica; ``members``: the world rank of each of the group's ranks, where the group is not the world.
    """
    waited = clock() - started
    roll = roll_call(default_store(), key, rank, world_size, waited, members=members)
    return ReplicaStalledError(
        collective=collective, rank=rank, world_size=world_size, waited=waited, roll=roll, cause=str(error)
    )


def default_store() -> Any:
    """The default process group's store, where torch exposes it (a private function, so guarded)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


# --- the heartbeat ----------------------------------------------------------------------------------------------


class Heartbeat:
    """A replica's sign of life: a daemon thread that rewrites ``aesgd/alive/<rank>`` every ``interval`` seconds.

    The stamp carries the beat's wall time (so that every beat changes it) and the roll-call key and wall time of
    the collective the replica entered last (:meth:`enter`), so that a roll call sees a late replica arrive. It
    writes over a connection of its own where the store can clone one: a long wait of the training thread on the
    shared connection would otherwise stop the beats. The thread never raises: a failed write (the store's host
    has gone, the job is ending) ends it quietly; and as a daemon it never keeps the interpreter alive.

    Args:
        store: the process group's store.
        rank: this replica's rank in the world.
        interval: seconds between beats.
    """

    def __init__(self, store: Any, rank: int, interval: float = BEAT_SECONDS) -> None:
        self.store, self.rank, self.interval = store, rank, interval
        self.pid = os.getpid()  # a forked child inherits this object but not its thread
        self._connection = _own_connection(store)
        self._position: tuple[str, float] | None = None
        self._stopping = threading.Event()
        self._gone = False
        self._thread = threading.Thread(target=self._beat, name=f"aesgd-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def enter(self, key: str) -> None:
        """Note that this replica enters the collective whose roll-call key is ``key`` (shown at the next beat)."""
        self._position = (key, time.time())

    def serves(self, store: Any, rank: int) -> bool:
        """Whether this heartbeat beats, in this process, for ``rank`` in ``store``."""
        return self.store is store and self.rank == rank and self.pid == os.getpid() and self._thread.is_alive()

    def stop(self, gone: bool = False, wait: float = 1.0) -> None:
        """Stop beating; with ``gone``, leave the stamp :data:`GONE` so that a roll call need not wait for it."""
        self._gone = gone
        self._stopping.set()
        if self.pid == os.getpid():
            self._thread.join(wait)

    def _beat(self) -> None:
        try:
            while not self._stopping.is_set():
                self._connection.set(alive_key(self.rank), _stamp(time.time(), self._position))
                self._stopping.wait(self.interval)
            if self._gone:
                self._connection.set(alive_key(self.rank), GONE)
        except Exception as error:  # the store's host has gone: there is no one left to tell
            log.debug("The heartbeat of replica %d stopped: %s", self.rank, error)


def _own_connection(store: Any) -> Any:
    """A connection to ``store`` of the heartbeat's own, with a short timeout; the store itself where none can be."""
    try:
        connection = store.clone()
        connection.set_timeout(timedelta(seconds=STORE_SECONDS))
        return connection
    except Exception:
        return store


_heartbeat: Heartbeat | None = None
_heartbeat_lock = threading.Lock()
_exit_registered = False


def keep_alive(store: Any, rank: int) -> Heartbeat | None:
    """Start this process's heartbeat for ``rank`` in ``store``, once; ``None`` where it cannot beat.

    A heartbeat for another store or rank (a later process group) is replaced; one inherited by a forked child is
    restarted there. Never raises: without a heartbeat, roll calls merely find this replica absent after a while.
    """
    global _heartbeat, _exit_registered
    if store is None:
        return None
    try:
        with _heartbeat_lock:
            current = _heartbeat
            if current is not None and current.serves(store, rank):
                return current
            if current is not None:
                current.stop(wait=0.0)
            _heartbeat = Heartbeat(store, rank)
            if not _exit_registered:
                atexit.register(_say_gone)
                _exit_registered = True
            return _heartbeat
    except Exception as error:
        log.debug("No heartbeat for replica %d: %s", rank, error)
        return None


def entering(key: str) -> None:
    """Note in this process's heartbeat that the replica enters the collective with roll-call key ``key``.

    Cheap enough for every collective: the next beat carries it.
    """
    heartbeat = _heartbeat
    if heartbeat is not None:
        heartbeat.enter(key)


@dataclass(frozen=True)
class Doing:
    """What this replica is doing, for a stalled collective's error (:func:`doing`).

    Attributes:
        where: in words (``"the merge after global step 12"``).
        step_key: the roll-call key under which a collective without a number of its own is waited for (a
            gradient bucket's sum, launched as it fills during the backward): the step's, the same on every replica.
    """

    where: str
    step_key: str | None = None


_doing: Doing | None = None


@contextmanager
def doing(where: str, step_key: str | None = None) -> Iterator[None]:
    """Within: a collective that stalls names ``where`` (:func:`now_doing`); not news for the heartbeat.

    The heartbeat shows a step's key only at its arrival (:func:`entering`), so that a roll call under it tells the
    replicas that arrived from one still computing.
    """
    global _doing
    before, _doing = _doing, Doing(where, step_key)
    try:
        yield
    finally:
        _doing = before


def now_doing() -> Doing | None:
    """What this replica is doing (:func:`doing`); ``None`` outside the engine's merges and steps."""
    return _doing


def stop_heartbeat(gone: bool = False) -> None:
    """Stop this process's heartbeat, if it has one (tests; a replica that exits says it is gone by itself)."""
    global _heartbeat
    with _heartbeat_lock:
        heartbeat, _heartbeat = _heartbeat, None
    if heartbeat is not None:
        heartbeat.stop(gone=gone)


def _say_gone() -> None:
    """At exit: the replica is gone, so a roll call need not wait for its heartbeat to go stale."""
    heartbeat = _heartbeat
    if heartbeat is not None and heartbeat.pid == os.getpid():
        heartbeat.stop(gone=True, wait=0.5)
