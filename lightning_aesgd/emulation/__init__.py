"""Heterogeneity emulation: slower devices on a machine without them, applied from outside the training path.

A :class:`~lightning_aesgd.emulation.profiles.SlowdownProfile` says how much slower each replica is and where the
slowness lands (see :mod:`.profiles`). The ``step`` mode stretches the spans in which a replica's device computes
(:class:`~lightning_aesgd.emulation.clock.StepStretcher`, told of them by the engine's
:class:`~lightning_aesgd.engine.timing.ComputeSpans`, or by DDP's communication hook for Lightning's DDP); the
other modes wrap the user's code, the data loader or a hook, or set a real CPU quota (:mod:`.cpu_quota`), through
:class:`~lightning_aesgd.callbacks.SlowdownCallback`. The engine never imports this package.
"""

from lightning_aesgd.emulation.clock import ComputeClock, StepStretcher, stretch
from lightning_aesgd.emulation.profiles import SlowdownChange, SlowdownProfile, as_profile

__all__ = [
    "ComputeClock",
    "SlowdownChange",
    "SlowdownProfile",
    "StepStretcher",
    "as_profile",
    "stretch",
]
