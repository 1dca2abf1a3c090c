"""Each kernel of :mod:`allocator.evaluate.kernels` against its plain-Python reference, on random inputs: int64 edge
values,
rooms without limit, empty inputs. The references themselves are checked against the rules elsewhere
(tests/evaluate/test_runs.py, tests/evaluate/test_units.py)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator.evaluate import kernels
from allocator.problem import build_problem
from allocator.evaluate.runs import columns, key_orders
from allocator.search.first_fit import Streams
from allocator.search.room import Room
from allocator.evaluate.units import groups
from trees import module_trees

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEVICES = [0, 1, "cpu", "disk", True, 1.0]
#: Room values: far below and above the int64 prefix sums, at the clamp, without limit.
ROOMS = st.one_of(st.integers(-2**70, 2**70), st.integers(-64, 4096),
                  st.sampled_from([0, -1, 2**62, -2**62, 2**63 - 1, -2**63, 2**70, math.inf]))


# ---------------------------------------------------------------------------------------------- fit stretch

@st.composite
def stretches(draw):
    """A room, the columns of the groups to seat (int64, totals far inside int64) and the device to stretch on."""
    devices = draw(st.integers(1, 5))
    targets = [False] * devices
    if devices > 1:
        for j in range(draw(st.integers(1, 2)) if devices > 2 else 1):
            targets[devices - 1 - j] = True
    names = list(range(devices))
    if targets[-1] and draw(st.booleans()):
        names[-1] = "disk"   # the last target is disk: groups with disk_ok False are refused there
    room = Room(names, [draw(ROOMS) for _ in range(devices)], targets,
                [draw(st.booleans()) for _ in range(devices)])
    n = draw(st.integers(0, 80))
    scale = draw(st.sampled_from([8, 2**20, 2**52]))
    values = st.one_of(st.integers(0, 8), st.integers(0, scale))
    size = np.array([draw(values) for _ in range(n)], dtype=np.int64)
    pinned = np.array([draw(st.integers(0, int(s))) for s in size], dtype=np.int64) if draw(st.booleans()) else \
        np.array([draw(values) for _ in range(n)], dtype=np.int64)
    offload = size - pinned if draw(st.booleans()) else np.array([draw(values) for _ in range(n)], dtype=np.int64)
    offload = np.maximum(offload, 0)
    stay = np.array([draw(st.booleans()) for _ in range(n)], dtype=bool)
    disk_ok = np.array([draw(st.booleans()) for _ in range(n)], dtype=bool) if draw(st.booleans()) else None
    return room, stay, pinned, size, offload, draw(st.integers(0, devices - 1)), disk_ok


@SETTINGS
@given(case=stretches())
def test_fit_stretch_equals_seating_one_group_after_another(case):
    room, stay, pinned, size, offload, j, disk_ok = case
    assert kernels.stretchable(pinned, size, offload)
    other = Room(room.devices, room.free, room.targets, room.charges)
    assert kernels.fit_stretch(room, stay, pinned, size, offload, j, disk_ok) == \
        kernels.fit_stretch_reference(other, stay, pinned, size, offload, j, disk_ok)
    assert room.free == other.free


@SETTINGS
@given(case=stretches(), low=st.integers(0, 4), high=st.one_of(st.none(), st.integers(0, 4)))
def test_seat_is_the_first_device_that_fits_then_take(case, low, high):
    room, stay, pinned, size, offload, _, disk_ok = case
    disks = [True] * len(stay) if disk_ok is None else disk_ok.tolist()
    for s, p, n, o, d in zip(stay.tolist(), pinned.tolist(), size.tolist(), offload.tolist(), disks):
        other = Room(room.devices, room.free, room.targets, room.charges)
        if not s:
            other.free[0] += p
        allowed = [j for j in range(len(room.free)) if room.targets[j] or low <= j and (high is None or j <= high)]
        expected = next((j for j in allowed if other.fits(j, n, o, p, s, d)), -1)
        if expected >= 0:
            other.take(expected, n, o, p)
        elif not s:
            other.free[0] -= p
        assert room.seat(n, o, p, s, low, high, disk_ok=d) == expected
        assert d or expected != room.disk or room.disk < 0
        assert room.free == other.free


def test_stretchable_refuses_what_int64_sums_cannot_hold():
    big = np.array([2**59, 2**59], dtype=np.int64)
    assert kernels.stretchable(big // 2) and not kernels.stretchable(big)
    assert not kernels.stretchable(np.array([1], dtype=object))


# --------------------------------------------------------------------------------------------------- pacing

@given(counts=st.lists(st.integers(0, 200), max_size=40), n=st.integers(0, 2000))
def test_stretches_pace_doubles_and_pauses(counts, n):
    pace = kernels.Stretches(n)
    assert pace.steps(5) == (0 if n >= kernels.NUMPY_FROM else 5)
    if n < kernels.NUMPY_FROM:
        return
    for count in counts:
        tried = pace.window
        pace.stretched(min(count, tried), tried)
        if count >= tried:
            assert pace.window == 2 * tried and pace.steps(1000) == 0
        else:
            assert pace.window == pace.FIRST
            pauses = pace.steps(1000)
            assert pauses == 1 + (pace.BURST if count < pace.SHORT else 0)
            pace.stepped(pauses)
            assert pace.steps(1000) == 0


# ------------------------------------------------------------------------------------------------------ runs

@st.composite
def problems_and_keys(draw):
    model = draw(module_trees(max_depth=3, max_children=3))
    problem = build_problem(model, {0: 10**6, "cpu": 10**9}, no_split_module_classes=draw(
        st.sampled_from([[], ["Block"]])))
    g = problem.graph
    names = [n.name for n in g.nodes] + [t.name for t in g.tensors] + ["nothing.here"]
    keys = draw(st.lists(st.sampled_from(names), max_size=12, unique=True))
    return g, keys, [draw(st.sampled_from(DEVICES)) for _ in keys]


@SETTINGS
@given(case=problems_and_keys())
def test_key_runs_equal_carving_key_by_key(case):
    g, keys, devices = case
    cols = columns(g)
    order = key_orders(g, keys)
    args = order, devices, cols.first, cols.last, len(cols.module), len(g.nodes)
    assert kernels.key_runs_vectorised(*args) == kernels.key_runs_reference(*args)


@st.composite
def side_by_side_keys(draw):
    """Sorted key ranges none of which encloses another, with gaps, module and tensor keys, devices of mixed types."""
    tensor_order = draw(st.integers(0, 50))
    lo, hi, pos = [], [], 0
    for _ in range(draw(st.integers(0, 30))):
        pos += draw(st.sampled_from([0, 0, 0, 1, 3]))
        lo.append(pos)
        pos += draw(st.integers(1, 4))
        hi.append(pos)
    order = [draw(st.integers(0, tensor_order - 1)) if tensor_order and draw(st.booleans())
             else tensor_order + draw(st.integers(0, 99)) for _ in lo]
    devices = [draw(st.sampled_from(DEVICES)) for _ in lo]
    tensors = pos + draw(st.integers(0, 3))
    as_int64 = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    return as_int64(lo), as_int64(hi), as_int64(order), devices, tensors, tensor_order


@SETTINGS
@given(case=side_by_side_keys())
def test_side_by_side_equals_merging_key_by_key(case):
    assert kernels.side_by_side_vectorised(*case) == kernels.side_by_side_reference(*case)
    assert kernels.side_by_side_reference(*case) == kernels.carve(
        [(a, -b, o, d) for a, b, o, d in zip(case[0].tolist(), case[1].tolist(), case[2].tolist(), case[3])],
        case[4], case[5])


# ------------------------------------------------------------------------------------------------ in a row

@st.composite
def batches(draw):
    """Entries (float64 sizes, integral or not, up to 2**53) covering spans of sorted places, and a room."""
    n = draw(st.integers(0, 60))
    scale = draw(st.sampled_from([16, 2**40, 2**53]))
    sizes = np.array([draw(st.one_of(st.integers(0, 16), st.integers(0, scale))) for _ in range(n)], dtype=np.float64)
    if n and draw(st.integers(0, 5)) == 0:
        sizes[draw(st.integers(0, n - 1))] += 0.5
    low, pos = [], 0
    for _ in range(n):
        pos += draw(st.integers(0, 3))
        low.append(pos)
    high = [a + draw(st.integers(1, 4)) for a in low]
    places = sorted(draw(st.lists(st.integers(0, pos + 5), max_size=40, unique=True)))
    live = draw(st.integers(0, len(places) + 1))
    room = draw(st.one_of(st.none(), st.integers(-5, 2**62), st.sampled_from([0, 2**63 - 1, 2**70])))
    as_int64 = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    return sizes, as_int64(low), as_int64(high), as_int64(places), live, room


@SETTINGS
@given(case=batches())
def test_in_a_row_equals_placing_entry_by_entry(case):
    assert kernels.in_a_row(*case) == kernels.in_a_row_reference(*case)


# ------------------------------------------------------------------------------------------ stream reserve

@SETTINGS
@given(data=st.data())
def test_stream_reserve_equals_folding_unit_by_unit(data):
    model = data.draw(module_trees(max_depth=3, max_children=3))
    offload_buffers = data.draw(st.booleans())
    problem = build_problem(model, {0: 10**6, "cpu": 10**9, "disk": 10**9}, offload_buffers=offload_buffers,
                            no_split_module_classes=data.draw(st.sampled_from([[], ["Block"], ["Block", "Layer"]])))
    found = groups(problem.graph, offload_buffers)
    streams = Streams(problem, found)
    off = np.array([data.draw(st.booleans()) for _ in range(len(streams.group))], dtype=bool)
    stream = streams.stream
    if data.draw(st.booleans()):   # bytes near the int64 edge, spread so that no sum passes it
        stream = np.array([data.draw(st.integers(0, 2**62 // max(len(stream), 1))) for _ in stream], dtype=np.int64)
    args = off, streams.is_module, streams.parent, stream, streams.levels, streams.nodes
    assert kernels.stream_reserve(*args) == kernels.stream_reserve_reference(*args)


def test_stream_reserve_of_nothing_is_zero():
    empty = np.zeros(0, dtype=np.int64)
    assert kernels.stream_reserve(empty.astype(bool), empty.astype(bool), empty, empty, [], 0) == 0 == \
        kernels.stream_reserve_reference(empty.astype(bool), empty.astype(bool), empty, empty, [], 0)


# --------------------------------------------------------------------------------------------------- group map

@st.composite
def seated_groups(draw):
    units = draw(st.integers(0, 40))
    members = np.array(draw(st.permutations(range(units))), dtype=np.int64)
    cuts = sorted(draw(st.lists(st.integers(1, max(units - 1, 1)), max_size=10, unique=True))) if units > 1 else []
    start = np.array([0, *cuts] if units else [], dtype=np.int64)
    order = np.array(draw(st.permutations(range(len(start)))), dtype=np.int64)
    names = np.array([f"u{k}" for k in range(units)], dtype=object)
    where = [draw(st.sampled_from(DEVICES)) for _ in range(len(start))]
    return order, where, names, members, start


@SETTINGS
@given(case=seated_groups())
def test_group_map_equals_seating_group_by_group(case):
    made, expected = kernels.group_map_vectorised(*case), kernels.group_map_reference(*case)
    assert made == expected and list(made) == list(expected)
