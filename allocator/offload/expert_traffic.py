"""What the MoE runtime (:mod:`allocator.offload.experts`) moved and ran, summed over calls: the counts
``runtime_of(model).traffic`` reports."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Traffic"]


@dataclass
class Traffic:
    """What the runtime moved, summed over calls (bytes; counts).

    Attributes
    ----------
    copied : int
        Bytes of expert slices copied to the main device (fetched experts; nothing on a CPU main device).
    read : int
        Bytes of non-resident expert slices used: copied, or read in place from the mapped files on a CPU main device.
    activations : int
        Bytes of activations moved to the CPU and back for experts computed where they live.
    routed, resident, fetched, computed : int
        Experts run: all of them, those resident, those fetched, those computed on the CPU.
    calls : int
        Forwards of experts modules.
    remote : int
        Experts resident on another accelerator than their layer's, computed there (activations moved).
    peer : int
        Bytes of experts resident on another accelerator copied to their layer's device (fetched from there).
    cache_hits, cache_misses : int
        Offloaded experts found in the runtime's cache of recently routed experts (:mod:`.expert_cache`: nothing read
        for them, and not counted in ``fetched``), and not found there; both 0 without a cache.
    """

    copied: int = 0
    read: int = 0
    activations: int = 0
    routed: int = 0
    resident: int = 0
    fetched: int = 0
    computed: int = 0
    calls: int = 0
    remote: int = 0
    peer: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
