"""Shared fixtures; and the rule that this test process never uses CUDA.

Many tests fork replica processes, and a process forked after CUDA was initialised cannot use CUDA ("Cannot
re-initialize CUDA in forked subprocess"), which Lightning's replicas do whenever CUDA is available (they read
its random state). So on a machine with GPUs this process hides them before anything initialises CUDA, and the
tests marked ``cuda`` run their bodies in fresh processes that see them again (``tests/cuda_run.py``).
"""

import os
import threading

# Before torch answers any CUDA question: device counts then come from NVML, which reads CUDA_VISIBLE_DEVICES
# when asked, so hiding the GPUs below takes effect even though torch is already imported.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
if "AESGD_TEST_CUDA_VISIBLE_DEVICES" not in os.environ:
    os.environ["AESGD_TEST_CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    os.environ["AESGD_TEST_CUDA_PRESENT"] = "unknown"

import pytest
import torch
from hypothesis import settings

# Under CI (CI=true) every property test draws the same examples on every run: a landing then never waits on a
# random draw, and a failure there reproduces. Elsewhere the draws stay random, so that each local run explores
# new cases (one found the admission search's early stop wrong on a fleet that CI's runs had never drawn).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI", "").lower() in ("1", "true"):
    settings.load_profile("ci")

if os.environ["AESGD_TEST_CUDA_PRESENT"] == "unknown":
    os.environ["AESGD_TEST_CUDA_PRESENT"] = "1" if torch.cuda.device_count() > 0 else "0"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Every test process runs one intra-op thread, and so do the replicas it forks or starts (OMP_NUM_THREADS). GNU
# OpenMP hangs a process forked after its parent ran a team of threads, and the replicas that tests fork with
# Lightning's own DDPStrategy inherit this process's thread count: on one thread they form no team, and this process
# forms none for them to inherit. One thread also keeps pytest-xdist's workers from oversubscribing the cores, which
# the timed tests (the learner tuner's measurements, stall timeouts) would measure instead of the code.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Skip the ``cuda`` tests where no GPU is present."""
    if os.environ["AESGD_TEST_CUDA_PRESENT"] == "1":
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """Append each failure's report to ``$AESGD_TEST_FAILURE_LOG`` as it happens (a time-boxed run, on a borrowed
    GPU machine say, may be stopped before pytest prints its summary)."""
    path = os.environ.get("AESGD_TEST_FAILURE_LOG")
    # Under pytest-xdist the controller sees each worker's report again (with its `node`): the worker wrote it.
    if path and report.failed and not hasattr(report, "node"):
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(autouse=True)
def _teardown_process_group():
    """Destroy any process group a test left behind, and stop the heartbeat its communicator started.

    A heartbeat is a daemon thread inside a store's C++ calls every few hundred milliseconds; left running, it beat
    into a destroyed group's store until the interpreter's exit. A daemon thread that wakes during finalization is
    ended by a forced unwind through C++ frames that cannot unwind, which aborts the process ("terminate called
    without an active exception", exit status 134): one full run of the suite ended so after every test had passed.
    The heartbeat is the one thread of the package that outlived its test, so the likely cause (three runs of the
    tests that create groups in this process did not reproduce it).
    """
    yield
    # Imported here: this module must not import the package before the GPUs are hidden above.
    from lightning_aesgd.engine.stalls import stop_heartbeat

    stop_heartbeat()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # A heartbeat the test started by itself: it would beat on in this process, into every later fork of it.
    beating = [thread for thread in threading.enumerate() if thread.name.startswith("aesgd-heartbeat")]
    for thread in beating:
        thread.join(1.0)
    if left := [thread.name for thread in beating if thread.is_alive()]:
        pytest.fail(f"the test left heartbeat thread(s) beating: {left}; stop them (Heartbeat.stop) before it ends")


@pytest.fixture(autouse=True)
def _restore_env_variables():
    """Lightning's launchers export rank variables and set torch's threads; keep them from leaking into later tests.

    A test that raises this process's thread count (Lightning and the strategy set a replica's share of the cores in
    the process that runs rank zero) may form a team of threads here; a later test's replicas forked with Lightning's
    own ``DDPStrategy`` would inherit the raised count and hang in GNU OpenMP, but inherit one thread once restored.
    """
    env_backup = os.environ.copy()
    threads = torch.get_num_threads()
    yield
    os.environ.clear()
    os.environ.update(env_backup)
    torch.set_num_threads(threads)
