"""Maps evaluated run by run (allocator.evaluate.runs) equal the same rules applied tensor by tensor.

The reference below is the plain reading of the runtime rules: every tensor's device by longest prefix, memory and
cost summed tensor by tensor, the streamed chain over every node. Random trees, random maps (nested keys, tensor
keys, uncovered tensors, every device kind) and both ``offload_buffers`` settings.
"""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import allocator
from allocator.evaluate.cost import change_seconds, estimate, tensor_seconds
from allocator.budgets import is_accelerator
from allocator.problem import build_problem
from allocator.evaluate import kernels
from allocator.evaluate.runs import Run, columns, runs
from allocator.evaluate.memory import device_of, main_device, moves_with_weights, offloaded_devices, tensor_devices
from allocator.evaluate.validate import check
from trees import module_trees

DEVICES = [0, 1, "cpu", "disk"]


def reference_peaks(problem, device_map):
    g, ob = problem.graph, problem.options.offload_buffers
    devices = [device_of(t.name, device_map) for t in g.tensors]
    used = set(device_map.values())
    main = main_device(used)
    hooks = len(used) > 1 or "disk" in used
    offloaded = offloaded_devices(main) if hooks else frozenset()
    resident = {d: 0 for d in used}
    resident.setdefault(main, 0)
    streamed = [0] * len(g.nodes)
    for t, d in zip(g.tensors, devices):
        if d is None:
            continue
        off = d in offloaded
        moves = moves_with_weights(t, ob)
        if off and moves:
            streamed[t.module] += t.nbytes
        if not t.counted:
            continue
        home = (main if not moves else "cpu" if d == "cpu" else "disk") if off else d
        resident[home] = resident.get(home, 0) + t.nbytes
    best, below = list(streamed), [0] * len(g.nodes)
    for i in range(len(g.nodes) - 1, -1, -1):
        best[i] += below[i]
        p = g.nodes[i].parent
        if p >= 0:
            below[p] = max(below[p], best[i])
    chain, i = [], 0
    while True:
        if streamed[i]:
            chain.append(g.nodes[i].name)
        if not g.nodes[i].children:
            break
        i = max(g.nodes[i].children, key=lambda c: best[c])
    resident[main] += best[0]
    return devices, resident, main, best[0], tuple(chain)


def reference_estimate(problem, device_map):
    g, profile = problem.graph, problem.profile
    devices = [device_of(t.name, device_map) for t in g.tensors]
    main = main_device(set(device_map.values()))
    offloaded = offloaded_devices(main)
    fast_tier = set(problem.budgets.accelerators) or {"cpu"}
    seconds, streamed, fast, changes, last = 0.0, 0, 0, 0, None
    for t, d in zip(g.tensors, devices):
        if d is None:
            continue
        run_on = main if d in offloaded or not is_accelerator(d) else d
        seconds += tensor_seconds(problem, main, profile, t, d)
        if d in offloaded and moves_with_weights(t, problem.options.offload_buffers):
            streamed += t.nbytes
        if d in fast_tier and not (d == "cpu" and main != "cpu"):
            fast += t.counted
        if t.nbytes:
            changes += last is not None and run_on != last
            last = run_on
    return seconds + changes * change_seconds(profile), streamed, fast, changes


def reference_no_split(problem, devices):
    g = problem.graph
    under = [set() for _ in g.nodes]
    for t, d in zip(g.tensors, devices):
        if d is not None:
            under[t.module].add(d)
    for i in range(len(g.nodes) - 1, 0, -1):
        under[g.nodes[i].parent] |= under[i]
    mixed = [i for i, n in enumerate(g.nodes) if n.cls in g.no_split and len(under[i]) > 1]
    outer = []
    for i in mixed:
        p = g.nodes[i].parent
        while p >= 0 and p not in mixed:
            p = g.nodes[p].parent
        if p < 0:
            outer.append(g.nodes[i].name)
    return outer


@st.composite
def maps(draw, graph):
    names = [n.name for n in graph.nodes] + [t.name for t in graph.tensors]
    keys = draw(st.lists(st.sampled_from(names), max_size=8, unique=True))
    if draw(st.booleans()):
        keys = [""] + [k for k in keys if k]
    return {k: draw(st.sampled_from(DEVICES)) for k in keys}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_runs_equal_the_rules_tensor_by_tensor(data):
    _runs_equal_the_rules(data)


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_runs_cut_with_numpy_equal_the_rules(data):
    """The numpy path of ``runs`` (large maps) on the same small maps."""
    with mock.patch.object(kernels, "NUMPY_FROM", 0):
        _runs_equal_the_rules(data)


def _runs_equal_the_rules(data):
    model = data.draw(module_trees(max_depth=3, max_children=3))
    problem = build_problem(model, {0: 10**6, 1: 10**6, "cpu": 10**6, "disk": 10**9},
                            offload_buffers=data.draw(st.booleans()),
                            no_split_module_classes=data.draw(st.sampled_from([[], ["Block"], ["Block", "Layer"]])))
    device_map = data.draw(maps(problem.graph))
    devices, resident, main, reserve, chain = reference_peaks(problem, device_map)
    assert tensor_devices(problem.graph, device_map) == devices
    violations, memory = check(problem, device_map)
    assert (memory.main, memory.streamed, memory.chain) == (main, reserve, chain)
    assert dict(memory.peak) == resident
    no_split = [v for v in violations if v.kind == "no-split"]
    assert [v.message.split(" (")[0] for v in no_split] == [n or "<root>" for n in reference_no_split(problem, devices)]
    coverage = [v for v in violations if v.kind == "coverage"]
    # only parameters and persistent buffers must have a device (allocator.rules.dispatch.must_cover)
    uncovered = sum(d is None and (t.is_param or t.persistent) for t, d in zip(problem.graph.tensors, devices))
    assert bool(coverage) == bool(uncovered)
    if coverage:
        assert coverage[0].message.startswith(f"{uncovered} tensors have no device")
    if device_map:
        cost = estimate(problem, device_map)
        seconds, streamed, fast, changes = reference_estimate(problem, device_map)
        assert (cost.streamed_bytes, cost.resident_fast, cost.device_changes) == (streamed, fast, changes)
        assert cost.seconds == pytest.approx(seconds, rel=1e-9, abs=1e-12)


def test_runs_of_nested_and_tensor_keys():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    g = build_problem(model, {"cpu": 10**6}).graph
    assert list(columns(g).first[:3]) == [0, 0, 2] and list(columns(g).last[:3]) == [8, 2, 6]
    found = runs(g, {"": "cpu", "1": 0, "1.0.bias": "disk", "nothing": 1})
    assert found == [Run(0, 2, "cpu"), Run(2, 3, 0), Run(3, 4, "disk", -1), Run(4, 6, 0), Run(6, 8, "cpu")]
    assert runs(g, {"0": 0, "2": "cpu"}) == [Run(0, 2, 0, 1), Run(2, 6, None), Run(6, 8, "cpu", 5)]
    assert runs(g, {}) == [Run(0, 8, None)]


def test_a_whole_subtree_run_streams_its_inner_chain():
    """An offloaded key with nested modules: the chain runs through the heaviest branch below it."""
    inner = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(8, 8), nn.Linear(2, 2)))
    model = nn.Sequential(nn.Linear(2, 2), inner)
    problem = build_problem(model, {0: 10**6, "cpu": 10**6})
    _, memory = check(problem, {"0": 0, "1": "cpu"})
    assert memory.chain == ("1.1.0",) and memory.streamed == (8 * 8 + 8) * 4
    assert allocator.validate(model, {"0": 0, "1": "cpu"}, {0: 10**6, "cpu": 10**6}) == []
