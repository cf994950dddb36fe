"""The race, ``python -m lightning_aesgd.bench [options]``: every algorithm on every device profile, with ratios to DDP.

One workload (:mod:`.suites`) is trained with every chosen algorithm under every chosen device profile,
interleaved and repeated (:mod:`.benchmark`); each run is composed with Hydra and fitted like the main job
(:mod:`.runner`) while a callback records its training clock, samples, validations and plans (:mod:`.recorder`).
The records become throughput, efficiency against the sum of the replicas' solo speeds, time to a target metric
and ratios to DDP (:mod:`.analysis`), written as a markdown table and JSON (:mod:`.report`) and as plots
(:mod:`.plots`). :mod:`.program` holds the command line.
"""

from lightning_aesgd.bench.race.program import main

__all__ = ["main"]
