"""A config's ``quantization_config`` sizes the layers its method replaces as they are stored (bitsandbytes 4/8-bit,
GPTQ, AWQ, fp8, fbgemm_fp8), leaves the rest unquantized, and anything else is an error; ``--dtype int4`` is half a
byte per weight. Sizes are checked against layouts computed by hand for a small Llama, and fp8 against the modules
transformers itself builds (they need no GPU)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

import allocator
from allocator import cli
from allocator.model.quantization import quantized_sizes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, tie_word_embeddings=False)
# (out, in) of the linear layers of one decoder layer: q, k, v, o (head dim 16, 2 kv heads), gate, up, down
LAYER = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)]
QUANTIZED = 2 * sum(o * i for o, i in LAYER)  # 73,728 weights; lm_head (1000 x 64) and the embeddings stay bf16

BNB4_NF4_DQ = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
               "bnb_4bit_use_double_quant": True}


def llama(**extra):
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, **extra))


def bf16_total(model) -> int:
    return allocator.build_problem(model, {"cpu": 0}, dtype=torch.bfloat16).graph.total


def planned_total(model, quantization_config) -> int:
    q = quantized_sizes(model, quantization_config)
    return allocator.build_problem(model, {"cpu": 0}, dtype=torch.bfloat16, size_fn=q.size_fn).graph.total


def per_layer(f) -> int:
    return 2 * sum(f(o, i) for o, i in LAYER)


# The stored bytes of each layout, by hand (see allocator/quantization.py for the tensors behind each term).
def bnb4_nf4_double_quant(o, i):
    n = o * i
    return n // 2 + n // 64 + 4 * math.ceil(n / 64 / 256) + 4 * 256 + 4 + 4 * 16


def bnb4_fp4(o, i):
    return o * i // 2 + 4 * (o * i // 64) + 4 * 16


def bnb8(o, i):
    return o * i + 4 * o


def gptq_4bit_g32(o, i):
    return o * i // 2 + 4 * (i // 32) * (o // 8) + 2 * (i // 32) * o + 4 * i


def awq_4bit_g32(o, i):
    return o * i // 2 + 4 * (i // 32) * (o // 8) + 2 * (i // 32) * o


def fp8_blocks_32(o, i):
    return o * i + 4 * math.ceil(o / 32) * math.ceil(i / 32)


CASES = {
    "bnb 4-bit nf4 double quant": (BNB4_NF4_DQ, bnb4_nf4_double_quant),
    "bnb 4-bit fp4": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, bnb4_fp4),
    "bnb 8-bit": ({"quant_method": "bitsandbytes", "load_in_8bit": True}, bnb8),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32}, gptq_4bit_g32),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32}, awq_4bit_g32),
    "fp8": ({"quant_method": "fp8", "weight_block_size": [32, 32]}, fp8_blocks_32),
}


@pytest.mark.parametrize("case", CASES)
def test_quantized_total_is_the_hand_computed_layout(case):
    config, layout = CASES[case]
    model = llama()
    q = quantized_sizes(model, config)
    assert q.quantized_elements == QUANTIZED and len(q.sizes) == 14
    expected = bf16_total(model) - 2 * QUANTIZED + per_layer(layout)
    assert planned_total(model, config) == expected
    assert ("lm_head" in q.not_converted) == (case != "gptq")  # GPTQ converts its blocks' layers only


def test_4bit_is_about_half_of_8bit_and_a_quarter_of_bf16():
    model = llama()
    bnb4, bnb8_ = (sum(quantized_sizes(model, c).sizes.values()) for c in (BNB4_NF4_DQ, CASES["bnb 8-bit"][0]))
    assert 0.5 < bnb4 / bnb8_ < 0.75 and 0.25 < bnb4 / (2 * QUANTIZED) < 0.4  # small layers: scales weigh more


def test_skipped_modules_stay_unquantized():
    model = llama()
    config = {**BNB4_NF4_DQ, "llm_int8_skip_modules": ["down_proj", "lm_head"]}
    q = quantized_sizes(model, config)
    assert not any("down_proj" in n or "lm_head" in n for n in q.sizes) and len(q.sizes) == 12
    down = 2 * 64 * 128
    expected = bf16_total(model) - 2 * (QUANTIZED - down) + per_layer(bnb4_nf4_double_quant) \
        - 2 * bnb4_nf4_double_quant(64, 128)
    assert planned_total(model, config) == expected


@pytest.mark.parametrize("config", [{"quant_method": "fp8", "weight_block_size": [32, 32]},
                                    {"quant_method": "fp8", "weight_block_size": None, "activation_scheme": "static"}])
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_fp8_matches_the_modules_transformers_builds(config, arch):
    """transformers' FineGrainedFP8 quantizer replaces layers on the meta device without a GPU: the planned total
    equals the bytes of the model it makes (its float8 weights and float32 scales; the rest in bfloat16)."""
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    def build():
        if arch == "llama":
            return llama()
        with torch.device("meta"):
            return transformers.MixtralForCausalLM(transformers.MixtralConfig(
                **{**TINY, "intermediate_size": 96}, num_local_experts=4, num_experts_per_tok=2))

    theirs = build()
    quantizer = AutoHfQuantizer.from_config(AutoQuantizationConfig.from_dict(dict(config)), pre_quantized=True)
    quantizer.preprocess_model(theirs, device_map=None)
    fp8_tensors = {n for n, t in theirs.named_parameters() if t.dtype == torch.float8_e4m3fn or "scale" in n}
    assert fp8_tensors
    kept = {f"{m}.{b}" if m else b for m, module in theirs.named_modules() for b in module._non_persistent_buffers_set}
    # float8 weights and scales at their size, non-persistent buffers (float32 inv_freq: no loader casts them) at
    # theirs, the rest in bfloat16
    expected = sum(t.numel() * (t.element_size() if n in fp8_tensors or n in kept else 2)
                   for n, t in [*theirs.named_parameters(), *theirs.named_buffers()])
    assert planned_total(build(), config) == expected


def test_fbgemm_fp8_matches_its_linear():
    from transformers.integrations.fbgemm_fp8 import FbgemmFp8Linear

    with torch.device("meta"):
        layer = FbgemmFp8Linear(64, 32, bias=True)
    stored = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
    q = quantized_sizes(torch.nn.Sequential(torch.nn.Linear(64, 32)), {"quant_method": "fbgemm_fp8",
                                                                        "modules_to_not_convert": []})
    assert sum(q.sizes.values()) == stored


def test_unknown_and_unsupported_methods_raise():
    model = llama()
    with pytest.raises(allocator.InvalidOption, match="'nope' is unknown to transformers"):
        quantized_sizes(model, {"quant_method": "nope"})
    with pytest.raises(allocator.InvalidOption, match="'hqq' is not supported"):
        quantized_sizes(model, {"quant_method": "hqq"})
    with pytest.raises(allocator.InvalidOption, match="has no quant_method"):
        quantized_sizes(model, {"bits": 4})
    with pytest.raises(allocator.InvalidOption, match="set block_name_to_quantize"):
        quantized_sizes(torch.nn.Sequential(torch.nn.Linear(4, 4)), {"quant_method": "gptq", "bits": 4})


def test_a_config_transformers_rejects_is_one_line_with_the_fix_and_its_error_as_the_cause():
    with pytest.raises(allocator.InvalidOption) as raised:
        quantized_sizes(torch.nn.Sequential(torch.nn.Linear(4, 4)), {"quant_method": "gptq", "bits": 7})
    assert str(raised.value) == ("transformers rejects the gptq quantization_config: ValueError: Only support "
                                 "quantization to [2,3,4,8] bits but found 7; fix the fields it names, or delete "
                                 "quantization_config to plan the model unquantized.")
    assert isinstance(raised.value.__cause__, ValueError)


def save(path, quantization_config):
    config = transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"], dtype="bfloat16")
    config.quantization_config = quantization_config
    config.save_pretrained(path)
    return path


@pytest.mark.subprocess
@pytest.mark.slow
def test_cli_plans_a_4bit_config_at_its_stored_size(tmp_path):
    folder = save(tmp_path / "bnb4", BNB4_NF4_DQ)
    bad = save(tmp_path / "compressed", {"quant_method": "compressed-tensors"})
    expected = bf16_total(llama()) - 2 * QUANTIZED + per_layer(bnb4_nf4_double_quant)
    script = (f"from allocator.cli import main; import sys; "
              f"sys.exit(main(['plan', {str(folder)!r}, '--max-memory', '0=1MiB,cpu=1GiB']) * 10 "
              f"+ main(['plan', {str(bad)!r}, '--max-memory', '0=1MiB,cpu=1GiB']))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr  # the first plan (0) then the unsupported method (2)
    lines = done.stdout.splitlines()
    assert lines[1].startswith("LlamaForCausalLM: ") and lines[1].endswith(f"; {cli._size(expected)} in bfloat16")
    assert lines[3].startswith("quantization: bitsandbytes 4-bit (nf4, double quant): 73,728 weights in 14 tensors")
    assert "not converted: lm_head" in lines[3] and "budgets x0.90" in lines[3]
    assert "921.6 KiB" in done.stdout  # GPU 0: 90 % of 1 MiB, as transformers' adjust_max_memory leaves
    # each plan warns that GPU 0 is absent where this machine has none (tests/cli: a warning line per command)
    errors = "".join(line for line in done.stderr.splitlines(keepends=True)
                     if not line.startswith("allocator: warning: --max-memory names accelerator 0, which this machine"))
    assert errors == ("allocator: error: quantization_config.quant_method 'compressed-tensors' is not supported: "
                      "allocator does not know how it stores weights and will not plan the model at full size; "
                      "it sizes bitsandbytes_4bit, bitsandbytes_8bit, gptq, awq, fp8, fbgemm_fp8.\n")


@pytest.mark.subprocess
def test_int4_is_half_a_byte_per_weight():
    model = llama()
    sizes = {d: allocator.build_problem(model, {"cpu": 0}, dtype=d).graph for d in ("int8", "int4", "int2")}
    numels = list(sizes["int8"].tensors.numel)
    assert list(sizes["int8"].tensors.nbytes) == numels
    assert list(sizes["int4"].tensors.nbytes) == [math.ceil(n / 2) for n in numels]
    assert list(sizes["int2"].tensors.nbytes) == [math.ceil(n / 4) for n in numels]
    done = subprocess.run([sys.executable, "-m", "allocator", "plan", "llama-3.2-1b", "--dtype", "int4",
                           "--max-memory", "0=1GiB,cpu=8GiB"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from allocator.model import zoo

    int8 = allocator.build_problem(zoo.build("llama-3.2-1b"), {"cpu": 0}, dtype="int8").graph.total
    assert done.stdout.splitlines()[1] == f"LlamaForCausalLM: {cli._size(math.ceil(int8 / 2))} in int4"


def test_fp8_with_dequantize_plans_the_unquantized_model():
    model = llama()
    q = quantized_sizes(model, {"quant_method": "fp8", "dequantize": True})
    assert q.sizes == {} and planned_total(model, {"quant_method": "fp8", "dequantize": True}) == bf16_total(model)
