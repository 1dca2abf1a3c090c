"""The runtime's cache of recently routed experts on the main device (``Runtime.expert_cache`` slots).

The plan keeps resident the experts most used per byte over the whole profile (``Plan.experts``): a static set. The
cache holds the last offloaded experts the routers picked, whichever layer they belong to, so an expert routed again
soon after is not read again: decoding routes each token's experts close to those of the tokens before it more often
than a whole-profile count says. It is least recently used out first (LRU): O(1) per look-up, no counts that go
stale when the text changes, and the long-run frequencies that an LFU cache would keep are already what the resident
set holds.

Where the slices live:

- on an accelerator (or its stand-in) main device, a copy of a fetched expert's slices on that device, made from the
  reused fetch buffer; a hit runs from that copy and nothing is read or copied;
- on a CPU main device, where routed experts run in place from the memory-mapped files, the expert's slices are
  kept in the process's private pages of the mapping (:meth:`allocator.offload.files.MappedFile.keep`: read once,
  then held in RAM) and given back to the file when evicted (:meth:`allocator.offload.files.MappedFile.release`);
  a hit is a read of the file avoided.

Its bytes (slots times the largest expert) are part of the main device's peak in the plan
(:func:`allocator.evaluate.memory.expert_cache_reserve`).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["ExpertCache"]


class ExpertCache:
    """Up to ``slots`` routed experts, least recently used out first, shared by every experts module of a runtime.

    Parameters
    ----------
    slots : int
        Experts held at most (the plan's ``Runtime.expert_cache``); 0 holds none and every look-up misses.

    Attributes
    ----------
    entries : OrderedDict
        ``(experts module, expert) -> value`` (the slices on the main device, or ``None`` for slices kept in the
        mapping), least recently used first.
    hits, misses : int
        Look-ups of offloaded experts found in the cache, and not found.
    evicted : int
        Entries put out for newer ones.

    Examples
    --------
    >>> cache = ExpertCache(2)
    >>> cache.put(("l0", 1), "a"), cache.put(("l0", 2), "b"), cache.get(("l0", 1))
    ([], [], 'a')
    >>> cache.put(("l1", 5), "c")          # ("l0", 2) was used least recently
    [(('l0', 2), 'b')]
    >>> cache.get(("l0", 2)) is None, cache.hits, cache.misses
    (True, 1, 1)
    """

    def __init__(self, slots: int):
        self.slots = int(slots)
        self.entries: OrderedDict = OrderedDict()
        self.hits = self.misses = self.evicted = 0

    def __contains__(self, key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key):
        """The value cached under ``key`` (marked most recently used, a hit), or ``None`` (a miss)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            self.hits += 1
            return self.entries[key]
        self.misses += 1
        return None

    def put(self, key, value) -> list:
        """Cache ``value`` under ``key`` as the most recently used; returns the ``(key, value)`` entries put out to
        make room (the caller gives their memory back). Holds nothing where there are no slots."""
        if self.slots <= 0:
            return []
        self.entries[key] = value
        self.entries.move_to_end(key)
        out = []
        while len(self.entries) > self.slots:
            out.append(self.entries.popitem(last=False))
        self.evicted += len(out)
        return out


def look_up(routed, experts: list[int]) -> dict:
    """Of ``experts`` (offloaded experts a :class:`allocator.offload.experts.RoutedExperts` on an accelerator main
    device was routed to), those in its cache: expert -> its slices on the main device; hits and misses counted in
    its traffic."""
    cache, out = routed.cache, {}
    for e in experts:
        tensors = cache.get((routed.layer.experts, e))
        if tensors is None:
            routed.traffic.cache_misses += 1
        else:
            routed.traffic.cache_hits += 1
            out[e] = tensors
    return out


def store(routed, fetched: dict) -> None:
    """Cache copies of the experts just fetched into the reused buffer (``fetched``: parameter name -> expert ->
    its slice on the main device), as the most recently used."""
    names = list(fetched)
    for e in fetched[names[0]] if names else ():
        routed.cache.put((routed.layer.experts, e), {n: fetched[n][e].clone() for n in names})


def in_place(routed, away: list[int]) -> list[int]:
    """Of ``away`` (offloaded experts a :class:`allocator.offload.experts.RoutedExperts` on a CPU main device runs
    in place from its files), those not in its cache, which are then kept in RAM in the mapping's private pages (the
    least recently used given back to the file); hits and misses counted in its traffic."""
    cache, misses = routed.cache, []
    for e in away:
        if cache.get((routed.layer.experts, e)) is not None:
            routed.traffic.cache_hits += 1
            continue
        routed.traffic.cache_misses += 1
        misses.append(e)
        for (_, out), owner in cache.put((routed.layer.experts, e), routed):   # the value: the module it belongs to
            _pages(owner, out, keep=False)
            pages = getattr(owner, "pages", None)   # its pages leave the process: ask again before the next read
            if pages is not None:
                pages.forget(owner.layer.experts, out)
        _pages(routed, e, keep=True)
    return misses


def _pages(routed, expert: int, *, keep: bool) -> None:
    """Keep ``expert``'s slices of every file-backed tensor in RAM, or give them back to the file."""
    for source in routed.sources.values():
        if source.file is None:
            continue
        per = (source.end - source.start) // routed.layer.num_experts
        start, end = source.start + expert * per, source.start + (expert + 1) * per
        (source.file.keep if keep else source.file.release)(start, end)
