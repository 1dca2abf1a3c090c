"""Immutable records and column tables: how the graph (:mod:`allocator.model.graph`) and the units
(:mod:`allocator.evaluate.units`) are stored.

A :class:`Table` holds columns of equal length, one tuple or read-only int64 buffer per field (:func:`frozen`), and
gives row ``i`` as a :class:`Record` (a tuple with named fields) only when asked for: a large model then holds a few
dozen Python objects besides its strings instead of one record per module and per tensor. A subclass names its
columns in ``__slots__`` (as ``_columns``) and builds its record in ``_row``.
"""

from __future__ import annotations

import inspect
from array import array
from collections.abc import Sequence
from typing import ClassVar

try:
    from _collections import _tuplegetter  # namedtuple's field accessor, in C
except ImportError:  # another Python implementation
    from operator import itemgetter

    def _tuplegetter(index, doc):
        return property(itemgetter(index), doc=doc)

__all__ = ["Record", "Table", "Paths", "frozen", "same", "picklable", "new_row"]


class Record(tuple):
    """An immutable record: a tuple whose fields, declared as annotations in order, also read as attributes
    (``namedtuple``'s accessors). Build one with the fields in order, or by name; defaults come from ``_defaults``.

    Why a tuple: a large model has hundreds of thousands of nodes and tensors, and a tuple builds much faster than a
    frozen slotted dataclass (which sets each field through ``object.__setattr__``). Records compare and hash as
    tuples; ``_replace`` stands for ``dataclasses.replace``.
    """

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, object]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._fields = tuple(inspect.get_annotations(cls))
        for k, name in enumerate(cls._fields):
            setattr(cls, name, _tuplegetter(k, None))

    def __new__(cls, /, *args, **kwargs):
        if kwargs or len(args) != len(cls._fields):
            given = {**cls._defaults, **dict(zip(cls._fields, args)), **kwargs}
            if len(args) > len(cls._fields) or given.keys() != set(cls._fields):
                raise TypeError(f"{cls.__name__} takes the fields {cls._fields}, got {len(args)} positional "
                                f"and {sorted(kwargs)}")
            args = tuple(given[f] for f in cls._fields)
        return tuple.__new__(cls, args)

    def _replace(self, /, **changes) -> Record:
        """A copy with some fields changed."""
        return type(self)(**{**dict(zip(self._fields, self)), **changes})

    def __getnewargs__(self) -> tuple:  # pickle and copy call __new__ with the fields
        return tuple(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={v!r}' for n, v in zip(self._fields, self))})"


def frozen(column):
    """A read-only column: an int64 ``array`` as a read-only view of it (no copy, no object per entry; numpy reads it
    with ``np.frombuffer``), anything else as a tuple."""
    if isinstance(column, array):
        return memoryview(column).toreadonly()
    if isinstance(column, memoryview):
        return column.toreadonly()
    if isinstance(column, Paths):
        return column
    return tuple(column)


def same(a, b) -> bool:
    """Whether two columns hold equal values, whatever their kinds (a tuple and a read-only int64 view compare)."""
    return a == b if type(a) is type(b) else len(a) == len(b) and all(x == y for x, y in zip(a, b))


def picklable(column):
    """A column as pickle takes it: a read-only view becomes an int64 ``array`` again."""
    return array(column.format, column.tobytes()) if isinstance(column, memoryview) else column


class Paths(Sequence):
    """A column of full tensor names, each made from its module's path and its local name when asked for: a large
    model's names are not kept twice (:func:`frozen` keeps it as it is). ``Paths(node_names, module, local)[k]`` is
    ``node_names[module[k]] + "." + local[k]`` (just the local name under the root)."""

    __slots__ = ("_node_names", "_module", "_local")

    def __init__(self, node_names: Sequence[str], module: Sequence[int], local: Sequence[str]):
        self._node_names, self._module, self._local = node_names, module, local

    def __len__(self) -> int:
        return len(self._local)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return tuple(self[j] for j in range(*k.indices(len(self))))
        node = self._node_names[self._module[k]]
        return f"{node}.{self._local[k]}" if node else self._local[k]

    def __iter__(self):
        return map(_path, map(self._node_names.__getitem__, self._module), self._local)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(self._local)

    def __reduce__(self):
        return tuple, (tuple(self),)   # unpickles as a plain tuple of names


def _path(node: str, local: str) -> str:
    return f"{node}.{local}" if node else local


class Table(Sequence):
    """Columns of equal length, one per name in ``_columns`` (a subclass's ``__slots__``), frozen by
    :func:`frozen`; ``table[i]`` is row ``i`` as a record (``_row``), slices give tuples of records. Immutable."""

    __slots__ = ()
    _columns: ClassVar[tuple[str, ...]] = ()
    _what: ClassVar[str] = "rows"

    def __init__(self, *columns):
        if len(columns) != len(self._columns):
            raise TypeError(f"{type(self).__name__} takes the columns {self._columns}, got {len(columns)}")
        columns = tuple(map(frozen, columns))
        if len(set(map(len, columns))) > 1:
            raise ValueError(f"{type(self).__name__} columns of different lengths {[len(c) for c in columns]}")
        for field_name, column in zip(self._columns, columns):
            object.__setattr__(self, field_name, column)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __len__(self) -> int:
        return len(getattr(self, self._columns[0]))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(map(self._row, range(*i.indices(len(self)))))
        return self._row(range(len(self))[i])  # an int in range (negative from the end), else an error

    def __iter__(self):
        return map(self._row, range(len(self)))

    def _row(self, i: int):
        raise NotImplementedError

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(same(getattr(self, c), getattr(other, c)) for c in self._columns)

    def __hash__(self) -> int:
        return hash(getattr(self, self._columns[0]))

    def __reduce__(self):
        return type(self), tuple(picklable(getattr(self, c)) for c in self._columns)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} {self._what})"


#: A record from a row in field order, without :meth:`Record.__new__`'s checks: ``new_row(Unit, fields)``.
new_row = tuple.__new__
