"""Ranking plans, and choosing among a strategy's candidates: the selection helpers every strategy uses.

Which plan is better (:func:`rank_key`, one rule): where the cost model's rates were measured on the machine the plan
is for (``PlanOptions.profile``), or the estimate alone decides (``objective="latency"``), the lowest estimated
seconds per forward, then the most bytes on the fastest tier, then the fewest changes of executing device. Otherwise
the estimate rests on constants never measured on that device, so what a user sees as plainly better comes first:
the most bytes on the fastest tier, then the fewest bytes streamed per forward, and the estimate breaks ties.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..evaluate.cost import Cost, estimate_runs, least_seconds, priced
from ..errors import AllocatorError, InfeasiblePlacement
from ..placement import Decision, Placement
from ..problem import Problem
from ..evaluate.memory import main_device
from ..evaluate.runs import columns
from .verdict import is_valid, violations as broken_rules
from ..evaluate.tiers import fast_bytes
from .contract import contract_violations, floor_shortfall, keeps_main_and_order, streams_no_more
from .witness import accelerate_map, contract_main, fill_memo, index_ordered, main_candidates, witness

__all__ = ["Best", "Tried", "best_fill", "best_of", "best_valid", "ceiling", "estimate_decides", "infeasible",
           "keeping_contract", "rank_key", "ranked_by", "score"]

#: How many valid candidates (by bytes on the fastest tier) ``best_of`` prices with the cost model.
PRICED = 8


def estimate_decides(problem: Problem) -> bool:
    """Whether the estimate ranks plans first: its rates were measured (``PlanOptions.profile``), or the caller asked
    for it (``objective="latency"``)."""
    return problem.cost.measured or not problem.deciding.contract


def rank_key(problem: Problem, cost: Cost) -> tuple:
    """The ranking key of a plan's estimate; higher is better (the module's docstring says which order)."""
    if estimate_decides(problem):
        return -cost.seconds, cost.resident_fast, -cost.device_changes
    return cost.resident_fast, -cost.streamed_bytes, -cost.seconds, -cost.device_changes


def ceiling(problem: Problem) -> tuple | None:
    """The highest key :func:`best_valid` can give any plan of ``problem`` where bytes rank first: every byte on the
    accelerators, nothing streamed, the fewest changes of device the budgets allow (a plan that keeps every byte
    on the accelerators uses at least as many as the fewest whose budgets hold the model, and changes device between
    them) and the least estimate with that many (:func:`allocator.evaluate.cost.least_seconds`). A candidate that
    reaches it cannot be beaten: :func:`best_valid` keeps the earlier candidate on a tie. ``None`` where the estimate
    ranks first, or there is no accelerator, or the model fits on none of them.

    Notes
    -----
    O(accelerators) after the per-tensor reads the cost model makes once per problem.
    """
    accelerators = problem.budgets.accelerators
    if estimate_decides(problem) or not accelerators:
        return None
    total = int(columns(problem.graph).sum_counted[-1])
    if not total:
        return None
    limits = [problem.budgets.limit(d) for d in accelerators]
    if None in limits:
        fewest = 1
    else:
        held, fewest = 0, 0
        for limit in sorted(limits, reverse=True):
            held, fewest = held + limit, fewest + 1
            if held >= total:
                break
        if held < total:
            return None
    return True, total, 0, -least_seconds(problem, fewest - 1), -(fewest - 1)


def ranked_by(problem: Problem) -> str:
    """What ranks plans (:func:`rank_key`), as a name the decisions record: ``"measured"`` (the estimate, from
    measured rates), ``"latency"`` (the estimate, as asked) or ``"bytes"`` (bytes on the fastest tier, then bytes
    streamed; the estimate breaks ties)."""
    if estimate_decides(problem):
        return "measured" if problem.deciding.contract else "latency"
    return "bytes"


def score(problem: Problem, device_map) -> tuple:
    """Ranking key of a valid device map (:func:`rank_key` of its estimate); higher is better."""
    return rank_key(problem, priced(problem, device_map))


def _quick(problem: Problem, found) -> int:
    """Bytes a map keeps on the fastest tier (orders the checks), from its runs."""
    return fast_bytes(problem, found)


def best_of(problem: Problem, candidates, strategy: str) -> Placement:
    """The best valid candidate by the cost model; raises when none is valid.

    A candidate (:class:`allocator.search.first_fit.Filled`) gives its ``runs()``, its ``main`` device, its
    ``device_map()``, its ``reserve`` and the main device it was made ``under`` (the ``"kept"`` decision records
    them). Candidates are ranked by bytes on the fastest tier; the first :data:`PRICED` valid ones are priced with
    the cost model (:func:`allocator.evaluate.cost.estimate_runs`, from their runs). Only the
    maps that must be checked are built: with at most :data:`PRICED` candidates every valid one is priced, so they are
    checked from the best price down and the first valid one wins (usually one map and one check); with more, each is
    checked on the way, in ranked order.
    """
    candidates = keeping_contract(problem, candidates)
    ranked = sorted(((_quick(problem, c.runs()), k) for k, c in enumerate(candidates)), reverse=True)
    best = None
    if len(candidates) <= PRICED:
        # every valid candidate is priced: check them from the best price down (on a tie, in ranked order); the
        # first valid one is the best
        costs = {k: _cost(problem, candidates[k]) for _, k in ranked}
        keys = [((streams_no_more(problem, costs[k].streamed_bytes), *rank_key(problem, costs[k])), -i, k)
                for i, (_, k) in enumerate(ranked)]
        failed: set[int] = set()   # a candidate listed twice (reserve: two starts, one fixed point) is checked once
        for key, _, k in sorted(keys, reverse=True):
            if id(candidates[k]) in failed:
                continue
            device_map = _final(problem, candidates[k])
            if is_valid(problem, device_map):
                best = (key, device_map, candidates[k], costs[k])
                break
            failed.add(id(candidates[k]))
    else:
        priced = 0
        for _, k in ranked:
            if priced >= PRICED:
                break
            device_map = _final(problem, candidates[k])
            if not is_valid(problem, device_map):
                continue
            priced += 1
            cost = _cost(problem, candidates[k])
            key = (streams_no_more(problem, cost.streamed_bytes), *rank_key(problem, cost))
            if best is None or key > best[0]:
                best = (key, device_map, candidates[k], cost)
    if best is None or (not best[0][0] and accelerate_map(problem) is not None):
        # none valid, or none streams no more than the baseline that keeps the contract (rule 3): the baseline
        return _witness_instead(problem, strategy)
    key, device_map, kept, cost = best
    return Placement(device_map=device_map, strategy=strategy, decisions=(Decision(
        "kept", devices=(main_device(device_map.values()),), bytes=int(cost.resident_fast),
        bound="estimate" if estimate_decides(problem) else "bytes",
        facts={"strategy": strategy, "candidates": len({id(c) for c in candidates}),
               "contract": problem.deciding.contract, "main": kept.under, "reserve": int(kept.reserve),
               "seconds": cost.seconds, "changes": int(cost.device_changes)}),))


def best_fill(problem: Problem, candidates, strategy: str) -> Placement:
    """:func:`best_of` over the fills ``candidates(problem, mains, memo, ordered=...)`` makes
    (:mod:`allocator.search.fills`) under the main devices a strategy may use (:func:`main_candidates`) and the
    contract's index order (:func:`allocator.judge.witness.index_ordered`), with the problem's memo of fills:
    ``reserve``'s and ``backfill``'s plan, and the same plan wherever another strategy starts from one of them."""
    found = candidates(problem, main_candidates(problem), fill_memo(problem), ordered=index_ordered(problem))
    return best_of(problem, found, strategy)


@dataclass(frozen=True, slots=True)
class Tried:
    """What became of one candidate of :func:`best_valid`, as data: its estimate where it has one, and why it lost
    when it could not win (``outcome``; :mod:`allocator.report.decisions` says it in words)."""

    name: str
    outcome: str = ""
    """``""`` for a candidate that keeps every rule; ``"error"`` (``detail``: the error's class), ``"invalid"``
    (``detail``: the kind of the first runtime rule it breaks), ``"contract"`` (it breaks rule 1 or 2: ``kinds``,
    and its ``main`` against the contract's ``wanted``), ``"short"`` (valid, but fewer bytes on the fastest tier than
    the baseline)."""
    detail: str = ""
    seconds: float | None = None
    eligible: bool = False  # valid and keeps rules 1 and 2 of the contract
    kinds: frozenset = frozenset()  # the contract rules it breaks ("contract-main", "contract-order", ...)
    key: tuple | None = None  # its ranking key (eligible candidates)
    main: object = None     # its main device ("contract")
    wanted: object = None   # the contract's main device ("contract")

    def record(self) -> dict:
        """The fields a decision keeps (JSON values): name, outcome, detail, seconds, main and wanted."""
        return {"name": self.name, "outcome": self.outcome, "detail": self.detail, "seconds": self.seconds,
                "main": self.main, "wanted": self.wanted}


@dataclass(frozen=True, slots=True)
class Best:
    """The outcome of :func:`best_valid`: the winning placement and its name (``None`` when no candidate is valid),
    its ranking key, and what became of every candidate, in the order tried."""

    placement: Placement | None = None
    name: str | None = None
    key: tuple | None = None
    tried: tuple[Tried, ...] = ()


def best_valid(problem: Problem, candidates: Iterable[tuple[str, Callable[[], Placement]]], *,
               than: Best | None = None, highest: tuple | None = None) -> Best:
    """The best of ``candidates`` (``(name, make)`` pairs; ``make()`` returns a :class:`Placement` or raises an
    :class:`allocator.AllocatorError`) that keeps the runtime rules and rules 1 and 2 of the contract.

    Ranked first by reaching the contract's floor (accelerate's bytes on the fastest tier), then by :func:`score`
    (:func:`rank_key`); on a tie the earlier candidate wins. ``than`` continues an earlier call: its winner is kept
    unless a candidate beats it. Under ``objective="latency"`` every valid map is eligible and only :func:`score`
    ranks. ``highest`` (:func:`ceiling`): the highest key any plan can have; once the best reaches it, the candidates
    left are not made (none could win).
    """
    best = than or Best()
    tried = list(best.tried)
    for name, make in candidates:
        if highest is not None and best.key is not None and best.key >= highest:
            break
        try:
            placement = make()
        except AllocatorError as err:
            tried.append(Tried(name, "error", type(err).__name__))
            continue
        violations = broken_rules(problem, placement.device_map)
        if violations:
            tried.append(Tried(name, "invalid", violations[0].kind))
            continue
        kinds = frozenset(v.kind for v in contract_violations(problem, placement.device_map))
        if kinds - {"contract-floor"}:   # rules 1 and 2 come first: the floor only ranks
            seconds = priced(problem, placement.device_map).seconds
            tried.append(Tried(name, "contract", "main" if "contract-main" in kinds else "order", seconds,
                               kinds=kinds, main=main_device(placement.device_map.values()),
                               wanted=contract_main(problem)))
            continue
        key = (not kinds, *score(problem, placement.device_map))
        tried.append(Tried(name, "short" if kinds else "", "", priced(problem, placement.device_map).seconds,
                           eligible=True, kinds=kinds, key=key))
        if best.key is None or key > best.key:
            best = Best(placement, name, key)
    return Best(best.placement, best.name, best.key, tuple(tried))


def keeping_contract(problem: Problem, candidates: list) -> list:
    """The candidates (:class:`allocator.search.first_fit.Filled`) that keep the contract's main device, index order
    and floor (:mod:`allocator.judge.contract`); all of them under ``objective="latency"``. When none reaches the
    floor and accelerate's map cannot be kept instead (it breaks rule 1 or 2 itself), those that keep rules 1 and 2."""
    if not problem.deciding.contract:
        return list(candidates)
    keep = [c for c in candidates if keeps_main_and_order(problem, c.main, c.runs())]
    above = [c for c in keep if not floor_shortfall(problem, _quick(problem, c.runs()))]
    return above if above or accelerate_map(problem) is not None else keep


def _cost(problem: Problem, candidate) -> Cost:
    """The estimate of a candidate (as :func:`allocator.evaluate.cost.estimate` of its map), from its runs."""
    return estimate_runs(problem, candidate.runs(), candidate.main)


def _final(problem: Problem, candidate) -> dict:
    """The device map a candidate is returned as (cleaned unless the options say not to)."""
    placed = candidate.device_map()
    return problem.cleaned(placed)


def _witness_instead(problem: Problem, strategy: str) -> Placement:
    """Where no candidate of a strategy keeps the contract: accelerate's own map where it keeps it, else the plan that
    proved the contract's main device (:attr:`allocator.judge.witness.Witness.main_plan`); raises where there is
    neither."""
    if problem.deciding.contract and accelerate_map(problem) is not None:
        return Placement(device_map=accelerate_map(problem), strategy=strategy, decisions=(Decision(
            "fallback", bound="contract",
            facts={"reason": "contract", "strategy": strategy, "main": contract_main(problem)}),))
    found = witness(problem).main_plan if problem.deciding.contract else None
    if found is None:
        raise infeasible(problem)
    return Placement(device_map=found, strategy=strategy, decisions=(Decision(
        "fallback", bound="main", facts={"reason": "main", "strategy": strategy, "main": contract_main(problem)}),))


def infeasible(problem: Problem) -> InfeasiblePlacement:
    """The error a strategy raises when no candidate is valid (``allocator.plan`` adds the minimum budget)."""
    return InfeasiblePlacement(
        f"no placement of {problem.graph.model_class} fits these budgets {dict(problem.budgets.limits)}."
    )
