"""Verdicts: does what we measured support what a paper says? Pure functions of the measured figures.

A claim names a *candidate* (the method the paper advocates) and its *rivals*. :func:`faster_verdict` compares
their time (or epochs) to a target metric and their final metric at equal epochs:

* **reproduced**: the candidate reaches the target before every rival (each ratio below ``margin``; a rival that
  never reaches it counts as slower) and its final metric is no worse than the best rival's by more than
  ``tolerance``;
* **partly reproduced**: faster than every rival at a final metric more than ``tolerance`` below the best, or
  faster than some rivals but not all;
* **not reproduced**: no rival is slower, or the candidate never reaches the target while a rival does;
* **inconclusive**: nobody reaches the target, so no time can be compared;
* **not run**: the claim could not be measured (e.g. its algorithm does not exist yet).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["NOT_RUN", "Measured", "Verdict", "faster_verdict", "not_run"]

Status = Literal["reproduced", "partly reproduced", "not reproduced", "inconclusive", "not run"]
NOT_RUN: Status = "not run"
Pace = Literal["time", "epochs"]


@dataclass(frozen=True)
class Measured:
    """One entrant's figures (medians over repeats); ``None`` where a figure does not exist.

    Attributes:
        name: the entrant.
        time_to_target: training-clock seconds to the target.
        epochs_to_target: epochs of data processed when the target was first met.
        final_metric: the target's metric after the last epoch.
    """

    name: str
    time_to_target: float | None = None
    epochs_to_target: float | None = None
    final_metric: float | None = None

    def pace(self, kind: Pace) -> float | None:
        """Time or epochs to the target, ``None`` where not reached."""
        value = self.time_to_target if kind == "time" else self.epochs_to_target
        return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class Verdict:
    """What a claim's measurement says: a status, and the figures behind it in words."""

    status: Status
    measured: str


def not_run(reason: str) -> Verdict:
    """A claim that was not measured, with why (e.g. ``"not run: algorithm missing"``).

    Example:
        >>> not_run("algorithm missing").measured
        'not run: algorithm missing'
    """
    return Verdict(NOT_RUN, f"not run: {reason}")


def faster_verdict(
    candidate: Measured,
    rivals: Sequence[Measured],
    kind: Pace = "time",
    tolerance: float = 0.01,
    margin: float = 1.0,
    metric: str = "metric",
) -> Verdict:
    """Whether ``candidate`` reaches the target before every rival without losing more than ``tolerance``.

    Args:
        candidate: the paper's method.
        rivals: what the paper compares it with.
        kind: compare ``"time"`` (training clock) or ``"epochs"`` (statistical efficiency) to the target.
        tolerance: how far the candidate's final metric may fall below the best rival's (higher is better).
        margin: the ratio of paces below which the candidate counts as faster (1: any gain).
        metric: the metric's name, for the text.

    Example:
        >>> fast = Measured("adaptive", time_to_target=5.0, final_metric=0.93)
        >>> faster_verdict(fast, [Measured("ddp", time_to_target=10.0, final_metric=0.93)]).status
        'reproduced'
        >>> faster_verdict(fast, [Measured("ddp", time_to_target=4.0, final_metric=0.93)]).status
        'not reproduced'
    """
    if not rivals:
        raise ValueError("A claim compares its method with at least one rival.")
    unit = "s" if kind == "time" else " epochs"
    own = candidate.pace(kind)
    parts = []
    faster = 0
    for rival in rivals:
        theirs = rival.pace(kind)
        if own is None:
            parts.append(f"{rival.name} {_pace_text(theirs, unit)}")
            continue
        if theirs is None:
            faster += 1
            parts.append(f"{rival.name} not reached")
            continue
        ratio = own / theirs if theirs > 0 else math.inf
        faster += ratio < margin
        parts.append(f"{ratio:.2f}× {rival.name}'s")
    finals = [r.final_metric for r in rivals if r.final_metric is not None]
    best = max(finals) if finals else None
    accuracy_kept = candidate.final_metric is not None and (best is None or candidate.final_metric >= best - tolerance)
    pace_text = f"{candidate.name} {_pace_text(own, unit)}"
    if own is not None:
        pace_text += " = " + ", ".join(parts)
    else:
        pace_text += "; " + ", ".join(parts)
    final_text = f"final {metric} {_metric_text(candidate.final_metric)} (best rival {_metric_text(best)})"
    measured = f"{'time' if kind == 'time' else 'epochs'} to target: {pace_text}; {final_text}"
    return Verdict(_status(own, rivals, kind, faster, accuracy_kept), measured)


def _status(own: float | None, rivals: Sequence[Measured], kind: Pace, faster: int, accuracy_kept: bool) -> Status:
    if own is None:
        return "inconclusive" if all(r.pace(kind) is None for r in rivals) else "not reproduced"
    if faster == len(rivals):
        return "reproduced" if accuracy_kept else "partly reproduced"
    return "partly reproduced" if faster > 0 else "not reproduced"


def _pace_text(value: float | None, unit: str) -> str:
    return "not reached" if value is None else f"{value:.2f}{unit}" if unit != "s" else f"{value:.1f} s"


def _metric_text(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"
