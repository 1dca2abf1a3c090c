"""``balanced`` / ``balanced_low_0``: the spill of transformers' "balanced" reproduced and avoided, optimality on the
zoo against an independent exact DP, ties, unequal budgets, offloading, ``low_0``, determinism, and the transformers
route.

Models are built on the meta device from configs (nothing is downloaded); accelerators are planned for, not present.
"""

from __future__ import annotations

import functools

import copy
import itertools
import random
from functools import cache

import pytest
import torch
from torch import nn

import allocator
from allocator.model import zoo
from allocator.budgets import parse_budgets
from allocator.evaluate.cost import estimate
from allocator.problem import Options, Problem
from allocator.evaluate.memory import device_of
from allocator.strategies import STRATEGIES
from allocator.evaluate.units import groups
from allocator.evaluate.validate import check
from allocator.report.decisions import notes

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import accelerate.utils as accelerate_utils  # noqa: E402
import transformers.integrations.accelerate as tia  # noqa: E402
import transformers.modeling_utils as modeling_utils  # noqa: E402

import allocator.integrations.transformers as hf

# where no valid plan exists, raise (plan's default returns accelerate's own map, flagged)
strict_plan = functools.partial(allocator.plan, strict=True)


def llama(layers: int, vocab: int, tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=tied)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def total_of(model) -> int:
    return allocator.build_problem(model, {"cpu": 0}).graph.total


def accelerator_peaks(plan) -> dict:
    return {d: b for d, b in plan.peak.items() if d not in ("cpu", "disk")}


def optimal_contiguous(sizes: list[int], n: int) -> int:
    """The least largest part over all splits of ``sizes`` into ``n`` contiguous non-empty parts: plain O(n · N²) DP,
    written here independently of the code under test."""
    prefix = list(itertools.accumulate(sizes, initial=0))
    inf = float("inf")
    best = [[inf] * (len(sizes) + 1) for _ in range(n + 1)]  # best[j][e]: first e items in j parts
    best[0][0] = 0
    for j in range(1, n + 1):
        for e in range(j, len(sizes) + 1):
            best[j][e] = min(max(best[j - 1][s], prefix[e] - prefix[s]) for s in range(j - 1, e))
    return best[n][len(sizes)]


# -- (a) the spill ---------------------------------------------------------------------------------------------------

# (layers, vocab, tied, accelerators, budget per accelerator as a share of the model): the largest leaf (the tied
# embedding+head of 2.05 MB, or the untied embedding and head of 1.02 MB each) exceeds total / n.
SPILLS = {"tied-2gpu": (4, 8000, True, 2, 1.4), "untied-4gpu": (6, 4000, False, 4, 1.2)}
# Whether transformers' map is valid at all: in the 4-GPU case GPU 1 becomes the main device (GPU 0 is left empty)
# and must hold the embeddings plus the streamed head, 2.05 MB of its 1.06 MB.
THEIRS_VALID = {"tied-2gpu": True, "untied-4gpu": False}


@pytest.mark.parametrize("case", list(SPILLS))
def test_transformers_balanced_spills_to_cpu_where_ours_fits_the_accelerators(case):
    layers, vocab, tied, n, share = SPILLS[case]
    model = llama(layers, vocab, tied)
    total = total_of(model)
    largest_leaf = max(p.numel() * p.element_size() for p in model.parameters())
    assert largest_leaf > total / n
    budget = {**{i: int(total * share / n) for i in range(n)}, "cpu": 10 * total}

    # transformers 5's own route for device_map="balanced": its get_balanced_memory + infer_auto_device_map
    theirs = tia._get_device_map(model, "balanced", copy.deepcopy(budget), None)
    # accelerate's functions, as transformers 4 and load_checkpoint_and_dispatch call them
    no_split = model._no_split_modules
    balanced_memory = accelerate_utils.get_balanced_memory(
        model, copy.deepcopy(budget), no_split_module_classes=no_split)
    theirs_accelerate = accelerate_utils.infer_auto_device_map(model, balanced_memory, no_split_module_classes=no_split)
    assert "cpu" in theirs.values() and "cpu" in theirs_accelerate.values()
    assert 0 not in theirs.values()  # GPU 0 left empty by the reservation of the largest layer
    assert (not allocator.validate(model, theirs, budget)) == THEIRS_VALID[case]

    ours = allocator.plan(model, budget, strategy="balanced")
    assert ours.valid, ours.violations
    assert set(ours.device_map.values()) == set(range(n))  # all resident, every accelerator used
    peaks = accelerator_peaks(ours)
    assert sum(peaks.values()) == total
    assert max(peaks.values()) <= budget[0]
    sizes = [g.size for g in groups(ours.problem.graph)]
    assert max(peaks.values()) == optimal_contiguous(sizes, n) == max(sizes)  # the leaf alone sets the peak


def test_transformers_balanced_mode_is_ours_under_the_patch():
    layers, vocab, tied, n, share = SPILLS["untied-4gpu"]
    model = llama(layers, vocab, tied)
    budget = {**{i: int(total_of(model) * share / n) for i in range(n)}, "cpu": 10 * total_of(model)}
    given = copy.deepcopy(budget)
    assert hf.MODE_TO_STRATEGY["balanced"] == "balanced"
    assert hf.MODE_TO_STRATEGY["balanced_low_0"] == "balanced_low_0"
    with hf.patch():
        # from_pretrained calls modeling_utils._get_device_map (transformers 5)
        got = {mode: modeling_utils._get_device_map(model, mode, given, None)
               for mode in ("balanced", "balanced_low_0")}
    assert given == budget
    for mode, device_map in got.items():
        assert device_map == allocator.plan(model, budget, strategy=mode).device_map, mode
        assert "cpu" not in device_map.values()
    assert "cpu" in tia._get_device_map(model, "balanced", copy.deepcopy(budget), None).values()  # unpatched again


# -- (b) optimality on the zoo ---------------------------------------------------------------------------------------

@cache
def zoo_graph(name):
    return allocator.build_problem(zoo.build(name), {"cpu": 0}).graph


def problem_for(graph, budget) -> Problem:
    return Problem(graph=graph, budgets=parse_budgets(budget), options=Options())


@pytest.mark.parametrize("name", zoo.names())
def test_zoo_largest_peak_is_the_optimal_contiguous_partition(name):
    graph = zoo_graph(name)
    sizes = [g.size for g in groups(graph)]
    for n in (2, 4):
        budget = {**{i: graph.total for i in range(n)}, "cpu": 2 * graph.total}  # ample: nothing binds
        problem = problem_for(graph, budget)
        placement = STRATEGIES["balanced"](problem)
        violations, memory = check(problem, placement.device_map)
        assert not violations, violations
        peaks = {d: memory.peak[d] for d in range(n)}  # every accelerator holds something
        assert set(placement.device_map.values()) == set(range(n))
        optimum = optimal_contiguous(sizes, n)
        assert max(peaks.values()) == optimum, (name, n, peaks, optimum)  # within one unit: exactly


# -- ties, unequal budgets, offloading, low_0, determinism ------------------------------------------------------------

def unit_devices(plan) -> list:
    """The device of every unit, in model order."""
    return [(u.name, device_of(u.name, plan.device_map)) for g in groups(plan.problem.graph) for u in g.units]


def test_tied_head_travels_with_the_embeddings_and_the_rest_is_contiguous():
    model = zoo.build("gpt2")  # wte tied to lm_head, which is defined last
    total = total_of(model)
    plan = allocator.plan(model, {0: total // 2, 1: total // 2, 2: total // 2, "cpu": total}, strategy="balanced")
    assert plan.valid
    where = dict(unit_devices(plan))
    assert where["transformer.wte"] == where["lm_head"] == 0
    order = [d for name, d in sorted(unit_devices(plan), key=lambda nd: plan.problem.graph.node_index.get(nd[0], 0))
             if name != "lm_head"]
    assert order == sorted(order) and set(order) == {0, 1, 2}  # contiguous in model order but for the tied head


class Chain(nn.Module):
    """Linear layers of the given widths in a row, on the meta device (no no-split classes: each is a unit)."""

    def __init__(self, widths):
        super().__init__()
        with torch.device("meta"):
            self.layers = nn.ModuleList(nn.Linear(w, 8, bias=False) for w in widths)


@pytest.mark.parametrize("widths,budgets", [
    ([8, 16, 4, 4, 32, 8, 8, 16], (2500, 1200)),
    ([8, 16, 4, 4, 32, 8, 8, 16], (1000, 1500, 1500)),
    ([8, 16, 4, 4, 32, 8, 8, 16], (1200, 3000, 600, 2000)),
    ([32, 1, 1, 1, 1, 1, 1, 32], (2000, 1000, 1500)),
])
def test_unequal_budgets_minimise_the_largest_fill(widths, budgets):
    model = Chain(widths)
    sizes = [32 * w for w in widths]  # float32, 8 outputs
    budget = {**dict(enumerate(budgets)), "cpu": 10**6}
    plan = allocator.plan(model, budget, strategy="balanced")
    assert plan.valid and "cpu" not in plan.device_map.values()
    fill = max(plan.peak[d] / budgets[d] for d in range(len(budgets)) if d in plan.peak)
    best = min(  # brute force over every contiguous split, empty parts allowed, within the budgets
        max(sum(sizes[a:b]) / c for a, b, c in zip((0, *cuts), (*cuts, len(sizes)), budgets))
        for cuts in itertools.combinations_with_replacement(range(len(sizes) + 1), len(budgets) - 1)
        if all(sum(sizes[a:b]) <= c for a, b, c in zip((0, *cuts), (*cuts, len(sizes)), budgets))
    )
    assert best <= fill <= best + 1 / max(budgets)


def test_optimal_splits_are_evened_out():
    """The min-max is set by the two 2 KiB ends; the six 256 B layers between them are shared 3 | 3, not 1 | 5."""
    model = Chain([64, 8, 8, 8, 8, 8, 8, 64])
    plan = allocator.plan(model, {0: 10**5, 1: 10**5, 2: 10**5, 3: 10**5, "cpu": 10**6}, strategy="balanced")
    assert plan.valid and [plan.peak[d] for d in range(4)] == [2048, 768, 768, 2048]


def test_offloads_only_what_the_accelerators_cannot_hold_and_balances_the_rest():
    model = zoo.build("llama-3.2-1b")
    total = total_of(model)
    budget = {0: int(0.25 * total), 1: int(0.25 * total), 2: int(0.25 * total), "cpu": 2 * total}
    ours = allocator.plan(model, budget, strategy="balanced")
    base = allocator.plan(model, budget, strategy="reserve")
    assert ours.valid and "cpu" in ours.device_map.values()
    resident = sum(ours.resident(d) for d in range(3))
    assert resident == sum(base.resident(d) for d in range(3))  # not a byte less resident than reserve's plan
    fill = max(accelerator_peaks(ours).values())
    assert fill <= max(accelerator_peaks(base).values())
    assert any("cannot hold the model" in note for note in notes(ours.placement))


@pytest.mark.parametrize("name", zoo.names()[::5])
def test_zoo_offloading_cells_valid_and_never_less_resident_than_reserve(name):
    graph = zoo_graph(name)
    for shares in ((.3, .3), (.3, .3, .3), (.15, .15, .15, .15)):
        budget = {**{d: int(f * graph.total) for d, f in enumerate(shares)}, "cpu": 2 * graph.total}
        problem = problem_for(graph, budget)
        resident = estimate(problem, STRATEGIES["reserve"](problem).device_map).resident_fast
        for strategy in ("balanced", "balanced_low_0"):
            placement = STRATEGIES[strategy](problem)
            assert not check(problem, placement.device_map)[0], (strategy, shares)
            assert estimate(problem, placement.device_map).resident_fast >= resident, (strategy, shares)


def test_idle_accelerators_are_explained():
    model = zoo.build("gemma3-4b")  # 15 % per GPU: no GPU can be main (test_strategies.py), all runs from RAM
    total = total_of(model)
    plan = allocator.plan(model, {0: int(.15 * total), 1: int(.15 * total), "cpu": 2 * total}, strategy="balanced")
    assert plan.valid and plan.main_device == "cpu"
    assert any(note.startswith("accelerators [0, 1] get nothing") for note in notes(plan.placement))


def test_no_accelerator_delegates_to_reserve():
    model = zoo.build("gpt2")
    budget = {"cpu": int(0.5 * total_of(model))}
    assert (allocator.plan(model, budget, strategy="balanced").device_map
            == allocator.plan(model, budget, strategy="reserve").device_map)


def test_infeasible_states_a_minimum_that_works():
    model = zoo.build("gpt2")
    total = total_of(model)
    budget = {0: int(0.05 * total), 1: int(0.05 * total), "cpu": int(0.05 * total)}
    with pytest.raises(allocator.InfeasiblePlacement) as info:
        strict_plan(model, budget, strategy="balanced")
    assert info.value.device == "cpu"
    assert strict_plan(model, {**budget, "cpu": info.value.minimum}, strategy="balanced").valid


def min_first_prefix(sizes: list[int], budgets: list[int]) -> int:
    """Smallest first-device load over contiguous splits within the budgets (the others may be empty): brute force."""
    best = None
    for cuts in itertools.combinations_with_replacement(range(len(sizes) + 1), len(budgets) - 1):
        parts = [sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes)))]
        if all(p <= c for p, c in zip(parts, budgets)):
            best = parts[0] if best is None else min(best, parts[0])
    return best


@pytest.mark.parametrize("name", ["llama-3.2-1b", "gpt2", "t5-base", "mixtral-8x7b"])
def test_low_0_keeps_the_first_accelerator_lightest(name):
    graph = zoo_graph(name)
    sizes = [g.size for g in groups(graph)]
    budgets = [max(int(0.3 * graph.total), max(sizes))] * 4  # the others hold at most 90 %: GPU 0 gets something
    problem = problem_for(graph, {**dict(enumerate(budgets)), "cpu": 2 * graph.total})
    placement = STRATEGIES["balanced_low_0"](problem)
    violations, memory = check(problem, placement.device_map)
    assert not violations and "cpu" not in placement.device_map.values()
    first = memory.peak.get(0, 0)
    assert 0 < first == min_first_prefix(sizes, budgets)
    # lightest, unless it holds nothing but the first group (gpt2's embeddings with the tied head)
    assert first <= min(memory.peak[d] for d in (1, 2, 3)) or first == sizes[0]
    balanced = STRATEGIES["balanced"](problem)
    assert first <= check(problem, balanced.device_map)[1].peak[0]


def test_low_0_leaves_the_first_accelerator_empty_when_the_others_hold_the_model():
    model = zoo.build("gpt2")
    total = total_of(model)
    plan = allocator.plan(model, {0: total, 1: total, 2: total, "cpu": total}, strategy="balanced_low_0")
    assert plan.valid and set(plan.device_map.values()) == {1, 2}
    assert any("gets nothing" in note for note in notes(plan.placement))


@pytest.mark.parametrize("strategy", ["balanced", "balanced_low_0"])
def test_deterministic_and_inputs_untouched(strategy):
    model = zoo.build("qwen2-0.5b")
    total = total_of(model)
    budget = {1: int(0.4 * total), 0: int(0.4 * total), 2: int(0.4 * total), "cpu": total}
    given = dict(budget)
    first = allocator.plan(model, budget, strategy=strategy).device_map
    again = allocator.plan(model, dict(reversed(list(budget.items()))), strategy=strategy).device_map
    assert first == again and budget == given
    assert list(first.items()) == list(allocator.plan(model, budget, strategy=strategy).device_map.items())


class _OnlyNonPersistent(torch.nn.Module):
    """A module whose only tensor is a non-persistent buffer (a rotary embedding's ``inv_freq``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(16), persistent=False)


@pytest.mark.parametrize("position", range(5))
def test_balanced_gives_a_lone_non_persistent_buffer_a_device(position):
    """Regression (found with issue #24): a module holding only a non-persistent buffer was mapped to ``None``."""
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    layers.insert(position, _OnlyNonPersistent())
    model = torch.nn.Sequential(*layers)
    rng = random.Random(position)
    planned = 0
    for _ in range(12):
        budgets = {0: rng.randint(0, 80000), 1: rng.randint(0, 80000), "cpu": rng.choice([10**6, 30000])}
        for strategy in ("balanced", "balanced_low_0"):
            try:
                p = allocator.plan(model, dict(budgets), strategy=strategy)
            except allocator.InfeasiblePlacement:
                continue
            assert None not in p.device_map.values(), (budgets, strategy, p.device_map)
            assert p.valid, p.explain()
            planned += 1
    assert planned >= 12, planned  # most budgets plan: the loop checks maps, not only errors
