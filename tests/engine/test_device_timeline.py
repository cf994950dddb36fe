"""Arrivals stamped on a device's own timeline, whose stamps are read later: a scripted device on CPU, and a GPU.

The scripted device runs behind the host by as much as the test says: its stamps become readable when the test
lets it catch up, or when the arrival clock blocks on one (counted). The ``cuda`` tests run their bodies in a fresh
process that sees the GPUs (``tests/cuda_run.py``); the functions they run are at the end of this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_run import run_on_cuda

from lightning_aesgd.core.sensing import PeriodReport
from lightning_aesgd.engine.arrivals import ArrivalClock
from lightning_aesgd.engine.gradient_sync import BUCKET_REBUILD_STEP
from lightning_aesgd.engine.report_exchange import FIRST_REPORT_STEP
from lightning_aesgd.engine.timing import CudaTimeline, HostTimeline, SpanLedger, Timeline

HERE = Path(__file__).resolve().parent
MEASURED_FIELDS = ("work", "planned", "steps", "active", "loader", "busy")


class ScriptedDevice(Timeline):
    """A device that runs behind the host: a stamp reads the scripted time, readable once the device reached it.

    The device reaches stamps in the order they were taken (one stream); :meth:`wait` blocks until it reached
    one, as ``Event.synchronize()`` does, and is counted.
    """

    deferred = True

    def __init__(self) -> None:
        self.now = 0.0
        self.times: list[float] = []
        self.reached = 0  # stamps below this index are readable
        self.waits = 0

    def stamp(self) -> int:
        self.times.append(self.now)
        return len(self.times) - 1

    def ready(self, stamp: Any) -> bool:
        return stamp < self.reached

    def wait(self, stamp: Any) -> None:
        self.waits += 1
        self.reached = max(self.reached, stamp + 1)

    def seconds(self, start: Any, end: Any) -> float:
        # Like Event.elapsed_time, reading a stamp the device has not reached is an error.
        assert self.ready(start), "read a stamp the device has not reached"
        assert self.ready(end), "read a stamp the device has not reached"
        return self.times[end] - self.times[start]

    def catch_up(self) -> None:
        """The device runs everything queued so far."""
        self.reached = len(self.times)


class ScriptedHost:
    """The host's clock, scripted: the same script as :class:`ScriptedDevice`, readable at once."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Step:
    """One step of a replica under synchronous gradient sums: its size, its own time, its wait for peers."""

    size: int
    active: float
    wait: float
    reports: bool
    loader: float = 0.0


def _arrivals(deferred: bool, unmeasured_step: int | None = BUCKET_REBUILD_STEP) -> tuple[ArrivalClock, Any]:
    """A clock on a scripted device or host; by default it leaves out the step gradient sync leaves out."""
    if deferred:
        device = ScriptedDevice()
        arrivals = ArrivalClock(timeline=device, unmeasured_step=unmeasured_step)
    else:
        device = ScriptedHost()
        arrivals = ArrivalClock(clock=device, unmeasured_step=unmeasured_step)
    arrivals.attach(torch.device("cpu"))
    return arrivals, device


def _run_gradient_steps(
    arrivals: ArrivalClock, clock: Any, steps: list[Step], first: int = 0
) -> tuple[list[PeriodReport], list[int]]:
    """Drive the clock as the gradient sync does: a step begins, arrives at its last bucket, is released after the
    sums. ``first``: the step of the fit the first of ``steps`` is (its first step begins a new epoch).

    Returns the reports and, per step, the blocking reads the clock made (0 on the host's clock).
    """
    reports, blocking = [], []
    for index, step in enumerate(steps):
        waits_before = getattr(clock, "waits", 0)
        arrivals.begin_step(new_epoch=first + index == 0)
        with arrivals.step(float(step.size), step.size, loader_seconds=step.loader):
            clock.now += step.active  # forward, backward: the last bucket is ready
            if step.reports:
                reports.append(arrivals.arrive(1.0))
            arrivals.begin_wait()
            clock.now += step.wait  # the sums wait for the slowest replica
            arrivals.end_wait()
        blocking.append(getattr(clock, "waits", 0) - waits_before)
    return reports, blocking


# Reports at steps 3, 5 and 7, as the engine's first report falls at a fit's fourth step. Each carries the whole
# steps before it, but for the fit's first two (one-time costs, DDP's bucket rebuild): {2}, {3, 4}, {5, 6}.
SCRIPT = [
    Step(size=8, active=0.10, wait=0.50, reports=False, loader=0.01),
    Step(size=9, active=0.20, wait=0.40, reports=False, loader=0.02),
    Step(size=10, active=0.30, wait=0.30, reports=False, loader=0.03),
    Step(size=11, active=0.40, wait=0.20, reports=True, loader=0.04),
    Step(size=12, active=0.50, wait=0.10, reports=False, loader=0.05),
    Step(size=13, active=0.60, wait=0.00, reports=True, loader=0.06),
    Step(size=14, active=0.70, wait=0.05, reports=False, loader=0.07),
    Step(size=15, active=0.80, wait=0.05, reports=True, loader=0.08),
]


def _measured(report: PeriodReport) -> tuple[float, ...]:
    return tuple(getattr(report, name) for name in MEASURED_FIELDS)


def test_the_host_clock_reports_the_whole_steps_before_the_report():
    arrivals, clock = _arrivals(deferred=False)
    reports, blocking = _run_gradient_steps(arrivals, clock, SCRIPT)
    first, second = reports[:2]
    assert (first.work, first.planned, first.steps, first.loader) == (10.0, 10.0, 1.0, pytest.approx(0.03))
    assert (first.active, first.wait_fraction) == (pytest.approx(0.30), pytest.approx(0.30 / 0.60))  # not 0's or 1's
    # Steps 3 and 4: their own time, their waits left out of it (and out of the busy time inside the step).
    assert (second.work, second.planned, second.steps, second.loader) == (23.0, 23.0, 2.0, pytest.approx(0.09))
    assert (second.active, second.busy) == (pytest.approx(0.90), pytest.approx(0.90))
    assert second.wait_fraction == pytest.approx((0.20 + 0.10) / (0.90 + 0.30))
    assert blocking == [0] * len(SCRIPT)


def test_a_deferred_report_carries_the_steps_of_the_report_before():
    arrivals, device = _arrivals(deferred=True)
    reports, _ = _run_gradient_steps(arrivals, device, SCRIPT)
    assert reports[0].steps == 0  # nothing was reported before a fit's first report
    assert not reports[0].measured
    assert (reports[1].work, reports[1].steps, reports[1].active) == (10.0, 1.0, pytest.approx(0.30))
    assert (reports[2].work, reports[2].steps, reports[2].active) == (23.0, 2.0, pytest.approx(0.90))


def test_deferred_reports_are_the_host_reports_one_report_later():
    """Work, planned, steps, loader, busy, active and the wait fraction of some steps travel together."""
    device_arrivals, device = _arrivals(deferred=True)
    host_arrivals, clock = _arrivals(deferred=False)
    deferred, _ = _run_gradient_steps(device_arrivals, device, SCRIPT)
    host, _ = _run_gradient_steps(host_arrivals, clock, SCRIPT)
    for late, now in zip(deferred[1:], host, strict=False):
        assert _measured(late) == pytest.approx(_measured(now))
        assert late.wait_fraction == pytest.approx(now.wait_fraction)


def test_a_report_blocks_at_most_once_and_steps_without_a_report_never():
    arrivals, device = _arrivals(deferred=True)
    _, blocking = _run_gradient_steps(arrivals, device, SCRIPT)
    # The device never caught up on its own: every report with steps to read waits once, for the latest of them.
    assert blocking == [0, 0, 0, 0, 0, 1, 0, 1]


def test_a_report_does_not_block_where_the_device_has_caught_up():
    arrivals, device = _arrivals(deferred=True)
    blocking = []
    for index, step in enumerate(SCRIPT):
        device.catch_up()  # e.g. a loss read on the host: the device ran everything queued before it
        blocking += _run_gradient_steps(arrivals, device, [step], first=index)[1]
    assert blocking == [0] * len(SCRIPT)


def test_active_time_excludes_waiting_for_peers_on_the_device_timeline():
    """A fast replica that waits most of each step for a slow peer measures its own time, not the peer's."""
    arrivals, device = _arrivals(deferred=True)
    steps = [Step(size=8, active=0.01, wait=0.99, reports=index % 4 == 3) for index in range(14)]
    reports, _ = _run_gradient_steps(arrivals, device, steps)
    measured = [report for report in reports if report.measured]
    assert len(measured) == len(reports) - 1
    for report in measured:
        assert report.active / report.steps == pytest.approx(0.01)
        assert report.wait_fraction == pytest.approx(0.99)


def test_a_merge_wait_counts_as_waiting_of_the_step_it_ends():
    """Under model merges the replica arrives after its update; the merge's wait is its step's, read with it."""
    arrivals, device = _arrivals(deferred=True, unmeasured_step=None)
    reports = []
    for index, (active, wait) in enumerate([(0.2, 0.6), (0.1, 0.1), (0.3, 0.1), (0.4, 0.0), (0.5, 0.0), (0.6, 0.0)]):
        arrivals.begin_step(new_epoch=index == 0)
        with arrivals.step(8.0, 8):
            device.now += active
        reports.append(arrivals.arrive(1.0))
        device.now += wait  # the merge's all-reduce waits for the slowest replica
        arrivals.release()
    # Each report reads the steps of the one before: step 1 (whole at step 2) at step 3, step 2 at step 4... (step 0,
    # the fit's first, by none)
    assert [report.steps for report in reports] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert (reports[3].active, reports[3].wait_fraction) == (pytest.approx(0.1), pytest.approx(0.1 / 0.2))
    assert (reports[4].active, reports[4].wait_fraction) == (pytest.approx(0.3), pytest.approx(0.1 / 0.4))
    assert (reports[5].active, reports[5].wait_fraction) == (pytest.approx(0.4), 0.0)
    assert device.waits <= 3  # at most once for each report with steps to read


def test_the_step_running_into_a_new_epoch_is_not_reported():
    arrivals, device = _arrivals(deferred=True)
    _run_gradient_steps(arrivals, device, SCRIPT[:3])
    device.now += 5.0  # the epoch-end hooks
    arrivals.begin_step(new_epoch=True)
    reports = [arrivals.arrive(1.0), arrivals.arrive(1.0)]
    assert (reports[1].work, reports[1].steps, reports[1].active) == (0.0, 0.0, 0.0)  # step 2 ran into the epoch


def test_a_new_fit_starts_without_the_previous_fits_steps():
    arrivals, device = _arrivals(deferred=True)
    _run_gradient_steps(arrivals, device, SCRIPT[:3])
    arrivals.detach()
    arrivals.attach(torch.device("cpu"))
    reports, _ = _run_gradient_steps(arrivals, device, SCRIPT[:6])
    assert [(report.steps, report.work) for report in reports] == [(0.0, 0.0), (1.0, 10.0)]  # its own step 2


def test_a_restart_on_a_deferred_timeline_forgets_the_steps_the_next_report_would_have_read():
    """On a device a report reads the steps of the report before: after sitting out, those are from before it."""
    device = ScriptedDevice()
    arrivals = ArrivalClock(timeline=device)
    arrivals.attach(torch.device("cpu"))
    arrivals.begin_step(new_epoch=True)
    for _ in range(3):  # working steps, then a report, then sitting out
        with arrivals.step(50.0, 50):
            device.now += 1.0
        arrivals.begin_step()
    arrivals.arrive(1.0)
    device.now += 100.0
    arrivals.restart()  # caught up
    with arrivals.step(10.0, 10):
        device.now += 0.1
    arrivals.begin_step()
    assert not arrivals.arrive(1.0).measured
    assert arrivals.arrive(1.0).work == 10.0  # its own step, a report later


def test_a_span_ledger_reads_spans_as_the_device_reaches_them():
    device = ScriptedDevice()
    ledger = SpanLedger(device)
    for seconds in (0.5, 0.25):
        start = device.stamp()
        device.now += seconds
        ledger.add("busy", start, device.stamp())
    assert (ledger.total("busy"), ledger.complete) == (0.0, False)
    device.reached = 2  # the first span's stamps only
    ledger.fold()
    assert ledger.total("busy") == 0.5
    ledger.settle()
    assert (ledger.total("busy"), ledger.complete, device.waits) == (0.75, True, 1)


def test_the_host_timeline_reads_its_clock_at_once():
    clock = ScriptedHost()
    timeline = HostTimeline(clock)
    start = timeline.stamp()
    clock.now = 1.5
    end = timeline.stamp()
    assert timeline.ready(end)
    assert not timeline.deferred
    assert timeline.seconds(start, end) == 1.5


def test_a_span_is_read_only_once_both_its_stamps_are_readable():
    """Stamps of two streams: the device may pass a span's end before its start (recorded on the other stream)."""
    device = ScriptedDevice()
    end = device.stamp()
    device.now = 0.5
    start = device.stamp()  # on another stream, which has not reached it yet
    device.reached = 1
    ledger = SpanLedger(device)
    ledger.add("busy", start, end)
    assert (ledger.total("busy"), ledger.complete) == (0.0, False)


def test_absorbing_a_later_ledger_adds_its_read_spans_and_reads_its_unread_ones_after_its_own():
    device = ScriptedDevice()
    ledger, later = SpanLedger(device), SpanLedger(device)
    for target, seconds in ((ledger, 0.5), (later, 0.25), (later, 0.125)):
        start = device.stamp()
        device.now += seconds
        target.add("active", start, device.stamp())
    device.reached = 4  # the device is past the first two spans, not the third
    later.fold()
    ledger.absorb(later)
    assert (ledger.total("active"), ledger.complete) == (0.25, False)
    ledger.fold()
    assert ledger.total("active") == 0.75
    ledger.settle()
    assert (ledger.total("active"), ledger.complete, device.waits) == (0.875, True, 1)


def test_the_host_timeline_reads_perf_counter_by_default():
    timeline = HostTimeline()
    start = timeline.stamp()
    assert isinstance(start, float)
    assert timeline.seconds(start, timeline.stamp()) >= 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is missing")
def test_the_cuda_timeline_needs_cuda():
    with pytest.raises(ValueError, match="CUDA is not available"):
        CudaTimeline(torch.device("cuda"))


# ------------------------------------------------------------------------------------------------ on a GPU
# The test process never initialises CUDA (see conftest.py): each body runs in a fresh process.


@pytest.mark.cuda
def test_sensed_active_time_follows_the_gpu_time_of_the_work(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    run_on_cuda("test_device_timeline:sensed_active_follows_gpu_time")


@pytest.mark.cuda
def test_cuda_stamps_are_readable_once_the_device_reached_them(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    run_on_cuda("test_device_timeline:cuda_stamps_are_read_without_waiting")


MATRIX_SIZE = 4096
MATMULS_PER_STEP = 8
PEER_SPIN_CYCLES = 20_000_000  # about 10 ms at GPU clock rates
GPU_STEPS = 16
REPORT_EVERY = 3


class CountingCudaTimeline(CudaTimeline):
    """The CUDA timeline, counting the host's blocking reads."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.waits = 0

    def wait(self, stamp: Any) -> None:
        self.waits += 1
        super().wait(stamp)


def _join_a_slow_peer(compute: torch.cuda.Stream, collective: torch.cuda.Stream) -> None:
    """A collective as NCCL queues it: after the compute queued so far, with the compute stream waiting for it.

    The slow peer is a spin on the collective's stream: the compute stream then stands still on the device, as
    it does while a peer has not arrived.
    """
    collective.wait_stream(compute)
    with torch.cuda.stream(collective):
        torch.cuda._sleep(PEER_SPIN_CYCLES)
    compute.wait_stream(collective)


def sensed_active_follows_gpu_time() -> None:
    """Long GPU work and short host work per step: the sensed active time is the GPU time, waits left out."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    matrix = torch.randn(MATRIX_SIZE, MATRIX_SIZE, device=device) / MATRIX_SIZE**0.5
    work = matrix.clone()
    for _ in range(4):  # cuBLAS and the kernels load before anything is timed
        work = torch.tanh(work @ matrix)
    torch.cuda.synchronize(device)
    timeline = CountingCudaTimeline(device)
    arrivals = ArrivalClock(timeline=timeline)
    arrivals.attach(device)
    compute, collective = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    pairs, reports, waits_in_reports = [], [], 0
    for step in range(GPU_STEPS):
        arrivals.begin_step(new_epoch=step == 0)  # as the engine's begin_step says
        with arrivals.step(16.0, 16):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(compute)
            for _ in range(MATMULS_PER_STEP):
                work = torch.tanh(work @ matrix)
            end.record(compute)
            pairs.append((start, end))
            # The engine's first report falls at FIRST_REPORT_STEP; it measures steps from the fit's second on.
            due = step >= FIRST_REPORT_STEP and (step - FIRST_REPORT_STEP) % REPORT_EVERY == 0
            if due:
                before = timeline.waits
                reports.append(arrivals.arrive(1.0))
                assert timeline.waits - before <= 1, "a report blocked the host more than once"
                waits_in_reports += timeline.waits - before
            arrivals.begin_wait()
            _join_a_slow_peer(compute, collective)
            arrivals.end_wait()
    torch.cuda.synchronize(device)
    assert timeline.waits == waits_in_reports, "the arrival clock blocked the host outside a report"
    assert reports[0].steps == 0
    measured = [report for report in reports if report.measured]
    assert len(measured) == len(reports) - 1, [report.steps for report in reports]
    covered = int(sum(report.steps for report in measured))  # steps 1 on: reports follow one another
    sensed = sum(report.active for report in measured) / covered
    gpu = sum(start.elapsed_time(end) for start, end in pairs[1 : 1 + covered]) / covered / 1000.0
    assert abs(sensed - gpu) <= 0.1 * gpu, f"sensed {sensed:.4f} s of activity per step, the GPU worked {gpu:.4f} s"
    assert all(report.wait_fraction > 0.1 for report in measured), [report.wait_fraction for report in measured]


def cuda_stamps_are_read_without_waiting() -> None:
    """Stamps behind a busy stream are not readable, and reading them waits for nothing else."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    timeline = CudaTimeline(device)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(PEER_SPIN_CYCLES * 20)  # the stream is busy for a while
    start = timeline.stamp()
    torch.cuda._sleep(PEER_SPIN_CYCLES)
    end = timeline.stamp()
    ledger = SpanLedger(timeline)
    ledger.add("busy", start, end)
    assert not timeline.ready(end)  # the host did not wait
    assert not ledger.complete
    ledger.settle()
    assert ledger.complete
    assert timeline.ready(start)
    assert 0.0 < ledger.total("busy") < 10.0
