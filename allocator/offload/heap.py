"""Giving freed memory back to the system once the runtime is attached or detached.

Loading a model allocates and frees many temporary tensors; glibc's ``malloc`` keeps the freed chunks inside its heap
for reuse, so the process's anonymous RSS stays where the load left it although nothing holds those bytes
(measured: docs/runtime.md, "Memory that comes back"). :func:`trim_heap` asks glibc to return them
(``malloc_trim(0)``); elsewhere (musl, macOS, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["trim_heap"]


def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Return the free pages of the C heap to the system (glibc ``malloc_trim(0)``).

    Returns
    -------
    bool
        Whether the C library had ``malloc_trim`` (Linux with glibc); ``False`` elsewhere, where nothing is done.

    Notes
    -----
    It walks the heap's free chunks once, linear in the heap's size, and gives back whole pages with
    ``madvise(MADV_DONTNEED)``: freed memory that glibc would otherwise keep for later allocations, which the
    process's anonymous RSS counts. Nothing in use is touched.

    Examples
    --------
    >>> isinstance(trim_heap(), bool)
    True
    """
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
