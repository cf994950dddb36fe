"""Gradient synchronisation at uneven batches, through DDP's own reducer: the ``sync="gradients"`` modes.

With ``sync="gradients"`` the model is wrapped in ``DistributedDataParallel`` as under DDP (bucketing, overlap
with backward, sparse gradients), and :class:`GradientSum` is its communication hook. Replica ``i`` computes the
mean gradient ``gᵢ`` of its ``bᵢ`` samples, weighted by ``bᵢ/M`` (the strategy scales its loss by that share
before backward, which weights every gradient for free), and the hook sums over replicas::

    g = Σᵢ (bᵢ/M)·gᵢ = (1/M)·Σ_{s in the step's M samples} ∇ℓ(s)

which is the gradient of the whole step batch: DDP's update with the same global batch, whatever the split.
Weighting the loss rather than the buckets matters for sparse gradients: an embedding's gradient holds a row per
occurrence (tens of thousands on XMC), and scaling or coalescing it costs milliseconds of a step's computation.
Every replica applies the same ``g`` with its own, identical, optimizer state, so any optimizer (Adam included)
follows DDP's trajectory.

With ``delay=1`` (ABS-SGD: Zhou et al., "ABS-SGD: A Delayed Synchronous Stochastic Gradient Descent Algorithm
with Adaptive Batch Size for Heterogeneous GPU Clusters", 2023) the sum of step ``t`` is launched during step
``t``'s backward and applied at step ``t+1``: ``θ_{t+1} = θ_t − η·g_{t−1}``, one step stale, so the
communication of a step and the waiting for the slowest replica overlap the next step's computation. The first
step after a flush applies nothing; :meth:`GradientSum.take_pending` hands over what is still in flight
so that every reduced gradient is applied exactly once.

A stale gradient under heavy momentum overshoots: for a quadratic of curvature ``λ``, heavy-ball SGD with
momentum ``μ`` stays stable up to ``η·λ < 2(1 + μ)`` (3.8 at ``μ = 0.9``) but only up to ``η·λ < 1 − μ`` (0.1) when
its gradient is one step old. So by default (``compensate_momentum``) a parameter whose optimizer group has a
``momentum`` ``μ > 0`` (SGD) is given

    g′_t = (1 + μ)·Ĝ_{t−1} − μ·Ĝ_{t−2}

instead of ``Ĝ_{t−1}``: *spike compensation* (Kosson, Chiley, Venigalla, Hestness, Köster, "Pipelined
Backpropagation at Scale: Training Large Models without Batches", MLSys 2021, with delay D = 1: a = μ, b = 1).
The momentum buffer then holds ``μ·v_t + Ĝ_{t−1}`` where ``v_t`` is the plain buffer of the delayed sums:
Nesterov's update, in which each gradient's contribution from its arrival on is what undelayed momentum gives
it, the step it missed added at once. The stable range grows to ``η·λ < 0.25`` at ``μ = 0.9``. Adam's ``betas``
are left alone.

Each bucket's contribution is guarded (:mod:`~lightning_aesgd.engine.finite_guard`): a replica whose bucket is not
finite sends zeros, and the sum is renormalised over the finite replicas' shares, the mean gradient of the step's
finite samples; under a GradScaler the guard is off, as the scaler must see the overflow.

A sparse gradient (an ``EmbeddingBag(sparse=True)``'s) travels in a bucket of its own, summed as
:mod:`~lightning_aesgd.engine.sparse_sums` says: all-reduced where the backend takes sparse tensors (gloo), else by
gathering every replica's rows or densifying, whichever receives fewer bytes (NCCL).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_aesgd.core.wide_floats import CARRIERS, joined_wide, split_wide
from lightning_aesgd.engine.comm import Communicator, TorchCommunicator, completed, copy_from_host
from lightning_aesgd.engine.finite_guard import (
    FLAG_SLOTS,
    Exclusions,
    finite_probe,
    flags_of,
    guarded,
    guarded_in_place,
    renormalised,
)
from lightning_aesgd.engine.sparse_sums import (
    SparseReduction,
    densified_sum,
    densifies,
    exchange_rows,
    gathered_sum,
    native_sparse_sum,
    no_rows,
)

IN_PLACE_MIN_ELEMENTS = 1 << 20
"""The size from which a synchronous host bucket is summed in place, its flags in a small all-reduce beside it.

A guarded contribution is a copy of its bucket with two flags appended (:func:`~.finite_guard.guarded`): on the
host, a pass over the bucket (and the page faults of a fresh tensor) that a second, small all-reduce saves from
about a million elements on, where the copy takes a few tenths of a millisecond. On a 17-million-parameter MLP
those copies made the strategy's steps 11% slower than DDP's on 2 equal CPU replicas (171 ms against 154 ms); in
place, 6%; in place into the gradients themselves (DDP's ``gradient_as_bucket_view``, which the strategy sets),
4% faster than Lightning's DDP and 3% slower than DDP with that option, because of the probe (docs/results/large_model).
Devices keep the copy, cheap at their bandwidth, where a second collective
is not. Every replica sees the same bucket sizes, so all choose alike."""

Launched = tuple[list[nn.Parameter], torch.futures.Future[Tensor], Tensor]
"""A bucket's sum in flight: its parameters, the future of the sum, and the sum's finite flags (finite_guard)."""

Rider = tuple[Tensor, "torch.futures.Future[Tensor]"]
"""A float64 table that rides in the last bucket's sum, and the future of its own sum (:meth:`GradientSum.carry`)."""

Pending = dict[int, Tensor]
"""Reduced gradients awaiting their update, keyed by ``id`` of the parameter: flat chunks in DDP's bucket layout
(a sparse gradient as it is)."""


class GradientSum:
    """The state of DDP's communication hook: launch and (with ``delay``) hold back each bucket's sum.

    Register with ``ddp_model.register_comm_hook(reduce, gradient_sum_hook)``. The gradients arrive weighted (the
    loss was scaled by the replica's share): the hook sums them as they are.

    Args:
        delay: steps between computing a gradient and applying it: 0 (synchronous) or 1 (ABS-SGD). It may go
            from 0 to 1 between steps (a synchronous warm-up): the first delayed step then applies nothing.
        on_last_bucket: called once per backward, when the last bucket is ready, before its sum is launched: this
            replica has finished its step's computation (its arrival).
        waiting: a context manager around time spent blocked on peers (the previous step's sums, with ``delay``).
        comm: the replicas' communicator, which runs every sum; by default, made at the first bucket, the default
            process group's (:class:`~lightning_aesgd.engine.comm.TorchCommunicator`).
        compensate_momentum: with ``delay``, give momentum parameters ``(1 + μ)·Ĝ_{t−1} − μ·Ĝ_{t−2}`` (see the
            module's docstring); the momenta are read from the optimizer by :meth:`read_momentum`.
        sparse_reduction: how a sparse gradient is summed (see
            :data:`~lightning_aesgd.engine.sparse_sums.SparseReduction`): ``"all_reduce"`` needs a backend that
            takes sparse tensors (gloo); ``"gather"`` and ``"densify"`` run on any.
    """

    def __init__(
        self,
        delay: int = 0,
        on_last_bucket: Callable[[], None] | None = None,
        waiting: Callable[[], AbstractContextManager[Any]] | None = None,
        comm: Communicator | None = None,
        compensate_momentum: bool = True,
        sparse_reduction: SparseReduction = "auto",
    ) -> None:
        if delay not in (0, 1):
            raise ValueError(f"gradient_delay must be 0 or 1 (ABS-SGD's one step), got {delay!r}.")
        if sparse_reduction not in get_args(SparseReduction):
            raise ValueError(f"sparse_reduction must be one of {get_args(SparseReduction)}, got {sparse_reduction!r}.")
        self.sparse_reduction = sparse_reduction
        self.delay = delay
        self.on_last_bucket = on_last_bucket
        self.waiting = waiting if waiting is not None else nullcontext
        self.comm = comm
        self.share = 1.0  # this replica's share of the step, set before each backward (see finite_guard)
        # Leave non-finite contributions out (finite_guard). Off under a GradScaler, which must see the overflow
        # in the sum to skip the step and lower its scale, on every replica alike.
        self.guard = True
        self.alone = False  # the job is one replica (set at a fit's start): its dense sums go unguarded, as DDP's
        self.exclusions = Exclusions()
        # Sum large synchronous buckets in place (IN_PLACE_MIN_ELEMENTS): every replica on the host, set at a fit's
        # start. All replicas decide alike, so that every sum has the same collectives on each.
        self.sums_in_place = False
        self._launched: list[Launched] = []
        self._previous: list[Launched] = []
        self._ready: Pending | None = None  # the previous step's sums, per parameter, once awaited
        self._took_previous = False
        self._step_flags: list[Tensor] = []  # the flags of this step's synchronous sums
        self._carrier: torch.device | None = None  # while on_last_bucket runs: the last bucket's, if it can carry
        self._rider: Rider | None = None  # what on_last_bucket handed it (see carry)
        self.compensate_momentum = compensate_momentum
        self._momentum: dict[int, float] = {}  # μ per parameter (id) where compensated
        self.applied: Pending = {}  # the raw sums of the latest update, for parameters with momentum

    def read_momentum(self, optimizer: torch.optim.Optimizer) -> None:
        """Take each parameter's momentum ``μ`` from ``optimizer`` (a scheduler may change it from step to step)."""
        if not (self.delay and self.compensate_momentum):
            return
        self._momentum = {
            id(param): float(group["momentum"])
            for group in optimizer.param_groups
            if group.get("momentum")  # SGD's (and RMSprop's); Adam's betas are not compensated
            for param in group["params"]
        }

    def compensated(self, sums: Pending) -> Pending:
        """What the optimizer is given for delayed ``sums``: ``(1 + μ)·Ĝ_{t−1} − μ·Ĝ_{t−2}`` where ``μ > 0``.

        The sums are remembered as the latest applied (``Ĝ_{t−2}`` of the next call; zero before the first).
        """
        if not self._momentum:
            return sums
        given: Pending = {}
        for key, summed in sums.items():
            momentum = self._momentum.get(key, 0.0)
            previous = self.applied.get(key)
            if not momentum:
                given[key] = summed
            elif previous is None:
                given[key] = summed * (1.0 + momentum)
            else:
                given[key] = summed * (1.0 + momentum) - previous * momentum
        self.applied = {key: summed for key, summed in sums.items() if key in self._momentum}
        return given

    def begin_step(self) -> None:
        """A step starts."""
        self._took_previous = False
        self._step_flags = []
        if self.delay:
            self._previous, self._launched = self._launched, []
        else:
            self._launched = []

    @property
    def applies_update(self) -> bool:
        """Whether this step's backward leaves a reduced gradient to apply (not so right after a flush)."""
        return not self.delay or bool(self._previous) or self._ready is not None

    def carry(self, table: Tensor) -> torch.futures.Future[Tensor] | None:
        """Carry a float64 ``table`` summed over replicas in the last bucket's all-reduce, about to be launched.

        Only from ``on_last_bucket``. A report then costs no collective of its own: on 2 cores shared by 4
        replicas, the separate all-reduce of the reports took the strategy's step from 5% faster than DDP's to as
        slow (``docs/results/machinery``). The table travels after the bucket and its flags, in float32 as two
        parts (:mod:`~lightning_aesgd.core.wide_floats`), exact to 48 bits where each element has one contributor.

        Returns:
            The future of the summed table; ``None`` where the last bucket cannot carry it, and the caller sums it
            itself: a sparse, half-precision or unguarded (grad-scaled) bucket, or one replica alone. Every
            replica decides alike, from what they all share, so the all-reduce has one size on every replica.
        """
        if self._carrier is None:
            return None
        # On CUDA a future of the device's, so that whoever waits for it waits for the stream that joined the parts.
        on_cuda = self._carrier.type == "cuda"
        devices: list[int | str | torch.device] | None = [self._carrier] if on_cuda else None
        carried: torch.futures.Future[Tensor] = torch.futures.Future(devices=devices)
        self._rider = (table, carried)
        return carried

    def _arrival(self, buffer: Tensor, on_last_bucket: Callable[[], None]) -> Rider | None:
        """Call ``on_last_bucket`` with the last bucket's sum offered to :meth:`carry`; what it handed over.

        Nothing handed over outlives this call (an exception in ``on_last_bucket`` included): no other bucket
        ever carries a table.
        """
        if self.guard and not self.alone and not buffer.is_sparse and buffer.dtype in CARRIERS:
            self._carrier = buffer.device
        try:
            on_last_bucket()
            return self._rider
        finally:
            self._carrier, self._rider = None, None

    def reduce(self, bucket: Any) -> torch.futures.Future[Tensor]:
        """DDP's hook body: sum the bucket over replicas; return this step's sum or the previous one's."""
        buffer = bucket.buffer()
        arrive = self.on_last_bucket if bucket.is_last() else None
        rider = self._arrival(buffer, arrive) if arrive is not None else None
        if self.alone:
            # A job of one replica: the sum is the bucket itself (dense or sparse), and its non-finite values can
            # reach no other replica's update. As under DDP: no collective and no finiteness test (a pass over every
            # gradient, which on one device was the largest part of the strategy's cost per step); no copy either,
            # but for a delayed sum, which the next backward must not overwrite. Not so for a segment's group of
            # one present replica (others sitting out): they take its model at the handoff.
            if not self.delay:
                return completed(buffer)
            result, flags = completed(_held_contribution(buffer)), torch.zeros(2, device=buffer.device)
        elif buffer.is_sparse:
            result, flags = self._sum_sparse(buffer)
        else:
            result, flags = self._sum_dense(buffer, rider)
        if not self.delay:
            self._step_flags.append(flags)
            return result
        params = list(bucket.parameters())
        self._launched.append((params, result, flags))
        ready = self._previous_sums()
        return completed(_assemble(ready, params) if ready is not None else _nothing_to_apply(buffer))

    def _sum_dense(self, buffer: Tensor, rider: Rider | None = None) -> tuple[torch.futures.Future[Tensor], Tensor]:
        """Launch the sum of a dense bucket, guarded (:mod:`~lightning_aesgd.engine.finite_guard`), with a ``rider``.

        The guarded contribution is a copy, which a delayed sum needs anyway: DDP refills the bucket's buffer with
        the next step's gradients, possibly while a slower replica has not joined this sum yet. A large
        synchronous bucket on the host is summed in place instead (:data:`IN_PLACE_MIN_ELEMENTS`).
        """
        comm = self._comm(buffer.device)
        if not self.guard:  # DDP's own sum, in place (a delayed one on a copy)
            held = _held_contribution(buffer) if self.delay else buffer
            plain: torch.futures.Future[list[Tensor]] = comm.all_reduce_sum_async(held)
            return plain.then(lambda future: future.value()[0]), torch.zeros(2, device=buffer.device)
        if self.sums_in_place and not self.delay and buffer.numel() >= IN_PLACE_MIN_ELEMENTS:
            return self._sum_in_place(buffer, rider)
        if rider is None:
            contribution = guarded(buffer, self.share)
            summed: torch.futures.Future[list[Tensor]] = comm.all_reduce_sum_async(contribution)
            return summed.then(lambda future: renormalised(future.value()[0])), flags_of(contribution)
        table, carried = rider
        length = buffer.numel() + FLAG_SLOTS

        def unloaded(future: torch.futures.Future[list[Tensor]]) -> Tensor:
            try:
                total = future.value()[0]
            except Exception as error:  # a peer failed: whoever waits for the table learns it too
                carried.set_exception(error)  # type: ignore[arg-type]  # torch's stub types it as the result
                raise
            carried.set_result(joined_wide(total[length:], table.shape))
            return renormalised(total[:length])

        try:
            contribution = guarded(buffer, self.share, split_wide(table, buffer.dtype))
            launched: torch.futures.Future[list[Tensor]] = comm.all_reduce_sum_async(contribution)
        except Exception as error:  # whoever waits for the table learns why it never came
            carried.set_exception(error)  # type: ignore[arg-type]
            raise
        return launched.then(unloaded), flags_of(contribution[:length])

    def _sum_in_place(self, buffer: Tensor, rider: Rider | None) -> tuple[torch.futures.Future[Tensor], Tensor]:
        """Launch the sum of a large host bucket in place, its flags (and any rider) in a small all-reduce beside it.

        The same sums as a copied contribution's (:func:`~.finite_guard.guarded_in_place`), without the copy.
        """
        comm = self._comm(buffer.device)
        table, carried = rider if rider is not None else (None, None)
        try:
            flags = guarded_in_place(buffer, self.share)
            small = flags if table is None else torch.cat([flags, split_wide(table, buffer.dtype)])
            summed: torch.futures.Future[list[Tensor]] = comm.all_reduce_sum_async(buffer)
            beside: torch.futures.Future[list[Tensor]] = comm.all_reduce_sum_async(small)
        except Exception as error:  # whoever waits for the table learns why it never came
            if carried is not None:
                carried.set_exception(error)  # type: ignore[arg-type]
            raise

        def unloaded(_: Any) -> Tensor:
            try:
                total, small_sum = summed.value()[0], beside.value()[0]
            except Exception as error:  # a peer failed: whoever waits for the table learns it too
                if carried is not None:
                    carried.set_exception(error)  # type: ignore[arg-type]
                raise
            if carried is not None and table is not None:
                carried.set_result(joined_wide(small_sum[FLAG_SLOTS:], table.shape))
            return renormalised(total, small_sum[:FLAG_SLOTS])

        return torch.futures.collect_all([summed, beside]).then(unloaded), small[:FLAG_SLOTS]

    def _comm(self, device: torch.device) -> Communicator:
        if self.comm is None:
            self.comm = TorchCommunicator(device)
        return self.comm

    def _all_reduces_sparse(self, device: torch.device) -> bool:
        if self.sparse_reduction == "auto":
            return self._comm(device).sums_sparse(device)
        return self.sparse_reduction == "all_reduce"

    def _sum_sparse(self, buffer: Tensor) -> tuple[torch.futures.Future[Tensor], Tensor]:
        """Launch the sum of a sparse gradient: all-reduced as it is, or by gathering its rows, or densified.

        A non-finite gradient is sent as no rows and the sum renormalised as dense buckets are
        (:mod:`~lightning_aesgd.engine.finite_guard`). Gloo's sparse all-reduce carries the finite flags in a small
        all-reduce beside it, and nothing blocks. Without it, a small all-gather first tells every replica each
        one's stored rows (which the gather needs, and the choice, which all must make alike) with the flags: the
        hook blocks on this exchange until every replica has reached this bucket.
        """
        comm = self._comm(buffer.device)
        if self._all_reduces_sparse(buffer.device):
            # Gloo stages the tensors through the host anyway: the finiteness is read there before the sum. The
            # values' sum, as for dense buckets (one pass): an embedding's gradient holds a row per occurrence,
            # and isfinite().all() over them cost 35x the sum.
            finite = not self.guard or math.isfinite(float(finite_probe(buffer._values())))
            local = buffer if finite else no_rows(buffer)
            # A delayed sum outlives this backward and keeps the contribution's values (see _held_contribution).
            contribution = _held_contribution(local) if self.delay and finite else local
            return native_sparse_sum(contribution, self.share, comm, finite)
        # An embedding's gradient repeats a row per occurrence: gathered or densified, each row travels once.
        local = buffer.coalesce()
        # The finiteness stays on the device and rides in the exchange, which the host reads anyway: one wait.
        on_device = torch.isfinite(finite_probe(local._values())) if self.guard else True
        with self.waiting():
            exchange = exchange_rows(local, self.share, comm, on_device)
        if not exchange.finite[comm.rank]:
            local = no_rows(local)
        flags = torch.empty(2, dtype=torch.float64, device=buffer.device)
        # pinned: no wait for the backward queued before
        copy_from_host(flags, [exchange.finite_share, float(exchange.left_out)])
        densify = densifies(local, exchange.counts, self.sparse_reduction)
        result = densified_sum(local, comm) if densify else gathered_sum(local, exchange.counts, comm)
        if exchange.left_out:
            scale = 1.0 / exchange.finite_share if exchange.finite_share > 0 else 0.0
            result = result.then(lambda future: future.value() * scale)
        return result, flags

    def _previous_sums(self) -> Pending | None:
        if not self._took_previous:
            self._took_previous = True
            if self._previous:
                with self.waiting():
                    self._ready = self._awaited(self._previous)
                self._previous = []
            if self._ready is not None:
                self._ready = self.compensated(self._ready)
        return self._ready

    def _awaited(self, launched: list[Launched]) -> Pending:
        """The sums of one step's buckets, awaited, per parameter; their exclusions counted."""
        pending = _per_parameter([(params, future) for params, future, _ in launched])
        self._count_exclusions([flags for _, _, flags in launched])
        return pending

    def _count_exclusions(self, flags: list[Tensor]) -> None:
        if flags and self.comm is not None:
            self.exclusions.add_step(flags, self.comm.world_size)

    def end_step(self) -> None:
        """The step's update is done: the sums it applied are spent (synchronous sums: counted now, complete)."""
        if not self.delay:
            self._count_exclusions(self._step_flags)
            self._step_flags = []
        self._ready = None

    def take_pending(self) -> Pending | None:
        """Hand over the sums no step has applied yet, awaiting those in flight: a flush (the caller applies them)."""
        pending = self.peek_pending()
        self._ready = None
        return pending

    def peek_pending(self) -> Pending | None:
        """The sums the next step would apply, awaited and kept there (a checkpoint stores them; the run goes on)."""
        if self.delay and self._launched:
            with self.waiting():
                self.hold(self._awaited(self._launched))
        return self._ready

    def hold(self, pending: Pending | None) -> None:
        """Make ``pending`` the sums the next step applies (a checkpoint's, when resuming)."""
        self._launched, self._previous, self._ready = [], [], pending


def _held_contribution(buffer: Tensor) -> Tensor:
    """The contribution of a bucket to a delayed sum: untouched by what happens to the bucket after this backward.

    A dense bucket's buffer is DDP's, refilled by the next backward: it is cloned. A sparse bucket's is the
    parameter's gradient tensor, to which DDP gives the hook's result with ``copy_``; a sparse ``copy_`` rebinds the
    tensor's indices and values instead of writing into them, so a new tensor over the same values keeps them at
    no cost (an embedding's gradient has one row per lookup: 16 MB for 800 XMC samples, whose clone cost 10-12 ms
    of CPU per step). Its indices are cloned (one integer per row): an embedding's backward may hand out a view of
    the input batch's indices, which the user's code owns. The bucket's tensor itself is never handed back while
    the sum is in flight (:func:`_nothing_to_apply`), so nothing writes into the held values in place.
    ``tests/engine/test_gradients.py`` pins the ``copy_`` semantics this relies on.
    """
    if buffer.is_sparse:
        return torch.sparse_coo_tensor(
            buffer._indices().clone(),
            buffer._values(),
            buffer.size(),
            is_coalesced=buffer.is_coalesced(),
            check_invariants=False,
        )
    return buffer.clone()


def _nothing_to_apply(buffer: Tensor) -> Tensor:
    """What a step with no sum to apply hands back to DDP; its update is skipped.

    The bucket's own buffer where dense (DDP's, already copied), zeros where sparse (the gradient tensor's values
    are shared with the sum in flight).
    """
    return no_rows(buffer) if buffer.is_sparse else buffer


def gradient_sum_hook(state: GradientSum, bucket: Any) -> torch.futures.Future[Tensor]:
    """The function DDP calls for every ready bucket (see :class:`GradientSum`)."""
    return state.reduce(bucket)


# DDP checks a hook's annotations as objects; this module's are strings (postponed evaluation).
gradient_sum_hook.__annotations__ = {
    "state": GradientSum,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}


def apply_gradients(params: Sequence[nn.Parameter], pending: Pending) -> None:
    """Write reduced gradients into ``.grad`` of the parameters they belong to (others get none)."""
    for param in params:
        grad = pending.get(id(param))
        param.grad = None if grad is None else _in_layout_of(param, grad.to(param.device))


def _in_layout_of(param: Tensor, flat: Tensor) -> Tensor:
    """A bucket's chunk of ``param``'s gradient, read as DDP lays it out.

    In the parameter's own strides where the parameter is dense (channels_last included), else contiguously.
    """
    if flat.is_sparse:
        return flat
    if param.is_complex():  # the bucket holds its real pairs (torch.view_as_real)
        flat = torch.complex(flat[0::2], flat[1::2])
    if _dense(param):
        return torch.as_strided(flat, param.size(), param.stride(), flat.storage_offset())
    return flat.view(param.size())


def _dense(tensor: Tensor) -> bool:
    """Whether the elements fill exactly ``numel`` consecutive slots in some order of the dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.size(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def pending_to_list(params: Sequence[nn.Parameter], pending: Pending | None) -> list[Tensor | None] | None:
    """``pending`` in parameter order, on the CPU: what a checkpoint stores."""
    if pending is None:
        return None
    return [None if id(p) not in pending else pending[id(p)].detach().cpu() for p in params]


def pending_from_list(params: Sequence[nn.Parameter], saved: Sequence[Tensor | None]) -> Pending:
    """The inverse of :func:`pending_to_list`, on the parameters' devices."""
    if len(saved) != len(params):
        raise ValueError(
            f"The checkpoint holds delayed gradients for {len(saved)} parameters, the model has {len(params)}."
        )
    return {id(p): g.to(p.device) for p, g in zip(params, saved, strict=True) if g is not None}


@contextmanager
def update_skipped(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Let Lightning's optimizer step run its closure (forward, backward) but leave the parameters alone.

    Lightning still counts the step, so ``global_step``, schedulers and loops advance as every step does.
    """

    def closure_only(closure: Callable[[], Any] | None = None, **_: Any) -> Any:
        return closure() if closure is not None else None

    # A learning-rate scheduler may have wrapped the step on the instance: that wrapper comes back afterwards.
    own = vars(optimizer).get("step")
    optimizer.step = closure_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is not None:
            optimizer.step = own  # type: ignore[method-assign]
        else:
            del optimizer.step  # the class's own step again


def _per_parameter(launched: list[tuple[list[nn.Parameter], torch.futures.Future[Tensor]]]) -> Pending:
    torch.futures.wait_all([future for _, future in launched])
    pending: Pending = {}
    for params, future in launched:
        summed: Tensor = future.value()
        if summed.is_sparse:  # a sparse gradient travels in a bucket of its own
            (param,) = params
            pending[id(param)] = summed
            continue
        # Each parameter's chunk, kept flat in the bucket's memory order (see _in_layout_of).
        # A complex gradient lies in the bucket as its real pairs (torch.view_as_real), twice its elements.
        sizes = [p.numel() * (2 if p.is_complex() else 1) for p in params]
        for param, flat in zip(params, torch.split(summed, sizes), strict=True):
            pending[id(param)] = flat
    return pending


def _assemble(pending: Pending, params: list[nn.Parameter]) -> Tensor:
    if len(params) == 1 and pending[id(params[0])].is_sparse:
        return pending[id(params[0])]
    return torch.cat([pending[id(p)].reshape(-1) for p in params])
