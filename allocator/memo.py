"""What follows from a frozen object, made once and owned by it: :class:`Derived`.

A :class:`allocator.problem.Problem` and a :class:`allocator.model.ModelGraph` never change, so what is computed
from them (the graph's columns, the units' groups, accelerate's own map, the contract's floor, the last few maps
checked and priced) can be kept with them: it goes when they go, and a problem made with
``dataclasses.replace`` starts with nothing derived.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

__all__ = ["Derived"]


class Derived:
    """A frozen object's derived values: named ones built once (:meth:`once`), and the last few results per kind
    of a linear-time evaluation of device maps (:meth:`recent`).

    Examples
    --------
    >>> d = Derived()
    >>> d.once("answer", lambda: 42), d.once("answer", lambda: 0)
    (42, 42)
    >>> d.recent("size", {"a": 0}, lambda: 1), d.recent("size", {"a": 0}, lambda: 2)
    (1, 1)
    """

    __slots__ = ("_values", "_recent")

    #: How many device maps per kind :meth:`recent` remembers.
    RECENT = 4

    def __init__(self):
        self._values: dict = {}
        self._recent: dict = {}

    def __repr__(self) -> str:
        return f"<Derived {sorted(self._values)}>"

    def once(self, name: str, build: Callable[[], object]):
        """``build()`` the first time ``name`` is asked for; the same value afterwards."""
        try:
            return self._values[name]
        except KeyError:
            value = self._values[name] = build()
            return value

    def recent(self, kind: str, device_map, evaluate: Callable[[], object]):
        """``evaluate()`` for ``device_map``, or the value remembered for a map with the same items in the same order
        (a map changed in place is evaluated again). Anything but a mapping is never remembered: its evaluation
        raises the typed error."""
        if not isinstance(device_map, Mapping):
            return evaluate()
        key = (tuple(device_map), tuple(device_map.values()))   # no pair per entry: two flat tuples
        entries = self._recent.setdefault(kind, [])
        for known, value in reversed(entries):
            if known == key:
                return value
        value = evaluate()
        entries.append((key, value))
        if len(entries) > self.RECENT:
            del entries[0]
        return value
