"""The step emulation's clock and stretcher: compute time as the emulation defines it, spans made f times longer."""

import threading
import time

import pytest
import torch

from lightning_aesgd.emulation import clock as clocks
from lightning_aesgd.emulation.profiles import SlowdownProfile


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

    monkeypatch.setattr(clocks.torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(clocks.torch.cuda, "synchronize", whole_device)
    clocks.ComputeClock(torch.device("cuda", 0)).now()
    assert synchronised == ["current stream"]


def test_the_stretcher_makes_each_span_take_the_replicas_factor_times_its_compute(monkeypatch):
    readings = iter([10.0, 10.2, 20.0, 20.1, 30.0])
    sleeps = []
    monkeypatch.setattr(clocks.time, "sleep", sleeps.append)
    stretcher = clocks.StepStretcher(SlowdownProfile([1.0, 3.0]), torch.device("cpu"))
    monkeypatch.setattr(stretcher.clock, "now", lambda: next(readings))
    stretcher.begin()
    stretcher.end(rank=1, global_step=0)  # 0.2 s of compute, factor 3: 0.4 s more
    stretcher.begin()
    stretcher.end(rank=0, global_step=0)  # factor 1: as it is
    stretcher.end(rank=1, global_step=1)  # no span begun: nothing to stretch
    assert sleeps == [pytest.approx(0.4)]
