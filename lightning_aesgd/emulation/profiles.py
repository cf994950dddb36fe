"""Heterogeneity emulation: make replica i's device take fᵢ times as long, with the slowness landing where chosen.

Machines without mixed GPUs can still show what a strategy does for mixed hardware. A
:class:`SlowdownProfile` gives a factor per replica and a ``mode``, the place where the extra time lands:

* ``step``: after each optimizer step's real computation the replica sleeps ``(fᵢ − 1) × c``, ``c`` the step's
  compute time. On CPU ``c`` is the CPU time of the computing thread (of the process where torch uses several
  intra-op threads), which excludes time blocked in collectives and the work of gloo's threads on a collective
  in flight; on CUDA, the device's own time for the step (events on its stream). ``adaptive_elastic`` applies
  this mode inside its own optimizer step (its ``slowdown`` argument), Lightning's DDP through
  :class:`~lightning_aesgd.callbacks.SlowdownCallback`.
* ``user``: the LightningModule's ``training_step`` takes ``fᵢ × s`` seconds per sample more, as slow user
  code does (``s = seconds_per_sample``).
* ``data``: the training DataLoader's collate function takes ``fᵢ × s`` seconds per sample (in the loader's
  worker processes when it has workers), as a slow data pipeline does.
* ``hook``: ``on_train_batch_end`` takes ``fᵢ × s`` seconds per sample, as a slow callback or logging does.
* ``quota``: no sleeping: each replica process gets a real CPU quota (a cgroup), ``1/fᵢ`` of its fair share of
  the machine's cores, as a container's CPU limit or a noisy neighbour does. Needs a writable cgroup
  hierarchy (see :mod:`lightning_aesgd.emulation.cpu_quota`).

Only ``step`` lands inside the region a strategy could time; the other modes are applied by
:class:`~lightning_aesgd.callbacks.SlowdownCallback` to every strategy alike, so comparisons are fair and the
strategy under test does not create the slowness it is measured against. Results on emulated devices are
ratios measured in one run, never absolute times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from lightning_aesgd.core.values import is_real

SlowdownMode = Literal["step", "user", "data", "hook", "quota"]
"""Where an emulated device's extra time lands (see the module docstring)."""

SLOWDOWN_MODES: tuple[str, ...] = get_args(SlowdownMode)
_PER_SAMPLE_MODES = ("user", "data", "hook")


@dataclass(frozen=True)
class SlowdownChange:
    """From ``step`` on (0-based global step), replica ``replica`` runs ``factor`` times slower than real."""

    step: int
    replica: int
    factor: float


@dataclass(frozen=True)
class SlowdownProfile:
    """Slowdown factors per replica, optionally changing at given steps.

    Args:
        factors: fᵢ ≥ 1 for every replica, in rank order: the devices' relative slowness.
        changes: later changes of single replicas' factors, e.g. one replica becoming 4× slower halfway.
        base: a common factor b ≥ 1 applied to every replica, so that replica i runs b·fᵢ times slower than
            real. With more replicas than cores (4 replicas on 2 cores), b = 4 keeps real computation a small
            part of every emulated step, so that replicas do not slow each other down by competing for cores
            and the devices' speeds keep the ratios fᵢ.
        mode: where the extra time lands: ``step``, ``user``, ``data``, ``hook`` or ``quota``.
        seconds_per_sample: device seconds per sample at factor 1 in the ``user``, ``data`` and ``hook`` modes.

    Example:
        >>> profile = SlowdownProfile((1, 1, 2, 4), (SlowdownChange(step=100, replica=0, factor=4),))
        >>> profile.factor(replica=0, step=99), profile.factor(replica=0, step=100), profile.factor(3, 0)
        (1.0, 4.0, 4.0)
        >>> SlowdownProfile((1, 2), base=3).factor(1, 0)
        6.0
    """

    factors: tuple[float, ...]
    changes: tuple[SlowdownChange, ...] = field(default_factory=tuple)
    base: float = 1.0
    mode: SlowdownMode = "step"
    seconds_per_sample: float | None = None

    def __post_init__(self) -> None:
        factors = tuple(self.factors)
        changes = tuple(c if isinstance(c, SlowdownChange) else SlowdownChange(**c) for c in self.changes)
        object.__setattr__(self, "factors", factors)
        object.__setattr__(self, "base", float(self.base))
        object.__setattr__(self, "changes", tuple(sorted(changes, key=lambda c: c.step)))
        if not factors:
            raise ValueError(
                "A slowdown profile needs one factor per replica. HINT: e.g. factors=[1, 2] for 2 replicas."
            )
        for value in (*factors, *(c.factor for c in changes), self.base):
            if not (is_real(value) and value >= 1):
                raise ValueError(
                    f"Slowdown factors must be numbers >= 1 (1 = real speed), got {value!r}. HINT: give the slowest "
                    "device the largest factor, e.g. [1, 1, 2, 4]."
                )
        for change in changes:
            if not 0 <= change.replica < len(factors):
                raise ValueError(
                    f"A change names replica {change.replica}, but there are {len(factors)}. HINT: number replicas "
                    "from 0 (rank order)."
                )
        self._check_mode(changes)

    def _check_mode(self, changes: tuple[SlowdownChange, ...]) -> None:
        if self.mode not in SLOWDOWN_MODES:
            raise ValueError(f"Unknown slowdown mode {self.mode!r}. HINT: choose one of {', '.join(SLOWDOWN_MODES)}.")
        per_sample = self.seconds_per_sample
        if self.mode in _PER_SAMPLE_MODES and not (per_sample is not None and per_sample > 0):
            raise ValueError(
                f"The {self.mode!r} slowdown mode adds fᵢ × seconds_per_sample per sample. HINT: set "
                f"seconds_per_sample > 0 (e.g. 0.001: a 64-sample step takes 64 ms at factor 1), got {per_sample}."
            )
        if changes and self.mode in ("data", "quota"):
            raise ValueError(
                f"Factors cannot change during training in the {self.mode!r} mode (it is set up once per "
                "process). HINT: use the step, user or hook mode for changing profiles."
            )

    def extra_seconds(self, replica: int, step: int, num_samples: int) -> float:
        """Seconds a batch of ``num_samples`` takes on ``replica``'s device in the per-sample modes."""
        assert self.seconds_per_sample is not None
        return self.factor(replica, step) * self.seconds_per_sample * num_samples

    @property
    def num_replicas(self) -> int:
        """Number of replicas the profile describes."""
        return len(self.factors)

    def factor(self, replica: int, step: int) -> float:
        """The total factor (base × fᵢ) of ``replica`` at ``step``."""
        value = self.factors[replica]
        for change in self.changes:
            if change.step <= step and change.replica == replica:
                value = change.factor
        return self.base * value

    def check_replicas(self, world_size: int) -> None:
        """Raise if the profile does not describe exactly ``world_size`` replicas."""
        if world_size != self.num_replicas:
            raise ValueError(
                f"The slowdown profile has {self.num_replicas} factors but {world_size} replicas train. "
                "HINT: give one factor per device (Trainer devices × num_nodes); to train real devices without "
                "emulation, use no profile (Hydra: devices=real, e.g. for algorithm=single_device)."
            )


def as_profile(spec: SlowdownProfile | Sequence[float] | Mapping[str, Any] | None) -> SlowdownProfile | None:
    """Accept a profile, a list of factors, or a mapping with ``factors`` and ``changes`` (Hydra configs).

    Raises:
        TypeError: for anything else, or a mapping without ``factors``.
        ValueError: for invalid factors, modes or changes.
    """
    if spec is None or isinstance(spec, SlowdownProfile):
        return spec
    if isinstance(spec, Mapping) and "factors" not in spec:
        raise TypeError(
            f"A slowdown mapping needs `factors`, got keys {sorted(spec)}. HINT: e.g. {{'factors': [1, 2]}}."
        )
    if isinstance(spec, (str, bytes)) or not isinstance(spec, (Mapping, Sequence)):
        raise TypeError(
            f"`slowdown` must be a SlowdownProfile, a list of factors or a mapping with `factors`, got {spec!r}. "
            "HINT: e.g. slowdown=[1, 2] for two replicas, the second twice as slow."
        )
    if isinstance(spec, Mapping):
        per_sample = spec.get("seconds_per_sample")
        return SlowdownProfile(
            tuple(spec["factors"]),
            tuple(spec.get("changes") or ()),
            float(spec.get("base", 1)),
            spec.get("mode", "step"),
            None if per_sample is None else float(per_sample),
        )
    return SlowdownProfile(tuple(spec))
