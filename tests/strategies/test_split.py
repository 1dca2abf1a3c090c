"""Decoder layers split under our runtime (issue #49, the planning half): the parts found from structure, the split
allowed only where our runtime runs it, chosen by the verdict's decode price, said with the numbers, and fit's longest
context with every attention and its KV cache on the accelerator. Every figure is an estimate (meta device)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import allocator
from allocator import cli
from allocator.evaluate.validate import check
from allocator.fit import split_map
from allocator.judge.verdict import verdict
from allocator.placement import Decision, Placement
from allocator.report.decisions import sentence
from allocator.model import zoo
from allocator.model.split import find_splits
from allocator.problem import build_problem
from allocator.profile import Profile
from allocator.strategies.split import main_bytes, split_layers

transformers = pytest.importorskip("transformers")

BUDGET_70B = {0: "24GiB", "cpu": "192GiB"}


def _plan(model, budget, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return allocator.plan(model, budget, **options)


def _tiny_llama(layers: int = 6):
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _attention_on(plan, splits, device) -> int:
    """Layers of ``splits`` whose attention computes on ``device`` (resident there, whole or split)."""
    return sum(1 for s in splits if check_device(plan.device_map, s.attention) == device)


def check_device(device_map, name):
    while True:
        if name in device_map:
            return device_map[name]
        if not name:
            return None
        name = name.rpartition(".")[0]


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, hidden_states, position_embeddings=None):
        return self.q(hidden_states)


class _Layer(nn.Module):
    """A decoder layer whose children have no usual names: found from what their forwards take and their sizes."""

    def __init__(self):
        super().__init__()
        self.n1 = nn.LayerNorm(8)
        self.zz = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8))
        self.aa = _Attn()

    def forward(self, x):
        return x


def test_parts_are_found_from_structure_not_names():
    model = nn.Sequential(_Layer(), _Layer())
    found = find_splits(model, {"_Layer"})
    assert [(s.layer, s.attention, s.near, s.far) for s in found] == [
        ("0", "0.aa", ("0.aa", "0.n1"), "0.zz"), ("1", "1.aa", ("1.aa", "1.n1"), "1.zz")]
    assert find_splits(model, {"Sequential"}) == ()   # no attention child: never split


@pytest.mark.slow
def test_moe_layers_split_at_their_routed_experts():
    found = find_splits(zoo.build("qwen3-moe-30b-a3b"), {"Qwen3MoeDecoderLayer"})
    assert len(found) == 48 and all(s.moe for s in found)
    assert found[3].far == "model.layers.3.mlp.experts" and "model.layers.3.mlp.gate" in found[3].near


def test_a_split_map_is_valid_only_for_our_runtime():
    model = _tiny_llama()
    budget = {0: "9MiB", "cpu": "100MiB"}
    ours = build_problem(model, budget, runtime="allocator")
    theirs = build_problem(model, budget)
    found = split_map(ours)
    assert found is not None and "model.layers.2.mlp" in found and found["model.layers.2.self_attn"] == 0
    assert not [v for v in check(ours, found)[0] if v.kind == "no-split"]
    assert theirs.splits == () and {v.kind for v in check(theirs, found)[0]} >= {"no-split"}
    whole = dict(found, **{"model.layers.2.mlp": "cpu", "model.layers.2.self_attn": "cpu"})
    assert {v.kind for v in check(ours, whole)[0]} >= {"no-split"}   # attention apart from its norms


def test_llama_70b_at_32k_keeps_more_attention_and_cache_on_the_gpu():
    """Done-when of issue #49 (estimates): more layers' attention with its cache on GPU 0 than the whole-layer plan,
    a faster estimated decoding step, at least its bytes (weights and KV cache) on GPU 0."""
    model = zoo.build("llama-70b")
    gen = allocator.GenerationBudget(1, 32768)
    options = dict(runtime="allocator", dtype=torch.bfloat16, generation=gen)
    whole = _plan(model, BUDGET_70B, split_layers=False, **options)
    split = _plan(model, BUDGET_70B, **options)
    assert whole.valid and split.valid and split.main_device == 0
    assert not whole.placement.of_kind("sublayer") and not split_layers(whole.problem, whole.device_map)
    cut = split_layers(split.problem, split.device_map)
    assert cut
    layers = split.problem.splits
    assert len(layers) == 80 and whole.problem.splits == ()
    assert _attention_on(split, layers, 0) > _attention_on(whole, layers, 0) > 0
    assert split.costs["decode"].seconds < whole.costs["decode"].seconds
    assert main_bytes(split.verdict, 0) >= main_bytes(whole.verdict, 0)
    assert split.parts[0]["cache"] > whole.parts[0]["cache"]
    # the MLP of a split layer decodes where its weights live; its attention's cache stays on the GPU
    assert all(split.compute[f"{layer}.mlp"]["decode"] == "cpu" for layer in cut)
    said = split.placement.of_kind("sublayer")[0]
    assert said.reason == "faster" and said.facts["decode"] < said.facts["decode_whole"]
    assert said.facts["bytes"] >= said.facts["bytes_whole"]
    assert "layers split" in split.explain() and "attention" in split.explain()
    assert split.to_dict()["compute"][f"{cut[0]}.mlp"] == {"prefill": 0, "decode": "cpu"}


def test_llama_70b_at_512_tokens_says_why_it_splits_or_not():
    model = zoo.build("llama-70b")
    p = _plan(model, BUDGET_70B, runtime="allocator", dtype=torch.bfloat16,
              generation=allocator.GenerationBudget(1, 512))
    said = p.placement.of_kind("sublayer")
    assert p.valid and len(said) == 1
    f = said[0].facts
    assert f["reason"] in ("faster", "slower", "none-fits") and f["context"] == 512
    assert (f["reason"] == "faster") == bool(split_layers(p.problem, p.device_map))
    if f["reason"] != "none-fits":
        assert (f["decode"] < f["decode_whole"]) == (f["reason"] == "faster")
    assert any(line.strip().startswith("- ") and "whole-layer plan" in line for line in p.explain().splitlines())


def test_no_split_where_the_price_says_so():
    """A profile whose accelerator reads slower than RAM: moving attention onto it slows decoding, so layers stay
    whole and the plan says why."""
    slow = Profile(accelerator_memory=Profile().cpu_memory / 100)
    gen = allocator.GenerationBudget(1, 256)
    budget = {0: "9MiB", "cpu": "100MiB"}
    p = _plan(_tiny_llama(), budget, runtime="allocator", generation=gen, profile=slow)
    whole = _plan(_tiny_llama(), budget, runtime="allocator", generation=gen, profile=slow, split_layers=False)
    said = p.placement.of_kind("sublayer")
    assert said and said[0].reason == "slower"
    assert p.device_map == whole.device_map
    assert "layers kept whole" in p.explain()
    fast = _plan(_tiny_llama(), budget, runtime="allocator", generation=gen)
    assert fast.placement.of_kind("sublayer")[0].reason == "faster" and split_layers(fast.problem, fast.device_map)


@pytest.mark.parametrize("objective", ["contract", "latency"])
def test_finer_units_pack_under_either_objective(objective):
    gen = allocator.GenerationBudget(1, 256)
    budget = {0: "9MiB", "cpu": "100MiB"}
    options = dict(runtime="allocator", generation=gen, objective=objective)
    p = _plan(_tiny_llama(), budget, **options)
    whole = _plan(_tiny_llama(), budget, split_layers=False, **options)
    assert split_layers(p.problem, p.device_map) and p.valid
    assert p.costs["decode"].seconds < whole.costs["decode"].seconds
    assert main_bytes(p.verdict, 0) >= main_bytes(whole.verdict, 0)


def test_accelerate_runtime_plans_never_split():
    gen = allocator.GenerationBudget(1, 256)
    budget = {0: "9MiB", "cpu": "100MiB"}
    p = _plan(_tiny_llama(), budget, generation=gen)
    assert p.problem.splits == () and not p.placement.of_kind("sublayer")
    assert p.device_map == _plan(_tiny_llama(), budget, generation=gen, split_layers=False).device_map


@pytest.mark.slow
def test_qwen3_moe_keeps_attention_router_and_norms_on_the_gpu_in_every_layer():
    model = zoo.build("qwen3-moe-30b-a3b")
    p = _plan(model, {0: "16GiB", "cpu": "64GiB"}, runtime="allocator", dtype=torch.bfloat16,
              generation=allocator.GenerationBudget(1, 4096))
    assert p.valid and p.main_device == 0 and p.placement.experts and len(p.problem.splits) == 48
    for s in p.problem.splits:
        assert all(check_device(p.device_map, name) == 0 for name in s.near), s
        assert check_device(p.device_map, s.far) in ("cpu", "disk")
    assert p.costs["decode"].seconds <= p.costs["prefill"].seconds


def test_fit_finds_the_longest_context_with_attention_and_cache_on_the_accelerator():
    model = zoo.build("llama-3.2-1b")
    budget = {0: "2GiB", "cpu": "16GiB"}
    found = allocator.fit(model, budget, dtype=torch.bfloat16, runtime="allocator")
    plain = allocator.fit(model, budget, dtype=torch.bfloat16)
    assert found.max_length == plain.max_length and plain.split_map is None
    assert found.split_length > max(found.max_length, 2) and found.split_map is not None
    assert "every layer's attention" in found.summary()
    for length, fits in ((found.split_length, True), (found.split_length + 1, False)):
        problem = build_problem(model, budget, dtype=torch.bfloat16, runtime="allocator", prefetch=0,
                                generation=allocator.GenerationBudget(1, length))
        assert verdict(problem, Placement(split_map(problem), strategy="t")).valid is fits


def test_a_saved_split_plan_reads_back_valid_with_its_compute_map():
    gen = allocator.GenerationBudget(1, 256)
    p = _plan(_tiny_llama(), {0: "9MiB", "cpu": "100MiB"}, runtime="allocator", generation=gen)
    assert split_layers(p.problem, p.device_map)
    data = p.to_dict()
    assert data["options"]["split_layers"] is True
    assert any(d["kind"] == "sublayer" and d["facts"]["reason"] == "faster" for d in data["decisions"])
    back = allocator.Plan.from_dict(data, _tiny_llama())
    assert back.device_map == p.device_map and back.valid and back.compute == p.compute


@pytest.mark.parametrize("reason, words", [("faster", "layers split"), ("slower", "layers kept whole"),
                                           ("none-fits", "no attention side"), ("fewer-bytes", "fewer bytes")])
def test_each_sublayer_reason_is_said_with_its_numbers(reason, words):
    facts = {"decode_whole": 7.999, "prefill_whole": 42.18, "bytes_whole": 15 * 2**30, "tried": 31, "valid": 9,
             "context": 32768, "reason": reason, "decode": 7.995, "prefill": 42.25, "bytes": 16 * 2**30,
             "layers": 9, "demoted": 2, "moved": 7, "cache": 2**30, "cache_whole": 2**29}
    said = sentence(Decision("sublayer", devices=(0,), facts=facts))
    assert words in said and "7999.000 ms" in said and "15.00 GiB" in said, said
    assert not said.startswith("sublayer")   # said from its fields, not the plain fallback


def test_cli_fit_with_our_runtime_says_the_split_context(capsys):
    assert cli.main(["fit", "llama-3.2-1b", "--max-memory", "0=2GiB,cpu=16GiB", "--dtype", "bf16", "--runtime",
                     "allocator", "--json", "-", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    found = allocator.fit(zoo.build("llama-3.2-1b"), {0: "2GiB", "cpu": "16GiB"}, dtype=torch.bfloat16,
                          runtime="allocator")
    assert data["split_length"] == found.split_length > 0
    assert data["split_map"] == {k: v for k, v in found.split_map.items()}


@pytest.mark.slow
def test_moe_layers_left_offloaded_get_their_attention_router_and_shared_experts_back():
    """qwen2-moe-a2.7b on 5 GiB: the fill left whole layers in RAM; the split moves the near side of some (attention,
    norms, router, shared experts) onto GPU 0, the routed experts placed per expert as before, decoding faster."""
    model = zoo.build("qwen2-moe-a2.7b")
    options = dict(runtime="allocator", dtype=torch.bfloat16, generation=allocator.GenerationBudget(1, 4096))
    budget = {0: "5GiB", "cpu": "64GiB"}
    p = _plan(model, budget, **options)
    whole = _plan(model, budget, split_layers=False, **options)
    assert p.valid and p.placement.experts == whole.placement.experts

    def near_on_gpu(plan):
        return sum(all(check_device(plan.device_map, n) == 0 for n in s.near) for s in p.problem.splits)

    assert near_on_gpu(p) > near_on_gpu(whole)
    assert all(check_device(p.device_map, s.far) in ("cpu", "disk") for s in p.problem.splits)
    assert p.costs["decode"].seconds < whole.costs["decode"].seconds
    assert p.placement.of_kind("sublayer")[0].reason == "faster"
