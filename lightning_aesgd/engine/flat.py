"""Flat views of a module's tensors, so that a merge moves one contiguous buffer instead of many small ones."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn


def check_stackable(tensors: Sequence[Tensor]) -> None:
    """Raise where several learners per device cannot stack ``tensors`` (a model's trainable parameters).

    Stacked learners live in one bound flat buffer (:class:`FlatView`), which needs every tensor in the flat's
    dtype (float32, or float64) on one device.

    Raises:
        ValueError: naming what stands in the way and the fix.
    """
    if not tensors or _bindable(tensors):
        return
    if any(t.is_complex() for t in tensors):
        raise ValueError(
            "Several learners per device cannot stack complex parameters. HINT: use learners_per_device=1 with this "
            "model."
        )
    found = sorted({f"{t.dtype} on {t.device}" for t in tensors})
    raise ValueError(
        "Several learners per device need every parameter in one dtype (all float32, or all float64) on one "
        f"device; this model has {', '.join(found)}. HINT: cast the model to one dtype (model.float()), or use "
        "learners_per_device=1 with this model or precision (a '*-mixed' precision keeps float32 weights)."
    )


def _bindable(tensors: Sequence[Tensor]) -> bool:
    """Whether ``tensors`` can become views of one flat buffer: one device, and the flat's dtype."""
    parts = _real_parts(tensors)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in parts) else torch.float32
    return bool(tensors) and len({t.device for t in tensors}) == 1 and all(t.dtype == dtype for t in tensors)


class FlatView:
    """Reads a fixed list of tensors into one flat tensor and writes a flat tensor back into them.

    Reduced precisions (float16, bfloat16) are widened to float32 in the flat copy, so that averages do not lose
    precision; float64 models keep float64.

    With ``bind=True`` and tensors of one device and of the flat dtype, the tensors become views of one
    persistent flat buffer (their ``.data`` is rebound, as torch's ``average_parameters`` does): :attr:`live`
    then *is* the model, and merges update it in place without copying it out and back.

    Flat copies live on :attr:`device`, an empty view's too: a merge puts every flat into one bucket, where an
    empty flat on another device than the model's fails as surely as a full one.

    With ``learners=k > 1`` the view holds ``k`` copies of the tensors (several learners of one model in one
    process, :mod:`lightning_aesgd.engine.learners`), and each tensor becomes ``k × shape``, so that a batched
    (``torch.func.vmap``) step updates every learner at once. Reads return a row per learner (``k × numel``);
    writes take rows, or one flat model that every learner takes. Bound, :attr:`live` holds the rows and each
    tensor is a view of its columns (parameters: merges then work in place). Unbound, each tensor is a
    contiguous block of its own (buffers: BatchNorm's batched update of its running statistics writes through a
    reshape, which a strided view would turn into a copy). :meth:`show_` makes the tensors views of one flat
    model instead (the merged model, for evaluation), and :meth:`restack_` gives them back their learners.

    Args:
        tensors: the tensors to view, e.g. a module's trainable parameters; their order is the flat layout.
        bind: make the tensors views of one flat buffer where possible.
        device: where the flats of a view without tensors live: give the model's device wherever a view may be
            empty (a model without buffers); the CPU by default. A view of tensors uses its first tensor's device.
        learners: copies of the tensors, one per learner; bound, more than one needs bindable tensors.
    """

    def __init__(
        self,
        tensors: Iterable[Tensor],
        bind: bool = False,
        device: torch.device | str | None = None,
        learners: int = 1,
    ) -> None:
        self.tensors = list(tensors)
        # A complex tensor is read and written as its real pairs (torch.view_as_real shares its storage), as torch's
        # collectives send it: cast to a real dtype, it would lose its imaginary part. A view holding one is never
        # bound (every merge copies). The views are taken anew at each use, so that they follow a rebound `.data`.
        parts = _real_parts(self.tensors)
        self.device = self.tensors[0].device if self.tensors else torch.device(device or "cpu")
        self.dtype = torch.float64 if any(t.dtype == torch.float64 for t in parts) else torch.float32
        self.numel = sum(t.numel() for t in parts)  # per learner
        self.learners = learners
        self._sizes = [t.numel() for t in parts]
        self.shapes = [t.shape for t in self.tensors]  # one model's, whatever the learners
        self._dtypes = [t.dtype for t in self.tensors]
        if learners > 1 and bind:
            check_stackable(self.tensors)
        self.live: Tensor | None = self._bind() if bind and self._bindable() else None
        self._blocks = self._stack() if learners > 1 and self.live is None else []
        self.showing = False  # whether the tensors show one model (show_) rather than their learners

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def follow(self, tensors: Sequence[Tensor]) -> bool:
        """View ``tensors`` from now on where they replaced the viewed ones one for one (same shapes and dtypes).

        A module that assigns a buffer anew (``self.ema = 0.9 * self.ema + ...``) leaves the view on the old
        tensor. Only an unbound view of one learner can follow: a bound one owns its tensors' storage.

        Returns:
            Whether the view now views ``tensors`` (``False``: they differ in number, shape or dtype, or the view
            cannot follow).
        """
        if all(new is old for new, old in zip(tensors, self.tensors, strict=False)) and len(tensors) == len(
            self.tensors
        ):
            return True
        same_layout = [(t.shape, t.dtype) for t in tensors] == list(zip(self.shapes, self._dtypes, strict=True))
        if not same_layout or self.live is not None or self.learners > 1:
            return False
        self.tensors = list(tensors)
        return True

    def _bindable(self) -> bool:
        return _bindable(self.tensors)

    @torch.no_grad()
    def _bind(self) -> Tensor:
        flat = torch.cat([t.detach().reshape(-1) for t in self.tensors])
        if self.learners > 1:
            flat = flat.unsqueeze(0).repeat(self.learners, 1)
        self._rebind(flat)
        return flat

    @torch.no_grad()
    def _stack(self) -> list[Tensor]:
        blocks = [t.detach().unsqueeze(0).repeat(self.learners, *[1] * t.dim()) for t in self.tensors]
        for tensor, block in zip(self.tensors, blocks, strict=True):
            tensor.data = block
        return blocks

    def _rebind(self, flat: Tensor) -> None:
        """Make the tensors views of ``flat``: one model (``numel``), or a row per learner (``k × numel``).

        A tensor of another dtype than ``flat`` (a float16 buffer beside float32 ones) takes a copy in its own.
        """
        lead = flat.shape[:-1]
        chunks = torch.split(flat, self._sizes, dim=-1)
        for tensor, chunk, shape, dtype in zip(self.tensors, chunks, self.shapes, self._dtypes, strict=True):
            tensor.data = chunk.view(tuple(lead) + tuple(shape)).to(dtype)  # a 0-dim tensor too

    @torch.no_grad()
    def show_(self, flat: Tensor) -> None:
        """Make the tensors views of ``flat``, one model of :attr:`numel` elements; the learners stay as they are.

        The tensors then hold ``flat`` (kept alive by them until :meth:`restack_`), each in its own dtype; for
        several learners only.
        """
        assert self.learners > 1, "only a view of several learners shows another model"
        self._rebind(flat.reshape(-1).to(self.dtype))
        self.showing = True

    def restack_(self) -> None:
        """Give the tensors back their learners after :meth:`show_`."""
        self.showing = False
        if self.live is not None:
            self._rebind(self.live)
            return
        for tensor, block in zip(self.tensors, self._blocks, strict=True):
            tensor.data = block

    def learner_mean(self) -> Tensor:
        """The mean of the learners' models, one flat model (the current values themselves for one learner)."""
        return self.current() if self.learners == 1 else rows_mean(self.current())

    def current(self) -> Tensor:
        """The current values: the live buffer itself when bound (do not keep it), otherwise a new copy."""
        return self.live if self.live is not None else self.read()

    def read(self) -> Tensor:
        """A new flat tensor holding the current values (a row per learner with several)."""
        if self.live is not None:
            return self.live.clone()
        if not self.tensors:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        if self._blocks:
            rows = [block.detach().reshape(self.learners, -1) for block in self._blocks]
            return torch.cat(rows, dim=1).to(self.device, self.dtype)
        return torch.cat([t.detach().reshape(-1).to(self.device, self.dtype) for t in _real_parts(self.tensors)])

    @torch.no_grad()
    def read_into(self, out: Tensor) -> Tensor:
        """Copy the current values into ``out`` (shaped as :meth:`read`'s result) and return it."""
        if self.live is not None or self._blocks:
            return out.copy_(self.current())
        offset = 0
        for tensor in _real_parts(self.tensors):
            out[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
            offset += tensor.numel()
        return out

    @torch.no_grad()
    def write_(self, flat: Tensor) -> None:
        """Copy ``flat`` back into the viewed tensors (casting to each tensor's dtype).

        With several learners ``flat`` holds a row per learner, or one model that every learner takes.
        """
        if flat.numel() not in (self.numel, self.numel * self.learners):
            raise ValueError(f"A flat tensor of {flat.numel()} elements cannot fill {self.numel} elements.")
        if not self.tensors:
            return
        rows = flat.reshape(-1) if self.learners == 1 else flat.reshape(-1, self.numel)
        if self.live is not None:
            if flat.data_ptr() != self.live.data_ptr():
                self.live.copy_(rows)
            return
        if self._blocks:
            for block, chunk in zip(self._blocks, torch.split(rows, self._sizes, dim=-1), strict=True):
                block.reshape(self.learners, -1).copy_(chunk)
            return
        for tensor, chunk in zip(_real_parts(self.tensors), torch.split(flat, self._sizes), strict=True):
            tensor.copy_(chunk.view_as(tensor))


def _real_parts(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [torch.view_as_real(t) if t.is_complex() else t for t in tensors]


def rows_mean(rows: Tensor) -> Tensor:
    """The mean of a flat's rows (learners), computed as ``x₀ + mean_j (x_j − x₀)``.

    Exact where the rows agree (learners that have not trained yet): a plain mean of ``k`` equal floats may round
    off the value they share.
    """
    first = rows[0]
    return (rows - first).mean(dim=0).add_(first)


def module_device(module: nn.Module) -> torch.device:
    """Where a module's tensors live: its first parameter's or buffer's device (the CPU for a module of neither)."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    return torch.device("cpu")


def to_host(tensor: Tensor) -> list[float]:
    """The elements of a small tensor, flattened, as Python numbers: where the engine waits for its device.

    The merge path reads device numbers through here only, so that its host synchronisations are few and
    visible, and tests on the ``meta`` device (which holds no numbers) can stand in for it.
    """
    return tensor.reshape(-1).tolist()


def trainable_parameters(module: nn.Module) -> list[Tensor]:
    """Parameters that training changes; frozen ones are identical on every replica and need no merge."""
    return [p for p in module.parameters() if p.requires_grad]


def floating_buffers(module: nn.Module) -> list[Tensor]:
    """Floating-point buffers (BatchNorm statistics); integer counters stay local, they advance in lockstep."""
    return [b for b in module.buffers() if b.is_floating_point()]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Floating-point and complex state tensors of an optimizer (momentum buffers, Adam moments) in a stable order."""
    tensors: list[Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            tensors.extend(value for _, value in sorted(state.items()) if _is_mergeable_state(value, param))
    return tensors


def _is_mergeable_state(value: object, param: Tensor) -> bool:
    # Per-parameter moments have the parameter's shape; scalars such as Adam's step count are left alone.
    if not isinstance(value, Tensor):
        return False
    return (value.is_floating_point() or value.is_complex()) and value.shape == param.shape
