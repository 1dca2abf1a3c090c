"""Contiguous partitions: cut a sequence of sizes into consecutive parts, each part within its own limit.

The exact core shared by :func:`allocator.parallel.contiguous_min_max` (pipeline stages) and the ``balanced``
strategy (a model over accelerators). Free of torch, so strategies may use it.

Glossary
--------
cuts
    The ``n - 1`` boundaries of ``n`` parts, non-decreasing: part ``j`` is ``sizes[c[j - 1]:c[j]]`` with
    ``c[-1] = 0`` and ``c[n - 1] = len(sizes)`` implied. Two equal cuts make an empty part.
limits
    One bound per part on the sum of its sizes (a negative limit admits no part at all, not even an empty one).
mins
    One lower bound per part on its number of items (0: the part may be empty).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate

from .bisection import boundary

__all__ = ["prefix_sums", "reachable", "split", "least_feasible", "parts"]


def prefix_sums(sizes: Sequence[int]) -> list[int]:
    """``[0, s0, s0 + s1, ...]``.

    >>> prefix_sums([3, 1, 2])
    [0, 3, 4, 6]
    """
    return list(accumulate(sizes, initial=0))


def reachable(prefix: Sequence[int], limits: Sequence[int],
              mins: Sequence[int] | None = None) -> list[list[int]] | None:
    """For each ``j``, the sorted end positions of the first ``j`` parts over all splits whose part ``i < j`` sums to
    at most ``limits[i]`` and holds at least ``mins[i]`` items, leaving enough items for the remaining parts' minimums;
    ``None`` when no split of the whole sequence exists.

    ``mins`` defaults to one item per part. Two-pointer sweep over the prefix sums: O(n · N) for ``n`` parts and
    ``N`` items.

    >>> reachable(prefix_sums([2, 2, 2]), [4, 2])
    [[0], [1, 2], [2, 3]]
    >>> reachable(prefix_sums([2, 2, 2]), [3, 3]) is None
    True
    """
    total, n = len(prefix) - 1, len(limits)
    mins = [1] * n if mins is None else list(mins)
    after = list(accumulate(reversed(mins), initial=0))[::-1]  # after[j]: items the parts j.. need at least
    layers = [[0]]
    for j, (limit, least) in enumerate(zip(limits, mins), 1):
        if limit < 0:
            return None
        previous, current = layers[-1], []
        low = q = 0
        for end in range(previous[0] + least, total - after[j] + 1):
            while prefix[end] - prefix[low] > limit:  # low: the earliest start whose part fits
                low += 1
            while q < len(previous) and previous[q] < low:
                q += 1
            if q < len(previous) and previous[q] <= end - least:
                current.append(end)
        if not current:
            return None
        layers.append(current)
    return layers if layers[-1][-1] == total else None


def _latest_cuts(layers: list[list[int]], mins: Sequence[int], total: int) -> list[int]:
    """Cuts of a split found by :func:`reachable`, each as late as possible, the last first."""
    cuts, end = [], total
    for j in range(len(mins) - 1, 0, -1):  # part j starts at the latest reachable position that leaves it its items
        reached = layers[j]
        end = reached[bisect_right(reached, end - mins[j]) - 1]
        cuts.append(end)
    return cuts[::-1]


def split(sizes: Sequence[int], limits: Sequence[int], mins: Sequence[int] | None = None, *,
          late: bool = True) -> list[int] | None:
    """Cuts of ``sizes`` into ``len(limits)`` contiguous parts within ``limits`` and ``mins``, or ``None``.

    Parameters
    ----------
    sizes : sequence of int
        Non-negative sizes, in order.
    limits, mins : sequence of int
        Per part, in order (see the module's glossary); ``mins`` defaults to one item per part.
    late : bool
        ``True``: every cut as late as possible, the last first (the last part as short as possible, then the one
        before it, ...). ``False``: every cut as early as possible, the first first (the first part as short as
        possible, then the second, ...).

    Returns
    -------
    list of int or None
        The ``n - 1`` cuts, or ``None`` when no split respects the limits and minimums.

    Notes
    -----
    Exact: a split is returned whenever one exists. O(n · N) time and memory.

    Examples
    --------
    >>> split([2, 2, 2, 2], [4, 4]), split([2, 2, 2, 2], [6, 6]), split([2, 2, 2, 2], [6, 6], late=False)
    ([2], [3], [1])
    >>> split([5, 1], [4, 5], [0, 0]) is None, split([5, 1], [4, 9], [0, 0]), split([5, 1], [9, 0], [0, 0])
    (True, [0], [2])
    """
    n = len(limits)
    mins = [1] * n if mins is None else list(mins)
    if late:
        layers = reachable(prefix_sums(sizes), limits, mins)
        return None if layers is None else _latest_cuts(layers, mins, len(sizes))
    backwards = split(list(sizes)[::-1], list(limits)[::-1], mins[::-1], late=True)
    return None if backwards is None else [len(sizes) - c for c in backwards[::-1]]


def least_feasible(feasible: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The least integer ``t`` in ``[lo, hi]`` with ``feasible(t)``, for a ``feasible`` monotone in ``t``; ``None``
    when ``feasible(hi)`` is false. Binary search: O(log(hi - lo)) calls.

    >>> least_feasible(lambda t: t * t >= 50, 0, 100), least_feasible(lambda t: False, 0, 9)
    (8, None)
    """
    if lo > hi or not feasible(hi):
        return None
    return boundary(feasible, hi, lo - 1)   # the one bisection; feasible(lo - 1) is never called


def parts(cuts: Sequence[int], count: int) -> list[range]:
    """The index range of each part that ``cuts`` make of ``count`` items (the glossary's rule).

    >>> parts([1, 3], 5), parts([2, 2], 4)
    ([range(0, 1), range(1, 3), range(3, 5)], [range(0, 2), range(2, 2), range(2, 4)])
    """
    bounds = [0, *cuts, count]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
