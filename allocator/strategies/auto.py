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

from ..budgets import format_ms
from ..placement import Placement, note
from ..problem import Problem, accelerators_up_to
from ..evaluate.units import problem_groups
from . import backfill, ilp, reserve
from ..judge.witness import accelerate_placement
from ..judge.ranking import Tried, best_valid, estimate_decides, infeasible, ranked_by

__all__ = ["place", "choice_note"]

log = logging.getLogger(__name__)
CANDIDATES = {"sequential": accelerate_placement, "reserve": reserve.place, "backfill": backfill.place}
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


def place(problem: Problem) -> Placement:
    """The best valid plan of ``sequential``, ``reserve``, ``backfill``, ``auto``'s plan without the last accelerator
    (under the contract, with two or more: offering one more accelerator never makes the plan rank lower) and a
    time-boxed ``ilp``."""
    candidates = [(name, lambda strategy=strategy: strategy(problem)) for name, strategy in CANDIDATES.items()]
    if problem.options.baseline is not None:   # the map the user gets today on this path: a plan too
        candidates.append(("transformers", lambda: Placement(problem.cleaned(problem.options.baseline),
                                                             "transformers")))
    accelerators = problem.budgets.accelerators
    if problem.options.contract and len(accelerators) > 1:
        candidates.append((f"auto without accelerator {accelerators[-1]!r}", lambda: _without_last(problem)))
    found = best_valid(problem, candidates)
    if _ilp_available(problem):
        hint = found.placement.device_map if found.placement else None
        found = best_valid(problem, [("ilp", lambda: ilp.place(problem, time_limit=ILP_SECONDS, hint=hint))],
                           than=found)
    if found.placement is None:
        raise infeasible(problem)
    placement = found.placement
    used = set(placement.device_map.values())
    if problem.budgets.accelerators and not used - {"cpu", "disk"}:
        log.info("no accelerator plan is valid or faster; running everything from RAM (cpu as main device)")
    choice = note(choice_note(found.name, found.tried, ranked_by(problem)), "choice",
                  bound="estimate" if estimate_decides(problem) else "bytes")
    return Placement(device_map=placement.device_map, strategy=f"auto:{placement.strategy}", base=placement.algorithm,
                     decisions=(choice,) + placement.decisions, optimal=placement.optimal)



def _against(seconds: float, other: float) -> str:
    """``"12.3 % faster"``: how ``seconds`` compares with ``other``."""
    if other <= 0 or abs(seconds - other) <= 1e-12 + 1e-9 * other:
        return "as fast as"
    change = (other - seconds) / other
    percent = abs(change) * 100
    number = f"{percent:.1f}" if percent >= 0.1 else f"{percent:.2g}"
    return f"{number} % {'faster' if change > 0 else 'slower'} than"


def choice_note(winner: str, tried: tuple[Tried, ...], ranking: str = "") -> str:
    """One sentence: the candidate kept, its estimate, the margin over accelerate's map (``sequential``) and over the
    runner-up (the next by rank), what became of the others, and what ranked them (``ranking``)."""
    chosen = next(t for t in tried if t.name == winner)
    text = f"auto chose {winner}: estimated {format_ms(chosen.seconds)} per forward"
    if chosen.why:
        text += f" (it {chosen.why}, and no candidate keeps as many)"
    theirs = next((t for t in tried if t.name == "sequential"), None)
    if winner == "sequential":
        text += ", accelerate's own map"
    elif theirs is not None and theirs.seconds is not None:
        text += (f", {_against(chosen.seconds, theirs.seconds)} accelerate's map (sequential, "
                 f"{format_ms(theirs.seconds)})" + (f", which {theirs.why}" if theirs.why else ""))
    elif theirs is not None:
        text += f"; accelerate's map (sequential) {theirs.why}"
    others = [t for t in tried if t.name not in (winner, "sequential" if winner != "sequential" else "")]
    rivals = sorted((t for t in others if t.eligible and t.key is not None), key=lambda t: t.key, reverse=True)
    if rivals:
        runner = rivals[0]
        if runner.key == chosen.key:
            text += (f"; {runner.name} ranks the same, and {winner} comes first on the ties (the order of the "
                     "candidates)")
        elif _against(chosen.seconds, runner.seconds) == "as fast as":
            text += (f"; {runner.name} is estimated the same, and {winner} comes first on the ties (more bytes on "
                     "the fastest tier, fewer device changes, then the order of the candidates)")
        else:
            text += f"; the runner-up, {runner.name}, is estimated {format_ms(runner.seconds)} ({winner} " \
                    f"{_against(chosen.seconds, runner.seconds)} it)"
    rest = [f"{t.name} {format_ms(t.seconds)}" + (f" ({t.why})" if t.why else "") if t.eligible else f"{t.name} {t.why}"
            for t in others if not rivals or t is not rivals[0]]
    if rest:
        text += "; the others: " + ", ".join(rest)
    return text + (f"; {ranking}" if ranking else "")
