"""``ilp``: an optimal plan by OR-Tools CP-SAT over the finest legal units.

Model, for each device that could be main (``M``): one device per tie group; accelerators before ``M`` stay empty and
``M`` holds at least one group; budgets with the exact reservation on ``M`` — the largest streamed chain of what is
offloaded, which is the largest ``stream`` of an offloaded group (only whole-module units are ever offloaded, and a
root-to-leaf chain crosses one unit at most), as a staircase of booleans — plus the buffers of offloaded groups; RAM
holds cpu-offloaded weights; a disk budget holds disk weights when given. The objective is
:func:`allocator.evaluate.cost.estimate` in picoseconds, priced tensor by tensor with
:func:`allocator.evaluate.cost.device_seconds`
(reads, copies, per-tensor latencies) plus each change of executing device between consecutive units, so a plan's
objective is its estimate up to rounding.

Search: warm-started from the best valid plan of ``sequential``, ``reserve`` and ``backfill`` (or the caller's
``hint``), whose cost also bounds every main device's objective from above; the other main devices are solved first
(most are pruned at once by that bound), then the hint's main gets the deterministic time left; mains still unproven
get a second round. Interchangeable groups (same sizes, streams and costs) take devices in a fixed order, and with
two executing devices runs of identical neighbours are ordered one way or the other; with more, under the contract,
the offloaded groups of such a run form one block (``search.cpsat.offloaded_block``). The warm start is given as a
complete solution — every boolean of the model: devices, reserve steps, device-used flags, changes of executing
device, the direction of each run (the one that changes device less often) — so CP-SAT starts from it at once instead
of first searching to complete it.

Deterministic: one worker, a fixed seed, deterministic time limits (``max_deterministic_time``), ``TIME_LIMIT``
per plan by default. CP-SAT's deterministic clock undercounts its LP work, so a deterministic second can take several
seconds of wall time with several accelerators: the budget is kept small for that reason, and Chvátal-Gomory cuts are
off (they cost wall time and proved nothing more on the benchmark zoo; benchmarks/RESULTS.md has the figures).
``Placement.optimal`` is ``True`` only when every main device was solved to optimality or proven unable to beat the
returned plan. When CP-SAT finds nothing at or below the warm start, the warm start is returned, so ``ilp`` is never
estimated slower than the best of those heuristics.

Notes
-----
Beyond ``max_units`` groups, consecutive single-unit groups are merged (a merged group goes to one device, so the
plan stays legal but may lose a little, and it is not called optimal); ``explain()`` says so.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..evaluate.cost import Profile, estimate
from ..errors import AllocatorError
from ..placement import Decision, Placement
from ..problem import Problem
from ..evaluate.memory import device_of, main_device, map_runs
from ..evaluate.units import problem_groups
from ..judge.verdict import is_valid, violations as broken_rules
from ..search.fills import backfill_candidates, reserve_candidates
from ..search.cpsat import MAX_UNITS, NS, coarsen, home_weightless, model_inputs, solve_for_main
from ..judge.ranking import best_fill, best_valid, infeasible
from ..evaluate.tiers import fast_bytes, order_violations
from ..judge.contract import floor_to_keep, main_or_order_violations
from ..judge.witness import accelerate_placement, index_ordered, main_candidates

__all__ = ["place"]

log = logging.getLogger(__name__)

TIME_LIMIT = 1.0  # deterministic seconds for CP-SAT per plan; see ``place``


def place(problem: Problem, *, profile: Profile | None = None, time_limit: float = TIME_LIMIT,
          max_units: int = MAX_UNITS, hint=None, keep: int = 0) -> Placement:
    """Solve for the plan with the lowest estimated cost per forward.

    Parameters
    ----------
    problem : Problem
    profile : Profile, optional
        Bandwidths of the target machine (the problem's when omitted).
    time_limit : float
        Deterministic time for CP-SAT (``max_deterministic_time``; with several accelerators one deterministic second
        may take several seconds of one core), shared by the main-device candidates; time one leaves unused goes to
        the next.
    max_units : int
        Beyond this many tie groups, consecutive groups are merged.
    hint : dict, optional
        A device map to warm-start from and to beat; when omitted, the best valid plan of ``sequential``,
        ``reserve`` and ``backfill``.
    keep : int
        Bytes the plan must keep on the fastest tier, beyond the contract's floor (``auto`` passes its best
        candidate's, so that where bytes rank first the solver looks for the fastest plan among those that keep as
        many: the exact candidate of the judge's ranking). A hint below it is not used as the warm start.

    Returns
    -------
    Placement
        ``optimal`` is ``True`` when proven for every main device.

    Raises
    ------
    InfeasiblePlacement
        When no main device admits a plan (CP-SAT proves it, or finds nothing in time) and the hint is not valid.
    """
    profile = profile or problem.profile
    g = problem.graph
    found = list(problem_groups(problem).records())
    found, merged = coarsen(found, max_units)
    tensors, sequence, ends = model_inputs(problem, found)
    if hint is None:
        hint = _heuristic(problem, profile)
    incumbent = None  # (estimated seconds, device map): the hint, kept when CP-SAT finds nothing better
    if hint is not None and is_valid(problem, hint) and not main_or_order_violations(problem, hint) \
            and fast_bytes(problem, map_runs(g, hint)) >= keep:
        incumbent = (estimate(problem, hint, profile).seconds, dict(hint))
    reached = None if incumbent is None else fast_bytes(problem, map_runs(g, incumbent[1]))
    need = max(floor_to_keep(problem, reached), keep)
    mains = main_candidates(problem)
    hinted = main_device(hint.values()) if hint else None
    # The other mains first, bounded by the hint's cost (most are pruned at once); the hint's main gets the time
    # left; mains still unproven then share what remains, from their best plan and below the best cost.
    mains.sort(key=lambda m: m == hinted)
    unit_hint = {u.name: device_of(u.name, hint) for grp in found for u in grp.units} if hint else None
    slack = len(found) + len(sequence)  # the objective rounds each group's cost and each change to a picosecond
    best, left, hints, todo = None, time_limit, {}, list(mains)
    for _ in range(2):
        pending = []
        for i, main in enumerate(todo):
            cutoff = best[0] if best else None
            if incumbent is not None:
                bound = int(round(incumbent[0] * NS)) + slack
                cutoff = bound if cutoff is None else min(cutoff, bound)
            start = hints.get(main, unit_hint if main == hinted else None)
            solved = solve_for_main(problem, found, tensors, sequence, main, profile, left / (len(todo) - i), start,
                                     cutoff, need, ends, ordered=index_ordered(problem))
            left = max(0.0, left - solved.work)
            if not solved.proven:
                pending.append(main)
            if solved.placed is not None:
                hints[main] = solved.placed
                if best is None or solved.objective < best[0]:
                    best = (solved.objective, main, solved.placed)
        if not pending or left <= 0:
            break
        todo = pending
    proven = not pending
    if best is None and incumbent is None:
        raise infeasible(problem)
    if best is None or (incumbent is not None and best[0] / NS > incumbent[0] + slack / NS):
        # CP-SAT found nothing at or below the hint: the hint is the plan (optimal when every main was proven)
        objective, main, placed = incumbent[0] * NS, main_device(incumbent[1].values()), incumbent[1]
        warm = True
    else:
        objective, main, placed = best
        warm = False
    objective /= NS
    homed = home_weightless(found, placed, main) if main in problem.budgets.order else placed
    if index_ordered(problem) and order_violations(problem, map_runs(g, homed)):
        # on the main device, a buffers-only module that runs after units on later accelerators would break their
        # index order: offloaded to RAM instead (the same memory: its buffers stay on the main device)
        homed = home_weightless(found, placed, main, home="cpu") if "cpu" in problem.budgets.order else placed
    if homed != placed:   # from disk to RAM costs no more (a zero-size parameter still pays its hook): price it again
        objective = estimate(problem, homed, profile).seconds
    placed = homed
    device_map = problem.cleaned(placed)
    violations = broken_rules(problem, device_map)
    if violations:
        raise AllocatorError(f"ilp produced an invalid plan (a modelling bug, please report): {violations[:3]}")
    decisions = [Decision("solver", devices=(main,), bound="estimate", facts={
        "reason": "solved", "groups": len(found), "mains": list(mains), "seconds": objective, "proven": proven,
        "warm_start": warm})]
    if merged:
        decisions.append(Decision("solver", facts={"reason": "coarsened", "merges": merged, "max_units": max_units}))
    return Placement(device_map=device_map, strategy="ilp", decisions=tuple(decisions), optimal=proven and not merged)


def _heuristic(problem: Problem, profile: Profile) -> dict | None:
    """The warm start and first cutoff: the best valid map of the fast strategies
    (:func:`allocator.judge.ranking.best_valid`, ranked under ``profile``), or ``None``."""
    ranked = problem if profile == problem.profile else replace(problem, profile=profile)
    fast = [("sequential", lambda: accelerate_placement(ranked)),
            ("reserve", lambda: best_fill(ranked, reserve_candidates, "reserve")),
            ("backfill", lambda: best_fill(ranked, backfill_candidates, "backfill"))]
    found = best_valid(ranked, fast)
    return found.placement.device_map if found.placement else None
