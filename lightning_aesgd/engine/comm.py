"""Communication between replicas: a thin layer over ``torch.distributed`` that tests can fake.

The strategy talks to other replicas only through a :class:`Communicator`. :class:`TorchCommunicator` is the
real one (any backend: gloo, nccl); :class:`LocalCommunicator` serves a single replica without a process group.
Tests substitute their own implementation of the protocol to count calls or simulate peers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeAlias, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_aesgd.engine.collective_watch import CollectiveWatch, watch_timeout
from lightning_aesgd.engine.flat import to_host

# `name as name`: the stall machinery's names stay importable from here, where the engine imports them.
from lightning_aesgd.engine.stalls import ReplicaStalledError as ReplicaStalledError
from lightning_aesgd.engine.stalls import default_store, entering, keep_alive, new_roll_calls, now_doing, roll_call_key
from lightning_aesgd.engine.stalls import is_peer_failure as is_peer_failure
from lightning_aesgd.engine.stalls import stalled_error as stalled_error

T = TypeVar("T")

Number: TypeAlias = float | Tensor
"""A host number, or a one-element tensor on the device that the host has not read."""


class Communicator(Protocol):
    """The collectives the strategy needs. Every replica must call them in the same order."""

    @property
    def world_size(self) -> int:
        """Number of replicas taking part."""
        ...

    @property
    def rank(self) -> int:
        """Index of this replica, in ``[0, world_size)``."""
        ...

    def all_reduce_sum_(self, tensor: Tensor) -> None:
        """Replace ``tensor`` in place by its elementwise sum over all replicas."""
        ...

    def all_reduce_sum_async(self, tensor: Tensor) -> torch.futures.Future[Any]:
        """Launch the in-place SUM of ``tensor`` over all replicas; the future's value is ``[tensor]`` once done."""
        ...

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every replica's ``tensor`` (all of one shape), in rank order.

        On a device the current stream waits for them and the host goes on, as after an async launch's ``wait``.
        """
        ...

    def sums_sparse(self, device: torch.device) -> bool:
        """Whether :meth:`all_reduce_sum_async` takes sparse tensors on ``device`` (gloo does, NCCL does not)."""
        ...

    def broadcast_(self, tensor: Tensor, src: int = 0) -> None:
        """Replace ``tensor`` in place by replica ``src``'s tensor."""
        ...

    def host_all_reduce_sum_(self, tensor: Tensor) -> None:
        """Replace a small CPU ``tensor`` of host data (counts, checks) in place by its sum over all replicas.

        It never touches the device, so the host need not wait for the device's queued work.
        """
        ...

    def host_all_reduce_max_(self, tensor: Tensor) -> None:
        """Replace a small CPU ``tensor`` of host data in place by its elementwise maximum over all replicas."""
        ...

    def all_gather_object(self, obj: T) -> list[T]:
        """Gather one picklable object from every replica, in rank order (never on the training path)."""
        ...

    def gather_object(self, obj: T, dst: int = 0) -> list[T] | None:
        """Gather one picklable object from every replica onto replica ``dst``, in rank order; ``None`` elsewhere."""
        ...

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Replica ``src``'s picklable ``obj`` on every replica (the others pass anything, e.g. ``None``)."""
        ...


class LocalCommunicator:
    """The communicator of a lone replica: every collective is the identity."""

    @property
    def world_size(self) -> int:  # noqa: D102
        return 1

    @property
    def rank(self) -> int:  # noqa: D102
        return 0

    def all_reduce_sum_(self, tensor: Tensor) -> None:  # noqa: D102
        return None

    def all_reduce_sum_async(self, tensor: Tensor) -> torch.futures.Future[Any]:  # noqa: D102
        return completed([tensor])

    def all_gather(self, tensor: Tensor) -> list[Tensor]:  # noqa: D102
        return [tensor]

    def sums_sparse(self, device: torch.device) -> bool:  # noqa: D102
        return True

    def broadcast_(self, tensor: Tensor, src: int = 0) -> None:  # noqa: D102
        return None

    def host_all_reduce_sum_(self, tensor: Tensor) -> None:  # noqa: D102
        return None

    def host_all_reduce_max_(self, tensor: Tensor) -> None:  # noqa: D102
        return None

    def all_gather_object(self, obj: T) -> list[T]:  # noqa: D102
        return [obj]

    def gather_object(self, obj: T, dst: int = 0) -> list[T] | None:  # noqa: D102
        return [obj]

    def broadcast_object(self, obj: T, src: int = 0) -> T:  # noqa: D102
        return obj


class TorchCommunicator:
    """Collectives over an initialised ``torch.distributed`` process group.

    Model tensors travel on the group's backend (NCCL on CUDA). Small host-side data (counts, checkpoint objects)
    travels on a gloo *host group* over the same ranks: NCCL has no CPU tensors, and its object collectives would
    copy every object through the device. Where the group is gloo already, it is its own host group; otherwise
    the host group is created at the first host-side collective, which every replica reaches in the same order.

    Where the host does not wait in the group's collectives (NCCL), a :class:`~lightning_aesgd.engine.
    collective_watch.CollectiveWatch` waits on them in the background and names a stall as gloo's timeout would;
    the next collective of this communicator or of its subgroups raises its report. The host group then times out
    with the watch, not the device group.

    Args:
        device: where small tensors for collectives live; must be a CUDA device for NCCL.
        group: the process group; the default (world) group when ``None``.
        host_group: a gloo group over the same ranks as ``group``; needed only for a ``group`` of another
            backend (a new group must be created by every process of the world, which a subgroup's members
            alone cannot do).
        watch: whether to watch device collectives; by default where the host does not wait in the group's
            collectives (NCCL), not where it does (gloo).
        watch_after: seconds a device collective may wait before the watch reports it (the strategy's
            ``timeout``); by default :func:`~lightning_aesgd.engine.collective_watch.watch_timeout` of the group's.

    Raises:
        ValueError: for a ``group`` that is not gloo without a ``host_group``.
    """

    def __init__(
        self,
        device: torch.device,
        group: Any = None,
        host_group: Any = None,
        watch: bool | None = None,
        watch_after: float | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs an initialised torch.distributed process group.")
        self.device = device
        self.group = group
        self._calls = 0
        # A group's size and this process's rank in it never change; torch's lookups cost microseconds per step.
        self._world_size, self._rank = dist.get_world_size(group), dist.get_rank(group)
        # A subgroup's roll calls are its own: its collectives are numbered apart from the world's.
        self._roll_prefix = "" if group is None else "group_" + "_".join(map(str, self._members() or [])) + "/"
        if group is None:
            new_roll_calls()
        self._host_group: Any = host_group if host_group is not None else group
        self._has_host_group = host_group is not None or _is_gloo(group)
        if group is not None and not self._has_host_group:
            raise ValueError(
                f"The process group's backend is {dist.get_backend(group)!r}, which cannot move host data. HINT: "
                "pass host_group=dist.new_group(ranks, backend='gloo') over the same ranks (every process of the "
                "world must create it), or leave group unset for the world group."
            )
        # Roll calls after a failed collective tell a late replica from a gone one by its heartbeat (once a process).
        keep_alive(default_store(), dist.get_rank())
        timeout = _group_timeout(group, device)
        if watch is None:
            watch = _backend_on(device, group) not in HOST_WAITING_BACKENDS
        if watch and watch_after is None and timeout is not None:
            watch_after = watch_timeout(timeout.total_seconds())
        self._watch = None
        if watch and watch_after is not None:
            self._watch = CollectiveWatch(watch_after, self._rank, self._world_size, self._members())
        self._host_timeout = timeout if self._watch is None else timedelta(seconds=self._watch.timeout)
        # The watches of this communicator and of its subgroups: a stall one reports is raised by any of them.
        self._watches = [] if self._watch is None else [self._watch]

    @property
    def world_size(self) -> int:  # noqa: D102
        return self._world_size

    @property
    def rank(self) -> int:  # noqa: D102
        return self._rank

    def all_reduce_sum_(self, tensor: Tensor) -> None:  # noqa: D102
        self._device_collective(
            "all-reduce", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        )

    def all_reduce_sum_async(self, tensor: Tensor) -> torch.futures.Future[Any]:  # noqa: D102
        self._raise_watched_stall()
        # Launching cannot fail for a late peer (waiting on the future can; the caller names where it waited).
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        if self._watch is not None:  # a gradient bucket's sum, launched as it fills: named by the step computed
            task = now_doing()
            key = task.step_key if task is not None and task.step_key else roll_call_key(f"{self._roll_prefix}sum")
            self._watch.watch(work, "all-reduce", key, time.monotonic(), None if task is None else task.where)
        future: torch.futures.Future[Any] = work.get_future()
        return future

    def all_gather(self, tensor: Tensor) -> list[Tensor]:  # noqa: D102
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._device_collective(
            "all-gather", lambda: dist.all_gather(gathered, tensor, group=self.group, async_op=True)
        )
        return gathered

    def sums_sparse(self, device: torch.device) -> bool:  # noqa: D102
        return _backend_on(device, self.group) in SPARSE_BACKENDS

    def broadcast_(self, tensor: Tensor, src: int = 0) -> None:  # noqa: D102
        self._device_collective("broadcast", lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True))

    def host_all_reduce_sum_(self, tensor: Tensor) -> None:  # noqa: D102
        group = self._host()
        self._collective("host all-reduce", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group))

    def host_all_reduce_max_(self, tensor: Tensor) -> None:  # noqa: D102
        group = self._host()
        self._collective("host all-reduce", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group))

    def all_gather_object(self, obj: T) -> list[T]:  # noqa: D102
        group = self._host()
        gathered: list[Any] = [None] * self.world_size
        self._collective("all-gather", lambda: dist.all_gather_object(gathered, obj, group=group))
        return gathered

    def gather_object(self, obj: T, dst: int = 0) -> list[T] | None:  # noqa: D102
        group = self._host()
        gathered: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        target = dst if group is None else dist.get_global_rank(group, dst)  # torch takes the world's rank
        self._collective("gather", lambda: dist.gather_object(obj, gathered, dst=target, group=group))
        return gathered

    def broadcast_object(self, obj: T, src: int = 0) -> T:  # noqa: D102
        group = self._host()
        carried: list[Any] = [obj]
        source = src if group is None else dist.get_global_rank(group, src)  # torch takes the world's rank
        self._collective("broadcast", lambda: dist.broadcast_object_list(carried, src=source, group=group))
        received: T = carried[0]
        return received

    def subgroup(self, members: Sequence[int]) -> TorchCommunicator | None:
        """A communicator over the world ranks ``members`` (sorted); ``None`` on a rank outside them.

        A collective of the whole world: every process creates every group, members or not (torch's rule), in
        the same order. Where the world is not gloo, a gloo group over the same ranks carries the host data.
        """
        ranks = sorted(members)
        timeout = _group_timeout(self.group, self.device)
        group = dist.new_group(ranks, timeout=timeout)
        host = None if _is_gloo(None) else gloo_group_beside_bound_world(ranks, self._host_timeout)
        if dist.get_rank() not in ranks:
            return None
        watch_after = None if self._watch is None else self._watch.timeout
        sub = TorchCommunicator(self.device, group, host, watch=self._watch is not None, watch_after=watch_after)
        if sub._watch is not None:  # its stall is raised at the world's next collective too, and the other way
            self._watches.append(sub._watch)
            sub._watches = self._watches
        return sub

    def close(self) -> None:
        """Destroy a subgroup's process groups (the world's stays): its fit is over."""
        if self.group is None:
            return
        if self._watch is not None:
            self._watch.stop()
            if self._watch.stalled is None:
                self._watches.remove(self._watch)
        for group in {id(self.group): self.group, id(self._host_group): self._host_group}.values():
            if group is not None:
                dist.destroy_process_group(group)
        self.group = self._host_group = None

    def _host(self) -> Any:
        """The host group, created over the world's ranks at its first use where the group is not gloo."""
        if not self._has_host_group:
            self._host_group = dist.new_group(backend="gloo", timeout=self._host_timeout)
            self._has_host_group = True
        return self._host_group

    def _device_collective(self, name: str, launch: Callable[[], Any]) -> None:
        """Launch a collective of device tensors and wait on its work: the host on gloo, the current stream on NCCL.

        Where the host does not wait, the watch waits on the work in the background (:meth:`_collective`).
        """
        self._collective(name, launch, on_device=True)

    def _collective(self, name: str, run: Callable[[], Any], on_device: bool = False) -> None:
        """Run one collective; a timeout or a lost peer becomes a :class:`ReplicaStalledError` naming the absent.

        Collectives are numbered in call order, the same on every replica, so that the replicas that fail in the
        same one can find each other in the store's roll call (:mod:`~lightning_aesgd.engine.stalls`). Until
        something fails this costs a note in the heartbeat, which shows a late replica arriving to the roll call.
        With ``on_device``, ``run`` launches the collective and returns its work, which this waits on (and the
        watch, if any, after it).
        """
        self._raise_watched_stall()
        index, self._calls = self._calls, self._calls + 1
        key = roll_call_key(f"{self._roll_prefix}{index}")
        entering(key)
        started = time.monotonic()
        try:
            work = run()
            if on_device:
                if self._watch is not None:  # first: on gloo (tests) the host waits below
                    task = now_doing()
                    self._watch.watch(work, f"{name} #{index}", key, started, None if task is None else task.where)
                work.wait()
        except RuntimeError as error:  # torch's DistBackendError and gloo's plain RuntimeError alike
            self._raise_watched_stall(error)
            if not is_peer_failure(error):
                raise
            stalled = stalled_error(
                error, f"{name} #{index}", key, self.rank, self.world_size, started, members=self._members()
            )
            task = now_doing()
            raise (stalled if task is None else stalled.during(task.where)) from error

    def _raise_watched_stall(self, error: BaseException | None = None) -> None:
        """Raise a watch's report of a stalled device collective (this group's or a subgroup's), once here.

        ``error``: what the training thread met meanwhile (the group aborted by its watchdog), kept as the cause.
        """
        for watch in self._watches:
            if watch.stalled is not None:
                raise watch.stalled from error

    def _members(self) -> list[int] | None:
        """The world rank of each of the group's ranks (whose heartbeats a roll call reads); ``None`` for the world."""
        return None if self.group is None else list(dist.get_process_group_ranks(self.group))


class NoMergeWeightError(ValueError):
    """Every replica's merge weight was zero; ``rows`` holds every replica's report row, in rank order."""

    def __init__(self, message: str, rows: list[list[float]]) -> None:
        super().__init__(message)
        self.rows = rows


SPARSE_BACKENDS = frozenset({"gloo"})
"""The backends whose all-reduce takes sparse tensors."""
HOST_WAITING_BACKENDS = frozenset({"gloo", "mpi"})
"""The backends whose collectives the host waits in, where a timeout raises in the training thread."""


def _backend_on(device: torch.device, group: Any) -> str:
    """The backend that runs ``group``'s collectives on ``device``.

    A group may name one per device type (``"cpu:gloo,cuda:nccl"``).
    """
    backend = str(dist.get_backend(group))
    for entry in backend.split(","):
        device_type, _, name = entry.rpartition(":")
        if device_type in ("", device.type):
            return name
    return backend


def gloo_group_beside_bound_world(ranks: list[int], timeout: timedelta | None) -> Any:
    """A gloo group over ``ranks``, created while the world's device binding is lifted; every rank calls it.

    Where the world is bound to a device (Lightning binds an NCCL group to its GPU), torch forms each new group by
    splitting the world's NCCL communicator, and a rank the new group leaves out joins that split as it returns
    (``perform_nocolor_split``, a collective of the whole world). Forming a gloo group, the members split nothing,
    so the left-out rank would wait in the split until its timeout, as NVIDIA-NeMo/RL found (PR 3189). Unbound, no
    rank splits; the world's own communicator is untouched.
    """
    world = dist.distributed_c10d._get_default_group()
    bound, world.bound_device_id = world.bound_device_id, None
    try:
        return dist.new_group(ranks, backend="gloo", timeout=timeout)
    finally:
        world.bound_device_id = bound


def _is_gloo(group: Any) -> bool:
    return dist.get_backend(group) == "gloo"


def _group_timeout(group: Any, device: torch.device) -> timedelta | None:
    """The timeout ``group`` was created with; ``None`` (torch's default) where torch does not tell.

    The host group waits as long, so that a stalled peer is found as soon on either group. Torch keeps the timeout
    in private options only, hence the guard.
    """
    try:
        process_group = group if group is not None else dist.distributed_c10d._get_default_group()
        timeout = process_group._get_backend(device).options._timeout
    except Exception:
        return None
    return timeout if isinstance(timeout, timedelta) else None


def default_communicator(device: torch.device, watch_after: float | None = None) -> Communicator:
    """The process group's collectives where torch.distributed runs, a single replica's otherwise.

    ``watch_after``: seconds a device collective may wait where the host does not wait in them (NCCL), before its
    stall is named (:class:`TorchCommunicator`).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return TorchCommunicator(device, watch_after=watch_after)
    return LocalCommunicator()


class WeightedAllReduce:
    """Weighted means of flat tensors over all replicas, with one SUM all-reduce per dtype.

    Each replica contributes one bucket ``[w·θ₁, w·θ₂, …, w]`` (all flats of one dtype back to back, then its
    weight); after the SUM every replica divides by ``Σw``:

        meanₖ = Σᵢ wᵢ θₖ,ᵢ / Σᵢ wᵢ

    A replica may also send a short row of statistics (its arrival report) in the same collective: the widest
    floating bucket gets ``n`` row slots after the weight, replica ``r`` writes its row into slot ``r`` and zeros
    elsewhere, so the SUM gathers every replica's row without a collective of its own.

    Every bucket lives on its flats' device, and the host waits for the device once a call: the division by
    ``Σw`` runs on the device, and ``Σw`` and the rows come back in one read (:func:`~.flat.to_host`). The weight
    and any number of the row may be a one-element tensor on that device, computed there and never read by the
    host before the collective (a merge's weight that depends on the device's own flags).

    Buckets are kept between calls: a merge runs on the training path, and a fresh model-sized buffer costs as
    much as a copy of the model.

    Args:
        comm: the communicator.
        device: where the rows travel when there are no flats (the model's device); the CPU by default.
    """

    def __init__(self, comm: Communicator, device: torch.device | None = None) -> None:
        self.comm = comm
        self.device = device if device is not None else torch.device("cpu")
        self._buckets: dict[tuple[torch.dtype, torch.device, int], Tensor] = {}

    def __call__(
        self, flats: Sequence[Tensor], weight: Number, row: Sequence[Number] = ()
    ) -> tuple[list[Tensor], list[list[float]]]:
        """Return the means, one per input in the same order, and every replica's ``row`` (rank order).

        The means are views of an internal bucket: valid until the next call, and free to be overwritten.

        A replica with a host weight of 0 contributes zeros, whatever its tensors hold (a non-finite replica left
        out). A weight on the device multiplies the tensors as they are: a replica that is not finite then makes
        every mean NaN, so its row must say so and the caller merge again with host weights (as
        :class:`~lightning_aesgd.engine.model_merge.ModelMerge` does).

        Raises:
            NoMergeWeightError: if the total weight is not positive (with every replica's row).
        """
        means = list(flats)  # placeholders, each replaced by its mean below
        dtypes = list(dict.fromkeys(flat.dtype for flat in flats))
        carrier = _row_carrier(dtypes) if row else None
        tail = _tail(weight, row, self.comm.rank, self.comm.world_size)
        summed_tail: Tensor | None = None  # Σw, then every replica's row: what the host reads back
        for dtype in dtypes:
            positions = [k for k, flat in enumerate(flats) if flat.dtype == dtype]
            bucket, body = self._reduce([flats[k] for k in positions], weight, tail if dtype == carrier else None)
            sizes = [flats[k].numel() for k in positions]
            for k, mean in zip(positions, torch.split(bucket[:body], sizes), strict=True):
                means[k] = mean
            if summed_tail is None or dtype == carrier:
                summed_tail = bucket[body:]
        if row and carrier is None:  # no float32/float64 bucket to carry the row: send it on its own
            summed_tail = torch.empty(len(tail), dtype=torch.float64, device=flats[0].device if flats else self.device)
            _fill_tail(summed_tail, tail)
            self.comm.all_reduce_sum_(summed_tail)
        if summed_tail is None:
            return means, []
        if not row and self.comm.world_size == 1 and not isinstance(weight, Tensor):
            # A group of one sums its own host weight: nothing to read back (a lone GPU replica's end-of-fit merge
            # would wait for its device here).
            total_weight, rows = float(weight), list[list[float]]()
        else:
            total_weight, rows = _split_tail(to_host(summed_tail), len(row))
        if flats and not total_weight > 0:
            raise NoMergeWeightError(
                f"The merge weights of all replicas sum to {total_weight}; at least one must be positive.", rows
            )
        return means, rows

    def _reduce(self, flats: Sequence[Tensor], weight: Number, tail: Sequence[Number] | None) -> tuple[Tensor, int]:
        """All-reduce one dtype's flats and divide them by ``Σw``, on the device; returns the bucket and its body.

        The bucket holds ``[w·θ…, w]``, then the rest of ``tail`` (the rows) where it carries them.
        """
        sizes = [flat.numel() for flat in flats]
        body = sum(sizes)
        bucket = self._bucket(flats[0].dtype, flats[0].device, body + (len(tail) if tail is not None else 1))
        for flat, chunk in zip(flats, torch.split(bucket[:body], sizes), strict=True):
            if isinstance(weight, Tensor) or weight != 0:
                torch.mul(flat.reshape(-1), weight, out=chunk)
            else:
                chunk.zero_()  # 0·NaN would be NaN
        if tail is not None:
            _fill_tail(bucket[body:], tail)
        elif isinstance(weight, Tensor):
            bucket[body].copy_(weight.reshape(()))
        else:
            bucket[body] = weight
        self.comm.all_reduce_sum_(bucket)
        # Divided by the summed weight where it lies: reading it first would make the host wait for the device.
        # A sum of zero gives NaN here, but then the caller raises and the means are never seen.
        bucket[:body].div_(bucket[body])
        return bucket, body

    def _bucket(self, dtype: torch.dtype, device: torch.device, size: int) -> Tensor:
        key = (dtype, device, size)
        if key not in self._buckets:
            self._buckets[key] = torch.empty(size, dtype=dtype, device=device)
        return self._buckets[key]


def _row_carrier(dtypes: Sequence[torch.dtype]) -> torch.dtype | None:
    """The bucket dtype that carries the report rows: float64 or float32, never a half-precision type.

    Half precision would turn counts above 65504 into ``inf`` (fp16) or round them (bf16); a model without a
    float32 or float64 bucket sends its rows in a small all-reduce of their own.
    """
    for dtype in (torch.float64, torch.float32):
        if dtype in dtypes:
            return dtype
    return None


def _tail(weight: Number, row: Sequence[Number], rank: int, world_size: int) -> list[Number]:
    """What follows a bucket's body: the weight, then this replica's row in its slot and zeros elsewhere."""
    width = len(row)
    tail: list[Number] = [weight] + [0.0] * (width * world_size)
    tail[1 + rank * width : 1 + (rank + 1) * width] = list(row)
    return tail


def _fill_tail(target: Tensor, tail: Sequence[Number]) -> None:
    """Write ``tail`` into ``target``: host numbers in one copy, then each device number where it belongs.

    A device number is copied on the device, so the host never waits for it (a ``float()`` of it would).
    """
    copy_from_host(target, [0.0 if isinstance(value, Tensor) else float(value) for value in tail])
    for position, value in enumerate(tail):
        if isinstance(value, Tensor):
            target[position].copy_(value.reshape(()))


def _split_tail(values: list[float], width: int) -> tuple[float, list[list[float]]]:
    """The summed weight and every replica's row from a summed tail as the host reads it."""
    rows = values[1:]
    return values[0], [rows[start : start + width] for start in range(0, len(rows), width)] if width else []


def copy_from_host(target: Tensor, values: Sequence[float]) -> None:
    """Fill ``target`` with host ``values`` through a staging tensor moved to ``target``'s device.

    On CUDA the staging tensor is pinned and the copy does not block: a plain copy from pageable memory would make
    the host wait for the device's queued work (the local step) before the merge's collective is even issued.
    """
    staging = torch.tensor(list(values), dtype=target.dtype)
    if target.device.type == "cuda":
        target.copy_(staging.pin_memory(), non_blocking=True)
    else:
        target.copy_(staging.to(target.device))


def completed(value: Any) -> torch.futures.Future[Any]:
    """A future already holding ``value``."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(value)
    return future
