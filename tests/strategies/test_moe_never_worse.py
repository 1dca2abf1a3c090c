"""Asking for our runtime never places worse than not asking (issue #39): over the zoo's mixtures of experts × budgets
× one and two GPUs (and a CPU main device), the plan for ``runtime="allocator"`` keeps no more bytes on disk and no
fewer on the fastest tier than the plan for accelerate's hooks, and where it places experts one by one, every-token
parts come first and the estimate of a forward (``Plan.cost.seconds``) is at least as good. Every case has a valid
plan for accelerate's hooks (asserted). Estimates on meta."""

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
    for m in plan.problem.moe:   # resident experts are read from their device, not from disk (counted once)
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
    assert theirs.valid, theirs.explain()   # every case has a valid plan for accelerate's hooks to compare with
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
        fastest = fast_tier(ours.problem.budgets)   # experts resident on any accelerator (or the CPU main device)
        resident = sum(sum(1 for d in r if d in fastest) for r in ours.experts.values())
        every_token_away = [t for t, d in enumerate(devices) if not inside[t] and d in slower]
        assert not (resident and every_token_away), (name, budgets, len(every_token_away), resident)
        assert ours.cost.seconds <= theirs.cost.seconds, (name, budgets, ours.cost.seconds, theirs.cost.seconds)


def _qwen3_next():
    """The Qwen3-Next-80B-A3B shape (512 experts, top-10, bf16) on meta: not in the zoo (transformers' Qwen3Next)."""
    import torch
    import transformers

    config = transformers.Qwen3NextConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_value_heads=32, linear_num_key_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        decoder_sparse_step=1, full_attention_interval=4, tie_word_embeddings=False)
    with torch.device("meta"):
        return transformers.Qwen3NextForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [1, 2])
def test_512_experts_on_32gib_gpus_place_expert_by_expert_with_nothing_on_disk(gpus):
    """Issue #39's "done when" (estimates on meta): on two 32 GiB GPUs + 128 GiB every layer's experts are placed one
    by one over both GPUs then RAM, nothing on disk; on one GPU the runtime's plan puts nothing on disk where the
    plan for accelerate's runtime fits in RAM (each expert counted once, where it lives)."""
    pytest.importorskip("transformers")
    model = _qwen3_next()
    budgets = {i: 32 * 2**30 for i in range(gpus)} | {"cpu": 128 * 2**30}
    theirs = allocator.plan(model, dict(budgets))
    ours = allocator.plan(model, dict(budgets), runtime="allocator")
    assert ours.valid and len(ours.experts) == len(ours.problem.moe) == 48
    assert _disk(theirs) == 0 and _disk(ours) == 0
    held = {d for row in ours.experts.values() for d in row}
    assert held == set(range(gpus)) | {"cpu"}
    assert _fast(ours) >= _fast(theirs) and ours.cost.seconds <= theirs.cost.seconds
