"""One cost path (issue #38): the CP-SAT objective's price of a tensor (``tensor_seconds``) and the estimate of a map
(``estimate_runs``) are made from the same per-tensor terms (``Columns.read_seconds`` from ``profile.read_seconds``,
``copy_seconds`` of the ``Moving`` columns), so summed tensor by tensor over a map they give its estimate, on real
architectures, with and without counted FLOPs, under both runtimes and both ``offload_buffers``."""

from __future__ import annotations

import logging

import pytest
import torch

import allocator
from allocator.budgets import is_accelerator, normalize_map
from allocator.evaluate.cost import (boundaries, change_seconds, counted_flops, counted_work, estimate, tensor_reads,
                                     tensor_seconds)
from allocator.evaluate.memory import main_device, map_runs, offloaded_devices
from allocator.evaluate.runs import columns
from allocator.model import zoo
from allocator.problem import build_problem
from allocator.profile import read_seconds

MODELS = ("llama-3.2-1b", "mixtral-8x7b", "t5-base", "clip-vit-base")
SETTINGS = ((None, "accelerate", False), ("default", "allocator", True), ("default", "accelerate", True),
            (None, "allocator", False))


def summed_tensor_by_tensor(problem, device_map) -> float:
    """The estimate as the CP-SAT model prices it: ``tensor_seconds`` of every tensor where the map puts it, plus a
    change of executing device between runs (with the counted activation where FLOPs were counted)."""
    g, profile = problem.graph, problem.profile
    device_map = normalize_map(device_map)
    main = main_device(set(device_map.values()))
    crossing = boundaries(problem)
    seconds, last, last_end = 0.0, None, 0
    for run in map_runs(g, device_map):
        if run.device is None:
            continue
        seconds += sum(tensor_seconds(problem, main, profile, g.tensors[t], run.device)
                       for t in range(run.start, run.end))
        if any(g.tensors[t].nbytes for t in range(run.start, run.end)):
            run_on = main if run.device in offloaded_devices(main) or not is_accelerator(run.device) else run.device
            if last is not None and run_on != last:
                seconds += change_seconds(profile, None if crossing is None else int(crossing[last_end]))
            last, last_end = run_on, run.end
    return seconds


def maps(model) -> list[dict]:
    """A few maps of every kind: the plans of ``sequential`` under one and two GPUs and RAM only, and the model's
    top modules dealt over two accelerators, RAM and disk."""
    problem = build_problem(model, {"cpu": 0})
    total = problem.graph.total
    found = [allocator.plan(model, budget, strategy="sequential").device_map
             for budget in ({0: total // 3, "cpu": total // 2}, {0: total // 6, 1: total // 6, "cpu": total // 2},
                            {"cpu": total // 2})]
    tops = [n.name for n in problem.graph.nodes if n.name and "." not in n.name] or [""]
    found.append({name: (0, 1, "cpu", "disk")[i % 4] for i, name in enumerate(tops)})
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_the_ilp_objective_summed_tensor_by_tensor_is_the_estimate(name, caplog):
    caplog.set_level(logging.ERROR)
    model = zoo.build(name)
    found, checked = maps(model), 0
    for inputs, runtime, offload_buffers in SETTINGS:
        problem = build_problem(model, {0: 10**9, 1: 10**9, "cpu": 10**10}, inputs=inputs, runtime=runtime,
                                offload_buffers=offload_buffers, objective="latency")
        for device_map in found:
            mine = estimate(problem, device_map).seconds
            # two float sums of the same terms in another order (tensor by tensor, and femtosecond prefix sums)
            torch.testing.assert_close(summed_tensor_by_tensor(problem, device_map), mine, rtol=1e-9, atol=0)
            checked += 1
    assert checked == 4 * len(SETTINGS)


def test_every_tensors_read_term_is_the_one_formula_of_one_piece():
    """``Columns.read_seconds`` (every tensor at once) is ``profile.read_seconds`` of each tensor alone."""
    model = zoo.build("llama-3.2-1b")
    for inputs in (None, "default"):
        problem = build_problem(model, {0: 10**9, "cpu": 10**10}, inputs=inputs, objective="latency")
        cols, profile = columns(problem.graph), problem.profile
        flops, work = counted_flops(problem), counted_work(problem) or ()
        assert (flops is None) == (inputs is None)
        for on, seconds in zip(("cpu", 0), tensor_reads(problem, profile)):
            one = [read_seconds(profile, on, int(cols.nbytes[t]), int(cols.numel[t]),
                                None if flops is None else float(flops[t]), tuple(float(v[t]) for v in work))
                   for t in range(len(seconds))]
            torch.testing.assert_close(torch.tensor(one, dtype=torch.float64),
                                       torch.tensor(seconds, dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("source", ["cpu", "disk"])
def test_the_compute_plans_streamed_price_is_the_one_copy_formula(source):
    """Under our runtime with a generation budget, each offloaded unit's streamed price in each phase
    (``PhaseChoice.streamed_seconds``) is ``copy_seconds`` of its bytes and tensors plus its read or compute on the
    main device and, at decode, its KV cache read there: no copy formula of its own (a rate changed in
    ``copy_seconds`` reaches the compute plan)."""
    from allocator.evaluate.compute import decide, unit_stats
    from allocator.evaluate.cost import copy_seconds

    model = zoo.build("llama-3.2-1b")
    problem = build_problem(model, {0: "600MiB", "cpu": "64GiB"}, runtime="allocator", dtype=torch.bfloat16,
                            generation=allocator.GenerationBudget(1, 256))
    device_map = {k: (source if v == "cpu" else v)
                  for k, v in allocator.plan(model, {0: "600MiB", "cpu": "64GiB"}, runtime="allocator",
                                             dtype=torch.bfloat16, split_layers=False,
                                             generation=allocator.GenerationBudget(1, 256)).device_map.items()}
    plan = decide(problem, device_map, 0)
    stats = unit_stats(problem, normalize_map(device_map))
    p = problem.profile
    assert plan is not None and plan.choices
    for choice in plan.choices:
        nbytes, numel, tensors, cache = stats[choice.unit]
        want = (copy_seconds(p, 0, source, nbytes, tensors, runtime="allocator")
                + max(nbytes / p.accelerator_memory, 2 * choice.tokens * numel / p.accelerator_flops)
                + (cache / p.accelerator_memory if choice.phase == "decode" else 0))
        assert choice.streamed_seconds == pytest.approx(want, rel=1e-12), choice
