"""The slowness program, ``python -m lightning_aesgd.bench slowness``: the strategy against slowness it did not create.

Each case (:mod:`.cases`) puts slowness where a real job meets it, the user's ``training_step``, data loading, a
hook, a CPU quota or the optimizer step, on 4 replicas of an image classifier (:mod:`.model`) and races
Lightning's DDP against ``adaptive_elastic`` on it, one timed run at a time (:mod:`.runner`), beside the
replicas' solo step times for the ideal (:mod:`.comparison`); the ``machinery`` runs of a near-empty model measure
each strategy's own per-step cost (:mod:`.machinery`). :mod:`.report` writes the tables and ``slowness.json``,
and :mod:`.program` holds the command line.
"""

from lightning_aesgd.bench.slowness.program import main

__all__ = ["main"]
