"""A strategy's answer: a device map, with the decisions that explain it, as data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .budgets import Device

__all__ = ["CONTRACT_RULES", "DECISION_KINDS", "Decision", "Placement", "clean_device_map"]

DECISION_KINDS = {
    "assign": "units placed on a device, in the order the strategy placed them (accelerate's algorithm); "
              "``facts['tied']``: the first unit with the units tied to it",
    "full": "a device the strategy left because the next unit did not fit; ``bytes`` it kept free, ``bound`` why",
    "empty": "accelerators that get nothing, and why (``devices``; ``facts['reason']``: ``kept-free``, "
             "``fewer-groups`` (``groups``, ``accelerators``), ``unbalanced``, ``cpu-main``, ``before-main`` "
             "(``main``), ``after-main-unbalanced``, ``after-main-reserve-fits``)",
    "not-main": "an accelerator before the main device that admits no plan as main; ``bytes`` the budget it needs",
    "split": "how the strategy cut the model over the devices (``facts['reason']``: ``contiguous``, ``re-split``, "
             "``no-accelerator``, ``one-accelerator``, ``no-split-fits``, ``not-more-balanced``; ``method``, "
             "``groups``, ``main``, ``low_0``)",
    "peaks": "the peak of each accelerator against its budget (``facts['peaks']``: ``[device, peak, budget]`` rows)",
    "kept": "which of a strategy's candidate plans it kept, and its estimate (``facts``: ``strategy``, ``candidates``, "
            "``contract``, ``main``, ``reserve``, ``seconds``, ``changes``; ``bytes`` on the fastest tier)",
    "choice": "which candidate strategy ``auto`` kept, against accelerate's map and the runner-up (``facts``: "
              "``winner``, ``tried`` (what became of each), ``runner``, ``same_rank``, ``ranking``)",
    "fallback": "where no plan of the strategy keeps the rules or the contract: accelerate's own map instead "
                "(``facts['reason']``: ``contract``, ``main``, ``infeasible``; ``strategy``, ``main``, ``error``)",
    "solver": "what the solver did (``facts['reason']`` ``solved``: ``groups``, ``mains``, ``seconds``, ``proven``, "
              "``warm_start``; ``coarsened``: ``merges``, ``max_units``)",
    "experts": "where the routed experts of the mixture-of-experts layers live (``units``: the experts modules; "
               "``devices``: where the resident ones are; ``bytes``: theirs), and why (``bound``)",
    "runtime": "what the plan reserves for our offload runtime (``facts``: ``prefetch``, its depth, of ``asked``), and "
               "why (``reason``: ``cpu-main``, ``deepest``, ``no-deeper``)",
    "grow": "offloaded tie groups moved onto the main device after the runtime's decisions left room there (``units``, "
            "``bytes``; ``facts``: ``groups``, ``room`` left before, the main device's ``peak`` before)",
    "sublayer": "decoder layers split under our runtime, attention side on the main device and MLP offloaded, or why "
                "not (``units``: the parts moved onto ``devices``; ``bytes``: what the main device gains; ``facts``: "
                "``reason`` ``faster``, ``slower``, ``none-fits`` or ``fewer-bytes``, ``decode``/``prefill`` seconds "
                "and ``bytes`` against ``decode_whole``/``prefill_whole``/``bytes_whole`` of the whole-layer plan, "
                "``layers`` split, ``moved`` attention sides onto it, ``demoted`` MLPs off it, ``cache`` on it, "
                "``context``, ``tried``, ``valid``)",
    "pipeline": "how a pipeline's component was placed (whole on a device, or with a map of its own) and why, or what "
                "diffusers' pipeline loading cannot express (:func:`allocator.plan_pipeline`)",
}
"""The kinds of :class:`Decision`, each with what it says. Code reads the fields, never the text; the sentences are
made from the kind and the fields in :mod:`allocator.report.decisions`."""

CONTRACT_RULES = frozenset({"main", "order", "floor"})
"""The rules of the contract of ``device_map="auto"`` a placement may be exempt from
(:attr:`Placement.exempt`): rule 1 (the main device), rule 2 (accelerators in index order), rule 3 (never below
accelerate's bytes on the fastest tier)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision of a strategy, as data: what it is (``kind``, one of :data:`DECISION_KINDS`), the devices and
    units it is about, the bytes involved, what bound it, and the other fields of its kind (``facts``: counts, names,
    seconds; ``facts["reason"]`` names which case of the kind it is). Strategies record no sentences:
    :mod:`allocator.report.decisions` says a decision from its kind and fields (``explain()``, ``to_dict()``).

    ``text`` holds a sentence only where the decision comes from outside the built-in strategies (a caller's
    strategy, a plan saved before its kind had fields); no code reads it but the report, which shows it as given.

    >>> Decision("full", devices=(0,), units=("layers.3",), bytes=1024, bound="reserve").device
    0
    """

    kind: str
    text: str = ""
    devices: tuple = ()
    units: tuple[str, ...] = ()
    bytes: int | None = None
    bound: str = ""
    """What bound the decision: a budget (``"budget"``), the streaming reserve (``"reserve"``), a runtime rule or a
    rule of the contract (``"main"``, ``"order"``, ``"floor"``), the estimate (``"estimate"``); empty when nothing
    did."""
    facts: Mapping = field(default_factory=dict, hash=False)
    """The other fields of the decision's kind (JSON values: numbers, strings, lists, ``None``), e.g. ``"reason"``
    (which case of the kind), ``"groups"``, ``"seconds"``."""

    @property
    def device(self) -> Device | None:
        """The one device the decision is about, or ``None``."""
        return self.devices[0] if len(self.devices) == 1 else None

    @property
    def reason(self) -> str:
        """``facts["reason"]``: which case of its kind the decision is (``""`` where the kind has one)."""
        return str(self.facts.get("reason", ""))


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each entry of the model goes.

    ``device_map`` maps module or tensor names (``""`` for the whole model) to a device: an accelerator index,
    ``"mps"``, ``"cpu"`` or ``"disk"``. ``decisions`` are the strategy's decisions in order, as data
    (:class:`Decision`); :func:`allocator.report.decisions.notes` says them as sentences.
    """

    device_map: Mapping[str, Device]
    strategy: str
    decisions: tuple[Decision, ...] = ()
    optimal: bool | None = None
    """``True`` when the strategy proved no valid plan has a lower estimated cost (``ilp``); ``None`` if unknown."""
    diagnostics: tuple[tuple[str, str], ...] = ()
    """``(level, message)`` pairs that :func:`allocator.plan` reports for the plan it returns: ``"warning"``
    (``warnings.warn``, as accelerate warns) or ``"info"`` (a log line at INFO, as accelerate logs)."""
    base: str = ""
    """The strategy whose algorithm made the map (``"reserve"`` for ``auto``'s pick of it); :attr:`strategy` when
    empty."""
    exempt: frozenset = frozenset()
    """The rules of the contract (:data:`CONTRACT_RULES`) this placement is exempt from by its meaning: all of them
    for accelerate's own map, ``{"main"}`` for ``balanced_low_0`` (it keeps GPU 0 light on purpose)."""
    experts: Mapping[str, tuple] = field(default_factory=dict)
    """For a plan the allocator runtime runs (``runtime="allocator"``) on a mixture of experts: each routed experts
    module (a name of the model) to the device of each of its experts, resident ones where they execute and the
    others where their weights stay (``"cpu"``, ``"disk"``); the device map holds the module as a whole where those
    stay. Empty otherwise."""

    @property
    def algorithm(self) -> str:
        """:attr:`base`, or :attr:`strategy` where no base is named."""
        return self.base or self.strategy

    @property
    def accelerates(self) -> bool:
        """Whether this is accelerate's own map (exempt from every rule of the contract)."""
        return self.exempt >= CONTRACT_RULES

    def of_kind(self, kind: str, device: Device | None = None) -> list[Decision]:
        """The decisions of ``kind`` (about ``device`` when given), in order."""
        return [d for d in self.decisions if d.kind == kind and (device is None or device in d.devices)]


def clean_device_map(device_map: Mapping[str, Device], module_name: str = "") -> dict:
    """Group entries whose keys under one prefix all share a device (accelerate's ``clean_device_map``).

    Same result as accelerate's, in O(total length of the names) instead of its O(keys x prefixes): from the top,
    a module whose keys strictly under it (at least two) all map to one device is replaced by a single entry.
    Returns a new dict; the argument is not modified.

    >>> clean_device_map({"a.x": 0, "a.y": 0, "b": "cpu"})
    {'a': 0, 'b': 'cpu'}
    """
    if not module_name and "" not in device_map and "." not in "".join(device_map):
        # one level of names (a flat stack): all of them become "" when they share one device, else nothing merges
        devices = set(device_map.values())
        return {"": next(iter(devices))} if len(devices) == 1 and len(device_map) > 1 else dict(device_map)
    root: dict = {}  # trie: component -> (children, key at this node or None)
    for key in device_map:
        node = root
        parts = key.split(".") if key else []
        for part in parts:
            node = node.setdefault(part, {})
        node[_KEY] = key
    below = _below(root, device_map)
    result: dict = {}
    _collapse(root, module_name, device_map, below, result, top=True)
    return result


_KEY = object()    # marks the map key that ends at a trie node
_NONE = object()   # no key below a trie node
_MIXED = object()  # keys below a trie node map to more than one device


def _merge(a, b):
    if b is _NONE:
        return a
    if a is _NONE:
        return b
    return a if a == b else _MIXED


def _below(root: dict, device_map) -> dict:
    """For every trie node (by id): (the one device of the keys strictly below it, or _NONE / _MIXED; their number),
    children before parents."""
    order, stack = [], [root]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(child for part, child in node.items() if part is not _KEY)
    below: dict = {}
    for node in reversed(order):  # every child was reached after its parent
        device, count = _NONE, 0
        for part, child in node.items():
            if part is _KEY:
                continue
            if _KEY in child:
                device = _merge(device, device_map[child[_KEY]])
                count += 1
            child_device, child_count = below[id(child)]
            if child_count:
                device = _merge(device, child_device)
                count += child_count
        below[id(node)] = (device, count)
    return below


def _collapse(node: dict, name: str, device_map, below: dict, result: dict, top: bool = False) -> None:
    device, count = below[id(node)]
    if top and not name and _KEY in node:
        # accelerate looks at every key from the root (the root's own key included)
        device = _merge(device, device_map[node[_KEY]])
        count += 1
    if device is not _NONE and device is not _MIXED and count > 1:
        result[name] = device
        return
    if _KEY in node:
        result[node[_KEY]] = device_map[node[_KEY]]
    for part, child in node.items():
        if part is _KEY:
            continue
        _collapse(child, f"{name}.{part}" if name else part, device_map, below, result)
