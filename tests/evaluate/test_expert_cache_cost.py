"""Issue #39: the cost model prices the expert cache (``expert_cache=N``) by Che's approximation for LRU from the
routing shares; estimates on the meta device, nothing run."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import allocator
from allocator.evaluate.cost import priced
from allocator.evaluate.experts import cache_hit_rate, che_hit_rates, routed_cost

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_models import small_config  # noqa: E402

LAYERS, EXPERTS, TOP_K, HOT = 6, 16, 2, 3
DECODE = allocator.Profile(tokens=1)   # one decoding step: one token routed per layer


@pytest.fixture(scope="module")
def moe():
    from transformers import AutoModelForCausalLM

    config = small_config("qwen3_moe", layers=LAYERS, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    return model, {"cpu": int(total * 0.4)}


def _skew(model):
    """Every layer routes 90 % of its choices to its HOT hot experts (the first ones), the rest spread."""
    names = [m.experts for m in allocator.build_problem(model, {"cpu": 0}, runtime="allocator").moe]
    counts = {n: tuple(300 if e < HOT else 10 for e in range(EXPERTS)) for n in names}
    return allocator.ExpertProfile(counts, tokens=1000)


def _price(model, budget, placement, **options):
    problem = allocator.build_problem(model, budget, runtime="allocator", profile=DECODE, **options)
    return routed_cost(problem, placement, priced(problem, placement.device_map)), problem


def test_che_hit_rates_follow_the_cache_size():
    rates = [0.9] * 4 + [0.05] * 40
    assert che_hit_rates(rates, 0) == [0.0] * 44
    assert che_hit_rates(rates, 3) == [0.0] * 44       # fewer slots than one step's certain requests: cycled through
    small, large = che_hit_rates(rates, 8), che_hit_rates(rates, 30)
    assert 0 < small[0] < large[0] <= 1 and small[-1] < large[-1] < large[0]
    assert che_hit_rates(rates, 44) == [1.0] * 44


def test_a_cache_lowers_the_estimate_where_the_hot_experts_are_not_resident(moe):
    """The placement keeps cold experts resident and leaves the hot ones on disk: a cache that holds the hot ones
    serves most lookups, and the estimate falls (same map, same residents; only the cache differs)."""
    model, budget = moe
    skew = _skew(model)
    plan = allocator.plan(model, budget, runtime="allocator", expert_profile=skew, profile=DECODE)
    assert plan.experts and all(row[e] != "disk" for row in plan.experts.values() for e in range(HOT))
    # the same number of residents per layer, taken from the cold experts
    cold = {}
    for name, row in plan.experts.items():
        kept = sum(d != "disk" for d in row)
        cold[name] = tuple("cpu" if HOT <= e < HOT + kept else "disk" for e in range(EXPERTS))
    assert all(sum(d != "disk" for d in cold[n]) == sum(d != "disk" for d in row) for n, row in plan.experts.items())
    placement = dataclasses.replace(plan.placement, experts=cold)
    slots = 2 * LAYERS * HOT
    without, _ = _price(model, budget, placement, expert_profile=skew)
    with_cache, problem = _price(model, budget, placement, expert_profile=skew, expert_cache=slots)
    assert with_cache.seconds < without.seconds * 0.9
    assert with_cache.streamed_bytes < without.streamed_bytes
    rate = cache_hit_rate(problem, placement)
    assert 0.8 < rate <= 1.0
    assert cache_hit_rate(_price(model, budget, placement, expert_profile=skew)[1], placement) is None


def test_under_uniform_routing_the_estimate_counts_the_residents_a_cache_gives_up(moe):
    """Uniform routing: the residents already serve what they can, and the slots the cache takes from them hit less
    than the residents they replace, so planning with a cache is estimated slower, not faster."""
    model, budget = moe
    base = allocator.plan(model, budget, runtime="allocator", profile=DECODE)
    cached = allocator.plan(model, budget, runtime="allocator", profile=DECODE, expert_cache=LAYERS * TOP_K * 2)
    resident = sum(d != "disk" for row in base.experts.values() for d in row)
    assert sum(d != "disk" for row in cached.experts.values() for d in row) < resident
    assert cached.runtime.expert_cache == LAYERS * TOP_K * 2
    assert cached.cost.seconds > base.cost.seconds
    ours, problem = _price(model, budget, cached.placement, expert_cache=LAYERS * TOP_K * 2)
    unpriced, _ = _price(model, budget, cached.placement)
    assert ours.seconds < unpriced.seconds     # the cache's hits are priced: it is not pure loss
    assert 0 < cache_hit_rate(problem, cached.placement) < 0.5
