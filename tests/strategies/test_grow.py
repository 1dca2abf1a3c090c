"""Room our runtime's own decisions leave on the main device is used (issue #46, :mod:`allocator.strategies.grow`)."""

from __future__ import annotations

import warnings

import pytest
import torch

import allocator
from allocator.model import zoo

pytest.importorskip("transformers")


def _plan(model, budget, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return allocator.plan(model, budget, **options)


@pytest.mark.slow
def test_llama_70b_at_32k_tokens_fills_the_gpu_its_runtime_leaves_room_on():
    """llama-70b in bf16 on 24 GiB + 192 GiB at 32k tokens, our runtime: the offloaded layers decode where their
    weights live, their KV cache in RAM, so GPU 0 takes more layers (before: 3.9 GiB resident, peak 13.1 of 24 GiB)."""
    model = zoo.build("llama-70b")
    budget = {0: "24GiB", "cpu": "192GiB"}
    p = _plan(model, budget, runtime="allocator", dtype=torch.bfloat16,
              generation=allocator.GenerationBudget(1, 32768))
    limit = p.problem.budgets.limit(0)
    assert p.valid and p.main_device == 0
    assert 0.85 * limit < p.peak[0] <= limit
    grown = p.placement.of_kind("grow")
    assert grown and grown[0].facts["groups"] >= 1
    assert p.resident(0) > grown[0].facts["peak"] - p.parts[0]["activations"] - p.parts[0]["logits"] \
        - grown[0].bytes // 2   # more than the embeddings and head alone
    assert p.parts["cpu"]["cache"] > 0 and all(r["decode"] == "cpu" for r in p.compute.values())
    assert "moved onto 0" in p.explain()
    assert p.costs["decode"].seconds <= p.costs["prefill"].seconds


def test_grow_leaves_accelerate_runtime_plans_alone():
    """Under accelerate's hooks offloaded layers decode on the main device with their cache there: nothing to grow."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=256, vocab_size=1000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    total = allocator.build_problem(model, {"cpu": 10 ** 12}).graph.total
    budget = {0: total // 2, "cpu": 4 * total}
    generation = allocator.GenerationBudget(1, 64)
    theirs = _plan(model, budget, generation=generation)
    assert not theirs.placement.of_kind("grow")
    ours = _plan(model, budget, generation=generation, runtime="allocator")
    assert ours.valid and ours.resident(0) >= theirs.resident(0)
    for d, limit in ((0, total // 2), ("cpu", 4 * total)):
        assert ours.peak[d] <= limit
