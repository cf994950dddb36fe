"""Crossbow's auto-tuner of learners per device: add a learner while the throughput rises enough.

Koliousis et al. (Crossbow, PVLDB 12(11), 2019, §5) start every GPU with one learner and add learners while the
measured throughput rises, up to the device's memory. With ``r_k`` the samples per second of ``k`` learners and
``g`` the smallest rise worth a learner, the tuner keeps

    k* = max { k : r_j ≥ (1 + g)·r_{j−1} for every 1 < j ≤ k },

and measures ``k + 1`` only while ``k`` is still the choice. Pure: the caller measures, and every replica decides
from the same (summed) rates.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = ["learners_to_keep", "measures_more", "rates_text"]


def learners_to_keep(rates: Sequence[float], min_gain: float) -> int:
    """The number of learners to keep, given ``rates[k − 1]``, the throughput of ``k`` learners.

    Example:
        >>> learners_to_keep([100.0, 180.0, 190.0], min_gain=0.1)
        2
    """
    if not rates:
        raise ValueError("Measure at least one learner before choosing how many to keep.")
    if min_gain < 0 or not math.isfinite(min_gain):
        raise ValueError(f"`min_gain` is a fraction of throughput >= 0, got {min_gain}.")
    keep = 1
    for previous, current in itertools.pairwise(rates):
        if not (current > 0.0 and current >= (1.0 + min_gain) * previous):  # a failed one (0, nan) ends it too
            break
        keep += 1
    return keep


def measures_more(rates: Sequence[float], min_gain: float, max_learners: int) -> bool:
    """Whether to measure one learner more: every learner so far paid for itself, and the cap is not reached.

    A failed measurement (rate 0: the device out of memory) ends the search, even of the first learner.
    """
    if not rates[-1] > 0.0:
        return False
    return len(rates) < max_learners and learners_to_keep(rates, min_gain) == len(rates)


def rates_text(rates: Sequence[float]) -> str:
    """The measured rates by number of learners, for logs and the summary; a learner count that could not run says so.

    Example:
        >>> rates_text([1200.0, 2300.5, 0.0])
        '1: 1,200, 2: 2,300, 3: did not run'
    """
    return ", ".join(f"{k}: {rate:,.0f}" if rate > 0 else f"{k}: did not run" for k, rate in enumerate(rates, start=1))
