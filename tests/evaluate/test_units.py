"""Units and groups stored as columns, and the first fit over them, against plain references.

- :func:`allocator.evaluate.units.units` against a preorder walk written from the definition (stop at every node that
is not
  split, take the direct tensors of every node that is), sizes summed tensor by tensor;
- :func:`allocator.evaluate.units.groups` against connected components of the tie groups;
- :class:`allocator.search.first_fit.Streams` against :func:`allocator.evaluate.memory.streamed_chain` of the unit
map;
- the runs and price of a fill's answer (:class:`allocator.search.first_fit.Filled`) against those of its map;
- the first fit's stretches (:func:`allocator.evaluate.kernels.fit_stretch`) against the same fit one group at a time
  (:meth:`allocator.search.room.Room.seat`).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator.evaluate.cost import estimate, estimate_runs
from allocator.placement import clean_device_map
from allocator.problem import build_problem
from allocator.evaluate.runs import runs
from allocator.evaluate.memory import map_runs, moves_with_weights, offloaded_devices, streamed_chain
from allocator.evaluate import kernels
from allocator.search.first_fit import Filled, Streams, _seat_all, fill, unit_map
from allocator.search.room import Room
from allocator.judge.witness import main_candidates
from allocator.evaluate.units import Group, Groups, Unit, Units, groups, units
from trees import module_trees

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NO_SPLIT = st.sampled_from([[], ["Block"], ["Block", "Layer"], ["Stack"]])


def reference_units(g, offload_buffers: bool) -> list[tuple]:
    """(name, node, size, offload, pinned, numel) of every unit by the definition, sizes tensor by tensor."""
    extra = dict(g.extra or {})
    out = []

    def subtree_tensors(i):
        return range(g.nodes.first[i], g.nodes.first[g.nodes.end[i]] if g.nodes.end[i] < len(g.nodes)
                     else len(g.tensors))

    def walk(i):
        if g.is_splittable(i):
            for t in g.nodes.tensors_of(i):
                tensor = g.tensors[t]
                moves = moves_with_weights(tensor, offload_buffers)
                numel = tensor.numel if tensor.is_param and tensor.counted else 0
                out.append((tensor.name, -1, tensor.counted, tensor.counted if moves else 0,
                            0 if moves else tensor.counted, numel))
            for c in g.nodes.children(i):
                walk(c)
            return
        tensors = [g.tensors[t] for t in subtree_tensors(i)]
        offload = sum(t.counted for t in tensors if moves_with_weights(t, offload_buffers))
        kept = sum(t.counted for t in tensors) - offload
        own_extra = sum(extra.get(j, 0) for j in range(i, g.nodes.end[i]))
        numel = sum(t.numel for t in tensors if t.is_param and t.counted)
        out.append((g.nodes.name[i], i, sum(t.counted for t in tensors) + own_extra, offload, kept + own_extra, numel))

    if len(g.nodes):
        walk(0)
    return out


@SETTINGS
@given(data=st.data())
def test_units_follow_their_definition(data):
    model = data.draw(module_trees(max_depth=3, max_children=3))
    offload_buffers = data.draw(st.booleans())
    g = build_problem(model, {"cpu": 10**9}, no_split_module_classes=data.draw(NO_SPLIT)).graph
    if data.draw(st.booleans()):   # generation bytes on some nodes (a GenerationBudget's KV cache and logits)
        nodes = data.draw(st.lists(st.integers(0, len(g.nodes) - 1), max_size=4))
        g = dataclasses.replace(g, extra={i: data.draw(st.integers(1, 999)) for i in nodes})
    found = units(g, offload_buffers)
    assert isinstance(found, Units) and all(isinstance(u, Unit) for u in found)
    expected = reference_units(g, offload_buffers)
    assert [(u.name, u.node, u.size, u.offload, u.pinned, u.numel) for u in found] == expected


@SETTINGS
@given(data=st.data())
def test_groups_are_the_components_of_the_ties(data):
    model = data.draw(module_trees(max_depth=3, max_children=3))
    problem = build_problem(model, {"cpu": 10**9}, no_split_module_classes=data.draw(NO_SPLIT))
    g = problem.graph
    found = groups(g)
    assert isinstance(found, Groups) and found is groups(g)   # built once, shared (immutable)
    records = list(found)
    # every unit in exactly one group, groups in the order of their first unit, units in model order inside
    position = {u.name: k for k, u in enumerate(units(g))}
    flat = [position[u.name] for grp in records for u in grp.units]
    assert sorted(flat) == list(range(len(position)))
    assert [position[grp.units[0].name] for grp in records] == sorted(position[grp.units[0].name] for grp in records)
    assert all([position[u.name] for u in grp.units] == sorted(position[u.name] for u in grp.units) for grp in records)
    # a tie group's names all fall in one group
    group_of = {u.name: k for k, grp in enumerate(records) for u in grp.units}

    def unit_of(name):
        while name not in group_of:
            name = name.rpartition(".")[0]
        return group_of[name]

    for tie in g.all_tie_groups():
        assert len({unit_of(n) for n in tie}) == 1
    for grp in records:
        assert grp.size == sum(u.size for u in grp.units) and grp.offload == sum(u.offload for u in grp.units)
        assert grp.pinned == sum(u.pinned for u in grp.units) and grp.stream == max(u.stream for u in grp.units)
        assert grp.resident_only == any(u.node < 0 for u in grp.units)
    # no two groups could be merged: each group is connected by ties (its units share a tie chain)
    if len(records) > 1 and not g.all_tie_groups():
        assert all(len(grp.units) == 1 for grp in records)


def test_tables_are_immutable_and_pickle():
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2), nn.ReLU()))
    model[1][0].weight = model[0].weight   # a tie across branches: one group of two units
    g = build_problem(model, {"cpu": 10**6}).graph
    found = groups(g)
    with pytest.raises(AttributeError):
        found.size = ()
    with pytest.raises(AttributeError):
        found.units.name = ()
    again = pickle.loads(pickle.dumps(found))
    assert again == found and list(again) == list(found)
    assert [len(grp.units) for grp in found] == [2, 1] and isinstance(found[0], Group)
    assert found[-1] == found[len(found) - 1] and found[:1] == (found[0],)


@SETTINGS
@given(data=st.data())
def test_streams_equal_the_chain_of_the_unit_map(data):
    model = data.draw(module_trees(max_depth=3, max_children=3))
    offload_buffers = data.draw(st.booleans())
    problem = build_problem(model, {0: 10**6, "cpu": 10**9, "disk": 10**9}, offload_buffers=offload_buffers,
                            no_split_module_classes=data.draw(NO_SPLIT))
    found = groups(problem.graph, offload_buffers)
    where = [data.draw(st.sampled_from([0, "cpu", "disk"])) for _ in range(len(found))]
    placed = unit_map(found, where, reserve=math.inf)
    for main in (0, "cpu"):
        offloaded = offloaded_devices(main)
        expected = streamed_chain(problem.graph, map_runs(problem.graph, placed), offloaded,
                                  offload_buffers=offload_buffers)[0]
        assert Streams(problem, found).reserve(where, offloaded) == expected


@SETTINGS
@given(data=st.data())
def test_runs_and_price_of_a_fill_equal_those_of_its_map(data):
    model = data.draw(module_trees(max_depth=3, max_children=3))
    offload_buffers = data.draw(st.booleans())
    problem = build_problem(model, {0: 10**6, 1: 10**6, "cpu": 10**9, "disk": 10**9}, offload_buffers=offload_buffers,
                            no_split_module_classes=data.draw(NO_SPLIT))
    found = groups(problem.graph, offload_buffers)
    where = [data.draw(st.sampled_from([0, 1, "cpu", "disk"])) for _ in range(len(found))]
    reserve = data.draw(st.sampled_from(sorted({0, *found.stream})))
    placed = unit_map(found, where, reserve)
    expected = runs(problem.graph, placed)
    for numpy_from in (kernels.NUMPY_FROM, 0):   # plain loops and numpy kernels
        with mock.patch.object(kernels, "NUMPY_FROM", numpy_from):
            made = Filled(problem, found, where, reserve, "")
            assert made.runs() == expected
            assert made.device_map() == placed and list(made.device_map()) == list(placed)
        assert estimate_runs(problem, made.runs(), made.main) == estimate(problem, clean_device_map(placed)) \
            == estimate(problem, placed)


def _synthetic(rng: random.Random, n: int) -> Groups:
    """Groups of single units with random sizes (pinned part of the size), for the first fit alone."""
    size = [rng.choice([0, 1, 2, 3, 5, 8, 64, 500]) for _ in range(n)]
    pinned = [rng.choice([0, 0, 0, s // 2, s]) for s in size]
    offload = [s - p for s, p in zip(size, pinned)]
    stream = [rng.choice([0, o, o + 1]) for o in offload]
    lone = [rng.random() < 0.05 for _ in range(n)]
    every = list(range(n))
    found = Units([f"u{k}" for k in every], [-1 if x else k for k, x in enumerate(lone)], size, offload, pinned,
                  stream, [0] * n, [0 if x else -1 for x in lone])
    return Groups(found, every, size, offload, pinned, stream, [0] * n, lone, every)


@pytest.mark.parametrize("seed", range(300))
def test_first_fit_stretches_equal_single_steps(seed):
    rng = random.Random(seed)
    found = _synthetic(rng, rng.choice([1, 10, 200, 3000]))
    reserve = rng.choice([0, 1, 4, 64])
    stays = (found.array("stream") > reserve) | found.array("resident_only")
    order = np.concatenate([np.flatnonzero(stays), np.flatnonzero(~stays)])
    devices = rng.choice([3, 4, 5])
    total = int(found.array("size").sum())
    # rooms that some prefix fills exactly, so that the comparisons are tested at equality too
    exact = np.cumsum(found.array("size")[order]).tolist() + np.cumsum(found.array("offload")[order]).tolist() + \
        found.array("size").tolist() + found.array("offload").tolist()
    choices = [-5, 0, total // 10, total // 3, total, math.inf, 2**70]
    room = [rng.choice(choices + [rng.choice(exact)] * 4) for _ in range(devices)]
    room[0] = rng.choice([0, total // 4, total, math.inf] + [rng.choice(exact)] * 4) - \
        int(found.array("pinned")[~stays].sum()) * rng.choice([0, 1])
    offloads = [False] * (devices - 2) + [True, True] if rng.random() < 0.8 else [False] * (devices - 1) + [True]
    charges = [rng.random() < 0.7 for _ in range(devices)]
    fast = Room(range(devices), room, offloads, charges, reserve)
    slow = Room(range(devices), room, offloads, charges, reserve)
    assert _seat_all(fast, *_seats(found, order, stays)) == _seat_one_by_one(slow, *_seats(found, order, stays))
    assert fast.free == slow.free


def _seats(found: Groups, order: np.ndarray, stays: np.ndarray) -> list[np.ndarray]:
    return [stays[order], *(found.array(c)[order] for c in ("pinned", "size", "offload"))]


def _seat_one_by_one(room: Room, stay, pinned, size, offload) -> list[int] | None:
    """The first fit as :meth:`Room.seat` of one group after another."""
    chosen = []
    for s, p, n, o in zip(stay.tolist(), pinned.tolist(), size.tolist(), offload.tolist()):
        chosen.append(room.seat(n, o, p, s))
        if chosen[-1] < 0:
            return None
    return chosen


@SETTINGS
@given(data=st.data())
def test_fill_places_every_group_or_none(data):
    model = data.draw(module_trees(max_depth=3, max_children=3))
    total = build_problem(model, {"cpu": 10**9}).graph.total
    budget = {0: int(total * data.draw(st.floats(0, 1.2))), "cpu": int(total * data.draw(st.floats(0, 1.2)))}
    problem = build_problem(model, budget, no_split_module_classes=data.draw(NO_SPLIT))
    found = groups(problem.graph)
    for main in main_candidates(problem):
        reserve = data.draw(st.sampled_from(sorted({0, *found.stream})))
        where = fill(problem, found, main, reserve, ordered=problem.deciding.contract)
        if where is not None:
            assert len(where) == len(found) and None not in where
            placed = unit_map(found, where, reserve)
            assert sorted(placed) == sorted(units(problem.graph).name)


def test_a_stretch_on_disk_stops_where_cpu_has_exactly_the_room():
    # main full, cpu holds exactly the one group of 5 bytes, the 8-byte groups go to disk around it
    n = 200
    size = [5 if k == 100 else 8 for k in range(n)]
    every = list(range(n))
    found = Units([f"u{k}" for k in every], every, size, size, [0] * n, size, [0] * n, [-1] * n)
    found = Groups(found, every, size, size, [0] * n, size, [0] * n, [False] * n, every)
    order, stays = np.arange(n), np.zeros(n, dtype=bool)
    room = Room([0, "cpu", "disk"], [0, 5, math.inf], [False, True, True], [True, True, True], math.inf)
    assert _seat_all(room, *_seats(found, order, stays)) == [2] * 100 + [1] + [2] * 99
    assert room.free[:2] == [0, 0]
