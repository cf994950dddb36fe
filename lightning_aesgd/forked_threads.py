"""Intra-op threads in a forked replica: keep them where they can run, fall back to one where they would hang.

GNU OpenMP (torch's CPU threads) keeps its thread pool between parallel regions, and a process forked from one
inherits the pool's bookkeeping but not its threads: its first parallel region of several threads then waits for
them forever. Any CPU work the launching process ran on several threads (building a large model, preparing data)
starts that pool, and Lightning's ``ddp_fork`` replicas, which it gives ``cores / replicas`` threads, hang in
their first wide kernel. Whether a process inherited such a pool shows only by trying, so a forked replica tries in
a probe process of its own before it trains (:func:`teams_form_after_fork`), and runs one thread where the probe
hangs, as PyTorch's DataLoader workers always do.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import warnings
from typing import NoReturn

import torch

PROBE_SECONDS = 3.0
"""How long the probe may take before it is taken to hang: it forks, runs one kernel and exits, in milliseconds."""


def teams_form_after_fork(threads: int, patience: float = PROBE_SECONDS) -> bool:
    """Whether a parallel CPU kernel on ``threads`` threads finishes in a process forked from this one.

    A probe forked from this process runs one kernel wide enough to be split over ``threads`` threads, and exits.
    One that has not exited after ``patience`` seconds is taken to hang (a loaded machine errs on the safe side),
    and is killed; so is one left behind by an interruption. It holds none of this process's files (a launcher
    watches a replica's pipe to learn that it ended), and on Linux it dies with this process.
    """
    probe = os.fork()
    if probe == 0:
        _run_probe(threads)
    try:
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            ended, status = os.waitpid(probe, os.WNOHANG)
            if ended:
                probe = 0
                return os.waitstatus_to_exitcode(status) == 0
            time.sleep(0.005)
        return False
    except ChildProcessError:  # reaped by someone else (SIGCHLD ignored): its verdict is lost, so assume the worst
        probe = 0
        return False
    finally:
        if probe:
            os.kill(probe, signal.SIGKILL)
            os.waitpid(probe, 0)


def _run_probe(threads: int) -> NoReturn:
    """The probe's life: one parallel kernel, then exit 0 (1 if it raised); it never returns to the caller."""
    code = 1
    try:
        os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
        if sys.platform == "linux":  # die with the replica that forked it (prctl PR_SET_PDEATHSIG = 1)
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)
        torch.set_num_threads(threads)
        torch.ones(1 << 20).tanh_()  # past torch's grain size and MKL's threshold: a parallel region
        code = 0
    finally:
        os._exit(code)


def threads_that_run_after_fork(warn: bool) -> int:
    """Keep this forked replica's intra-op threads where they can run, else cap them at one; the threads it runs.

    Args:
        warn: whether to say so where the cap takes threads away (rank zero).
    """
    threads = torch.get_num_threads()
    if threads <= 1 or teams_form_after_fork(threads):
        return threads
    torch.set_num_threads(1)
    if warn:
        warnings.warn(
            f"Forked replicas run one intra-op thread each, not {threads}: the launching process ran CPU work on "
            "several threads before the fork, and GNU OpenMP hangs in a process forked after that. HINT: "
            "start_method='popen' (the default) or 'spawn' gives each replica its share of the cores.",
            stacklevel=2,
        )
    return 1
