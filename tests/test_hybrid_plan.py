"""Issue #40, the plan's side: where each offloaded unit computes per phase (``Plan.compute``), decided only for the
allocator runtime on an accelerator main device, carried as data, explained, and priced (estimates)."""

from __future__ import annotations

import pytest
import torch

import allocator
from allocator.cli.render import device_table
from allocator.evaluate.compute import decide, phase_tokens
from allocator.evaluate.validate import check

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow   # plans of a tiny llama with a generation budget: seconds each on 2 shared cores


def _meta_llama(layers: int = 6):
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


BUDGET = {0: "9MiB", "cpu": "100MiB"}
GEN = allocator.GenerationBudget(1, 256)


@pytest.fixture(scope="module")
def hybrid():
    return allocator.plan(_meta_llama(), BUDGET, runtime="allocator", generation=GEN)


def test_offloaded_units_get_a_device_per_phase(hybrid):
    assert hybrid.main_device == 0
    offloaded = {k for k, d in hybrid.device_map.items() if d in ("cpu", "disk")}
    assert offloaded and set(hybrid.compute) == offloaded
    assert all(set(v) == {"prefill", "decode"} and set(v.values()) <= {0, "cpu"} for v in hybrid.compute.values())
    assert any(v["decode"] == "cpu" for v in hybrid.compute.values())
    data = hybrid.to_dict()
    assert data["compute"] == hybrid.compute
    assert set(data["estimate"]["steps"]) == {"prefill", "decode"}
    assert hybrid.phase_steps["hybrid"]["decode"] < hybrid.phase_steps["stream"]["decode"]


def test_explain_and_cli_say_where_units_compute(hybrid):
    text = hybrid.explain()
    assert "compute on the CPU at decode" in text and "GB/s" in text
    assert "computes (decode)" in device_table(hybrid)


def test_cache_of_cpu_decoding_units_counted_in_ram(hybrid):
    moved = hybrid.hybrid.cache_moved
    assert moved > 0
    memory = check(hybrid.problem, hybrid.device_map)[1]   # the map's peaks before the compute plan moved the cache
    assert hybrid.peak["cpu"] == memory.peak["cpu"] + moved
    assert hybrid.peak[0] == memory.peak[0] - moved
    assert hybrid.peak["cpu"] == sum(hybrid.parts["cpu"].values())


@pytest.mark.parametrize("options", [dict(runtime="accelerate"), dict(runtime="allocator", budget={"cpu": "100MiB"})])
def test_nothing_changes_for_accelerate_or_a_cpu_main_device(options):
    budget = options.pop("budget", BUDGET)
    p = allocator.plan(_meta_llama(), budget, generation=GEN, **options)
    assert p.compute == {} and p.hybrid is None and p.to_dict()["compute"] is None
    assert "computes (decode)" not in device_table(p)
    assert decide(p.problem, p.device_map, p.main_device) is None


def test_phase_tokens_follow_the_generation_budget(hybrid):
    assert phase_tokens(hybrid.problem) == {"prefill": 255, "decode": 1}
    big = allocator.plan(_meta_llama(), BUDGET, runtime="allocator",
                         generation=allocator.GenerationBudget(4, 128, prompt_length=100))
    assert phase_tokens(big.problem) == {"prefill": 400, "decode": 4}
    assert big.hybrid.threshold == 4


def test_cpu_decoding_stops_where_ram_has_no_room_for_the_cache():
    """The KV cache of a unit decoding on the CPU lives in RAM: with RAM's budget half a cache short of what moving
    every such cache needs, some units decode on the main device instead and RAM's peak stays within its budget (the
    map is the same as with ample RAM). Whole layers (``split_layers=False``): a split plan is judged on its own
    RAM (tests/strategies/test_split.py)."""
    hybrid = allocator.plan(_meta_llama(), BUDGET, runtime="allocator", generation=GEN, split_layers=False)
    before = check(hybrid.problem, hybrid.device_map)[1].peak["cpu"]
    budget = before + hybrid.hybrid.cache_moved // 2
    tight = allocator.plan(_meta_llama(), {**BUDGET, "cpu": budget}, runtime="allocator", generation=GEN,
                           split_layers=False)
    assert tight.device_map == hybrid.device_map
    assert tight.valid and tight.peak["cpu"] <= budget, (tight.peak, budget)
    assert 0 < tight.hybrid.cache_moved <= budget - before
    decode = [v["decode"] for v in tight.compute.values()]
    assert "cpu" in decode and 0 in decode
    assert tight.peak[0] == hybrid.peak[0] + hybrid.hybrid.cache_moved - tight.hybrid.cache_moved
