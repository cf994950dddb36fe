"""The step emulation's clock and stretcher: compute time as the emulation defines it, spans made f times longer."""

import threading
import time
from pathlib import Path

import pytest
import torch
from cuda_run import run_on_cuda

from lightning_aesgd.emulation import clock as clocks
from lightning_aesgd.emulation.profiles import SlowdownProfile
from lightning_aesgd.engine import timing
from lightning_aesgd.engine.timing import HostTimeline


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_compute_clock_counts_the_computing_threads_work_and_not_other_threads():
    """gloo works on a collective in flight (a DDP bucket, ABS-SGD's delayed sum) on threads of its own: a slower
    device would not slow that work, so the step emulation must not stretch it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        clock = clocks.ComputeClock(torch.device("cpu"))
        started = clock.mark()
        other = threading.Thread(target=_spin, args=(0.3,))
        other.start()
        _spin(0.1)
        other.join()
        assert 0.09 <= clock.seconds_since(started) < 0.2
    finally:
        torch.set_num_threads(threads)


class _ScriptedTimeline(HostTimeline):
    """A host timeline on scripted readings that records each blocking read."""

    def __init__(self, readings):
        self.readings, self.waited = iter(readings), []
        super().__init__(lambda: next(self.readings))

    def wait(self, stamp):
        self.waited.append(stamp)


def test_a_cuda_span_is_timed_by_events_on_the_current_stream_and_its_mark_never_waits(monkeypatch):
    """A device-wide synchronisation would also wait for the collectives' streams (for peers, not compute), and a
    wait at the mark would cost replicas sharing a GPU a turn on it for nothing."""
    recorded, synchronised = [], []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self, stream):
            self.at = float(len(recorded))
            recorded.append(stream)

        def synchronize(self):
            synchronised.append(self.at)

        def elapsed_time(self, end):
            return 1000.0 * (end.at - self.at) * 0.25  # milliseconds

    def whole_device(device=None):
        raise AssertionError("the compute clock synchronised the whole device")

    monkeypatch.setattr(timing.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing.torch.cuda, "current_stream", lambda device=None: "current stream")
    monkeypatch.setattr(timing.torch.cuda, "synchronize", whole_device)
    clock = clocks.ComputeClock(torch.device("cuda", 0))
    started = clock.mark()
    assert (recorded, synchronised) == (["current stream"], [])
    assert clock.seconds_since(started) == pytest.approx(0.25)
    # The end event, then the mark (passed already where both lie on one stream); never the whole device.
    assert (recorded, synchronised) == (["current stream"] * 2, [1.0, 0.0])


def test_the_stretcher_makes_each_span_take_the_replicas_factor_times_its_compute(monkeypatch):
    sleeps = []
    monkeypatch.setattr(clocks.time, "sleep", sleeps.append)
    stretcher = clocks.StepStretcher(SlowdownProfile([1.0, 3.0]), torch.device("cpu"))
    timeline = _ScriptedTimeline([10.0, 10.2, 20.0, 30.0])
    stretcher.clock = clocks.ComputeClock(torch.device("cpu"), timeline)
    stretcher.begin()
    stretcher.end(rank=1, global_step=0)  # 0.2 s of compute, factor 3: 0.4 s more
    stretcher.begin()
    stretcher.end(rank=0, global_step=0)  # factor 1: as it is, and never read
    stretcher.end(rank=1, global_step=1)  # no span begun: nothing to stretch
    assert sleeps == [pytest.approx(0.4)]
    assert timeline.waited == [10.2, 10.0]  # one read (its end, then its mark), for the span it stretched


@pytest.mark.cuda
def test_on_a_gpu_a_span_holds_its_own_device_work_and_its_mark_does_not_wait(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent))
    run_on_cuda("test_clock:span_of_gpu_work")


SPIN_CYCLES = 100_000_000  # about 50 ms at GPU clock rates


def span_of_gpu_work() -> None:
    """Body of the ``cuda`` test: two equal kernels, a span around the second; run in a process that sees the GPU."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.cuda._sleep(1000)  # CUDA's start-up outside the timings
    torch.cuda.synchronize(device)
    clock = clocks.ComputeClock(device)
    before = time.perf_counter()
    torch.cuda._sleep(SPIN_CYCLES)  # queued work before the span
    started = clock.mark()
    marked = time.perf_counter() - before
    torch.cuda._sleep(SPIN_CYCLES)  # the span's work
    seconds = clock.seconds_since(started)
    total = time.perf_counter() - before
    assert marked < 0.1 * total, (marked, total)
    assert 0.35 * total <= seconds <= 0.65 * total, (seconds, total)
