"""The project's benchmark: ``python -m lightning_aesgd.bench`` (or ``aesgd-bench``).

Trains one workload with every chosen algorithm under every chosen device profile (emulated heterogeneity),
and reports per (profile, algorithm): throughput on the training clock, efficiency against the sum of the
replicas' solo speeds, time to a target metric, the final metric at equal epochs, and ratios to Lightning's
DDP under the same profile, as a markdown table, a JSON file and plots. ``python -m lightning_aesgd.bench
overhead`` measures what the machinery costs: a merge against a plain all-reduce, the planner and the sampler.

Example:
    ``python -m lightning_aesgd.bench --profiles strong --algorithms adaptive_sgd,ddp --repeats 3``
"""

from lightning_aesgd.bench.cli import main

__all__ = ["main"]
