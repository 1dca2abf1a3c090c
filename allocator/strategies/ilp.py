"""``ilp``: an optimal plan by OR-Tools CP-SAT over the finest legal units.

Model, for each device that could be main (``M``): one device per tie group; accelerators before ``M`` stay empty and
``M`` holds at least one group; budgets with the exact reservation on ``M`` — the largest streamed chain of what is
offloaded, which is the largest ``stream`` of an offloaded group (only whole-module units are ever offloaded, and a
root-to-leaf chain crosses one unit at most), as a staircase of booleans — plus the buffers of offloaded groups; RAM
holds cpu-offloaded weights; a disk budget holds disk weights when given. The objective is
:func:`allocator.evaluate.cost.estimate` in picoseconds, priced tensor by tensor with
:func:`allocator.evaluate.cost.tensor_seconds`
(reads, copies, per-tensor latencies) plus each change of executing device between consecutive units, so a plan's
objective is its estimate up to rounding.

Search: warm-started from the best valid plan of ``sequential``, ``reserve`` and ``backfill`` (or the caller's
``hint``), whose cost also bounds every main device's objective from above; the other main devices are solved first
(most are pruned at once by that bound), then the hint's main gets the deterministic time left; mains still unproven
get a second round. Interchangeable groups (same sizes, streams and costs) take devices in a fixed order, and with
two executing devices runs of identical neighbours are ordered one way or the other. The warm start is given as a
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
from dataclasses import dataclass, replace

from ..budgets import is_accelerator
from ..evaluate.cost import Profile, boundaries, change_seconds, estimate, tensor_seconds
from ..errors import AllocatorError
from ..placement import Placement, note
from ..problem import Problem
from ..rules.loaders import loads_disk_only
from ..evaluate.runs import columns
from ..evaluate.memory import device_of, main_device, map_runs, offloaded_devices, streams_held, workspace
from ..evaluate.units import Group, disk_loadable, problem_groups
from ..evaluate.validate import check
from . import backfill, reserve
from .ranking import best_valid, infeasible
from ..evaluate.tiers import fast_bytes, fast_tier, order_violations
from .contract import contract_violations
from .witness import accelerate_map, accelerate_placement, floor, main_candidates

__all__ = ["place"]

log = logging.getLogger(__name__)

MAX_UNITS = 400
TIME_LIMIT = 1.0  # deterministic seconds for CP-SAT per plan; see ``place``
NS = 1e12  # picoseconds: tiny models must not round every cost to zero


def _coarsen(found: list[Group], limit: int) -> tuple[list[Group], int]:
    """Merge runs of consecutive single-unit groups until at most ``limit`` groups remain."""
    merged = 0
    while len(found) > limit:
        out, i = [], 0
        while i < len(found):
            a = found[i]
            b = found[i + 1] if i + 1 < len(found) else None
            if b is not None and len(a.units) == 1 and len(b.units) == 1 and len(out) + len(found) - i > limit:
                out.append(Group(a.units + b.units, a.size + b.size, a.offload + b.offload, a.pinned + b.pinned,
                                 max(a.stream, b.stream), a.numel + b.numel, a.resident_only or b.resident_only))
                merged += 1
                i += 2
            else:
                out.append(a)
                i += 1
        if len(out) == len(found):
            break
        found = out
    return found, merged


@dataclass(frozen=True, slots=True)
class _Solved:
    placed: dict | None   # unit name -> device, or None when nothing was found at or below the cutoff
    proven: bool          # optimal, or proven that nothing beats the cutoff (or that nothing fits)
    objective: int        # picoseconds (meaningful when ``placed``)
    work: float           # deterministic time spent


def _devices(problem: Problem, main) -> list:
    """The main device, the accelerators after it, then cpu and disk: those that ``max_memory`` names (``disk``
    always; the CPU without a budget only executes what streams from disk)."""
    b = problem.budgets
    if main == "cpu":
        devices = ["cpu", "disk"]
    else:
        devices = [d for d in b.accelerators if b.order.index(d) >= b.order.index(main)]
        devices += ["disk"] if main == "mps" else ["cpu", "disk"]
    return [d for d in devices if d in b.order]


def _runs(found: list[Group], sequence: list[int], cost: list[dict], changes: bool) -> list[list[int]]:
    """Classes of interchangeable groups: same sizes, streams and costs on every device; each a single unit.

    Without changes of executing device any two such groups can swap devices; with them, only neighbours in the
    execution sequence (a run), so a class is a maximal run of consecutive identical groups.
    """
    def key(k):
        grp = found[k]
        return (grp.size, grp.offload, grp.pinned, grp.stream, grp.resident_only,
                tuple(sorted(cost[k].items(), key=str)))

    single = {k for k, grp in enumerate(found) if len(grp.units) == 1}
    if not changes:
        classes: dict = {}
        for k in sorted(single):
            classes.setdefault(key(k), []).append(k)
        return [ks for ks in classes.values() if len(ks) > 1]
    runs, current = [], []
    for k in sequence:
        if k in single and current and key(k) == key(current[-1]) and k != current[-1]:
            current.append(k)
            continue
        if len(current) > 1:
            runs.append(current)
        current = [k] if k in single else []
    if len(current) > 1:
        runs.append(current)
    return runs


def _solve_for_main(problem: Problem, found: list[Group], tensors: list[list[int]], sequence: list[int], main,
                    profile: Profile, seconds: float, hint: dict | None, cutoff: int | None, need: int = 0,
                    ends: list[int] | None = None) -> _Solved:
    """CP-SAT for one main device; ``cutoff`` (picoseconds) bounds the objective from above when given; ``need``:
    bytes the plan must keep on the fastest tier (the contract's floor); ``ends``: one past the last tensor of each
    unit of ``sequence`` (where a change of device after it moves that unit's output)."""
    ends = ends if ends is not None else [0] * len(sequence)
    from ortools.sat.python import cp_model

    g, b = problem.graph, problem.budgets
    devices = _devices(problem, main)
    targets = offloaded_devices(main)
    model = cp_model.CpModel()
    x = {(k, d): model.NewBoolVar(f"x{k}_{d}") for k in range(len(found)) for d in devices}
    off = {}
    no_disk = [k for k, ok in enumerate(disk_loadable(problem).tolist()) if not ok] if "disk" in devices else []
    for k, grp in enumerate(found):
        model.AddExactlyOne(x[k, d] for d in devices)
        off[k] = sum(x[k, d] for d in devices if d in targets)
        if grp.resident_only:  # lone tensors are never hooked by accelerate: keep them resident
            for d in devices:
                if d in targets:
                    model.Add(x[k, d] == 0)
    for k in no_disk:   # what the loader would not load right from disk (allocator.rules.loaders.loads_from_disk)
        model.Add(x[k, "disk"] == 0)
    if "disk" in devices and found and not loads_disk_only(problem.options.loader):
        model.Add(sum(x[k, "disk"] for k in range(len(found))) <= len(found) - 1)

    # The exact streaming reserve. Only whole-module units are ever offloaded (tensor units are resident-only) and
    # a root-to-leaf chain crosses at most one unit's subtree, so the reserve is the largest ``stream`` offloaded:
    # a staircase of booleans "the reserve is at least level j", each implied by offloading a group of that level.
    levels = sorted({grp.stream for grp in found if grp.stream and not grp.resident_only})
    steps = [model.NewBoolVar(f"r{j}") for j in range(len(levels))]
    for j in range(1, len(steps)):
        model.AddImplication(steps[j], steps[j - 1])
    reserve = sum((levels[j] - (levels[j - 1] if j else 0)) * steps[j] for j in range(len(steps)))
    at = {level: j for j, level in enumerate(levels)}
    for k, grp in enumerate(found):
        if grp.stream and not grp.resident_only:
            model.Add(off[k] <= steps[at[grp.stream]])
    pinned = sum(grp.pinned * off[k] for k, grp in enumerate(found))
    used_of = {}
    for d in devices:
        limit = b.limit(d)
        if d == main:
            resident = sum(grp.size * x[k, d] for k, grp in enumerate(found))
            model.Add(resident + pinned + streams_held(problem.options, reserve) + workspace(g, main=True) <= limit)
            if is_accelerator(d):
                model.Add(sum(x[k, d] for k in range(len(found))) >= 1)
        elif d in targets:
            if d == "cpu" or limit is not None:
                model.Add(sum(grp.offload * x[k, d] for k, grp in enumerate(found)) <= limit)
        elif g.workspace:  # a device that runs anything also holds the activations of a generation budget
            used = used_of[d] = model.NewBoolVar(f"used_{d}")
            for k in range(len(found)):
                model.AddImplication(x[k, d], used)
            weights = sum(grp.size * x[k, d] for k, grp in enumerate(found))
            model.Add(weights + workspace(g, main=False) * used <= limit)
        else:
            model.Add(sum(grp.size * x[k, d] for k, grp in enumerate(found)) <= limit)

    # The contract: resident groups take accelerators in index order along the model. A level per group that never
    # decreases in model order; a group on an executing device has that device's level (offloaded groups follow it).
    executing = [d for d in devices if d not in targets]  # offloaded groups execute on the main device
    if problem.options.contract and len(executing) > 1:
        level = [model.NewIntVar(0, len(executing) - 1, f"level{k}") for k in range(len(found))]
        for k in range(1, len(found)):
            model.Add(level[k] >= level[k - 1])
        for k in range(len(found)):
            for i, d in enumerate(executing):
                model.Add(level[k] == i).OnlyEnforceIf(x[k, d])
        if hint:
            _hint_levels(model, hint, found, executing, level)
    if need:   # never below accelerate: at least its bytes on the fastest tier
        counted = columns(g).counted
        fast = [d for d in devices if d in fast_tier(problem.budgets)]
        model.Add(sum(sum(counted[t] for t in tensors[k]) * x[k, d] for k in range(len(found)) for d in fast) >= need)

    # Objective: the estimate, tensor by tensor (reads, copies, per-tensor latencies), and the changes of executing
    # device, in picoseconds.
    cost = [{d: int(round(sum(tensor_seconds(problem, main, profile, g.tensors[t], d) for t in tensors[k]) * NS))
             for d in devices} for k in range(len(found))]
    terms = [cost[k][d] * x[k, d] for k in range(len(found)) for d in devices if cost[k][d]]
    changes = len(executing) > 1
    switches = []  # (k1, k2, boolean): a change of executing device between consecutive groups k1 and k2
    if changes:
        crossing = boundaries(problem)   # activation bytes at each tensor boundary, where they were counted
        for (k1, end), k2 in zip(zip(sequence, ends), sequence[1:]):
            if k1 == k2:
                continue
            change_ps = int(round(change_seconds(profile, None if crossing is None else int(crossing[end])) * NS))
            ch = model.NewBoolVar("")
            for a in executing:
                e1 = x[k1, a] + (off[k1] if a == main else 0)
                e2 = x[k2, a] + (off[k2] if a == main else 0)
                model.Add(ch >= e1 - e2)
                model.Add(ch >= e2 - e1)
            terms.append(change_ps * ch)
            switches.append((k1, k2, ch))
    objective = sum(terms)
    model.Minimize(objective)
    if cutoff is not None:
        model.Add(objective <= cutoff)

    # Symmetry: interchangeable groups take devices in a fixed order of rank (the main device's executing devices
    # first). With changes of executing device, a run of identical neighbours is ordered one way or the other: with
    # at most two executing devices, one of the two monotone orders has the fewest changes for the same counts.
    rank_of = {d: i for i, d in enumerate([main] + [d for d in devices if d in targets]
                                         + [d for d in executing if d != main])}
    if len(executing) <= 2:
        for run in _runs(found, sequence, cost, changes):
            ranks = [sum(rank_of[d] * x[k, d] for d in devices) for k in run]
            up = model.NewBoolVar("") if changes else None
            for r1, r2 in zip(ranks, ranks[1:]):
                if up is None:
                    model.Add(r1 <= r2)
                else:
                    model.Add(r1 <= r2).OnlyEnforceIf(up)
                    model.Add(r1 >= r2).OnlyEnforceIf(up.Not())
            if hint:
                hint, ascending = _sort_run(hint, found, sequence, run, rank_of, targets, main, changes)
                if up is not None:
                    model.AddHint(up, ascending)
    if hint:
        # A complete hint (every boolean of the model, not only the devices) is a solution CP-SAT takes as it is;
        # an incomplete one it first completes by a search of its own, which costs wall time.
        device = {k: hint.get(grp.units[0].name) for k, grp in enumerate(found)}
        for k in range(len(found)):
            for dev in devices:
                model.AddHint(x[k, dev], dev == device[k])
        top = max((grp.stream for k, grp in enumerate(found)
                   if device[k] in targets and grp.stream and not grp.resident_only), default=0)
        for level, step in zip(levels, steps):
            model.AddHint(step, level <= top)
        for d, used in used_of.items():
            model.AddHint(used, d in device.values())
        runs_on = {k: main if d in targets else d for k, d in device.items()}
        for k1, k2, ch in switches:
            model.AddHint(ch, runs_on[k1] != runs_on[k2])
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = seconds
    solver.parameters.linearization_level = 2  # proves more 2-GPU cells of the zoo within the same budget
    # Chvatal-Gomory cuts: their separation costs wall time that the deterministic clock barely counts (on the zoo's
    # 2- and 4-GPU cells, a third of the wall time at the same deterministic budget), for no more proofs there.
    solver.parameters.add_cg_cuts = False
    status = solver.Solve(model)
    work = solver.response_proto.deterministic_time
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _Solved(None, status == cp_model.INFEASIBLE, 0, work)
    placed = {}
    for k, grp in enumerate(found):
        d = next(dev for dev in devices if solver.Value(x[k, dev]))
        for u in grp.units:
            placed[u.name] = d
    return _Solved(placed, status == cp_model.OPTIMAL, int(solver.ObjectiveValue()), work)


def _hint_levels(model, hint: dict, found: list[Group], executing: list, level: list) -> None:
    """Hint the contract's levels of a hinted plan: each group's executing device, carried over offloaded groups."""
    rank = {d: i for i, d in enumerate(executing)}
    current = 0
    for k, grp in enumerate(found):
        current = max(current, rank.get(hint.get(grp.units[0].name), current))
        model.AddHint(level[k], current)


def _sort_run(hint: dict, found: list[Group], sequence: list[int], run: list[int], rank_of: dict, targets, main,
              changes: bool) -> tuple[dict, bool]:
    """The hint with the devices of interchangeable groups sorted by rank: ascending, or with changes of executing
    device (``run`` is then consecutive in ``sequence``) descending where that changes device less often next to the
    run's neighbours; and whether ascending."""
    name = lambda k: found[k].units[0].name  # noqa: E731
    ordered = sorted((hint.get(name(k)) for k in run), key=lambda d: rank_of.get(d, 0))
    ascending = True
    if changes:
        i = sequence.index(run[0])
        left = hint.get(name(sequence[i - 1])) if i > 0 else None
        right = hint.get(name(sequence[i + len(run)])) if i + len(run) < len(sequence) else None

        def switches(devices) -> int:
            runs_on = [main if d in targets else d for d in [left, *devices, right] if d is not None]
            return sum(a != b for a, b in zip(runs_on, runs_on[1:]))

        ascending = switches(ordered) <= switches(ordered[::-1])
    chosen = ordered if ascending else ordered[::-1]
    return dict(hint) | {name(k): d for k, d in zip(run, chosen)}, ascending


def _home_weightless(found, placed: dict, main, home=None) -> dict:
    """Groups that stream nothing (buffers only, which stay on the main device anyway) put on the main device (or
    ``home``, an offload target) rather than wherever the solver left them: the same memory and cost, and no ``disk``
    in a map that needs no offload folder."""
    offloaded = offloaded_devices(main)
    out = dict(placed)
    for grp in found:
        if grp.offload == 0 and not grp.resident_only and out.get(grp.units[0].name) in offloaded:
            out.update(dict.fromkeys(grp.names, main if home is None else home))
    return out


def _unit_tensors(g, unit) -> list[int]:
    """Indices of the graph tensors a unit holds (its subtree's, or the one tensor of a tensor unit)."""
    if unit.node < 0:
        return [g.tensor_index[unit.name]]
    nodes, out, stack = g.nodes, [], [unit.node]
    while stack:
        n = stack.pop()
        out += nodes.tensors_of(n)
        stack.extend(nodes.children(n))
    return out


def _unit_order(found: list[Group], g) -> list[str]:
    names = [u.name for grp in found for u in grp.units]
    position = {}
    for i, name in enumerate(g.nodes.name):
        position.setdefault(name, i)
    for name in g.tensors.name:
        position.setdefault(name, g.node_index.get(name.rpartition(".")[0], 0) + 0.5)
    return sorted(names, key=lambda n: position.get(n, 0))


def place(problem: Problem, *, profile: Profile | None = None, time_limit: float = TIME_LIMIT,
          max_units: int = MAX_UNITS, hint=None) -> Placement:
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
    found, merged = _coarsen(found, max_units)
    tensors = [[t for u in grp.units for t in _unit_tensors(g, u)] for grp in found]
    unit_group = {u.name: k for k, grp in enumerate(found) for u in grp.units}
    weighted = {u.name for grp in found for u in grp.units if any(g.tensors.nbytes[t] for t in _unit_tensors(g, u))}
    by_name = {u.name: u for grp in found for u in grp.units}
    ordered = [name for name in _unit_order(found, g) if name in weighted]
    sequence = [unit_group[name] for name in ordered]
    ends = [max(_unit_tensors(g, by_name[name])) + 1 for name in ordered]
    if hint is None:
        hint = _heuristic(problem, profile)
    incumbent = None  # (estimated seconds, device map): the hint, kept when CP-SAT finds nothing better
    if hint is not None and not check(problem, hint)[0] and not _breaks_order_or_main(problem, hint):
        incumbent = (estimate(problem, hint, profile).seconds, dict(hint))
    need = _floor_to_keep(problem, incumbent)
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
            solved = _solve_for_main(problem, found, tensors, sequence, main, profile, left / (len(todo) - i), start,
                                     cutoff, need, ends)
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
        kept = "; no better plan than the warm start"
    else:
        objective, main, placed = best
        kept = ""
    objective /= NS
    homed = _home_weightless(found, placed, main) if main in problem.budgets.order else placed
    if problem.options.contract and order_violations(problem, map_runs(g, homed)):
        # on the main device, a buffers-only module that runs after units on later accelerators would break their
        # index order: offloaded to RAM instead (the same memory: its buffers stay on the main device)
        homed = _home_weightless(found, placed, main, home="cpu") if "cpu" in problem.budgets.order else placed
    if homed != placed:   # from disk to RAM costs no more (a zero-size parameter still pays its hook): price it again
        objective = estimate(problem, homed, profile).seconds
    placed = homed
    device_map = problem.cleaned(placed)
    violations = check(problem, device_map)[0]
    if violations:
        raise AllocatorError(f"ilp produced an invalid plan (a modelling bug, please report): {violations[:3]}")
    notes = [f"CP-SAT over {len(found)} groups for main devices {mains}: best main {main!r}, "
             f"estimated {objective * 1e3:.6f} ms per forward, "
             f"{'proven optimal' if proven else 'not proven optimal'}{kept}"]
    if merged:
        notes.append(f"coarsened: {merged} merges of consecutive units to stay under {max_units} groups")
    return Placement(device_map=device_map, strategy="ilp", decisions=tuple(note(n, "solver") for n in notes),
                     optimal=proven and not merged)


def _breaks_order_or_main(problem: Problem, device_map) -> bool:
    """Whether a map breaks the contract's main device or index order (the floor is :func:`_floor_to_keep`'s)."""
    return any(v.kind != "contract-floor" for v in contract_violations(problem, device_map))


def _floor_to_keep(problem: Problem, incumbent) -> int:
    """The contract's floor (accelerate's bytes on the fastest tier) where a plan keeping the contract is known to
    reach it (accelerate's own map, or the warm start); else 0, as in :func:`allocator.strategies.ranking.best_of`."""
    if not problem.options.contract:
        return 0
    need = floor(problem)
    if accelerate_map(problem) is not None:
        return need
    reached = incumbent is not None and fast_bytes(problem, map_runs(problem.graph, incumbent[1])) >= need
    return need if reached else 0


def _heuristic(problem: Problem, profile: Profile) -> dict | None:
    """The warm start and first cutoff: the best valid map of the fast strategies
    (:func:`allocator.strategies.ranking.best_valid`, ranked under ``profile``), or ``None``."""
    ranked = problem if profile == problem.profile else replace(problem, profile=profile)
    fast = [("sequential", lambda: accelerate_placement(ranked)), ("reserve", lambda: reserve.place(ranked)),
            ("backfill", lambda: backfill.place(ranked))]
    found = best_valid(ranked, fast)
    return found.placement.device_map if found.placement else None
