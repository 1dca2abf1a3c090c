"""The contract every ``device_map="auto"`` user relies on, stated once and checked once.

A plan that is faster on the estimate but surprises its users is worse. Under ``objective="contract"`` (the
default) every strategy but ``sequential`` (accelerate's algorithm, reproduced on purpose) returns only plans that
keep accelerate's conventions:

1. **Main device.** The main device (where offloaded units execute and where users send their inputs) is the first
   accelerator, by index, on which some valid plan can execute (:func:`contract_main`); the CPU executes only when no
   accelerator can. So no lower-index accelerator is left empty while a later one holds weights, unless no valid plan
   can use it (the plan's notes say why).
2. **Index order.** Along the model (execution order), the accelerator indices of resident units never decrease:
   ``0, cpu, 0, 1, disk, 1`` is fine, ``0, 1, 0`` is not (:func:`order_violations`). A tie group is placed as one at
   its first unit, so the units a tie pulls along (a tied ``lm_head``, BERT's decoder and the bias it shares) are
   not counted where they stand.
3. **Never below accelerate.** Wherever ``sequential``'s map is valid, the plan keeps at least as many bytes on the
   fastest tier (the accelerators; RAM when there are none) as it does (:func:`floor`). Where accelerate's map itself
   breaks rule 1 or 2 (it leaves GPU 0 empty, or places a module with its tie on an earlier accelerator) and no
   plan that keeps them reaches its bytes, the strategies return the best plan that keeps rules 1 and 2, and
   :func:`allocator.plan` logs a warning that names the shortfall: rules 1 and 2 come first.

Within these, plans are ranked by the cost model. ``objective="latency"`` lifts all three: the estimate alone decides,
over every device that could be main (the CPU included). ``balanced_low_0`` keeps GPU 0 as light as possible on
purpose (transformers' meaning of the mode): rule 1 does not apply to it.

Notes
-----
:func:`contract_main` runs ``reserve``'s fills (:mod:`allocator.strategies.first_fit`) for each accelerator in index
order until one admits a valid plan: O(a · s · g) for a accelerators, s candidate reserves, g groups, and it is computed
once per problem. :func:`floor` runs ``sequential`` once per problem.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

import numpy as np

from ..budgets import Device, is_accelerator
from ..errors import AllocatorError
from ..placement import clean_device_map
from ..problem import Problem
from ..evaluate.runs import Run, columns
from ..evaluate.memory import main_device, map_runs, streams_held
from ..evaluate.units import problem_groups
from ..evaluate.validate import Violation, check, format_bytes
from . import sequential
from .first_fit import Filled, Streams, every_main, fill_to_fixed_point, full_reserve, reserve_sizes

__all__ = ["accelerate_map", "accelerate_placement", "contract_main", "contract_violations", "fast_bytes",
           "fast_tier", "fill_memo", "floor", "main_candidates", "order_violations", "why_empty"]

EXEMPT_FROM_MAIN = frozenset({"balanced_low_0"})
"""Strategies whose meaning is to keep GPU 0 light (rule 1 does not apply)."""

def derived(problem: Problem, name: str, build: Callable[[], object]):
    """``build()`` once per problem and name (the problem is frozen, so what follows from it does not change)."""
    return problem.derived.once(name, build)


def fast_tier(problem: Problem) -> frozenset:
    """The devices of the fastest tier: the accelerators, or RAM when there are none."""
    return frozenset(problem.budgets.accelerators) or frozenset({"cpu"})


def fast_bytes(problem: Problem, found: list[Run]) -> int:
    """Counted bytes that runs of a map keep on the fastest tier (:func:`fast_tier`)."""
    fast = fast_tier(problem)
    counted = columns(problem.graph).sum_counted
    return sum(counted[run.end] - counted[run.start] for run in found if run.device in fast)


# -- rule 1: the main device ----------------------------------------------------------------------------------------

def contract_main(problem: Problem) -> Device:
    """The main device the contract requires: the first accelerator (by index) on which a valid plan executes, else
    ``"cpu"``.

    An accelerator admits a plan when accelerate's own valid map (``sequential``) has it as main device, or one of
    ``reserve``'s fills with it as the main device — every streaming reserve that some unit's offload would need,
    each raised to its fixed point — gives a valid map that uses it.
    """
    return derived(problem, "contract_main", lambda: _first_main(problem))


def main_candidates(problem: Problem) -> list[Device]:
    """The devices a strategy tries as main: :func:`contract_main` alone under the contract; every device that could
    be main (:func:`allocator.strategies.first_fit.every_main`) under ``objective="latency"``."""
    return [contract_main(problem)] if problem.options.contract else every_main(problem)


def _first_main(problem: Problem) -> Device:
    theirs = _accelerate(problem)
    witness = main_device(theirs.values()) if theirs is not None else None
    for device in problem.budgets.accelerators:
        if device == witness or ((problem.budgets.limit(device) or 0) > 0 or not problem.graph.total) \
                and _admits(problem, device):
            return device
    return "cpu"


def accelerate_placement(problem: Problem):
    """``sequential``'s placement of this problem, made once (the floor, the main device's witness and ``auto``'s
    candidate are the same run); raises what ``sequential`` raises."""
    def build():
        try:
            return sequential.place(problem), None
        except AllocatorError as err:
            return None, err

    placement, error = derived(problem, "sequential", build)
    if error is not None:
        raise error
    return placement


def _accelerate(problem: Problem) -> dict | None:
    """``sequential``'s map where it is valid (accelerate's own plan: a witness that its main device admits one)."""
    def build():
        try:
            device_map = accelerate_placement(problem).device_map
        except AllocatorError:
            return None
        return None if check(problem, device_map)[0] else dict(device_map)

    return derived(problem, "accelerate", build)


def _admits(problem: Problem, main: Device) -> bool:
    found = problem_groups(problem)
    streams, memo = Streams(problem, found), fill_memo(problem)
    tried = set()
    for start in [full_reserve(problem), *reserve_sizes(problem, found)]:
        where, reserve = fill_to_fixed_point(problem, found, main, start, streams=streams, memo=memo)
        if where is None or (main, reserve) in tried:
            continue
        tried.add((main, reserve))
        candidate = Filled(problem, found, where, reserve, "")
        if candidate.main != main:
            continue
        device_map = candidate.device_map()
        if problem.options.clean_result:
            device_map = clean_device_map(device_map)
        if not check(problem, device_map)[0]:
            return True
    return False


def fill_memo(problem: Problem) -> dict:
    """The fills already made for this problem, by (main, reserve), shared by the contract and the fill strategies."""
    return derived(problem, "fill_memo", dict)


def why_empty(problem: Problem, device: Device) -> str:
    """A sentence saying why an accelerator before the contract's main device holds nothing."""
    b = problem.budgets
    limit = b.limit(device) or 0
    if limit == 0:
        return f"accelerator {device!r} has a budget of 0"
    need = streams_held(problem.options, full_reserve(problem))
    smallest = min((s for s in problem_groups(problem).size if s), default=0)
    g = problem.graph
    generate = g.workspace + g.main_workspace
    return (f"accelerator {device!r} ({format_bytes(limit)}) admits no valid plan as the main device: it would hold "
            f"at least one unit (the smallest is {format_bytes(smallest)}) plus the weights streamed through it at "
            f"once (up to {format_bytes(need)}) and the buffers of offloaded modules"
            + (f", and what generate needs on the main device ({format_bytes(generate)} of activations and "
               "next-token scores, plus the KV cache of the layers it runs)" if generate else ""))


# -- rule 2: accelerators in index order ----------------------------------------------------------------------------

def _pulled(problem: Problem) -> list[int]:
    """Sorted tensor indices that sit with a tie: the tensors of every unit of a tie group but its first (a tied
    ``lm_head``, BERT's decoder and the bias it shares go where the embeddings are)."""
    def build():
        found = problem_groups(problem)
        counts = found.counts()
        if not len(counts) or counts.max() < 2:
            return []
        members, start = found.array("members"), found.array("start")
        later = np.zeros(len(members), dtype=bool)
        for k in np.flatnonzero(counts > 1).tolist():
            later[members[start[k] + 1:start[k] + counts[k]]] = True
        keep, lo, hi, _ = found.units.spans(problem.graph)
        chosen = later[keep]
        return sorted({t for a, b in zip(lo[chosen].tolist(), hi[chosen].tolist()) for t in range(a, b)})

    return derived(problem, "pulled", build)


def accelerator_sequence(problem: Problem, found: list[Run]) -> list[Device]:
    """The accelerators of the runs of a map in model order, runs made only of tied second names left out."""
    pulled = _pulled(problem)
    out = []
    for run in found:
        if not is_accelerator(run.device) or run.device is None:
            continue
        inside = bisect.bisect_left(pulled, run.end) - bisect.bisect_left(pulled, run.start) if pulled else 0
        if pulled and inside == run.end - run.start:
            continue
        out.append(run.device)
    return out


def order_violations(problem: Problem, found: list[Run]) -> list[Violation]:
    """Rule 2: a resident unit on a lower-index accelerator after one on a higher index."""
    sequence = accelerator_sequence(problem, found)
    rank = {d: i for i, d in enumerate(problem.budgets.accelerators)}
    top = None
    for device in sequence:
        if device not in rank:
            continue
        if top is not None and rank[device] < rank[top]:
            return [Violation("contract-order", f"accelerator {device!r} holds a unit that runs after units on "
                              f"accelerator {top!r}: accelerators must be used in index order along the model "
                              "(objective='latency' allows any order).")]
        top = device if top is None or rank[device] > rank[top] else top
    return []


# -- rule 3: never below accelerate ---------------------------------------------------------------------------------

def floor(problem: Problem) -> int:
    """Bytes on the fastest tier that every contract plan keeps: ``sequential``'s, where its map is valid; else 0."""
    return derived(problem, "floor", lambda: _floor(problem))[0]


def accelerate_map(problem: Problem) -> dict | None:
    """``sequential``'s map when it is valid and keeps rules 1 and 2: a plan every strategy may fall back to."""
    return derived(problem, "floor", lambda: _floor(problem))[1]


def _floor(problem: Problem) -> tuple[int, dict | None]:
    device_map = _accelerate(problem)
    if device_map is None:
        return 0, None
    found = map_runs(problem.graph, device_map)
    keeps = not (_main_violations(problem, device_map) or order_violations(problem, found))
    return fast_bytes(problem, found), device_map if keeps else None


# -- the checker ----------------------------------------------------------------------------------------------------

def _main_violations(problem: Problem, device_map: Mapping) -> list[Violation]:
    want = contract_main(problem)
    got = main_device(device_map.values())
    if got == want:
        return []
    if want == "cpu":
        return [Violation("contract-main", f"the plan executes on {got!r}, but no accelerator admits a valid plan as "
                          "the main device here.")]
    return [Violation("contract-main", f"the plan's main device is {got!r}, but accelerator {want!r} is the first "
                      "that can hold a unit plus what streams through it: the contract makes it the main device "
                      "(where users send inputs); objective='latency' lifts this.")]


def contract_violations(problem: Problem, device_map: Mapping, *, strategy: str = "") -> list[Violation]:
    """Every way a (valid) map breaks the contract of this module; empty under ``objective="latency"`` and for
    ``sequential`` (accelerate's own algorithm, kept as it is).

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
    if not problem.options.contract or strategy.startswith("sequential") or not len(problem.graph.tensors.name):
        return []   # lifted, accelerate's own algorithm, or a model without tensors (nothing lives anywhere)
    found = map_runs(problem.graph, device_map)
    out = [] if strategy in EXEMPT_FROM_MAIN else _main_violations(problem, device_map)
    out += order_violations(problem, found)
    have, need = fast_bytes(problem, found), floor(problem)
    if have < need:
        out.append(Violation("contract-floor", f"the plan keeps {format_bytes(have)} on the fastest tier, less than "
                             f"accelerate's valid map ({format_bytes(need)}); objective='latency' lifts this."))
    return out
