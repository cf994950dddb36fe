"""What a host synchronisation costs when several processes share one GPU.

Replicas sharing a GPU (``experiment=gpu_shared``) are separate processes, each with its own CUDA context. This
probe separates what sharing costs from what the strategy does: for each number of processes ``N``, every process
trains the same small network (XMC mini's shape: 2,000 inputs, 128 hidden units, 500 labels, batch 512) for a
few seconds, either waiting for the device after every step (as the ``step`` emulation's reads and ``.item()``
calls do) or only at the end, and reports its steps per second. If a synchronised step slows down with ``N`` much
more than an unsynchronised one, each wait for the device is also a wait for the other processes' work.

Usage::

    python scripts/gpu_sharing_probe.py                     # N = 1, 2, 4 on cuda:0, 3 s each
    python scripts/gpu_sharing_probe.py --processes 1,4 --seconds 5 --device cpu
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Barrier

import torch
import torch.multiprocessing as mp

INPUTS, HIDDEN, LABELS, BATCH = 2000, 128, 500, 512


def steps_per_second(device: str, seconds: float, synchronise: bool, threads: int, start: Barrier) -> float:
    """Train the probe network on ``device`` for about ``seconds``; steps per second of this process."""
    torch.set_num_threads(threads)
    target = torch.device(device)
    model = torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, LABELS))
    model.to(target)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    inputs = torch.rand(BATCH, INPUTS, device=target)
    labels = (torch.rand(BATCH, LABELS, device=target) < 0.01).float()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.binary_cross_entropy_with_logits(model(inputs), labels).backward()
        optimizer.step()

    def wait() -> None:
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    for _ in range(10):  # warm-up: kernels chosen, memory allocated
        step()
    wait()
    start.wait()
    began, steps = time.perf_counter(), 0
    while time.perf_counter() - began < seconds:
        step()
        steps += 1
        if synchronise:
            wait()
    wait()
    return steps / (time.perf_counter() - began)


def _worker(device: str, seconds: float, synchronise: bool, threads: int, start: Barrier, results: mp.Queue) -> None:
    results.put(steps_per_second(device, seconds, synchronise, threads, start))


def measure(device: str, processes: int, seconds: float, synchronise: bool) -> list[float]:
    """Steps per second of each of ``processes`` processes training at once on ``device``."""
    context = mp.get_context("spawn")  # CUDA cannot be used in forked children
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # A process that dies before the start would leave the others at the barrier: it times out, and so does the run.
    start, results = context.Barrier(processes, timeout=120), context.Queue()
    threads = max(1, cores // processes)
    workers = [
        context.Process(target=_worker, args=(device, seconds, synchronise, threads, start, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    rates: list[float] = []
    deadline = time.monotonic() + 180 + seconds
    try:
        while len(rates) < processes:
            if any(worker.exitcode not in (None, 0) for worker in workers) or time.monotonic() > deadline:
                codes = [worker.exitcode for worker in workers]
                raise RuntimeError(f"a probe process failed or hung (exit codes {codes})")
            try:
                rates.append(results.get(timeout=1))
            except queue.Empty:
                continue
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    return rates


def table(device: str, counts: list[int], seconds: float) -> Iterator[str]:
    """A Markdown table, printed line by line as each run ends.

    Per process count and mode: each process's steps/s, ms per step and the total. A time box that stops the probe
    keeps the rows printed before it.
    """
    yield f"Probe network {INPUTS}→{HIDDEN}→{LABELS}, batch {BATCH}, on {device}, {seconds:g} s per run."
    yield ""
    yield "| processes | wait for the device | steps/s per process (median) | ms per step | steps/s, all processes |"
    yield "|---|---|---|---|---|"
    for count in counts:
        for synchronise in (False, True):
            rates = measure(device, count, seconds, synchronise)
            median = statistics.median(rates)
            mode = "every step" if synchronise else "at the end"
            if not device.startswith("cuda"):
                mode += " (no device to wait for)"
            yield f"| {count} | {mode} | {median:.1f} | {1000 / median:.2f} | {sum(rates):.1f} |"


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run the probe, print its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2,4", help="comma list of process counts (default: 1,2,4)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds each run trains (default: 3)")
    parser.add_argument("--device", default="cuda:0", help="the device every process shares (default: cuda:0)")
    args = parser.parse_args(argv)
    counts = [int(count) for count in args.processes.split(",")]
    if any(count < 1 for count in counts) or args.seconds <= 0:
        parser.error("process counts must be >= 1 and --seconds > 0")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"{args.device} is not available: CUDA is not. HINT: --device cpu runs the probe on the CPU")
    for line in table(args.device, counts, args.seconds):
        print(line, flush=True)


if __name__ == "__main__":
    main()
