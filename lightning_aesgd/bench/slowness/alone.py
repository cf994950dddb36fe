"""``slowness --alone``: a case under ``adaptive_elastic`` alone, as one JSON line, to compare versions of the strategy.

Two versions of the strategy are compared by alternating their runs on one machine
(``scripts/alternate_commits.py``): without DDP beside them each run is short, and the figures say what changed in
the strategy's own behaviour, not only its ratio to DDP. Per run, from rank zero's clock and the plans:

* ``ms_per_step``: mean milliseconds per step from step 10 to the end, and ``ms_per_step_from_100`` from step 100
  (``None`` for a run that short);
* ``left_out_at``: per replica, the first step of the first plan that left it out (``None``: never);
* ``probes``: the steps from which a left-out replica was given work again (a probe, or back in for good).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.utils.data import TensorDataset

from lightning_aesgd.bench.slowness.cases import Case
from lightning_aesgd.bench.slowness.runner import WARMUP_STEPS, run_once

LATE_STEP = 100
"""The step from which ``ms_per_step_from_100`` counts (after the first plans and leavings, in most cases)."""


def run_alone(case: Case, dataset: TensorDataset, steps: int, out: Path) -> dict[str, Any]:
    """Train ``steps`` steps of ``case`` under ``adaptive_elastic`` only; the run's figures (see the module)."""
    run_once(case, "adaptive_elastic", dataset, steps, out, name="alone")
    return alone_figures(json.loads((out / "runs" / f"{case.name}-alone.json").read_text()))


def alone_figures(record: dict[str, Any]) -> dict[str, Any]:
    """The figures of one :class:`~lightning_aesgd.bench.slowness.runner.StepClock` record (see the module).

    Example:
        >>> plans = {"starts": [0, 5, 40, 43], "sizes": [[4, 4], [8, 0], [6, 2], [8, 0]]}
        >>> times = [0.01 * step for step in range(120)]
        >>> alone_figures({"times": times, "plans": plans})
        {'ms_per_step': 10.0, 'ms_per_step_from_100': 10.0, 'left_out_at': [None, 5], 'probes': [40]}
    """
    times, plans = record["times"], record["plans"]
    figures: dict[str, Any] = {"ms_per_step": _ms_per_step(times, WARMUP_STEPS)}
    figures["ms_per_step_from_100"] = _ms_per_step(times, LATE_STEP)
    starts, sizes = plans["starts"], plans["sizes"]
    figures["left_out_at"] = [
        next((start for start, plan in zip(starts, sizes, strict=True) if plan[rank] == 0), None)
        for rank in range(len(sizes[0]))
    ]
    figures["probes"] = [
        start
        for start, plan, before in zip(starts[1:], sizes[1:], sizes[:-1], strict=True)
        if any(size > 0 and was == 0 for size, was in zip(plan, before, strict=True))
    ]
    return figures


def _ms_per_step(times: list[float], first: int) -> float | None:
    """Mean milliseconds per step from step ``first`` on; ``None`` where the run is not longer than that."""
    if len(times) <= first:
        return None
    return round(1000 * (times[-1] - times[first - 1]) / (len(times) - first), 2)
