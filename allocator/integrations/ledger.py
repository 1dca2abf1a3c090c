"""What the loads of one :func:`allocator.patch` block will still need on each device, so that a later load in the
block plans in what the earlier ones left (issue #47: a target and its draft model loaded one after the other).

A later ``from_pretrained(device_map="auto")`` *without* ``max_memory`` plans over the machine's free memory
(accelerate's ``get_max_memory``), which the earlier loads' weights and resident experts already take. What they do
not take yet is the rest of their plans' peaks: the KV cache and expert cache they fill while generating, and what
they hold while they run (streaming reserve, fetch buffers, activations, logits). Those are taken off the later
load's budgets, and it says so at INFO. A ``max_memory`` the caller gives means what it says and is planned as given
(:func:`allocator.plan_together` places models jointly where both are known before loading).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..budgets import canonical, format_bytes

LOADED = ("weights", "experts")
"""Parts of a plan's peak (:data:`allocator.judge.verdict.PARTS`) that its load has taken from the machine's free
memory already; the others are still owed."""

__all__ = ["Ledger"]

log = logging.getLogger("allocator.integrations")


class Ledger:
    """Bytes per device that the loads of one patch will still need (:meth:`add`), and the budgets a later load
    without ``max_memory`` plans over (:meth:`left`).

    >>> ledger = Ledger()
    >>> ledger.left({"cpu": 1000}, shared=True)
    {'cpu': 1000}
    >>> ledger.kept["cpu"] = 300
    >>> ledger.left({"cpu": 1000}, shared=True), ledger.left({"cpu": 1000}, shared=False)
    ({'cpu': 700}, {'cpu': 1000})
    """

    def __init__(self):
        self.kept: dict = {}
        self.loads: list[str] = []

    def add(self, plan, name: str) -> None:
        """Count what ``plan``'s model will still need on each device beyond what its load took."""
        for device, parts in plan.parts.items():
            kept = sum(v for k, v in parts.items() if k not in LOADED)
            if kept and device != "disk":
                self.kept[device] = self.kept.get(device, 0) + int(kept)
        self.loads.append(name)

    def left(self, budgets: Mapping, *, shared: bool) -> dict:
        """``budgets`` less what earlier loads keep, where ``shared`` (the caller gave no ``max_memory``: the machine's
        free memory, which those loads' weights already take); ``budgets`` as given otherwise."""
        budgets = dict(budgets)
        if not shared or not any(self.kept.values()):
            return budgets
        out = {d: (max(int(v) - self.kept.get(canonical(d), 0), 0) if isinstance(v, (int, float)) else v)
               for d, v in budgets.items()}
        log.info("no max_memory given: planned in what the earlier loads of this patch left (%s still need %s for "
                 "their caches, reserves and activations)",
                 ", ".join(self.loads), {d: format_bytes(n) for d, n in self.kept.items() if n})
        return out
