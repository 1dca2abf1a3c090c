"""The contract every ``device_map="auto"`` user relies on, stated once and checked once.

A plan that is faster on the estimate but surprises its users is worse. Under ``objective="contract"`` (the
default) every strategy but ``sequential`` (accelerate's algorithm, reproduced on purpose) returns only plans that
keep accelerate's conventions:

1. **Main device.** The main device (where offloaded units execute and where users send their inputs) is the first
   accelerator, by index, on which some valid plan can execute (:attr:`allocator.judge.witness.Witness.main`);
   the CPU executes only when no accelerator can. So no lower-index accelerator is left empty while a later one holds
   weights, unless no valid plan can use it (the plan's decisions say why).
2. **Index order.** Along the model (execution order), the accelerator indices of resident units never decrease:
   ``0, cpu, 0, 1, disk, 1`` is fine, ``0, 1, 0`` is not (:func:`allocator.evaluate.tiers.order_violations`). A tie
   group is placed as one at its first unit, so the units a tie pulls along (a tied ``lm_head``, BERT's decoder and
   the bias it shares) are not counted where they stand.
3. **Never below accelerate.** Wherever ``sequential``'s map is valid, the plan keeps at least as many bytes on the
   fastest tier (the accelerators; RAM when there are none) as it does
   (:attr:`allocator.judge.witness.Witness.floor`). Where accelerate's map itself breaks rule 1 or 2 (it leaves
   GPU 0 empty, or places a module with its tie on an earlier accelerator) and no plan that keeps them reaches its
   bytes, the strategies return the best plan that keeps rules 1 and 2, and :func:`allocator.plan` logs a warning
   that names the shortfall: rules 1 and 2 come first. On ``from_pretrained`` (the baseline is transformers' own
   map, ``PlanOptions.baseline``), where that map keeps the whole model on the accelerators and the plan does too,
   the plan also leaves at least as much free memory on its fullest accelerator as that map
   (:attr:`allocator.judge.witness.Witness.headroom`): the headroom users rely on for activations and the KV
   cache.

Within these, plans are ranked by the cost model. ``objective="latency"`` lifts all three: the estimate alone decides,
over every device that could be main (the CPU included). A placement may be exempt from rules by its meaning
(:attr:`allocator.placement.Placement.exempt`): ``balanced_low_0`` keeps GPU 0 as light as possible on purpose
(transformers' meaning of the mode), so rule 1 does not apply to it; accelerate's own map is exempt from all three.

Every rule is decided in the judge, and only there: strategies and the search (:mod:`allocator.search`) propose,
and read what the rules ask of a proposal as data the judge computes — the main devices to try
(:func:`allocator.judge.witness.main_candidates`), whether the devices that execute follow index order
(:func:`allocator.judge.witness.index_ordered`), the main device a split must start on (:func:`required_main`), the
bytes a plan must keep on the fastest tier (:func:`floor_to_keep`), what a candidate lacks to reach the floor
(:func:`floor_shortfall`) — never the rule itself.

Notes
-----
The main device and the floor are the witness's (:mod:`allocator.judge.witness`), computed once per problem;
checking a map is O(keys).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..budgets import Device
from ..evaluate.cost import priced
from ..evaluate.memory import main_device, map_runs
from ..evaluate.tiers import fast_bytes, order_violations
from .verdict import headroom
from ..evaluate.validate import Violation, format_bytes
from ..placement import CONTRACT_RULES
from ..problem import Problem
from .witness import accelerate_map, witness

__all__ = ["contract_violations", "floor_shortfall", "floor_to_keep", "floor_violations", "keeps_main_and_order",
           "main_or_order_violations", "main_violations", "required_main", "streams_no_more"]


def main_violations(problem: Problem, device_map: Mapping[str, Device]) -> list[Violation]:
    """Rule 1: the map's main device is not the witness's."""
    want = witness(problem).main
    got = main_device(device_map.values())
    if got == want:
        return []
    if want == "cpu":
        return [Violation("contract-main", f"the plan executes on {got!r}, but no accelerator admits a valid plan as "
                          "the main device here.")]
    return [Violation("contract-main", f"the plan's main device is {got!r}, but accelerator {want!r} is the first "
                      "that can hold a unit plus what streams through it: the contract makes it the main device "
                      "(where users send inputs); objective='latency' lifts this.")]


def required_main(problem: Problem) -> Device | None:
    """Rule 1 as a bound for proposers: the main device every plan must have (the witness's), or ``None`` where the
    contract is lifted."""
    return witness(problem).main if problem.deciding.contract else None


def keeps_main_and_order(problem: Problem, main: Device, found: Sequence) -> bool:
    """Rules 1 and 2 on a candidate given by its main device and its runs (:func:`allocator.evaluate.memory.map_runs`
    of its map): ``True`` under ``objective="latency"``."""
    if not problem.deciding.contract:
        return True
    return main == witness(problem).main and not order_violations(problem, found)


def floor_shortfall(problem: Problem, have: int) -> int:
    """Rule 3's first half: the bytes a plan that keeps ``have`` on the fastest tier lacks to reach the valid
    baseline's (:attr:`allocator.judge.witness.Witness.floor`); 0 where it reaches them or the contract is lifted."""
    if not problem.deciding.contract:
        return 0
    return max(witness(problem).floor - int(have), 0)


def streams_no_more(problem: Problem, streamed: int) -> bool:
    """Rule 3's second half: a plan that streams ``streamed`` bytes per forward streams no more than the valid baseline
    where that baseline also keeps rules 1 and 2 (always ``True`` where there is none or the contract is lifted)."""
    if not problem.deciding.contract:
        return True
    seen = witness(problem)
    return seen.fallback is None or streamed <= seen.streamed


def floor_to_keep(problem: Problem, reached: int | None = None) -> int:
    """Rule 3 as a bound for proposers: the bytes a plan must keep on the fastest tier, where a plan keeping the
    contract is known to reach them — accelerate's own valid map where it keeps rules 1 and 2, or a plan of the
    caller's that keeps ``reached`` bytes there; else 0 (rules 1 and 2 come first). 0 under ``objective="latency"``.
    """
    if not problem.deciding.contract:
        return 0
    need = witness(problem).floor
    if accelerate_map(problem) is not None or (reached is not None and reached >= need):
        return need
    return 0


def main_or_order_violations(problem: Problem, device_map: Mapping, *,
                             exempt: frozenset = frozenset()) -> list[Violation]:
    """Rules 1 and 2 only (:func:`contract_violations` without the floor): what a plan may not break even where no
    plan reaches the floor."""
    return [v for v in contract_violations(problem, device_map, exempt=exempt) if v.kind != "contract-floor"]


def contract_violations(problem: Problem, device_map: Mapping, *, exempt: frozenset = frozenset()) -> list[Violation]:
    """Every way a (valid) map breaks the contract of this module; empty under ``objective="latency"``. ``exempt``
    names the rules (of :data:`allocator.placement.CONTRACT_RULES`) the map's placement is exempt from
    (:attr:`allocator.placement.Placement.exempt`).

    Examples
    --------
    >>> import torch.nn as nn
    >>> from allocator.problem import build_problem
    >>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # 16.25 KiB per layer
    >>> problem = build_problem(model, {0: 40_000, 1: 40_000, "cpu": 10**6})
    >>> [v.kind for v in contract_violations(problem, {"0": 1, "1": 1, "2": 0, "3": 0})]
    ['contract-order']
    >>> contract_violations(problem, {"0": 0, "1": 0, "2": 1, "3": 1})
    []
    """
    if not problem.deciding.contract or exempt >= CONTRACT_RULES or not len(problem.graph.tensors.name):
        return []   # lifted, accelerate's own map, or a model without tensors (nothing lives anywhere)
    found = map_runs(problem.graph, device_map)
    out = [] if "main" in exempt else main_violations(problem, device_map)
    out += [] if "order" in exempt else order_violations(problem, found)
    if "floor" not in exempt:
        out += floor_violations(problem, device_map, found)
    return out


def floor_violations(problem: Problem, device_map: Mapping, found) -> list[Violation]:
    """Rule 3: fewer bytes on the fastest tier than the valid baseline (the map the user gets today on this path:
    :attr:`allocator.judge.witness.Witness.baseline`), or, where the baseline also keeps rules 1 and 2, more bytes
    streamed per forward."""
    seen = witness(problem)
    have, need = fast_bytes(problem, found), seen.floor
    theirs = "transformers' map" if problem.deciding.baseline is not None else "accelerate's valid map"
    if floor_shortfall(problem, have):
        return [Violation("contract-floor", f"the plan keeps {format_bytes(have)} on the fastest tier, less than "
                          f"{theirs} ({format_bytes(need)}); objective='latency' lifts this.")]
    room = seen.headroom
    if room is not None:
        mine = headroom(problem, device_map)
        if mine is not None and mine < room:
            return [Violation("contract-floor", f"the plan leaves {format_bytes(mine)} free on its fullest "
                              f"accelerator, less than {theirs} ({format_bytes(room)}); objective='latency' lifts "
                              "this.")]
    if seen.fallback is None:   # the baseline breaks rule 1 or 2 (it runs on the CPU with a GPU offered): those first
        return []
    streamed, mine = seen.streamed, priced(problem, device_map).streamed_bytes
    if not streams_no_more(problem, mine):
        return [Violation("contract-floor", f"the plan streams {format_bytes(mine)} per forward, more than {theirs} "
                          f"({format_bytes(streamed)}); objective='latency' lifts this.")]
    return []
