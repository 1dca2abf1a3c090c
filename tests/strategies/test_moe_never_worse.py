"""Asking for our runtime never places worse than not asking (issue #39): over the zoo's mixtures of experts × budgets
× one and two GPUs (and a CPU main device), the plan for ``runtime="allocator"`` keeps no more bytes on disk and no
fewer on the fastest tier than the plan for accelerate's hooks, and where it places experts one by one, every-token
parts come first and the decoding estimate is at least as good. Estimates on meta."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import allocator
from allocator.evaluate.experts import expert_bytes
from allocator.evaluate.memory import map_runs, tensor_devices
from allocator.evaluate.runs import columns
from allocator.evaluate.tiers import fast_bytes, fast_tier
from allocator.model import zoo

MODELS = zoo.names(family="moe-llm")
#: (GPU budgets as fractions of the model, RAM as a fraction), the rest on disk
BUDGETS = [((), 0.3), ((), 0.6), ((0.25,), 0.3), ((0.25,), 1.0), ((0.15, 0.15), 0.5), ((0.3, 0.3), 1.0)]


SLACK = 4096


@functools.lru_cache(maxsize=None)
def _model(name):
    return zoo.build(name)


@functools.lru_cache(maxsize=None)
def _total(name):
    return allocator.build_problem(_model(name), {"cpu": 0}).graph.total


def _disk(plan) -> int:
    g = plan.problem.graph
    nbytes = np.asarray(g.tensors.nbytes)
    on = np.fromiter((d == "disk" for d in tensor_devices(g, plan.device_map)), dtype=bool, count=len(nbytes))
    total = int(nbytes[on].sum())
    for m in plan.problem.moe:   # resident experts are read from their device, not from disk
        row = plan.experts.get(m.experts)
        if row and plan.device_map.get(m.experts) == "disk":
            total -= sum(1 for d in row if d != "disk") * expert_bytes(plan.problem, m)
    return total


def _fast(plan) -> int:
    tier = fast_tier(plan.problem.budgets)
    resident = sum(expert_bytes(plan.problem, m) * sum(1 for d in plan.experts.get(m.experts, ()) if d in tier
                                                        and d != plan.device_map.get(m.experts))
                   for m in plan.problem.moe)
    return fast_bytes(plan.problem, map_runs(plan.problem.graph, plan.device_map)) + resident


@pytest.mark.slow
@pytest.mark.parametrize("gpus,ram", BUDGETS)
@pytest.mark.parametrize("name", MODELS)
def test_allocator_runtime_never_places_worse(name, gpus, ram):
    model, total = _model(name), _total(name)
    budgets = {i: int(f * total) for i, f in enumerate(gpus)} | {"cpu": int(ram * total)}
    theirs = allocator.plan(model, dict(budgets))
    ours = allocator.plan(model, dict(budgets), runtime="allocator")
    if not theirs.valid:
        return
    assert ours.valid, ours.explain()
    assert _disk(ours) <= _disk(theirs), (name, budgets, _disk(ours), _disk(theirs))
    # SLACK: the dense strategies under runtime="allocator" may place a buffer of a few bytes elsewhere (DeepSeek's
    # rotary inv_freq, 256 B), which is not expert awareness
    assert _fast(ours) >= _fast(theirs) - SLACK, (name, budgets, _fast(ours), _fast(theirs))
    if ours.experts:   # every-token parts before any routed expert: none offloaded while experts are resident
        g, cols = ours.problem.graph, columns(ours.problem.graph)
        inside = np.zeros(len(g.tensors.nbytes), dtype=bool)
        for m in ours.problem.moe:
            node = g.node_index[m.experts]
            inside[cols.first[node]:cols.last[node]] = True
        devices = tensor_devices(g, ours.device_map)
        slower = {d for d in devices if d in ("disk",) or (d == "cpu" and ours.main_device != "cpu")}
        resident = sum(r.count(ours.main_device) for r in ours.experts.values())
        every_token_away = [t for t, d in enumerate(devices) if not inside[t] and d in slower]
        assert not (resident and every_token_away), (name, budgets, len(every_token_away), resident)
