"""Generation budgets: the KV cache, logits and activations of ``generate``, against transformers on CPU.

- The predicted cache bytes of every layer equal the storage of the ``DynamicCache`` that ``generate`` really fills:
  a GQA llama, T5 (self- and cross-attention: ``EncoderDecoderCache``), and sliding-window models (Mistral, and a
  Gemma3 mixing sliding and full layers, whose sliding layers hold the whole prompt right after the prefill).
- What ``generate`` allocates on CPU at its peak (every allocation, traced by the torch profiler) is within the
  predicted cache + logits + activations, and not far below it.
- Plans with a generation budget keep every device's peak (weights + cache + logits + activations) within its budget,
  for every strategy but ``sequential`` (accelerate's algorithm, unchanged: the validator flags its map), while the
  plan made without the budget overflows it.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import allocator  # noqa: E402
from allocator import GenerationBudget, InvalidOption  # noqa: E402
from allocator.evaluate.units import groups  # noqa: E402
from allocator.model.cache_kwarg import output_cache  # noqa: E402
from allocator.evaluate.validate import check, peak_parts  # noqa: E402

# where no valid plan exists, raise (plan's default returns accelerate's own map, flagged)
strict_plan = functools.partial(allocator.plan, strict=True)

BATCH, PROMPT, NEW = 2, 7, 6


def _llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        vocab_size=1000, max_position_embeddings=512, tie_word_embeddings=False, **extra))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3, num_heads=4, vocab_size=1000,
        decoder_start_token_id=0))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=1000, sliding_window=4))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        intermediate_size=128, vocab_size=1000, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]))


def _generate(model, new_tokens: int, prompt: int = PROMPT, batch: int = BATCH):
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (batch, prompt))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True)
    return out


def _storage(layer) -> int:
    """Bytes a cache layer really holds: a sliding layer keeps a view of a larger tensor, so count storages."""
    return layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()


def _measured_layers(cache) -> dict:
    """(kind, layer index) -> bytes held, for a DynamicCache or an EncoderDecoderCache."""
    if hasattr(cache, "self_attention_cache"):
        out = {("self", i): _storage(l) for i, l in enumerate(cache.self_attention_cache.layers)}
        out.update({("cross", i): _storage(l) for i, l in enumerate(cache.cross_attention_cache.layers)})
        return out
    return {("self", i): _storage(l) for i, l in enumerate(cache.layers)}


def _predicted_layers(model, budget) -> dict:
    needs = allocator.build_problem(model, {"cpu": 10**9}, generation=budget).generation
    return {("cross" if layer.kind == "cross" else "self", layer.index): layer.nbytes for layer in needs.layers}


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {name: make().eval() for name, make in
            (("llama", _llama), ("t5", _t5), ("mistral", _mistral), ("gemma3", _gemma3))}


def test_llama_cache_bytes_equal_dynamic_cache(models):
    model = models["llama"]
    cache = output_cache(_generate(model, NEW))
    assert type(cache).__name__ == "DynamicCache"
    measured = _measured_layers(cache)
    predicted = _predicted_layers(model, GenerationBudget(BATCH, PROMPT + NEW))
    assert predicted == measured
    # 4 layers x (K + V) x batch 2 x 12 tokens x 2 kv heads x 16 dims x 4 bytes
    assert sum(predicted.values()) == 4 * 2 * 2 * (PROMPT + NEW - 1) * 2 * 16 * 4 == 24576


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=64))


def _falcon():
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          multi_query=True, new_decoder_architecture=False, vocab_size=1000))


@pytest.mark.parametrize("make", [_gpt2, _falcon], ids=["gpt2", "falcon-multi-query"])
def test_fused_projection_cache_bytes_equal_dynamic_cache(make):
    """Keys and values from one fused projection: the width comes from the module's heads (Falcon: one kv head)."""
    torch.manual_seed(0)
    model = make().eval()
    measured = _measured_layers(output_cache(_generate(model, NEW)))
    assert _predicted_layers(model, GenerationBudget(BATCH, PROMPT + NEW)) == measured


def test_t5_self_and_cross_cache_bytes_equal_encoder_decoder_cache(models):
    model = models["t5"]
    out = _generate(model, NEW)
    assert type(output_cache(out)).__name__ == "EncoderDecoderCache"
    assert out.sequences.shape[1] == NEW + 1  # the decoder's start token, then the new tokens
    measured = _measured_layers(output_cache(out))
    predicted = _predicted_layers(model, GenerationBudget(BATCH, NEW + 1, prompt_length=PROMPT))
    assert predicted == measured
    assert {k for k in measured if k[0] == "cross"} == {("cross", i) for i in range(3)}


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_sliding_window_cache_bytes_equal_dynamic_cache_at_its_peak(models, name):
    """A sliding layer holds the whole prompt after the prefill and ``window`` tokens later: the prediction is the
    larger, per layer; full layers of the same model hold ``max_length - 1`` tokens."""
    model = models[name]
    after_prefill = _measured_layers(output_cache(_generate(model, 1)))
    at_end = _measured_layers(output_cache(_generate(model, NEW)))
    measured = {k: max(after_prefill[k], at_end[k]) for k in at_end}
    predicted = _predicted_layers(model, GenerationBudget(BATCH, PROMPT + NEW, prompt_length=PROMPT))
    assert predicted == measured
    kinds = {layer.kind for layer in allocator.build_problem(
        model, {"cpu": 10**9}, generation=GenerationBudget(BATCH, PROMPT + NEW)).generation.layers}
    assert kinds == ({"sliding"} if name == "mistral" else {"sliding", "full"})
    assert after_prefill != at_end  # the window really trims the cache after the prefill


def _generate_peak(model, budget_args, prompt, new, batch):
    """Bytes ``generate`` allocates at once on CPU (every allocation the torch profiler sees), and the prediction."""
    from prefill_memory import profiled_peak

    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (batch, prompt))
    with torch.no_grad():
        peak = profiled_peak(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                    pad_token_id=0))
    problem = allocator.build_problem(model, {"cpu": 10**9}, generation=GenerationBudget(*budget_args,
                                                                                         prompt_length=prompt))
    plan_peak = check(problem, {"": "cpu"})[1]
    return peak, plan_peak.generation["cpu"]


@pytest.mark.parametrize("name, batch, prompt", [("llama", 2, 200), ("llama", 8, 20), ("t5", 2, 100)])
def test_generate_allocations_within_predicted_cache_logits_and_activations(models, name, batch, prompt):
    model = models[name]
    new = 4
    length = new + 1 if name == "t5" else prompt + new
    measured, predicted = _generate_peak(model, (batch, length), prompt, new, batch)
    # Measured on this machine (2026-12-06, transformers 5.25): llama 2.11 MB vs 2.22 MB predicted, 0.84 vs 1.00; t5
    # 0.75 vs 1.40 (T5's position bias is counted as eager scores in float32, more than it allocates).
    assert measured <= predicted <= 2.5 * measured, (measured, predicted)


@pytest.fixture(scope="module")
def meta_llama():
    with torch.device("meta"):
        return _llama()


BUDGET = GenerationBudget(4, 256)


def _budgets(meta):
    """Either GPU holds the weights with room to spare, neither the weights with the cache and activations of BUDGET
    too; the two together hold everything."""
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    g = allocator.build_problem(meta, {"cpu": 10**12}, generation=BUDGET).graph
    gen = check(allocator.build_problem(meta, {"cpu": 10**12}, generation=BUDGET), {"": "cpu"})[1].generation["cpu"]
    cache = gen - g.workspace - g.main_workspace
    each = g.workspace + g.main_workspace + (total + cache) * 6 // 10
    return {0: each, 1: each, "cpu": 10 * total}, total, gen


@pytest.mark.parametrize("strategy", ["auto", "backfill", "reserve", "ilp"])
def test_plan_with_generation_keeps_every_peak_within_budget(meta_llama, strategy):
    budgets, total, gen = _budgets(meta_llama)
    # backfill's static reserve admits no plan with GPU 0 as main here: its fill is checked without the contract
    objective = "latency" if strategy == "backfill" else "contract"
    p = allocator.plan(meta_llama, dict(budgets), strategy=strategy, generation=BUDGET, objective=objective)
    assert p.valid, p.explain()
    for device, peak in p.peak.items():
        assert peak <= budgets.get(device, peak), (device, peak, budgets.get(device), p.device_map)
        assert device != "disk" or peak == 0, p.device_map
        parts = p.parts[device]
        assert sum(parts.values()) == peak
    executing = [d for d in p.peak if d not in ("cpu", "disk") or d == p.main_device]
    if strategy in ("auto", "ilp"):  # neither GPU can run it alone: both do (first-fit's split costs 3 device
        assert set(executing) == {0, 1}, p.device_map  # changes and is estimated slower than the CPU alone)
    assert all(p.parts[d]["activations"] == p.problem.graph.workspace > 0 for d in executing)
    assert sum(p.parts[d]["cache"] for d in p.parts) == p.problem.generation.cache_bytes
    # Without the generation budget the same budgets give a plan whose main device overflows during generate.
    without = allocator.plan(meta_llama, dict(budgets), strategy=strategy, objective=objective)
    violations, memory = check(p.problem, without.device_map)
    assert [v.kind for v in violations] == ["budget"] and "is for generate" in violations[0].message
    main = without.main_device
    assert memory.peak[main] > budgets[main] >= without.peak[main]


def test_sequential_stays_accelerates_algorithm_and_is_flagged(meta_llama):
    budgets, _, _ = _budgets(meta_llama)
    with_gen = allocator.plan(meta_llama, dict(budgets), strategy="sequential", generation=BUDGET)
    plain = allocator.plan(meta_llama, dict(budgets), strategy="sequential")
    assert with_gen.device_map == plain.device_map
    assert not with_gen.valid and {v.kind for v in with_gen.violations} == {"budget"}


def test_cache_of_an_offloaded_layer_lives_on_the_main_device(meta_llama):
    problem = allocator.build_problem(meta_llama, {0: 10**9, 1: 10**9, "cpu": 10**9}, generation=BUDGET)
    per_layer = {layer.module: layer.nbytes for layer in problem.generation.layers}
    device_map = {"model.embed_tokens": 0, "model.layers.0": "cpu", "model.layers.1": 0, "model.layers.2": 1,
                  "model.layers.3": "disk", "model.norm": 1, "model.rotary_emb": 1, "lm_head": 1}
    violations, memory = check(problem, device_map)
    assert not violations
    parts = peak_parts(problem, device_map, memory)
    layer = "model.layers.{}.self_attn"
    assert parts[0]["cache"] == sum(per_layer[layer.format(i)] for i in (0, 1, 3))  # offloaded layers run on 0
    assert parts[1]["cache"] == per_layer[layer.format(2)]
    assert parts["cpu"]["cache"] == parts["cpu"]["activations"] == 0  # RAM only holds offloaded weights
    g = problem.graph
    assert parts[1]["logits"] == BUDGET.batch_size * 1000 * 4  # lm_head runs on 1: one position, float32
    assert parts[0]["logits"] == g.main_workspace == 3 * BUDGET.batch_size * 1000 * 4  # scores on the main device
    assert parts[0]["activations"] == parts[1]["activations"] == g.workspace


def test_explain_shows_cache_logits_and_activations(meta_llama):
    p = allocator.plan(meta_llama, {0: 10**8, "cpu": 10**8}, generation=BUDGET)
    text = p.explain()
    assert "= weights" in text and "cache 1020.00 KiB" in text  # 4 layers x 2 x 4 x 255 x 32 x 4 bytes
    assert "cache" not in allocator.plan(meta_llama, {0: 10**8, "cpu": 10**8}).explain()


def test_half_precision_dtype_halves_the_cache(meta_llama):
    full = allocator.build_problem(meta_llama, {"cpu": 1}, generation=BUDGET).generation.cache_bytes
    half = allocator.build_problem(meta_llama, {"cpu": 1}, dtype="float16", generation=BUDGET).generation.cache_bytes
    explicit = allocator.build_problem(meta_llama, {"cpu": 1}, generation=GenerationBudget(4, 256, torch.bfloat16))
    assert half * 2 == full == explicit.generation.cache_bytes * 2


@pytest.mark.parametrize("args, kwargs, words", [
    ((0, 10), {}, "batch_size must be a positive int"),
    ((True, 10), {}, "batch_size must be a positive int"),
    ((1, 2.5), {}, "max_length must be a positive int"),
    ((1, 1), {}, "at least 2"),
    ((1, 10), {"prompt_length": 0}, "prompt_length must be a positive int"),
    ((1, 10, "floaty"), {}, "not a torch dtype"),
])
def test_bad_generation_budget_raises_typed_error(args, kwargs, words):
    with pytest.raises(InvalidOption, match=words):
        GenerationBudget(*args, **kwargs)


def test_generation_errors_say_the_fix(meta_llama):
    with pytest.raises(InvalidOption, match="prompt_length <= 9"):
        allocator.plan(meta_llama, {"cpu": 10**9}, generation=GenerationBudget(1, 10, prompt_length=10))
    with pytest.raises(InvalidOption, match="allocator.GenerationBudget"):
        allocator.plan(meta_llama, {"cpu": 10**9}, generation=(1, 10))
    with pytest.raises(InvalidOption, match="transformers config"):
        allocator.plan(torch.nn.Linear(4, 4), {"cpu": 10**9}, generation=GenerationBudget(1, 10))
    from transformers import BertConfig, BertForMaskedLM, MambaConfig, MambaForCausalLM, ViTConfig, ViTModel

    with torch.device("meta"):
        bert = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=100))
        mamba = MambaForCausalLM(MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=100))
    with pytest.raises(InvalidOption, match="cannot generate"):
        allocator.plan(bert, {"cpu": 10**9}, generation=GenerationBudget(1, 10))
    with pytest.raises(InvalidOption, match="no attention module with a layer_idx"):  # a state-space cache
        allocator.plan(mamba, {"cpu": 10**9}, generation=GenerationBudget(1, 10))

    with torch.device("meta"):
        vit = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(InvalidOption, match="without generation="):
        allocator.plan(vit, {"cpu": 10**9}, generation=GenerationBudget(1, 10))


def test_max_new_tokens_as_generate_takes_it(models, meta_llama):
    budget = GenerationBudget(BATCH, prompt_length=PROMPT, max_new_tokens=NEW)
    assert budget.max_length == PROMPT + NEW
    assert budget == GenerationBudget(BATCH, PROMPT + NEW, prompt_length=PROMPT, max_new_tokens=NEW)  # agreeing
    same = GenerationBudget(BATCH, PROMPT + NEW, prompt_length=PROMPT)
    assert _predicted_layers(models["llama"], budget) == _predicted_layers(models["llama"], same)
    # encoder-decoder: the decoder holds its start token and the new tokens; the prompt is the encoder's input
    t5 = _predicted_layers(models["t5"], budget)
    assert t5 == _predicted_layers(models["t5"], GenerationBudget(BATCH, NEW + 1, prompt_length=PROMPT))
    out = _generate(models["t5"], NEW)
    assert t5 == _measured_layers(output_cache(out))


@pytest.mark.parametrize("kwargs, words", [
    ({"max_new_tokens": 6}, "needs prompt_length"),
    ({"max_length": 20, "prompt_length": 7, "max_new_tokens": 6}, "prompt_length 7 \\+ max_new_tokens 6 = 13"),
    ({"prompt_length": 7, "max_new_tokens": 0}, "max_new_tokens must be a positive int"),
    ({"prompt_length": 0, "max_new_tokens": 6}, "prompt_length must be a positive int"),
    ({}, "needs max_length, or max_new_tokens with prompt_length"),
])
def test_max_new_tokens_errors_say_the_fix(kwargs, words):
    with pytest.raises(InvalidOption, match=words):
        GenerationBudget(2, **kwargs)


def test_max_length_beyond_the_position_embeddings_warns_when_planning(meta_llama):
    assert meta_llama.config.max_position_embeddings == 512
    with pytest.warns(UserWarning, match="max_length 600 is above LlamaConfig.max_position_embeddings 512") as caught:
        allocator.plan(meta_llama, {"cpu": "1GiB"}, generation=GenerationBudget(1, prompt_length=100,
                                                                                max_new_tokens=500))
    assert caught[0].filename == __file__  # the line that asked for the plan
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        allocator.plan(meta_llama, {"cpu": "1GiB"}, generation=GenerationBudget(1, 512))


def test_inputs_are_not_modified(models):
    model = models["llama"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = copy.deepcopy(model.config.to_dict())
    budgets = {"cpu": 10**9, 0: 10**6}
    kept = dict(budgets)
    allocator.plan(model, budgets, generation=BUDGET)
    assert budgets == kept
    assert model.config.to_dict() == config
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_cli_generation_flag(capsys):
    from allocator import cli

    code = cli.main(["plan", "llama-3.2-1b", "--max-memory", "0=3GiB,cpu=30GiB", "--dtype", "bfloat16",
                     "--generation", "8,4096", "--explain"])
    out = capsys.readouterr().out
    assert code == 0 and "+ cache 1023.75 MiB" in out  # 16 layers x 2 x 8 x 4095 tokens x 512 x 2 bytes
    assert cli.main(["plan", "llama-3.2-1b", "--generation", "8"]) != 0
    assert "--generation takes BATCH,MAX_LENGTH" in capsys.readouterr().err


def test_minimum_ram_error_counts_generation(meta_llama):
    with pytest.raises(allocator.InfeasiblePlacement, match="what generate needs") as err:
        strict_plan(meta_llama, {"cpu": 2_000_000}, generation=BUDGET)
    minimum = err.value.minimum
    with pytest.raises(allocator.InfeasiblePlacement) as plain:
        strict_plan(meta_llama, {"cpu": 100_000})
    needs = allocator.build_problem(meta_llama, {"cpu": 1}, generation=BUDGET).generation
    assert minimum > plain.value.minimum + needs.cache_bytes + needs.activations
    assert strict_plan(meta_llama, {"cpu": minimum}, generation=BUDGET).valid
    with pytest.raises(allocator.InfeasiblePlacement):
        strict_plan(meta_llama, {"cpu": int(minimum * 0.98)}, generation=BUDGET)


def test_patched_from_pretrained_plans_with_generation_and_generates(tmp_path):
    """``allocator.patch(generation=...)``: transformers' ``device_map="auto"`` gets the plan made with the generation
    budget; the dispatched model (layers streamed from disk) generates, and fills the cache that was predicted."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path / "model")
    with torch.device("meta"):
        meta = _llama()
    budget = GenerationBudget(BATCH, PROMPT + NEW)
    max_memory = {"cpu": 1_600_000}  # the weights (1,497,408 B) fit, not with what generate needs too
    expected = allocator.plan(meta, dict(max_memory), generation=budget)
    assert expected.valid and "disk" in expected.device_map.values()
    with allocator.patch(generation=budget):
        model = LlamaForCausalLM.from_pretrained(tmp_path / "model", device_map="auto", max_memory=dict(max_memory),
                                                 offload_folder=str(tmp_path / "offload"))
    assert model.hf_device_map == expected.device_map
    cache = output_cache(_generate(model, NEW))
    assert sum(_measured_layers(cache).values()) == expected.problem.generation.cache_bytes
    assert sum(p["cache"] for p in expected.parts.values()) == expected.problem.generation.cache_bytes


def test_validate_counts_generation(meta_llama):
    budgets = {0: 2_000_000, "cpu": 10**8}  # the weights (1,497,408 B) fit on GPU 0, not with generate's needs
    assert allocator.validate(meta_llama, {"": 0}, budgets) == []
    found = allocator.validate(meta_llama, {"": 0}, budgets, generation=BUDGET)
    assert [v.kind for v in found] == ["budget"] and "is for generate" in found[0].message


@pytest.mark.parametrize("strategy", ["balanced", "balanced_low_0"])
def test_balanced_split_leaves_room_for_generation(meta_llama, strategy):
    """Two GPUs that hold the weights, the cache and the activations together only when the split counts them."""
    problem = allocator.build_problem(meta_llama, {"cpu": 10**12}, generation=BUDGET)
    g = problem.graph
    need = sum(grp.size for grp in groups(g)) + 2 * g.workspace + g.main_workspace
    budgets = {0: need * 11 // 20, 1: need * 11 // 20, "cpu": 10 * need}
    p = allocator.plan(meta_llama, dict(budgets), strategy=strategy, generation=BUDGET)
    assert p.valid, p.explain()
    assert set(p.device_map.values()) <= {0, 1}, p.device_map  # nothing offloaded
    for device in (0, 1):
        assert p.parts[device]["activations"] == g.workspace
        assert p.peak[device] <= budgets[device]
    assert sum(p.parts[d]["cache"] for d in p.parts) == p.problem.generation.cache_bytes
