"""The scale program, ``python -m lightning_aesgd.bench scale``: the speedup over lockstep DDP as replicas multiply.

Measured at 2, 4 and 8 replica processes with the same spread of speeds (:mod:`.measured`, the slowness
benchmark's ``user`` case), and simulated at 16 to 256 replicas (:mod:`.simulation`: cost factors drawn within a
spread, per-step noise from a measured run (:mod:`.noise`), lockstep DDP against the strategy's real plan loop,
its planning timed per step, and the real sampler's split checked at that scale (:mod:`.sampling`)).
:mod:`.report` writes the tables and ``scale.json``, and :mod:`.program` holds the command line.
"""

from lightning_aesgd.bench.scale.program import main

__all__ = ["main"]
