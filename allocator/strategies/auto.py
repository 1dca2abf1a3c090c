"""``auto``: the best valid plan by the cost model among the fast strategies and a time-boxed ``ilp``.

Runs ``sequential`` (accelerate), ``reserve`` and ``backfill``, then ``ilp`` warm-started from the best of them
within a small deterministic budget (when OR-Tools imports and the model has at most ``ilp.MAX_UNITS`` groups), and
keeps the valid plan with the lowest estimated seconds per forward among those that keep the contract
(:mod:`allocator.judge.contract`; every valid plan under ``objective="latency"``). Because accelerate's own map
is a candidate where it keeps the contract, the result is never estimated slower than ``sequential`` there, never
keeps fewer bytes on the accelerators than it wherever its map is valid, and it is never invalid: when nothing fits,
:class:`allocator.InfeasiblePlacement` says the minimum budget.

Notes
-----
The sum of its candidates' costs; ``ilp`` gets ``ILP_SECONDS`` of deterministic time, the ``ilp`` strategy's own
default, so that from the same warm start it returns the same plan. Deterministic.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..placement import Decision, Placement
from ..problem import Problem, accelerators_up_to
from ..evaluate.units import problem_groups
from . import backfill, ilp, reserve
from ..judge.witness import accelerate_placement
from ..judge.ranking import Tried, best_valid, ceiling, estimate_decides, infeasible, ranked_by

__all__ = ["place", "choice"]

log = logging.getLogger(__name__)
BASELINE = "sequential"   # the candidate that is accelerate's own map
CANDIDATES = {BASELINE: accelerate_placement, "reserve": reserve.place, "backfill": backfill.place}
ILP_SECONDS = ilp.TIME_LIMIT


def _without_last(problem: Problem) -> Placement:
    """``auto``'s plan of the problem without its last accelerator: a plan of this problem that leaves it empty."""
    fewer = place(accelerators_up_to(problem, problem.budgets.accelerators[-2]))
    return replace(fewer, strategy=fewer.algorithm)


def _ilp_available(problem: Problem) -> bool:
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return len(problem_groups(problem)) <= ilp.MAX_UNITS


def _bytes_to_keep(problem: Problem, found) -> int:
    """Where bytes on the fastest tier rank first (:func:`allocator.judge.ranking.rank_key`, no measured profile,
    the contract kept), the best candidate's bytes there: ``ilp`` then solves for the fastest plan among those that
    keep as many, the one candidate that can beat it in the judge's ranking, on two accelerators or more (where
    the heuristic fills leave the most room); else 0 (the estimate ranks first, and
    ``ilp`` minimises it over every plan that keeps the contract's floor)."""
    if (found.placement is None or estimate_decides(problem) or found.key is None or not found.key[0]
            or len(problem.budgets.accelerators) < 2):
        return 0
    return int(found.key[1])


def _fewer_could_win(problem: Problem, found) -> bool:
    """Whether ``auto``'s plan without the last accelerator could rank above ``found`` (the best so far): not where
    bytes rank first and ``found`` keeps the contract's floor with more bytes on the accelerators than the others'
    budgets hold together (that plan keeps at most those)."""
    if found.key is None or not found.key[0] or estimate_decides(problem):
        return True
    limits = [problem.budgets.limit(d) for d in problem.budgets.accelerators[:-1]]
    return None in limits or found.key[1] <= sum(limits)


def _solved(found) -> bool:
    """Whether the best so far is the first ``ilp``'s plan, proven optimal: the fastest of every plan with the
    contract's main device that keeps the floor, so also of those that keep its bytes (the second ``ilp``'s plans)."""
    return found.name == "ilp" and found.placement is not None and found.placement.optimal


def place(problem: Problem) -> Placement:
    """The best valid plan of ``sequential``, ``reserve``, ``backfill``, ``auto``'s plan without the last accelerator
    (under the contract, with two or more: offering one more accelerator never makes the plan rank lower) and a
    time-boxed ``ilp``; then, with two accelerators or more where bytes rank first, ``ilp`` again from the best so
    far, keeping its bytes on the fastest tier (:func:`_bytes_to_keep`): the fastest plan among those that keep as
    many, which the ranking takes only where it wins. Each ``ilp`` gets ``ILP_SECONDS`` deterministic seconds (one
    worker, fixed seed), so the plan does not depend on the machine's speed.

    A candidate that could not rank above the best so far is not made: once a candidate reaches the highest key any
    plan can have (:func:`allocator.judge.ranking.ceiling`: every byte on the accelerators, the fewest changes of
    device), none after it; the plan without the last accelerator only where it could keep as many bytes on the
    accelerators (:func:`_fewer_could_win`); the second ``ilp`` only where the first did not win with a proof
    (:func:`_solved`). The plan is the same as with every candidate made: on a tie the earlier candidate wins."""
    highest = ceiling(problem)
    candidates = [(name, lambda strategy=strategy: strategy(problem)) for name, strategy in CANDIDATES.items()]
    if problem.deciding.baseline is not None:   # the map the user gets today on this path: a plan too
        candidates.append(("transformers", lambda: Placement(problem.cleaned(problem.deciding.baseline),
                                                             "transformers")))
    found = best_valid(problem, candidates, highest=highest)
    accelerators = problem.budgets.accelerators
    if problem.deciding.contract and len(accelerators) > 1 and _fewer_could_win(problem, found):
        found = best_valid(problem, [(f"auto without accelerator {accelerators[-1]!r}",
                                      lambda: _without_last(problem))], than=found, highest=highest)
    if _ilp_available(problem):
        hint = found.placement.device_map if found.placement else None
        found = best_valid(problem, [("ilp", lambda: ilp.place(problem, time_limit=ILP_SECONDS, hint=hint))],
                           than=found, highest=highest)
        keep = 0 if _solved(found) else _bytes_to_keep(problem, found)
        if keep:   # the exact candidate of the bytes-first ranking, from the best so far: never ranks lower
            best = found.placement.device_map
            found = best_valid(problem, [("ilp at the best bytes", lambda: ilp.place(
                problem, time_limit=ILP_SECONDS, hint=best, keep=keep))], than=found, highest=highest)
    if found.placement is None:
        raise infeasible(problem)
    placement = found.placement
    used = set(placement.device_map.values())
    if problem.budgets.accelerators and not used - {"cpu", "disk"}:
        log.info("no accelerator plan is valid or faster; running everything from RAM (cpu as main device)")
    chose = choice(found.name, found.tried, ranked_by(problem),
                   bound="estimate" if estimate_decides(problem) else "bytes")
    return Placement(device_map=placement.device_map, strategy=f"auto:{placement.strategy}", base=placement.algorithm,
                     decisions=(chose,) + placement.decisions, optimal=placement.optimal)



def choice(winner: str, tried: tuple[Tried, ...], ranking: str = "", bound: str = "") -> Decision:
    """The ``"choice"`` decision: the candidate kept, what became of every candidate (:meth:`Tried.record`, in the
    order tried), the runner-up (the next by rank among the others that keep the rules, accelerate's map aside) and
    whether it ranks the same, what ranked them (``ranking``: :func:`allocator.judge.ranking.ranked_by`), and which
    candidate is accelerate's map (``baseline``)."""
    chosen = next(t for t in tried if t.name == winner)
    others = [t for t in tried if t.name not in (winner, BASELINE)]
    rivals = sorted((t for t in others if t.eligible and t.key is not None), key=lambda t: t.key, reverse=True)
    return Decision("choice", bound=bound, facts={
        "winner": winner, "tried": [t.record() for t in tried], "runner": rivals[0].name if rivals else None,
        "same_rank": bool(rivals) and rivals[0].key == chosen.key, "ranking": ranking, "baseline": BASELINE})
