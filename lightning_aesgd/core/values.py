"""What counts as a whole or a real number in an option: any integral or real type, NumPy's included, but no bool.

``True`` is an ``int`` to Python, so ``period=True`` would pass a plain ``isinstance`` check as 1; every option
check in the package asks these two instead.
"""

from __future__ import annotations

import numbers

__all__ = ["is_real", "is_whole", "plain"]


def is_whole(value: object) -> bool:
    """Whether ``value`` is an integer (a Python or NumPy one), not a bool.

    Example:
        >>> is_whole(3), is_whole(True), is_whole(3.0)
        (True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Whether ``value`` is a real number (integers included), not a bool.

    Example:
        >>> is_real(0.5), is_real(2), is_real(False)
        (True, True, False)
    """
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def plain(value: object) -> object:
    """``value`` with NumPy's (or any other library's) numbers made Python's ``int`` and ``float``, in lists too.

    What options hold ends up in checkpoints, which torch loads with ``weights_only=True`` (no NumPy scalars),
    and in JSON summaries. Bools and everything else come back as they are.

    Example:
        >>> import numpy as np
        >>> plain(np.int64(8)), plain([np.float32(0.5), 2]), plain(True)
        (8, [0.5, 2], True)
    """
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return type(value)(plain(item) for item in value)
    return value
