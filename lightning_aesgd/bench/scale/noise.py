"""The simulation's per-step noise: measured step times of one replica, each over their median.

:data:`STEP_TIME_RATIOS` holds the ratios of one measured run, stored so that the simulation needs no run of its
own: one replica alone (no strategy), the measured part's ``user`` slowness at cost 1 (64 ms per 64-sample
step), rank zero's wall clock at the end of every step after the warm-up. :func:`measure_step_noise` repeats the
measurement (``python -m lightning_aesgd.bench scale --measure-noise STEPS``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from lightning_aesgd.bench.slowness.cases import Case

NOISE_CASE = Case("noise", "user", (1.0,))
"""One replica at cost 1 with the slowness in the user's ``training_step``, as the measured part's."""
SKIPPED_STEPS = 10
"""Steps before the first measured one (start-up), as in the measured runs."""

# fmt: off
# Measured with `python -m lightning_aesgd.bench scale --measure-noise 110` (100 steps after 10 skipped) on the
# 2-core machine of the results, shared with other work at the time (load average about 3).
STEP_TIME_RATIOS: tuple[float, ...] = (
    0.9983, 0.9983, 0.9984, 0.9984, 0.9984, 0.9984, 0.9985, 0.9985, 0.9985, 0.9985, 0.9986, 0.9986,
    0.9986, 0.9987, 0.9987, 0.9987, 0.9987, 0.9987, 0.9987, 0.9988, 0.9989, 0.9989, 0.9989, 0.9991,
    0.9991, 0.9992, 0.9992, 0.9993, 0.9993, 0.9993, 0.9993, 0.9993, 0.9994, 0.9994, 0.9994, 0.9995,
    0.9996, 0.9996, 0.9997, 0.9997, 0.9997, 0.9997, 0.9997, 0.9998, 0.9999, 0.9999, 0.9999, 0.9999,
    0.9999, 1.0000, 1.0000, 1.0000, 1.0001, 1.0001, 1.0001, 1.0001, 1.0001, 1.0002, 1.0002, 1.0002,
    1.0003, 1.0004, 1.0004, 1.0005, 1.0006, 1.0006, 1.0007, 1.0007, 1.0009, 1.0010, 1.0010, 1.0011,
    1.0011, 1.0011, 1.0011, 1.0012, 1.0013, 1.0013, 1.0014, 1.0015, 1.0017, 1.0018, 1.0019, 1.0019,
    1.0020, 1.0021, 1.0022, 1.0022, 1.0022, 1.0023, 1.0023, 1.0026, 1.0026, 1.0029, 1.0035, 1.0131,
    1.0328, 1.0419, 1.0604, 1.0684,
)
"""Step times over their median, sorted."""
# fmt: on


def relative_step_times(times: Sequence[float], skipped: int = SKIPPED_STEPS) -> list[float]:
    """The steps after the first ``skipped`` (end to end, as the measured runs time them) over their median, sorted.

    Example:
        >>> relative_step_times([0.0, 1.0, 2.0, 3.1, 4.0, 5.2], skipped=1)
        [0.9, 1.0, 1.0, 1.1, 1.2]
    """
    durations = [later - earlier for earlier, later in zip(times[skipped - 1 : -1], times[skipped:], strict=True)]
    middle = statistics.median(durations)
    return sorted(round(duration / middle, 4) for duration in durations)


def measure_step_noise(steps: int, out: Path) -> list[float]:
    """Train :data:`NOISE_CASE` alone for ``steps`` steps; returns :func:`relative_step_times` of its steps."""
    # Imported here: the simulation itself needs neither Lightning nor the data.
    from lightning_aesgd.bench.slowness.model import load_data
    from lightning_aesgd.bench.slowness.runner import run_once

    run_once(NOISE_CASE, "solo", load_data(), steps, out)
    # Where run_once's StepClock writes rank zero's record.
    record = json.loads((out / "runs" / f"{NOISE_CASE.name}-solo.json").read_text())
    return relative_step_times(record["times"])
