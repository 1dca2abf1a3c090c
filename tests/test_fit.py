"""``allocator.fit`` and ``allocator fit``: the longest context (or largest batch) with the whole model on the
accelerators, exact (the plan for N keeps everything there, the plans for N + 1 and 1.1 N do not), on a decoder-only
model, encoder-decoder models and a VLM; then the plan for a longer target."""

from __future__ import annotations

import json
import math

import pytest
import torch

import allocator
from allocator import cli
from allocator.fit import MAX_TOKENS, TERMS
from allocator.model import zoo

OFFLOADED = {"cpu", "disk"}


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = zoo.build(name)
        return cache[name]

    return get


def weights(model, dtype) -> int:
    return allocator.build_problem(model, {"cpu": 0}, dtype=dtype).graph.total


def devices(model, budget, batch, length, dtype):
    p = allocator.plan(model, budget, dtype=dtype, generation=allocator.GenerationBudget(batch, length))
    return set(p.device_map.values())


@pytest.mark.parametrize("name, dtype, share", [
    ("qwen2-0.5b", "bfloat16", 1.6),     # decoder-only
    ("t5-base", "float32", 1.3),         # encoder-decoder (the encoder's input is the prompt)
    ("whisper-small", "float16", 1.4),   # encoder-decoder, audio
    ("qwen2-vl-2b", "bfloat16", 1.3),    # a VLM: the cache is the language model's
])
def test_the_plan_for_n_stays_on_the_accelerator_and_beyond_does_not(built, name, dtype, share):
    model = built(name)
    budget = {0: int(share * weights(model, dtype)), "cpu": "64GiB"}
    found = allocator.fit(model, budget, dtype=dtype)
    n = found.max_length
    assert n > 2 and found.device == 0 and found.term in TERMS
    assert set(found.plan.device_map.values()) == {0}
    assert found.plan.problem.generation.budget.max_length == n
    assert devices(model, budget, 1, n, dtype) == {0}
    assert devices(model, budget, 1, n + 1, dtype) & OFFLOADED     # exact: one token more offloads
    assert devices(model, budget, 1, math.ceil(1.1 * n), dtype) & OFFLOADED
    assert found.tries <= 2 + math.ceil(math.log2(MAX_TOKENS))


def test_the_answer_of_the_issue_llama_8b_on_24_gib(built):
    model = built("llama-8b")
    found = allocator.fit(model, {0: "24GiB"}, dtype="bfloat16")
    budget = {0: "24GiB", "cpu": "64GiB"}
    assert devices(model, budget, 1, found.max_length, "bfloat16") == {0}
    assert devices(model, budget, 1, math.ceil(1.1 * found.max_length), "bfloat16") & OFFLOADED
    assert found.positions == ("max_position_embeddings", 8192) and "positions end at 8,192" in found.summary()
    capped = allocator.fit(model, {0: "24GiB"}, dtype="bfloat16", limit_positions=True)
    assert (capped.max_length, capped.term, capped.device) == (8192, "positions", None)


def test_batch_margin_two_accelerators_and_target(built):
    model = built("qwen2-0.5b")
    size = weights(model, "bfloat16")
    budget = {0: int(1.5 * size), "cpu": "64GiB"}
    batch = allocator.fit(model, budget, dtype="bfloat16", max_length=2048)
    b = batch.batch_size
    assert batch.searched == "batch_size" and batch.max_length == 2048 and b >= 1
    assert devices(model, budget, b, 2048, "bfloat16") == {0}
    assert devices(model, budget, b + 1, 2048, "bfloat16") & OFFLOADED
    plain = allocator.fit(model, budget, dtype="bfloat16")
    kept = allocator.fit(model, budget, dtype="bfloat16", margin=0.1)
    assert kept.max_length < plain.max_length
    assert max(kept.plan.peak.values()) <= 0.9 * budget[0]
    two = {0: int(0.7 * size), 1: int(0.7 * size), "cpu": "64GiB"}
    split = allocator.fit(model, two, dtype="bfloat16")
    assert set(split.plan.device_map.values()) == {0, 1}
    assert devices(model, two, 1, split.max_length + 1, "bfloat16") & OFFLOADED
    longer = allocator.fit(model, budget, dtype="bfloat16", target=2 * plain.max_length)
    assert longer.longer.problem.generation.budget.max_length == 2 * plain.max_length
    assert set(longer.longer.device_map.values()) & OFFLOADED
    assert "of weights offloaded" in longer.summary()


def test_nothing_fits_says_so(built):
    model = built("qwen2-0.5b")
    budget = {0: "100MiB", "cpu": "8GiB"}
    before = dict(budget)
    found = allocator.fit(model, budget, dtype="bfloat16", target=1024)
    assert budget == before  # never modified
    assert (found.max_length, found.plan, found.term) == (0, None, "weights")
    assert "not even 2 tokens fit" in found.reason and found.longer is not None


@pytest.mark.parametrize("keywords, words", [
    (dict(margin=1.0), "margin must be"),
    (dict(batch_size=0), "batch_size must be"),
    (dict(target=1), "target must be"),
    (dict(generation=allocator.GenerationBudget(1, 10)), "fit chooses the generation budget"),
    (dict(max_memory={"cpu": "8GiB"}), "names none"),
])
def test_bad_input_is_a_typed_error(built, keywords, words):
    model = built("qwen2-0.5b")
    keywords = {"max_memory": {0: "8GiB"}, **keywords}
    with pytest.raises(allocator.InvalidOption, match=words):
        allocator.fit(model, **keywords)


def test_cli_fit(capsys, built):
    code = cli.main(["fit", "qwen2-0.5b", "--max-memory", "0=2GiB,cpu=8GiB", "--target", "200000", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    found = allocator.fit(built("qwen2-0.5b"), {0: "2GiB", "cpu": "8GiB"}, dtype="bfloat16", target=200000)
    assert f"fits: {found.max_length:,} tokens (max_length) at batch 1" in out
    assert f"bound: {found.reason}" in out and "plan for --target 200,000:" in out
    code = cli.main(["fit", "qwen2-0.5b", "--max-memory", "0=2GiB", "--batch", "--context", "4096", "--json", "-"])
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert code == 0 and data["searched"] == "batch_size" and data["max_length"] == 4096
    assert set(data["plan"]["device_map"].values()) == {0}


@pytest.mark.parametrize("argv, words", [
    (["--batch"], "add --context"),
    (["--context", "100"], "without --batch"),
    (["--margin", "2"], "in [0, 1)"),
    (["--batch-size", "x"], "invalid int value"),
    (["--json", "/no/such/folder/fit.json"], "does not exist"),
])
def test_cli_fit_bad_input_is_one_line(capsys, argv, words):
    code = cli.main(["fit", "qwen2-0.5b", "--max-memory", "0=2GiB", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and words in err, err


def test_a_generation_budget_too_large_says_how_many_tokens_fit(capsys, built):
    code = cli.main(["plan", "qwen2-0.5b", "--max-memory", "0=2GiB,cpu=4GiB", "--generation", "1,2000000"])
    out, err = capsys.readouterr()
    found = allocator.fit(built("qwen2-0.5b"), {0: "2GiB", "cpu": "4GiB"}, dtype="bfloat16")
    assert code == 2 and out == "" and err.count("allocator: error:") == 1
    assert f"at most {found.max_length:,} tokens fit at batch 1 (--generation 1,{found.max_length})" in err


def _llama_with(attention: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=100, max_position_embeddings=100_000)
    config._attn_implementation = attention
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def test_fit_states_and_computes_for_the_attention_implementation():
    """Issue 37: eager attention materialises the scores (batch x heads x tokens x tokens, two copies at once) and a
    float mask, sdpa neither for one sequence (issue 48, measured in tests/model/test_prefill_memory.py): eager fits a
    shorter context on the same budget, sdpa's activations grow linearly, eager's by those squares, and the answer
    says which implementation it assumed."""
    from allocator.model.generation import generation_needs

    sdpa, eager = _llama_with("sdpa"), _llama_with("eager")
    found = {name: allocator.fit(m, {0: "4MiB"}) for name, m in (("sdpa", sdpa), ("eager", eager))}
    assert 0 < found["eager"].max_length < found["sdpa"].max_length
    assert "attention eager" in found["eager"].summary() and "attention sdpa" in found["sdpa"].summary()
    graph = allocator.build_problem(sdpa, {"cpu": 0}).graph

    def activations(model, tokens):
        return generation_needs(model, graph, allocator.GenerationBudget(1, tokens + 1)).activations

    T, heads, dtype_bytes = 256, 4, 4
    assert activations(sdpa, 2 * T) == 2 * activations(sdpa, T)   # no tokens x tokens term
    squares = T * T * dtype_bytes + heads * T * T * 2 * dtype_bytes  # the float mask, two float32 copies of the scores
    assert 0 < activations(eager, T) - squares < activations(sdpa, T)
