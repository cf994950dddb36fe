"""Verdicts: does what we measured support what a paper says? Pure functions of every repeat's figures.

A claim names a *candidate* (the method the paper advocates) and its fair *rivals*. :func:`judge` compares their
training-clock times to a target metric, repeat by repeat; a repeat that never met the target counts as an
infinite time. Its verdict is one of:

* **reproduced**: every judged entrant has at least :data:`MIN_REPEATS` repeats, and the candidate is beyond the
  spread of every rival: its slowest repeat reached the target before the fastest repeat of each rival
  (``max(candidate) < min(rival)``, equivalently: the largest ratio of a candidate repeat to a rival repeat is
  below 1); and its median final metric is no more than ``tolerance`` below the best rival's;
* **partly reproduced**: beyond every rival's spread on time, at a final metric more than ``tolerance`` below the
  best rival's;
* **not reproduced**: at least :data:`MIN_REPEATS` repeats each, and the candidate is beyond the spread of some
  rival on the wrong side: its fastest repeat came after that rival's slowest (``min(candidate) > max(rival)``);
* **tie**: anything else: the repeats overlap, or there are too few to tell a difference from the noise;
* **inconclusive**: neither the candidate nor any rival met the target in most of its repeats;
* **not implemented**: the capability the claim needs does not exist yet (its race was not run);
* **not run**: the claim needs hardware this machine lacks (a GPU); its race runs where it has it;
* **failed**: the claim's race could not be measured (an error, or a judged entrant whose repeats all crashed).

Why complete separation: if the candidate and the rival were equally fast, so that their ``n + m`` times were
exchangeable, every repeat of the candidate would come before every repeat of the rival with probability
``1 / C(n + m, n)``: 1/252 with 5 repeats each, 1/70 with 4. Five repeats keep a "reproduced" that is due to
chance below 1%, whatever the times' distribution, where a ratio of medians says nothing about chance.

The table names the *strongest* rival (the best median time; a missed target counts as infinite), whose spread
it shows, but the candidate is judged against every fair rival: a weaker rival whose repeats overlap the
candidate's still makes a tie.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MIN_REPEATS",
    "AllRepeatsCrashedError",
    "Measured",
    "Verdict",
    "failed",
    "judge",
    "median_or_none",
    "not_implemented",
    "not_run",
    "range_text",
    "separation",
    "spread_text",
    "strongest_rival",
]

Status = Literal[
    "reproduced", "partly reproduced", "tie", "not reproduced", "inconclusive", "not implemented", "not run", "failed"
]
Side = Literal["faster", "slower", "overlap"]

MIN_REPEATS = 5
"""Repeats of the candidate and of every rival below which no claim is reproduced or refuted."""


class AllRepeatsCrashedError(RuntimeError):
    """A judged entrant has no repeat to judge: leaving it out would judge the claim against weaker rivals."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        super().__init__(f"every repeat of {', '.join(self.names)} crashed")


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median, a missing value counting as infinitely late; ``None`` when most are missing.

    Example:
        >>> median_or_none([1.0, None, 2.0]), median_or_none([1.0, None, None]), median_or_none([])
        (2.0, None, None)
    """
    if not values:
        return None
    middle = statistics.median(_late(v) for v in values)
    return middle if math.isfinite(middle) else None


def _late(value: float | None) -> float:
    """A time to the target, a missed target (``None``, NaN or infinite) counting as infinitely late."""
    return value if value is not None and math.isfinite(value) else math.inf


@dataclass(frozen=True)
class Measured:
    """One entrant's figures, repeat by repeat: the repeats that ran to the end, and how many crashed.

    Attributes:
        name: the entrant.
        times: training-clock seconds to the target of each finished repeat; ``None`` where it missed the target.
        epochs: epochs of data processed when each finished repeat first met the target (``None``: missed).
        finals: the target's metric after the last epoch of each finished repeat.
        crashed: repeats that raised instead of finishing (in none of the tuples).
    """

    name: str
    times: tuple[float | None, ...] = ()
    epochs: tuple[float | None, ...] = ()
    finals: tuple[float | None, ...] = ()
    crashed: int = 0

    @property
    def repeats(self) -> int:
        """The finished repeats."""
        return len(self.times)

    @property
    def time_to_target(self) -> float | None:
        """Median seconds to the target (:func:`median_or_none`)."""
        return median_or_none(self.times)

    @property
    def epochs_to_target(self) -> float | None:
        """Median epochs to the target (:func:`median_or_none`)."""
        return median_or_none(self.epochs)

    @property
    def final_metric(self) -> float | None:
        """Median final metric of the repeats that logged one."""
        finals = [v for v in self.finals if v is not None and math.isfinite(v)]
        return statistics.median(finals) if finals else None

    def span(self) -> tuple[float, float]:
        """The fastest and slowest repeat's time, a missed target counting as infinite.

        Example:
            >>> Measured("ddp", times=(4.0, None, 3.0)).span()
            (3.0, inf)
        """
        if not self.times:
            raise AllRepeatsCrashedError([self.name])
        late = [_late(v) for v in self.times]
        return min(late), max(late)


@dataclass(frozen=True)
class Verdict:
    """What a claim's measurement says: a status, the rival it is shown against, the spread, and the figures."""

    status: Status
    measured: str
    rival: str = ""
    spread: str = ""


def not_implemented(reason: str) -> Verdict:
    """A claim whose capability does not exist yet, with what is missing.

    Example:
        >>> not_implemented("configs/algorithm/x.yaml missing").measured
        'not implemented: configs/algorithm/x.yaml missing'
    """
    return Verdict("not implemented", f"not implemented: {reason}")


def not_run(reason: str) -> Verdict:
    """A claim this machine cannot measure (it needs a GPU), with what would.

    Example:
        >>> not_run("needs a GPU").status
        'not run'
    """
    return Verdict("not run", f"not run here: {reason}")


def failed(reason: str) -> Verdict:
    """A claim whose race could not be measured, with why.

    Example:
        >>> failed("every repeat of ddp crashed").status
        'failed'
    """
    return Verdict("failed", f"failed: {reason}")


def separation(candidate: Measured, rival: Measured) -> Side:
    """Where the candidate's repeats lie against the rival's: ``"faster"``, ``"slower"`` or ``"overlap"``.

    ``"faster"``: the candidate's slowest repeat beat the rival's fastest, ``max(candidate) < min(rival)``;
    ``"slower"``: its fastest came after the rival's slowest, ``min(candidate) > max(rival)``; ``"overlap"``
    otherwise (equal times included). A missed target counts as infinite, so two entrants that both missed it
    in some repeat overlap.

    Raises:
        AllRepeatsCrashedError: either has no finished repeat.

    Example:
        >>> separation(Measured("a", times=(1.0, 2.0)), Measured("b", times=(3.0, None)))
        'faster'
        >>> separation(Measured("a", times=(1.0, 3.5)), Measured("b", times=(3.0, 4.0)))
        'overlap'
    """
    own_fastest, own_slowest = candidate.span()
    their_fastest, their_slowest = rival.span()
    if own_slowest < their_fastest:
        return "faster"
    if own_fastest > their_slowest:
        return "slower"
    return "overlap"


def strongest_rival(rivals: Sequence[Measured]) -> Measured:
    """The rival with the best median time (a median that missed the target is infinite).

    Equal medians are decided by the fastest repeat, then by the rivals' order.

    Example:
        >>> strongest_rival([Measured("sma", times=(5.0,)), Measured("ddp", times=(4.0, 6.0))]).name
        'ddp'
    """
    if not rivals:
        raise ValueError("A claim compares its method with at least one rival.")
    return min(rivals, key=lambda r: (_late(r.time_to_target), r.span()[0]))


def judge(
    candidate: Measured,
    rivals: Sequence[Measured],
    tolerance: float = 0.01,
    metric: str = "metric",
    min_repeats: int = MIN_REPEATS,
) -> Verdict:
    """The verdict on ``candidate`` against ``rivals`` by the rules of this module, with its figures in words.

    Args:
        candidate: the paper's method.
        rivals: every fair rival it is judged against (the strongest is the one shown).
        tolerance: how far the candidate's median final metric may fall below the best rival's (higher is
            better).
        metric: the metric's name, for the text.
        min_repeats: finished repeats each entrant needs for a verdict other than a tie.

    Raises:
        ValueError: no rival.
        AllRepeatsCrashedError: the candidate or a rival has no finished repeat.

    Example:
        >>> fast = Measured("adaptive", times=(4.0, 4.2, 4.1, 4.3, 4.4), finals=(0.93,) * 5)
        >>> slow = Measured("ddp", times=(5.0, 5.5, 5.2, 5.1, 5.3), finals=(0.93,) * 5)
        >>> judge(fast, [slow]).status, judge(slow, [fast]).status
        ('reproduced', 'not reproduced')
        >>> judge(fast, [slow], min_repeats=6).status
        'tie'
    """
    if not rivals:
        raise ValueError("A claim compares its method with at least one rival.")
    crashed = [m.name for m in (candidate, *rivals) if m.repeats == 0]
    if crashed:
        raise AllRepeatsCrashedError(crashed)
    strongest = strongest_rival(rivals)
    sides = {rival.name: separation(candidate, rival) for rival in rivals}
    fewest = min(m.repeats for m in (candidate, *rivals))
    finals = [r.final_metric for r in rivals if r.final_metric is not None]
    best_final = max(finals) if finals else None
    own_final = candidate.final_metric
    accuracy_kept = own_final is not None and (best_final is None or own_final >= best_final - tolerance)

    status: Status
    if candidate.time_to_target is None and all(r.time_to_target is None for r in rivals):
        status, reason = "inconclusive", "nobody met the target in most repeats"
    elif fewest < min_repeats:
        status, reason = "tie", f"too few repeats to tell ({fewest} < {min_repeats})"
    elif any(side == "slower" for side in sides.values()):
        status, reason = "not reproduced", _beyond("slower", sides, strongest.name)
    elif all(side == "faster" for side in sides.values()):
        status = "reproduced" if accuracy_kept else "partly reproduced"
        reason = _beyond("faster", sides, strongest.name)
        if not accuracy_kept:
            reason += f", but its final {metric} is more than {tolerance:g} below the best rival's"
    else:
        overlapping = [name for name, side in sides.items() if side == "overlap"]
        status, reason = "tie", f"repeats overlap {_names(overlapping)}"

    pace = _pace_text(candidate, strongest, rivals)
    final = f"final {metric} {_metric_text(own_final)} (best rival {_metric_text(best_final)})"
    return Verdict(status, f"{pace}; {final}; {reason}", strongest.name, spread_text(candidate, strongest))


def _pace_text(candidate: Measured, strongest: Measured, rivals: Sequence[Measured]) -> str:
    """The medians: the candidate's as a ratio of the strongest rival's, then of the other rivals'."""
    own = candidate.time_to_target
    others = [r for r in rivals if r is not strongest]
    if own is None:
        shown = ", ".join(f"{r.name} {_seconds(r.time_to_target)}" for r in [strongest, *others])
        return f"median time to target: {candidate.name} not reached; {shown}"
    text = f"median time to target: {candidate.name} {_seconds(own)} = {_versus(own, strongest)}"
    if strongest.time_to_target is not None:
        text += f" {_seconds(strongest.time_to_target)}"
    if others:
        text += f" ({', '.join(_versus(own, r) for r in others)})"
    return text


def _versus(own: float, rival: Measured) -> str:
    ratio = None if rival.time_to_target is None else _divide(own, rival.time_to_target)
    return f"{rival.name} not reached" if ratio is None else f"{_number(ratio)}× {rival.name}'s"


def _beyond(side: Side, sides: dict[str, Side], strongest: str) -> str:
    if side == "faster":
        return "every repeat beat every repeat of " + _names(list(sides))
    names = [name for name, s in sides.items() if s == "slower"]
    names.sort(key=lambda name: name != strongest)  # the shown rival first
    return "every repeat came after every repeat of " + _names(names)


def _names(names: Sequence[str]) -> str:
    return ", ".join(names)


def spread_text(candidate: Measured, rival: Measured) -> str:
    """The fastest–slowest repeat of both (``∞``: a missed target) and the range of their repeats' ratios.

    The ratio's range runs from ``min(candidate) / max(rival)`` to ``max(candidate) / min(rival)``: the
    candidate is beyond the rival's spread when the range lies wholly below 1 (or above 1, on the wrong side).

    Example:
        >>> spread_text(Measured("a", times=(4.0, 5.0)), Measured("b", times=(4.5, 6.0, None), crashed=1))
        'a 4.0–5.0 s (2 repeats), b 4.5–∞ s (3 repeats, 1 crashed); ratio 0.00–1.11'
    """
    own_fastest, own_slowest = candidate.span()
    their_fastest, their_slowest = rival.span()
    low, high = _divide(own_fastest, their_slowest), _divide(own_slowest, their_fastest)
    ratio = f"{_number(low)}–{_number(high)}" if low is not None and high is not None else "–"
    return f"{range_text(candidate)}, {range_text(rival)}; ratio {ratio}"


def range_text(measured: Measured) -> str:
    """The fastest–slowest repeat's time (``∞``: a missed target), with the finished and crashed repeats.

    Example:
        >>> range_text(Measured("ddp", times=(5.2, 4.8, None), crashed=1))
        'ddp 4.8–∞ s (3 repeats, 1 crashed)'
        >>> range_text(Measured("ddp", crashed=2))
        'ddp: 2 repeats crashed'
    """
    if not measured.repeats:
        return f"{measured.name}: {measured.crashed} repeats crashed"
    fastest, slowest = measured.span()
    repeats = f"{measured.repeats} repeat{'s' if measured.repeats != 1 else ''}"
    if measured.crashed:
        repeats += f", {measured.crashed} crashed"
    if math.isinf(fastest):
        return f"{measured.name} never at the target ({repeats})"
    return f"{measured.name} {_number(fastest, '.1f')}–{_number(slowest, '.1f')} s ({repeats})"


def _divide(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator`` for times, an infinite time over a finite one infinite; undefined for ∞/∞."""
    if denominator == 0 or (math.isinf(numerator) and math.isinf(denominator)):
        return None
    return numerator / denominator


def _number(value: float | None, spec: str = ".2f") -> str:
    if value is None:
        return "–"
    return "∞" if math.isinf(value) else format(value, spec)


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


def _metric_text(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"
