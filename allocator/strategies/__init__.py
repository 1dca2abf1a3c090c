"""Strategies: one module each, one pure function ``place(problem) -> Placement``; ``STRATEGIES`` names them."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import InvalidOption
from ..placement import Placement
from ..problem import Problem
from . import auto, backfill, balanced, ilp, reserve, sequential

__all__ = ["BUILT_IN", "STRATEGIES", "resolve"]

Strategy = Callable[..., Placement]

STRATEGIES: dict[str, Strategy] = {
    "auto": auto.place,
    "sequential": sequential.place,
    "backfill": backfill.place,
    "reserve": reserve.place,
    "ilp": ilp.place,
    "balanced": balanced.place,
    "balanced_low_0": balanced.place_low_0,
}
"""Strategy name to ``place`` function: the one place a strategy is registered (a stranger's too)."""

BUILT_IN = frozenset(STRATEGIES.values())
"""The built-in strategies' functions, which return their maps cleaned and say what they are exempt from; a strategy
registered in :data:`STRATEGIES` later, or passed as a callable, is cleaned and judged by :func:`allocator.plan`
as it stands (exempt from nothing)."""


def resolve(strategy: str | Strategy) -> tuple[str, Strategy]:
    """The name and function of a strategy given by name (``"auto"`` included) or as a callable."""
    if callable(strategy):
        return getattr(strategy, "__name__", "custom"), strategy
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise InvalidOption(f"unknown strategy {strategy!r}; choose one of {list(STRATEGIES)} or pass a callable.")
    return strategy, STRATEGIES[strategy]


def run(strategy, problem: Problem) -> Placement:
    """Run a strategy on a problem and check it returned a :class:`Placement`."""
    name, fn = resolve(strategy)
    placement = fn(problem)
    if not isinstance(placement, Placement):
        raise InvalidOption(f"strategy {name!r} returned {type(placement).__name__}, expected allocator.Placement.")
    return placement
