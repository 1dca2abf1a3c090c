"""What follows from a frozen object, made once and owned by it: :class:`Derived`.

A :class:`allocator.problem.Problem` and a :class:`allocator.model.ModelGraph` never change, so what is computed
from them (the graph's columns, the units' groups, accelerate's own map, the contract's floor, the last few maps
checked and priced) can be kept with them: it goes when they go, and a problem made with
``dataclasses.replace`` starts with nothing derived.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

__all__ = ["Derived", "Key"]


class Key:
    """The name of one kind of derived value: a constant of the module that derives it, equal only to itself, so two
    modules never share a value by spelling the same word. Calling it adds the typed arguments the value depends on
    (``GROUPS(offload_buffers, read_copies)``, ``READS(profile)``): the key is then a tuple, compared by those values.

    Examples
    --------
    >>> ANSWER = Key("answer")
    >>> ANSWER, ANSWER(1) == ANSWER(1), ANSWER(1) == Key("answer")(1)
    (Key('answer'), True, False)
    """

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Key({self.name!r})"

    def __call__(self, *args) -> tuple:
        return (self, *args)


def _typed(key) -> None:
    if not (isinstance(key, Key) or isinstance(key, tuple) and key and isinstance(key[0], Key)):
        raise TypeError(f"a derived value is named by a memo.Key (or a Key called with its arguments), not {key!r}")


class Derived:
    """A frozen object's derived values: named ones built once (:meth:`once`), and the last few results per kind
    of a linear-time evaluation of device maps (:meth:`recent`).

    Examples
    --------
    >>> ANSWER, SIZE = Key("answer"), Key("size")
    >>> d = Derived()
    >>> d.once(ANSWER, lambda: 42), d.once(ANSWER, lambda: 0)
    (42, 42)
    >>> d.recent(SIZE, {"a": 0}, lambda: 1), d.recent(SIZE, {"a": 0}, lambda: 2)
    (1, 1)
    >>> d.once("answer", lambda: 42)
    Traceback (most recent call last):
    ...
    TypeError: a derived value is named by a memo.Key (or a Key called with its arguments), not 'answer'
    """

    __slots__ = ("_values", "_recent")

    #: How many device maps per kind :meth:`recent` remembers.
    RECENT = 4

    def __init__(self):
        self._values: dict = {}
        self._recent: dict = {}

    def __repr__(self) -> str:
        return f"<Derived {sorted(map(repr, self._values))}>"

    def once(self, key: Key | tuple, build: Callable[[], object]):
        """``build()`` the first time ``key`` (a :class:`Key`, or one called with its arguments) is asked for; the same
        value afterwards."""
        try:
            return self._values[key]
        except KeyError:
            _typed(key)
            value = self._values[key] = build()
            return value

    def recent(self, kind: Key, device_map, evaluate: Callable[[], object]):
        """``evaluate()`` for ``device_map``, or the value remembered for a map with the same items in the same order
        (a map changed in place is evaluated again). Anything but a mapping is never remembered: its evaluation
        raises the typed error."""
        if not isinstance(device_map, Mapping):
            return evaluate()
        key = (tuple(device_map), tuple(device_map.values()))   # no pair per entry: two flat tuples
        entries = self._recent.get(kind)
        if entries is None:
            _typed(kind)
            entries = self._recent[kind] = []
        for known, value in reversed(entries):
            if known == key:
                return value
        value = evaluate()
        entries.append((key, value))
        if len(entries) > self.RECENT:
            del entries[0]
        return value
