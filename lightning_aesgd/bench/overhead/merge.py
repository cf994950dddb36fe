"""What one model merge costs against one plain all-reduce of the same bytes, on real gloo processes.

A merge (:meth:`~lightning_aesgd.engine.averager.ElasticAverager.merge`, Adaptive SGD's rule: weighted average, outer
momentum, hard reset) packs the weighted parameters and the weight into one bucket, all-reduces it, divides,
applies the rule and writes the model back. Its floor is one ``torch.distributed.all_reduce`` of a tensor as
large as the model; the ratio merge / all-reduce says what the packing and the rule add on top. The same merge
without outer momentum (local SGD's) is measured beside it: the momentum costs three more passes over the model.
"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import start_processes

from lightning_aesgd.core.merge import get_merge_rule
from lightning_aesgd.engine.averager import ElasticAverager, MergeSettings
from lightning_aesgd.engine.comm import TorchCommunicator
from lightning_aesgd.engine.flat import trainable_parameters
from lightning_aesgd.workloads import XMCNet, get_preset

PROCESSES = 2
WARMUP_ITERATIONS = 2


def build_model(size: str) -> nn.Module:
    """``"xmc_mini"`` / ``"xmc_eurlex"`` (the workloads' networks), or a parameter count such as ``"1e6"``.

    A count n gives four square linear layers of width w = round(√(n/4)), so that merges see several tensors
    (4·(w² + w) ≈ n parameters) as real models have.
    """
    presets = {"xmc_mini": "mini", "xmc_eurlex": "eurlex4k"}
    if size in presets:
        spec = get_preset(presets[size])
        return XMCNet(spec.num_features, spec.num_labels, hidden=128)
    width = max(1, round(math.sqrt(float(size) / 4)))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))


def measure_merges(sizes: Sequence[str], iterations: int) -> list[dict[str, float | str]]:
    """Median seconds of a merge and of an all-reduce of the same bytes, per model size, on 2 gloo processes."""
    with tempfile.TemporaryDirectory(prefix="aesgd-overhead-") as scratch:
        path = Path(scratch) / "merges.json"
        start_processes(  # type: ignore[no-untyped-call]
            _worker,
            args=(_free_port(), list(sizes), iterations, str(path)),
            nprocs=PROCESSES,
            start_method=_start_method(),
        )
        rows: list[dict[str, float | str]] = json.loads(path.read_text())
    return rows


def _worker(rank: int, port: int, sizes: list[str], iterations: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes on a machine that may have two cores
    dist.init_process_group("gloo", rank=rank, world_size=PROCESSES)
    try:
        rows = [_measure_one(size, iterations) for size in sizes]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(path).write_text(json.dumps(rows))


def _measure_one(size: str, iterations: int) -> dict[str, float | str]:
    torch.manual_seed(0)
    module = build_model(size)
    parameters = sum(p.numel() for p in trainable_parameters(module))
    # adaptive_sgd's merge (outer momentum 0.3) and local SGD's (plain weighted average), on the same model.
    merges = {
        "merge": _averager(module, momentum=0.3),
        "merge_no_momentum": _averager(copy.deepcopy(module), momentum=0.0),
    }
    plain = torch.randn(parameters)
    times: dict[str, list[float]] = {name: [] for name in [*merges, "all_reduce"]}
    for iteration in range(WARMUP_ITERATIONS + iterations):
        # Alternate them, so that drift of a shared machine hits all alike.
        measured = {name: _timed(partial(averager.merge, 1.0 + dist.get_rank())) for name, averager in merges.items()}
        measured["all_reduce"] = _timed(lambda: dist.all_reduce(plain))
        if iteration >= WARMUP_ITERATIONS:
            for name, seconds in measured.items():
                times[name].append(seconds)
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "model": size,
        "parameters": parameters,
        "merge_ms": 1e3 * median["merge"],
        "merge_no_momentum_ms": 1e3 * median["merge_no_momentum"],
        "all_reduce_ms": 1e3 * median["all_reduce"],
        "ratio": median["merge"] / median["all_reduce"],
        "ratio_no_momentum": median["merge_no_momentum"] / median["all_reduce"],
    }


def _averager(module: nn.Module, momentum: float) -> ElasticAverager:
    rule = get_merge_rule("elastic_average", alpha=1.0, momentum=momentum)
    return ElasticAverager(module, TorchCommunicator(torch.device("cpu")), MergeSettings(rule, period=1))


def _timed(operation: Callable[[], object]) -> float:
    """Seconds of ``operation`` on this rank, started together with the peer's (a barrier first)."""
    dist.barrier()
    start = time.perf_counter()
    operation()
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_method() -> str:
    # fork starts in milliseconds; spawn where fork does not exist.
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
