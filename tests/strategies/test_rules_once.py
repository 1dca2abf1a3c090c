"""Each rule once (issue #46): the contract's rules decided by the judge only, one fill, one bisection, one "where a
unit executes".

- the judge's bounds (:mod:`allocator.judge.contract`: ``floor_shortfall``, ``streams_no_more``,
  ``keeps_main_and_order``, ``main_or_order_violations``, ``floor_to_keep``) say what ``contract_violations`` says, on
  random trees and maps;
- no module of ``search/`` or ``strategies/`` reads whether the contract holds (``deciding.contract``) but ``auto``'s
  gate: they read the judge's bounds;
- the one fill (:func:`allocator.search.first_fit.fill`) with a priority order against the seating rule written out
  one group at a time (bounds by brute force), and ``kit.seat`` is that fill;
- the one bisection (:func:`allocator.search.bisection.boundary`) against brute force and against the loops it
  replaced (same answers, to the byte, for the 1 % search of the smallest budget);
- :func:`allocator.rules.dispatch.executes_on` against accelerate's rule, stated as a table.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import allocator
from allocator.evaluate.cost import priced
from allocator.evaluate.memory import main_device, map_runs, offloaded_devices
from allocator.evaluate.tiers import fast_bytes
from allocator.evaluate.units import disk_loadable, groups
from allocator.judge import contract
from allocator.judge.witness import index_ordered, main_candidates, witness
from allocator.problem import build_problem
from allocator.rules.dispatch import executes_on
from allocator.search.bisection import boundary
from allocator.search.first_fit import _seat_in_index_order, _seat_in_model_order, fill
from allocator.search.partition import least_feasible
from allocator.search.room import Room
from allocator.strategies import kit
from trees import module_trees

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROOT = Path(allocator.__file__).parent


# -- the contract's rules, decided in the judge -----------------------------------------------------------------------

def _problem(data, objective="contract"):
    model = data.draw(module_trees(max_depth=3, max_children=3))
    total = max(build_problem(model, {"cpu": 10**9}).graph.total, 1)
    frac = lambda: int(total * data.draw(st.floats(0.0, 1.2)))  # noqa: E731
    budget = data.draw(st.sampled_from([{0: frac(), "cpu": frac()}, {0: frac(), 1: frac(), "cpu": frac()},
                                        {0: frac(), 1: frac(), 2: frac(), "cpu": frac()}]))
    return build_problem(model, budget, objective=objective)


def _random_map(data, problem) -> dict:
    names = list(groups(problem.graph).units.array("name"))
    devices = list(problem.budgets.order)
    return {name: data.draw(st.sampled_from(devices)) for name in names}


@SETTINGS
@given(data=st.data())
def test_the_judges_bounds_say_what_the_contract_says(data):
    problem = _problem(data)
    device_map = _random_map(data, problem)
    if not len(problem.graph.tensors.name):
        return   # nothing lives anywhere: no rule applies (contract_violations says so too)
    kinds = {v.kind for v in contract.contract_violations(problem, device_map)}
    found = map_runs(problem.graph, device_map)
    main = main_device(device_map.values())
    # rules 1 and 2
    assert contract.keeps_main_and_order(problem, main, found) == (not kinds & {"contract-main", "contract-order"})
    assert {v.kind for v in contract.main_or_order_violations(problem, device_map)} == kinds - {"contract-floor"}
    # rule 3: fewer bytes on the fastest tier, or (where the baseline keeps rules 1 and 2) more streamed
    short = contract.floor_shortfall(problem, fast_bytes(problem, found))
    assert short == max(witness(problem).floor - fast_bytes(problem, found), 0)
    seen, streamed = witness(problem), priced(problem, device_map).streamed_bytes
    streams = contract.streams_no_more(problem, streamed)
    assert streams == (seen.fallback is None or streamed <= seen.streamed)
    if seen.fallback is not None:   # the baseline streams no more than itself
        assert contract.streams_no_more(problem, seen.streamed)
        assert not contract.streams_no_more(problem, seen.streamed + 1)
    assert ("contract-floor" in kinds) == bool(short or not streams)
    # what a proposer must keep: the floor where a plan keeping the contract reaches it
    reached = contract.floor_to_keep(problem, fast_bytes(problem, found))
    assert reached in (0, witness(problem).floor)
    if contract.accelerate_map(problem) is not None:
        assert reached == witness(problem).floor
    assert contract.required_main(problem) == witness(problem).main
    assert index_ordered(problem)


@SETTINGS
@given(data=st.data())
def test_the_judges_bounds_are_lifted_with_the_contract(data):
    problem = _problem(data, objective="latency")
    device_map = _random_map(data, problem)
    found = map_runs(problem.graph, device_map)
    assert contract.floor_shortfall(problem, 0) == 0 and contract.streams_no_more(problem, 10**18)
    assert contract.floor_to_keep(problem, 0) == 0 and contract.required_main(problem) is None
    assert contract.keeps_main_and_order(problem, main_device(device_map.values()) if device_map else "cpu", found)
    assert not contract.main_or_order_violations(problem, device_map) and not index_ordered(problem)


def test_no_proposer_decides_whether_the_contract_holds():
    """search/ and strategies/ read the judge's bounds (main devices, index order, the floor to keep); only ``auto``'s
    gate (whether to try one accelerator fewer) reads the objective itself."""
    readers = []
    for folder in ("search", "strategies"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"deciding\.contract\b", line) and not line.lstrip().startswith("#"):
                    readers.append(f"{folder}/{path.name}:{number}")
    assert [r for r in readers if not r.startswith("strategies/auto.py:")] == [], readers


# -- one fill ---------------------------------------------------------------------------------------------------------

def _seat_by_the_rule(problem, found, main, reserve, priority, ordered):
    """The seating rule one group at a time: those that must stay, then the others, each in ``priority``; under
    index order a group takes an executing device between the highest one used before it in the model and the lowest
    one used after it (found by looking at every seated group)."""
    room = Room.of(problem, main, reserve, found)
    if room is None:
        return None
    stays = Room.must_stay(found.array("stream"), found.array("resident_only"), reserve)
    disk_ok = disk_loadable(problem)
    if room.targets.count(True) == 1 and room.disk >= 0:
        stays, disk_ok = stays | ~disk_ok, np.ones(len(found), dtype=bool)
    ordered = ordered and room.targets.count(False) > 1
    seated: dict[int, int] = {}
    for k in [k for k in priority if stays[k]] + [k for k in priority if not stays[k]]:
        low, high = 0, None
        if ordered:
            before = [j for g, j in seated.items() if g < k and not room.targets[j]]
            after = [j for g, j in seated.items() if g > k and not room.targets[j]]
            low, high = max(before, default=0), min(after, default=None)
        j = room.seat(int(found.array("size")[k]), int(found.array("offload")[k]), int(found.array("pinned")[k]),
                      bool(stays[k]), low=low, high=high, disk_ok=bool(disk_ok[k]))
        if j < 0:
            return None
        seated[k] = j
    return [room.devices[seated[k]] for k in range(len(found))]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_one_fill_seats_in_any_priority_by_the_rule(data):
    problem = _problem(data)
    found = groups(problem.graph)
    if not len(found):
        return
    priority = data.draw(st.permutations(range(len(found))))
    reserve = data.draw(st.sampled_from(sorted({0, *found.stream})))
    ordered = data.draw(st.booleans())
    for main in main_candidates(problem):
        want = _seat_by_the_rule(problem, found, main, reserve, priority, ordered)
        assert fill(problem, found, main, reserve, ordered=ordered, priority=priority) == want
        # model order by default (its own O(g) loop): the rule with model order as the priority
        assert fill(problem, found, main, reserve, ordered=ordered) == \
            _seat_by_the_rule(problem, found, main, reserve, range(len(found)), ordered)
        if ordered:   # kit.seat is the one fill
            assert kit.seat(problem, kit.tie_groups(problem), priority, main, reserve) == want


def test_a_group_between_two_that_stay_on_gpu_0_is_offloaded_rather_than_sent_to_gpu_1():
    """Index order's upper bound, on both seating loops of the one fill: A and C must stay and take GPU 0 (full after
    them), B between them in the model may be offloaded; GPU 1 has room, but B there would run 0, 1, 0."""
    for seat in (_seat_in_model_order, _seat_in_index_order):
        room = Room(devices=[0, 1, "cpu"], free=[16, 100, 100], targets=[False, False, True],
                    charges=[False, False, True])
        order = np.array([0, 2, 1])   # seats: A and C (they stay), then B
        stay = np.array([True, True, False])
        eight = np.full(3, 8)
        assert seat(room, order, stay, np.zeros(3, dtype=np.int64), eight, eight) == [0, 0, 2], seat.__name__


# -- one bisection ----------------------------------------------------------------------------------------------------

def _old_smallest(works, low, high):
    """report/minimum.smallest before the one bisection."""
    while high - low > max(1, high // 100):
        middle = (low + high) // 2
        if works(middle):
            high = middle
        else:
            low = middle
    return high


def _old_largest(ok, lo, hi):
    """fit.py's and strategies/experts.py's loop before the one bisection (ok(lo), not ok(hi))."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


@settings(max_examples=300, deadline=None)
@given(lo=st.integers(-50, 10**6), width=st.integers(1, 10**7), offset=st.integers(0, 10**7))
@example(lo=968_159, width=7_744_044, offset=5_040_146)   # the 1 % stop is judged on the bracket's end that works
def test_the_one_bisection_finds_the_boundary_as_the_loops_it_replaced(lo, width, offset):
    hi = lo + width
    edge = lo + offset % (width + 1)                 # ok(t) for t <= edge
    calls = []

    def ok(t):
        calls.append(t)
        return t <= edge
    if edge < hi:
        assert boundary(ok, lo, hi) == edge == _old_largest(ok, lo, hi)
    assert lo not in calls and hi not in calls      # the bracket's ends are known, never asked
    works = lambda t: t >= edge + 1                  # noqa: E731  the smallest that works is edge + 1
    if edge + 1 <= hi and lo < edge + 1:
        found = boundary(works, hi, lo, precision=100)
        assert found == _old_smallest(works, lo, hi)
        assert works(found) and found - (edge + 1) <= max(1, found // 100)
        assert boundary(works, hi, lo) == edge + 1 == least_feasible(works, lo + 1, hi)


# -- one "where a unit executes" --------------------------------------------------------------------------------------

def test_where_a_unit_executes_is_accelerates_rule():
    """accelerate 1.16 ``dispatch_model``: modules on ``cpu``/``disk`` execute on the main device (with ``mps`` main,
    ``cpu`` modules are moved there); a CPU main device streams only ``disk``; the compute map of our runtime wins
    for an offloaded unit."""
    table = {("cpu", 0): 0, ("disk", 0): 0, (1, 0): 1, (0, 0): 0, ("cpu", "cpu"): "cpu", ("disk", "cpu"): "cpu",
             ("cpu", "mps"): "mps", ("disk", "mps"): "mps", ("mps", "mps"): "mps"}
    for (device, main), want in table.items():
        assert executes_on(device, main) == want == executes_on(device, main, offloaded_devices(main), True)
    assert executes_on("cpu", "mps", offloaded_devices("mps"), False) == "cpu"   # no hooks: nothing moves
    assert executes_on("cpu", 0, computes="cpu") == "cpu" and executes_on(1, 0, computes="cpu") == 1
