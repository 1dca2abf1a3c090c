"""``ilp``: an optimal plan by OR-Tools CP-SAT over the finest legal units.

Model, for each device that could be main (``M``): one device per tie group; accelerators before ``M`` stay empty and
``M`` holds at least one group; budgets with the exact reservation on ``M`` — the largest *chain* of weights that
offloaded units stream at once (a variable per split module: its offloaded direct weights plus its largest child
chain) — plus the buffers of offloaded groups; RAM holds cpu-offloaded weights; a disk budget holds disk weights when
given. The objective is :func:`allocator.cost.estimate` in picoseconds: reading weights where they execute, copying
offloaded ones, and each change of executing device between consecutive units.

Deterministic: one worker, a fixed seed, a deterministic time limit (``max_deterministic_time``), warm-started from
the best heuristic plan. ``Placement.optimal`` says whether optimality was proven for every main device.

Notes
-----
Beyond ``max_units`` groups, consecutive single-unit groups are merged (a merged group goes to one device, so the
plan stays legal but may lose a little); ``explain()`` says so.
"""

from __future__ import annotations

import logging

from ..budgets import is_accelerator
from ..cost import Profile, change_seconds, tensor_seconds
from ..errors import AllocatorError
from ..placement import Placement, clean_device_map
from ..problem import Problem
from ..runtime import device_of
from ..units import Group, groups as unit_groups
from ..validate import check
from ._fill import main_candidates

__all__ = ["place"]

log = logging.getLogger(__name__)

MAX_UNITS = 400
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


def _solve_for_main(problem: Problem, found: list[Group], main, profile: Profile, seconds: float, hint: dict | None):
    from ortools.sat.python import cp_model

    g, b = problem.graph, problem.budgets
    if main == "cpu":
        devices = ["cpu", "disk"]
    else:
        devices = [d for d in b.accelerators if b.order.index(d) >= b.order.index(main)]
        devices += ["disk"] if main == "mps" else ["cpu", "disk"]
    targets = {"disk"} if main in ("cpu", "mps") else {"cpu", "disk"}
    model = cp_model.CpModel()
    tensors = [[t for u in grp.units for t in _unit_tensors(g, u)] for grp in found]
    x = {(k, d): model.NewBoolVar(f"x{k}_{d}") for k in range(len(found)) for d in devices}
    off = {}
    for k, grp in enumerate(found):
        model.AddExactlyOne(x[k, d] for d in devices)
        off[k] = sum(x[k, d] for d in devices if d in targets)
        if grp.resident_only:  # lone tensors are never hooked by accelerate: keep them resident
            for d in devices:
                if d in targets:
                    model.Add(x[k, d] == 0)

    # The exact streaming reserve: chains through the split-module tree.
    unit_group = {u.name: k for k, grp in enumerate(found) for u in grp.units}
    unit_by_name = {u.name: u for grp in found for u in grp.units}
    upper = sum(grp.stream for grp in found) + 1
    chain_var: dict[int, object] = {}

    def chain(node: int):
        if node in chain_var:
            return chain_var[node]
        name = g.nodes[node].name
        if name in unit_by_name:  # a whole-module unit
            expr = unit_by_name[name].stream * off[unit_group[name]]
            chain_var[node] = expr
            return expr
        own = []
        for t in g.nodes[node].params + g.nodes[node].buffers:
            tname = g.tensors[t].name
            if tname in unit_by_name and unit_by_name[tname].stream:
                own.append(unit_by_name[tname].stream * off[unit_group[tname]])
        var = model.NewIntVar(0, upper, f"c{node}")
        own_sum = sum(own) if own else 0
        model.Add(var >= own_sum)
        for child in g.nodes[node].children:
            model.Add(var >= own_sum + chain(child))
        chain_var[node] = var
        return var

    reserve = chain(0)
    # Redundant staircase cuts: "the reserve is at least level j" as booleans, so the solver can branch on the
    # reserve first (once it is fixed, what remains is a knapsack).
    levels = sorted({grp.stream for grp in found if grp.stream and not grp.resident_only})
    steps = [model.NewBoolVar(f"r{j}") for j in range(len(levels))]
    for j in range(1, len(steps)):
        model.AddImplication(steps[j], steps[j - 1])
    if steps:
        model.Add(reserve >= sum((levels[j] - (levels[j - 1] if j else 0)) * steps[j] for j in range(len(steps))))
        at = {level: j for j, level in enumerate(levels)}
        for k, grp in enumerate(found):
            if grp.stream and not grp.resident_only:
                model.Add(off[k] <= steps[at[grp.stream]])
    pinned = sum(grp.pinned * off[k] for k, grp in enumerate(found))
    for d in devices:
        limit = b.limit(d)
        if d == main:
            resident = sum(grp.size * x[k, d] for k, grp in enumerate(found))
            model.Add(resident + pinned + reserve <= limit)
            if is_accelerator(d):
                model.Add(sum(x[k, d] for k in range(len(found))) >= 1)
        elif d in targets:
            if d == "cpu" or limit is not None:
                model.Add(sum(grp.offload * x[k, d] for k, grp in enumerate(found)) <= limit)
        else:
            model.Add(sum(grp.size * x[k, d] for k, grp in enumerate(found)) <= limit)

    # Objective: the estimate, tensor by tensor (reads, copies, per-tensor latencies), and the changes of executing
    # device, in picoseconds.
    terms = []
    for k, grp in enumerate(found):
        for d in devices:
            cost = sum(tensor_seconds(problem, main, profile, g.tensors[t], d) for t in tensors[k])
            if cost:
                terms.append(int(round(cost * NS)) * x[k, d])
    accelerators = [d for d in devices if d not in ("cpu", "disk")]
    if main != "cpu" and len(accelerators) > 1 or (main != "cpu" and targets):
        weighted = {u.name for k, grp in enumerate(found) for u in grp.units
                    if any(g.tensors[t].nbytes for t in _unit_tensors(g, u))}
        sequence = [unit_group[name] for name in _unit_order(found, g) if name in weighted]
        change_ps = int(round(change_seconds(profile) * NS))
        for k1, k2 in zip(sequence, sequence[1:]):
            if k1 == k2:
                continue
            ch = model.NewBoolVar("")
            for a in accelerators:
                e1 = x[k1, a] + (off[k1] if a == main else 0)
                e2 = x[k2, a] + (off[k2] if a == main else 0)
                model.Add(ch >= e1 - e2)
                model.Add(ch >= e2 - e1)
            terms.append(change_ps * ch)
    model.Minimize(sum(terms))
    if hint:
        for k, grp in enumerate(found):
            d = hint.get(grp.units[0].name)
            for dev in devices:
                model.AddHint(x[k, dev], dev == d)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = seconds
    solver.parameters.linearization_level = 2  # proves more 2-GPU cells of the zoo within the same budget
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, status == cp_model.INFEASIBLE, None
    placed = {}
    for k, grp in enumerate(found):
        d = next(dev for dev in devices if solver.Value(x[k, dev]))
        for u in grp.units:
            placed[u.name] = d
    return placed, status == cp_model.OPTIMAL, solver.ObjectiveValue() / NS


def _unit_tensors(g, unit) -> list[int]:
    """Indices of the graph tensors a unit holds (its subtree's, or the one tensor of a tensor unit)."""
    if unit.node < 0:
        return [g.tensor_index[unit.name]]
    out, stack = [], [unit.node]
    while stack:
        n = stack.pop()
        out += g.nodes[n].params + g.nodes[n].buffers
        stack.extend(g.nodes[n].children)
    return out


def _unit_order(found: list[Group], g) -> list[str]:
    names = [u.name for grp in found for u in grp.units]
    position = {}
    for i, n in enumerate(g.nodes):
        position.setdefault(n.name, i)
    for t in g.tensors:
        position.setdefault(t.name, g.node_index.get(t.name.rpartition(".")[0], 0) + 0.5)
    return sorted(names, key=lambda n: position.get(n, 0))


def place(problem: Problem, *, profile: Profile | None = None, time_limit: float = 2.0,
          max_units: int = MAX_UNITS, hint=None, **_) -> Placement:
    """Solve for the plan with the lowest estimated cost per forward.

    Parameters
    ----------
    problem : Problem
    profile : Profile, optional
        Bandwidths of the target machine (the problem's when omitted).
    time_limit : float
        Deterministic time for CP-SAT, shared by the main-device candidates.
    max_units : int
        Beyond this many tie groups, consecutive groups are merged.
    hint : dict, optional
        A device map to warm-start from (e.g. the best heuristic's).

    Raises
    ------
    InfeasiblePlacement
        When no main device admits a plan (CP-SAT proves it, or finds nothing in time).
    """
    from ._select import infeasible

    profile = profile or problem.profile
    found = unit_groups(problem.graph, problem.options.offload_buffers)
    found, merged = _coarsen(found, max_units)
    mains = main_candidates(problem)
    unit_hint = None
    if hint:
        unit_hint = {u.name: device_of(u.name, hint) for grp in found for u in grp.units}
    results, proven = [], True
    for main in mains:
        placed, proven_here, objective = _solve_for_main(
            problem, found, main, profile, time_limit / max(1, len(mains)), unit_hint if _hint_main(hint, main) else None)
        proven = proven and proven_here
        if placed is not None:
            results.append((objective, main, placed))
    if not results:
        raise infeasible(problem)
    objective, main, placed = min(results, key=lambda r: r[0])
    device_map = clean_device_map(placed) if problem.options.clean_result else placed
    violations = check(problem, device_map)[0]
    if violations:
        raise AllocatorError(f"ilp produced an invalid plan (a modelling bug, please report): {violations[:3]}")
    notes = [f"CP-SAT over {len(found)} groups for main devices {mains}: best main {main!r}, "
             f"estimated {objective * 1e3:.6f} ms per forward, {'proven optimal' if proven else 'not proven optimal'}"]
    if merged:
        notes.append(f"coarsened: {merged} merges of consecutive units to stay under {max_units} groups")
    return Placement(device_map=device_map, strategy="ilp", notes=tuple(notes), optimal=proven and not merged)


def _hint_main(hint, main) -> bool:
    if not hint:
        return False
    from ..runtime import main_device

    return main_device(hint.values()) == main
