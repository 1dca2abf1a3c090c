"""Which routed experts' pages are already in memory, so that only the others are read ahead.

On a CPU main device the routed experts of a layer run in place from the memory-mapped files
(:mod:`allocator.offload.experts`), which are advised ``MADV_RANDOM`` (no read-ahead around a fault). Before a call
reads them, the runtime asks the kernel to read the routed experts' slices in (``MADV_WILLNEED``): a cold expert is then
read in large requests instead of one page per fault. That request is not free when the pages are already there: the
kernel looks up every page of the range in the page cache, about 15 µs per MiB measured here (Linux 6.18), one call
per run of experts and per tensor — 75 calls per decoded token on ``benchmarks/moe.py``'s Qwen3 shape, where a token
takes 6 ms in RAM, and 140 µs per expert of Qwen3-30B-A3B's size.

:class:`Residency` asks first, with ``mincore``: one call over the ranges of a file that lie close together (every
routed expert of a layer's tensors, where the file holds them side by side), and only the ranges with a page not in
memory are advised. Measured here: a call costs about 1.3 µs through ``ctypes``, plus about 1 ns per page mapped in this
process and 66 ns per page only in the page cache, so ranges more than 16 pages apart are asked about in separate
calls rather than with the pages between them.

Asking costs too (about 5 µs a call measured inside a decode step here, six calls per layer and token on that shape),
so an expert found in memory, or read in, less than :data:`FRESH` seconds ago is not asked about again: the kernel
reclaims the pages used least recently first, and these were used a moment ago. :meth:`Residency.forget` (the runtime's
``evict``, an expert given back by the cache) makes the next call ask again.

``mincore`` tells the page cache's state only for a file this process could open for writing (its owner, root, or write
permission); for any other file Linux answers "resident" for every page (``mm/mincore.c``, ``can_do_mincore``), so
such files are advised as before, unasked. Off Linux, or where ``mincore`` cannot be called, every run is advised.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time

from .files import PAGE

__all__ = ["FRESH", "Residency", "runs_of"]

log = logging.getLogger(__name__)

FRESH = 0.5
"""Seconds an expert found in memory (or read in) is taken to stay there without asking again."""

_LOW_BIT = bytes(i & 1 for i in range(256))   # mincore sets bit 0 of a page's byte; the others are reserved
_GAP_PAGES = 16   # a gap between ranges worth one more call (~1.3 µs) rather than asking about its pages (module doc)


def runs_of(experts) -> list[tuple[int, int]]:
    """Runs ``[a, b)`` of consecutive experts, ascending.

    >>> runs_of([5, 1, 2, 3, 9])
    [(1, 4), (5, 6), (9, 10)]
    """
    runs: list[list[int]] = []
    for e in sorted(set(experts)):
        if runs and runs[-1][1] == e:
            runs[-1][1] = e + 1
        else:
            runs.append([e, e + 1])
    return [(a, b) for a, b in runs]


def _libc_mincore():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)   # the process's own symbols: libc's, without a library search
        fn = libc.mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class Residency:
    """Asks the kernel which pages of mapped ranges are in memory (``mincore``), for one runtime's experts.

    Attributes
    ----------
    calls : int
        ``mincore`` calls made.
    known : dict
        ``(experts module, expert) -> time.monotonic()`` when its pages were last found in memory or read in.
    vector : bytearray
        The answer's buffer, one byte a page, grown to the largest range asked about and reused.
    """

    def __init__(self):
        self.mincore = _libc_mincore()
        self.calls = 0
        self.vector = bytearray()
        self.pointer = None   # the vector as mincore writes it
        self.answers: dict[str, bool] = {}   # path -> whether mincore tells its page cache's state
        self.known: dict[tuple, float] = {}

    def stale(self, layer: str, experts: list[int]) -> list[int]:
        """Of ``experts`` of experts module ``layer``, those not found in memory or read in during the last
        :data:`FRESH` seconds; the caller reads them now, so they count as read in from now on."""
        now, known = time.monotonic(), self.known
        out = [e for e in experts if now - known.get((layer, e), -FRESH) >= FRESH]
        for e in out:
            known[(layer, e)] = now
        return out

    def forget(self, layer: str | None = None, expert: int | None = None) -> None:
        """Ask again about ``expert`` of ``layer`` (everything, by default) at its next call."""
        if layer is None:
            self.known.clear()
        else:
            self.known.pop((layer, expert), None)

    def tells(self, path: str) -> bool:
        """Whether ``mincore`` tells the state of ``path``'s pages to this process (module docstring)."""
        known = self.answers.get(path)
        if known is None:
            try:
                known = self.mincore is not None and (
                    os.geteuid() == 0 or os.stat(path).st_uid == os.geteuid() or os.access(path, os.W_OK))
            except OSError:
                known = False
            self.answers[path] = known
        return known

    def _pages(self, lo: int, hi: int):
        """:attr:`vector` holding one byte per page of addresses ``[lo, hi)`` (page-aligned ``lo``), bit 0 set for a
        page in memory; ``None`` where ``mincore`` failed."""
        count = (hi - lo + PAGE - 1) // PAGE
        if len(self.vector) < count:
            self.pointer = None
            self.vector = bytearray(max(count, 2 * len(self.vector)))
            self.pointer = (ctypes.c_char * len(self.vector)).from_buffer(self.vector)
        self.calls += 1
        if self.mincore(lo, hi - lo, self.pointer) != 0:
            log.debug("mincore failed (errno %d): the range is read ahead unasked", ctypes.get_errno())
            return None
        return self.vector

    def missing(self, path: str, address: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Of ``ranges`` (byte offsets from ``address``, the mapped address of file ``path``'s first byte;
        ascending, disjoint), those with a page not in memory, or all of them where that cannot be told. Ranges
        less than ``_GAP_PAGES`` pages apart are asked about in one call."""
        if not ranges or not self.tells(path):
            return list(ranges)
        out = []
        i = 0
        while i < len(ranges):
            j = i + 1   # ranges[i:j] one call: each next range starts near where the last ended
            while j < len(ranges) and (ranges[j][0] - ranges[j - 1][1]) // PAGE <= _GAP_PAGES:
                j += 1
            first = (address + ranges[i][0]) // PAGE
            pages = self._pages(first * PAGE, address + ranges[j - 1][1])
            out += [(a, b) for a, b in ranges[i:j] if pages is None or 0 in pages[
                (address + a) // PAGE - first:(address + b - 1) // PAGE + 1 - first].translate(_LOW_BIT)]
            i = j
        return out
