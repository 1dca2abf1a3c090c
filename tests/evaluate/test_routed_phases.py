"""Issue #46: one price for mixtures of experts. Every phase prices an offloaded experts layer from its routed experts
with one formula (``allocator/evaluate/experts.py``), so a decoding step is never priced above the prefill of the same
plan, and the plan's mode per layer and phase is the cheaper by that formula. Estimates on meta, over the zoo's
mixtures of experts x budgets x runtimes."""

from __future__ import annotations

import functools

import pytest

import allocator
from allocator.evaluate.compute import phase_tokens, step_seconds
from allocator.evaluate.experts import layer_mode, routed_layers, routed_seconds
from allocator.model import zoo

MODELS = zoo.names(family="moe-llm")
#: DeepSeek-V2's MLA attention has no key/value projections a generation budget can size (InvalidOption): it is planned
#: without one (prefill ``Profile.tokens``, decode 1 token)
NO_GENERATION = {"deepseek-v2-lite"}
#: (GPU budget as a fraction of the model, RAM as a fraction), the rest on disk; () for no GPU
BUDGETS = [(0.25, 1.5), (0.1, 0.5), ((), 0.4)]
RUNTIMES = ("allocator", "accelerate")


@functools.lru_cache(maxsize=None)
def _model(name):
    return zoo.build(name)


@functools.lru_cache(maxsize=None)
def _plan(name, gpu, ram, runtime):
    model = _model(name)
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    budget = ({} if gpu == () else {0: int(total * gpu)}) | {"cpu": int(total * ram)}
    generation = None if name in NO_GENERATION else allocator.GenerationBudget(1, 4096)
    return allocator.plan(model, budget, runtime=runtime, generation=generation)


def _steps(plan, runtime) -> dict:
    return {phase: step_seconds(plan.problem, plan.device_map, plan.main_device, phase, plan.hybrid,
                                runtime=runtime, experts=plan.experts)
            for phase in ("prefill", "decode")}


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("gpu,ram", BUDGETS)
@pytest.mark.parametrize("name", MODELS)
def test_a_decoding_step_is_never_priced_above_the_prefill(name, gpu, ram, runtime):
    """Per plan: one decoding step (one token) is priced at most at the prefill step of the prompt, and at most at the
    plan's estimate of one forward (``Plan.cost``: ``Profile.tokens`` tokens); both as the plan runs them and with
    every offloaded unit streamed (``Plan.phase_steps``)."""
    plan = _plan(name, gpu, ram, runtime)
    steps = _steps(plan, runtime)
    assert 0 < steps["decode"] <= steps["prefill"], steps
    for kind, row in plan.phase_steps.items():
        assert row["decode"] <= row["prefill"], (kind, row)
    if runtime == "allocator" and plan.experts:
        assert steps["decode"] <= plan.cost.seconds, (steps, plan.cost.seconds)


@pytest.mark.parametrize("name", MODELS)
def test_the_plans_modes_are_the_cheaper_by_the_one_formula(name):
    """``Plan.runtime.expert_mode`` names, per offloaded experts layer and phase, the mode :func:`layer_mode` finds
    cheaper at that phase's tokens; the phase's step prices each layer's routed experts in that mode
    (:func:`routed_seconds`), and forcing the other mode never prices it lower."""
    plan = _plan(name, 0.1, 0.5, "allocator")
    problem, placed = plan.problem, plan.experts
    layers = routed_layers(problem, plan.device_map, placed)
    assert layers and set(plan.runtime.expert_mode) == {m.experts for m in layers}
    tokens = phase_tokens(problem)
    assert plan.runtime.threshold == tokens["decode"]
    for phase, count in tokens.items():
        modes = {n: row[phase] for n, row in plan.runtime.expert_mode.items()}
        for layer in layers:
            mode, seconds = layer_mode(problem, layer, plan.device_map, placed.get(layer.experts), count)
            assert modes[layer.experts] == mode and seconds[mode] <= min(seconds.values())
        chosen = routed_seconds(problem, plan.device_map, placed, count, modes)
        other = routed_seconds(problem, plan.device_map, placed, count,
                               {n: "compute" if m == "fetch" else "fetch" for n, m in modes.items()})
        assert all(chosen[n] <= other[n] for n in chosen)
