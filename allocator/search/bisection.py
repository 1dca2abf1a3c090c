"""The one bisection: the integer where a monotone test stops holding, used by every search over one number (the
smallest budget that works, the longest context that fits, how many experts can move, the least balanced bound).

Notes
-----
O(log |fails - holds|) calls of the test, fewer with ``precision``. Deterministic: the same calls in the same order
for the same arguments.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["boundary"]


def boundary(ok: Callable[[int], bool], holds: int, fails: int, *, precision: int = 0) -> int:
    """The integer next to ``fails`` where ``ok`` still holds, for ``ok`` monotone between ``holds`` and ``fails``.

    ``ok(holds)`` is known to hold and ``ok(fails)`` known not to (neither is called). ``holds < fails`` finds the
    largest value that holds (the longest context that fits); ``holds > fails`` the smallest (the smallest budget
    that works). Each step tests the middle ``(holds + fails) // 2`` and keeps the half where the boundary lies.

    Parameters
    ----------
    ok : callable
        ``ok(value) -> bool``, monotone: true from ``holds`` up to the boundary, false after it.
    holds, fails : int
        The bracket: a value where ``ok`` holds and one where it does not.
    precision : int
        Where positive, stop once the bracket is at most ``|holds| // precision`` wide (``100``: to 1 %); exact
        otherwise.

    Returns
    -------
    int
        The last value found to hold (``holds`` itself where no value between holds).

    Examples
    --------
    >>> boundary(lambda t: t * t <= 50, 0, 100)         # the largest t with t² ≤ 50
    7
    >>> boundary(lambda t: t * t >= 50, 100, 0)         # the smallest t with t² ≥ 50
    8
    >>> boundary(lambda b: b >= 12_345, 100_000, 0, precision=100)   # to 1 %
    12402
    """
    while abs(fails - holds) > max(1, abs(holds) // precision if precision > 0 else 1):
        middle = (holds + fails) // 2
        if ok(middle):
            holds = middle
        else:
            fails = middle
    return holds
