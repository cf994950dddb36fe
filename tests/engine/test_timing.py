import threading
import time
from pathlib import Path

import pytest
import torch
from cuda_run import run_on_cuda

from lightning_aesgd.engine import timing
from lightning_aesgd.engine.timing import BusyTimer

# ----------------------------------------------------------------------------------------------- BusyTimer


class FakeClock:
    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def __call__(self) -> float:
        return self.readings.pop(0)


def test_busy_timer_cpu_returns_completed_regions_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing.time, "perf_counter", FakeClock(10.0, 10.5, 20.0, 22.0, 30.0, 30.25))
    timer = BusyTimer(torch.device("cpu"))
    for _ in range(2):
        timer.start()
        timer.stop()
    assert timer.pop_completed() == [0.5, 2.0]
    assert timer.pop_completed() == []
    timer.start()
    assert timer.is_running
    assert timer.pop_completed() == []  # a running region is not complete
    timer.stop()
    assert not timer.is_running
    assert timer.pop_completed() == [0.25]


def test_busy_timer_cpu_measures_real_time() -> None:
    timer = BusyTimer(torch.device("cpu"))
    timer.start()
    torch.ones(256, 256) @ torch.ones(256, 256)
    timer.stop()
    (seconds,) = timer.pop_completed()
    assert 0.0 < seconds < 10.0


def test_busy_timer_stop_without_start_raises() -> None:
    timer = BusyTimer(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="without start"):
        timer.stop()
    timer.start()
    timer.stop()
    with pytest.raises(RuntimeError, match="without start"):
        timer.stop()


def test_busy_timer_start_twice_raises() -> None:
    timer = BusyTimer(torch.device("cpu"))
    timer.start()
    with pytest.raises(RuntimeError, match="called twice"):
        timer.start()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is missing")
def test_busy_timer_rejects_cuda_without_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        BusyTimer(torch.device("cuda"))


@pytest.mark.cuda
def test_busy_timer_cuda_reads_events_without_synchronising(monkeypatch: pytest.MonkeyPatch) -> None:
    # The test process never initialises CUDA (see conftest.py): the body runs in a fresh process.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent))
    run_on_cuda("test_timing:busy_timer_reads_events_without_synchronising")


def busy_timer_reads_events_without_synchronising() -> None:
    device = torch.device("cuda")
    timer = BusyTimer(device)
    matrix = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize(device)
    # Block the stream long enough that the regions cannot have finished when first polled.
    torch.cuda._sleep(int(5e8))
    for _ in range(3):
        timer.start()
        for _ in range(5):
            matrix = torch.tanh(matrix @ matrix)
        timer.stop()
    assert timer.pop_completed() == []  # still queued behind the sleep: no synchronisation happened
    torch.cuda.synchronize(device)
    seconds = timer.pop_completed()
    assert len(seconds) == 3
    assert all(0.0 < value < 10.0 for value in seconds)
    assert timer.pop_completed() == []


def test_emulated_slowdown_sleeps_factor_minus_one_times_the_compute_time(monkeypatch):
    class Clock:
        readings = iter([2.0, 2.5])

        def now(self):
            return next(self.readings)

    sleeps = []
    monkeypatch.setattr(timing.time, "sleep", sleeps.append)
    with timing.emulated_slowdown(Clock(), factor=4.0):
        pass
    assert sleeps == [pytest.approx(1.5)]


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
        clock = timing.ComputeClock(torch.device("cpu"))
        started = clock.now()
        other = threading.Thread(target=_spin, args=(0.3,))
        other.start()
        _spin(0.1)
        other.join()
        assert 0.09 <= clock.now() - started < 0.2
    finally:
        torch.set_num_threads(threads)


def test_compute_clock_waits_for_the_current_stream_not_the_whole_device(monkeypatch):
    """A device-wide synchronisation would also wait for the collectives' streams: for peers, not compute."""
    synchronised = []

    class Stream:
        def synchronize(self):
            synchronised.append("current stream")

    def whole_device(device=None):
        raise AssertionError("the compute clock synchronised the whole device")

    monkeypatch.setattr(timing.torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(timing.torch.cuda, "synchronize", whole_device)
    timing.ComputeClock(torch.device("cuda", 0)).now()
    assert synchronised == ["current stream"]
