"""The contract of ``device_map="auto"`` (allocator.judge.contract): the first accelerator that can hold anything
is the main device, accelerators are used in index order, never fewer bytes on them than accelerate's valid map; every
``max_memory`` accelerate accepts plans; accelerate's warnings and log lines where its tests look for them;
``objective="latency"`` lifts the contract; where no valid plan exists, accelerate's map comes back flagged."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import allocator
from allocator.model import zoo
from allocator.evaluate.tiers import accelerator_sequence
from allocator.judge.witness import contract_main
from allocator.evaluate.memory import map_runs

transformers = pytest.importorskip("transformers")

CONTRACT_STRATEGIES = ["auto", "backfill", "reserve", "ilp", "balanced"]


def tiny_llama(layers=8, tie=False):
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
                                      tie_word_embeddings=tie)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def size_of(model) -> int:
    return allocator.build_problem(model, {"cpu": 0}).graph.total


def in_index_order(plan) -> bool:
    seq = accelerator_sequence(plan.problem, map_runs(plan.problem.graph, plan.device_map))
    return all(a <= b for a, b in zip(seq, seq[1:]))


# -- rule 1: the main device ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", CONTRACT_STRATEGIES)
def test_a_small_model_runs_on_gpu_0_when_one_is_offered(strategy):
    """transformers' test_cpu_offload budget: the cost model estimates the CPU faster for a model this small, but
    users who offered GPU 0 send their inputs there."""
    model = tiny_llama()
    total = size_of(model)
    p = allocator.plan(model, {0: int(0.7 * total), "cpu": 2 * total}, strategy=strategy)
    assert p.valid and p.main_device == 0 and set(p.device_map.values()) == {0, "cpu"}, p.device_map
    assert not allocator.contract_violations(p.problem, p.device_map, exempt=p.placement.exempt)


def test_latency_objective_lets_the_estimate_choose_the_cpu():
    model = tiny_llama()
    total = size_of(model)
    budget = {0: int(0.7 * total), "cpu": 2 * total}
    contract = allocator.plan(model, budget)
    # the parameter-rule estimate (inputs=None; counted FLOPs put this model on the GPU): a small model on the CPU
    latency = allocator.plan(model, budget, objective="latency", inputs=None)
    assert latency.valid and latency.main_device == "cpu"          # the estimate alone decides
    assert latency.cost.seconds < contract.cost.seconds
    assert "objective latency" in latency.explain() and "objective contract" in contract.explain()
    assert "main device 0" in latency.explain()   # what the contract would have chosen, and the margin
    with pytest.raises(allocator.InvalidOption, match="objective"):
        allocator.plan(model, budget, objective="fastest")


@pytest.mark.parametrize("strategy", CONTRACT_STRATEGIES)
def test_a_model_that_fits_gpu_1_still_starts_on_gpu_0(strategy):
    """transformers' test_model_parallelism budget: the whole model on GPU 1 is cheaper on the estimate (no device
    change) but inputs sent to GPU 0 would meet a model without hooks on GPU 1."""
    model = tiny_llama()
    total = size_of(model)
    p = allocator.plan(model, {0: int(0.7 * total), 1: 2 * total, "cpu": 2 * total}, strategy=strategy)
    assert p.valid and p.main_device == 0 and set(p.device_map.values()) == {0, 1}, p.device_map


def test_a_first_gpu_too_small_to_be_main_is_left_empty_and_explained(caplog):
    model = tiny_llama()
    total = size_of(model)
    budget = {0: 1024, 1: int(0.6 * total), "cpu": 2 * total}
    with caplog.at_level(logging.INFO, logger="allocator"):
        p = allocator.plan(model, budget)
    assert p.valid and p.main_device == 1 and 0 not in p.device_map.values()
    assert contract_main(p.problem) == 1
    assert any("insufficient memory" in r.getMessage() and "- 0:" in r.getMessage() for r in caplog.records)
    notes = "\n".join(allocator.report.decisions.notes(p.placement))
    assert "accelerator 0" in notes and "it needs at least" in notes
    # the budget the note names does make GPU 0 the main device, 1 % less does not
    minimum = allocator.report.minimum.main_minimum(p.problem, 0)
    assert contract_main(allocator.report.minimum.with_budget(p.problem, 0, minimum)) == 0
    assert contract_main(allocator.report.minimum.with_budget(p.problem, 0, minimum - max(1, minimum // 100) - 1)) == 1


# -- rule 2: accelerators in index order ----------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", CONTRACT_STRATEGIES)
def test_accelerators_in_index_order_along_the_model(strategy):
    """The tiny llama on two 10 MiB GPUs (the issue's case: embeddings on GPU 1, the head on GPU 0 before) and
    llama-3.2-1b on four equal GPUs (embeddings on GPU 3 before)."""
    for model, budget in [(tiny_llama(layers=16), {0: 10 * 2**20, 1: 10 * 2**20, "cpu": 64 * 2**20}),
                          (zoo.build("llama-3.2-1b"), None)]:
        if budget is None:
            total = size_of(model)
            budget = {**{d: int(0.3 * total) for d in range(4)}, "cpu": 2 * total}   # embeddings: 22 %
        p = allocator.plan(model, budget, strategy=strategy)
        assert p.valid and p.main_device == 0 and in_index_order(p), p.device_map
        embed = next(d for k, d in p.device_map.items() if "embed" in k or k == "")
        assert embed in (0, "cpu", "disk")


def test_a_tied_head_sits_with_its_embeddings_and_counts_there():
    model = zoo.build("llama-3.2-1b")   # tie_word_embeddings: lm_head shares the embedding matrix
    total = size_of(model)
    p = allocator.plan(model, {0: int(0.4 * total), 1: int(0.4 * total), "cpu": 2 * total})
    assert p.device_map.get("lm_head") == p.device_map.get("model.embed_tokens", p.device_map.get("model"))
    assert not allocator.contract_violations(p.problem, p.device_map)


def test_going_back_to_an_earlier_gpu_is_a_contract_violation_unless_latency():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    budget = {0: 40_000, 1: 40_000, "cpu": 10**6}

    def backwards(problem):
        return allocator.Placement({"0": 1, "1": 1, "2": 0, "3": 0}, "backwards")

    with pytest.raises(allocator.BrokenContract, match="index order"):
        allocator.plan(model, budget, strategy=backwards)
    assert allocator.plan(model, budget, strategy=backwards, objective="latency").valid


# -- rule 3: never below accelerate ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["segformer-b0", "convnext-tiny", "t5-base", "gpt2", "bert-base", "whisper-small"])
def test_never_fewer_accelerator_bytes_than_a_valid_accelerate_map(name):
    model = zoo.build(name)
    total = size_of(model)
    for budget in ({0: int(0.3 * total), "cpu": 2 * total}, {0: int(0.6 * total), "cpu": 2 * total},
                   {0: int(0.3 * total), 1: int(0.3 * total), "cpu": 2 * total}, {"cpu": int(0.5 * total)}):
        theirs = allocator.plan(model, budget, strategy="sequential")
        for strategy in CONTRACT_STRATEGIES:
            ours = allocator.plan(model, budget, strategy=strategy)
            assert ours.valid and not allocator.contract_violations(ours.problem, ours.device_map,
                                                                    exempt=ours.placement.exempt)
            if theirs.valid:
                assert ours.cost.resident_fast >= theirs.cost.resident_fast, (name, budget, strategy)


def test_segformer_model_keeps_a_third_on_one_gpu_at_60_percent():
    """The seed case: transformers' SegformerModel (it declares SegformerStage no-split), one GPU at 60 %: every
    strategy ran it all on the CPU before the contract."""
    config = zoo.build("segformer-b0").config  # the checkpoint's config, for the bare encoder-decoder model
    with torch.device("meta"):
        model = transformers.SegformerModel(config)
    total = size_of(model)
    budget = {0: int(0.6 * total), "cpu": 2 * total}
    for strategy in CONTRACT_STRATEGIES:
        p = allocator.plan(model, budget, strategy=strategy)
        assert p.valid and p.main_device == 0
        assert p.resident(0) >= 0.35 * total, (strategy, p.resident(0) / total)


# -- rule 4: every max_memory accelerate accepts --------------------------------------------------------------------

@pytest.mark.parametrize("strategy", CONTRACT_STRATEGIES + ["sequential", "balanced_low_0"])
def test_every_max_memory_accelerate_accepts(strategy):
    model = tiny_llama()
    total = size_of(model)
    for budget in ({0: 100 * 2**20}, {0: total // 2, 1: total // 2}, {0: total // 2, "disk": 10 * total},
                   {"disk": 10 * total}, {0: total // 3}):
        p = allocator.plan(model, budget, strategy=strategy)
        assert p.valid, (budget, p.violations)
        assert "cpu" not in p.device_map.values(), (budget, p.device_map)   # no RAM budget: nothing resident there
        if strategy != "balanced_low_0" and any(isinstance(d, int) for d in budget) and budget.get(0, 0) > total:
            assert p.main_device == 0


def test_nothing_may_be_offloaded_says_the_minimum_accelerator_budget():
    model = tiny_llama()
    total = size_of(model)
    budget = {0: total // 3, "disk": 0}   # no RAM, no disk: everything must fit GPU 0
    with pytest.raises(allocator.InfeasiblePlacement, match="no 'cpu' budget") as info:
        allocator.plan(model, budget, strict=True)
    assert info.value.device == 0 and info.value.minimum >= total
    assert allocator.plan(model, {**budget, 0: info.value.minimum}, strict=True).valid


@pytest.mark.subprocess
def test_cli_plans_a_budget_without_cpu():
    out = subprocess.run([sys.executable, "-m", "allocator", "plan", "t5-base", "--max-memory", "0=100MiB"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr


# -- where no valid plan exists -------------------------------------------------------------------------------------

def test_no_valid_plan_returns_accelerates_map_flagged_or_raises_when_strict():
    config = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37)
    with torch.device("meta"):
        model = transformers.BertModel(config)
    total = size_of(model)
    budget = {0: total // 2, "cpu": total // 2}   # transformers' test_disk_offload_bin: embeddings are 60 %
    with pytest.warns(UserWarning, match="No valid plan exists"):
        p = allocator.plan(model, budget)
    assert not p.valid and p.strategy.startswith("sequential") and "disk" in p.device_map.values()
    assert p.device_map == allocator.plan(model, budget, strategy="sequential").device_map
    with pytest.raises(allocator.InfeasiblePlacement) as info:
        allocator.plan(model, budget, strict=True)
    assert info.value.minimum > total // 2


# -- accelerate's warnings and log lines ----------------------------------------------------------------------------

class ThreeLayers(nn.Module):
    """linear1 64 B, batchnorm 72 B, linear2 100 B of parameters, as in accelerate's tests' model."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)


def with_buffers(extra_layer=False):
    model = ThreeLayers()
    model.linear1.register_buffer("b1", torch.zeros(10, 2))
    model.batchnorm.register_buffer("b2", torch.zeros(10, 3))
    model.linear2.register_buffer("b3", torch.zeros(10, 3))
    if extra_layer:
        model.linear3 = nn.Linear(4, 5)
        model.linear3.register_buffer("b4", torch.zeros(10, 2))
    return model


def caught(fn):
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        result = fn()
    return result, [w for w in found if "bytes of buffer for offloaded layers" in str(w.message)]


@pytest.mark.parametrize("call", ["plan", "adapter"])
def test_sequential_warns_when_offloaded_buffers_fit_no_gpu(call):
    def run(model, budget, **kw):
        if call == "plan":
            return allocator.plan(model, budget, strategy="sequential", **kw).device_map
        return allocator.infer_auto_device_map(model, budget, strategy="sequential", **kw)

    model = with_buffers()
    device_map, found = caught(lambda: run(model, {0: 400, "cpu": "1GB"}))
    assert device_map == {"linear1": 0, "batchnorm": "cpu", "linear2": "cpu"}
    assert len(found) == 1 and issubclass(found[0].category, UserWarning)
    assert "Current model requires 280 bytes of buffer" in str(found[0].message)
    assert "offload_buffers=True" in str(found[0].message)
    _, found = caught(lambda: run(model, {0: 400, "cpu": "1GB"}, offload_buffers=True))
    assert not found
    model = with_buffers(extra_layer=True)
    device_map, found = caught(lambda: run(model, {0: 400, 1: 400, "cpu": "1GB"}))   # GPU 1 holds them
    assert device_map == {"linear1": 0, "batchnorm": 1, "linear2": "cpu", "linear3": "cpu"} and not found
    _, found = caught(lambda: run(model, {0: 400, 1: 200, "cpu": "1GB"}))
    assert len(found) == 1
    _, found = caught(lambda: run(model, {0: 400, 1: 200, "cpu": "1GB"}, offload_buffers=True))
    assert not found


def nested():
    inner = nn.Sequential(OrderedDict([("linear1", nn.Linear(10, 4)), ("linear2", nn.Linear(4, 4)),
                                       ("linear3", nn.Linear(4, 8))]))
    return nn.Sequential(OrderedDict([("module", inner)]))


def test_sequential_logs_devices_left_empty_for_want_of_memory(caplog):
    with caplog.at_level(logging.INFO):
        device_map = allocator.infer_auto_device_map(nested(), {0: 256}, strategy="sequential")
    assert all(d != 0 for d in device_map.values())
    lines = [r.getMessage() for r in caplog.records if "insufficient memory" in r.getMessage()]
    assert len(lines) == 1 and "  - 0: " in lines[0] and "bytes required" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        device_map = allocator.infer_auto_device_map(nested(), {0: 256}, strategy="sequential",
                                                     fallback_allocation=True)
    assert device_map == {"module.linear1": "disk", "module.linear2": 0, "module.linear3": "disk"}
    assert not [r for r in caplog.records if "insufficient memory" in r.getMessage()]


def test_the_default_uses_gpu_0_where_accelerate_leaves_it_empty(caplog):
    """accelerate reserves its largest layer (176 B) on GPU 0 and leaves 80 B, less than the first layer; streaming
    what is offloaded needs no more than 176 B, so linear2 stays on GPU 0 and nothing is logged as empty."""
    with caplog.at_level(logging.INFO):
        device_map = allocator.infer_auto_device_map(nested(), {0: 256})
    assert 0 in device_map.values()
    assert not [r for r in caplog.records if "insufficient memory" in r.getMessage()]


def test_auto_does_not_repeat_accelerates_diagnostics_for_a_map_it_did_not_return():
    model = with_buffers()
    _, found = caught(lambda: allocator.plan(model, {0: 400, "cpu": "1GB"}))
    assert not found   # auto's plan keeps the buffers of offloaded modules within GPU 0's budget


def test_results_answer_to_the_callers_spelling_of_devices():
    model = tiny_llama()
    total = size_of(model)
    p = allocator.plan(model, {"cuda:0": int(0.7 * total), "cpu": 2 * total})
    assert p.main_device == 0 and p.resident("cuda:0") == p.resident(0) > 0
    assert p.peak.get("cuda:0") == p.peak[0] == p.peak[torch.device("cuda", 0)] and "cuda:0" in p.peak
    assert p.parts["cuda:0"] == p.parts[0] and p.peak.get("cuda:7") is None
