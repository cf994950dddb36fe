"""The project's benchmarks, six programs behind one command (``python -m lightning_aesgd.bench`` or ``aesgd-bench``).

* :mod:`~lightning_aesgd.bench.race`, ``python -m lightning_aesgd.bench [options]``: trains one workload with
  every chosen algorithm under every chosen device profile (emulated heterogeneity) and reports per (profile,
  algorithm) the throughput on the training clock, the efficiency against the sum of the replicas' solo speeds,
  the time to a target metric, the final metric at equal epochs and ratios to Lightning's DDP under the same
  profile, as a markdown table, a JSON file and plots.
* :mod:`~lightning_aesgd.bench.overhead`, ``python -m lightning_aesgd.bench overhead [options]``: what the
  machinery costs, a merge against a plain all-reduce of the same bytes, and the planner and the sampler per
  step without communication.
* :mod:`~lightning_aesgd.bench.slowness`, ``python -m lightning_aesgd.bench slowness [options]``: DDP and
  ``adaptive_elastic`` against slowness the strategy did not create (in the user's ``training_step``, data
  loading, a hook, a CPU quota), and each strategy's own per-step cost.
* :mod:`~lightning_aesgd.bench.seeds`, ``python -m lightning_aesgd.bench seeds [options]``: the seed papers'
  claims, each a small race with the paper's statement and a verdict ("claim | paper says | we measured |
  verdict").
* :mod:`~lightning_aesgd.bench.scale`, ``python -m lightning_aesgd.bench scale [options]``: the speedup over
  lockstep DDP as the replicas grow in number and spread, measured up to 8 replicas and simulated up to 256.
* :mod:`~lightning_aesgd.bench.placement`, ``python -m lightning_aesgd.bench placement [options]``: the GPU
  alone, GPU + CPU replicas (``devices=gpu_cpu``) and CPU replicas alone, each also with the GPU emulated slower.

:mod:`~lightning_aesgd.bench.cli` dispatches on the first argument; :mod:`~lightning_aesgd.bench.common` holds
what the programs share. Each program's ``--help`` lists its options.

Example:
    ``python -m lightning_aesgd.bench --profiles strong --algorithms adaptive_sgd,ddp --repeats 3``
"""

from lightning_aesgd.bench.cli import main

__all__ = ["main"]
