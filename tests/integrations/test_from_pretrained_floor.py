"""On the path users take: ``from_pretrained(device_map="auto")`` under ``allocator.patch()`` against the same call
unpatched, on small saved models of eight architectures (tied and untied). Where transformers' own map is valid, the
plan never keeps fewer bytes on the fastest tier and never streams more per forward — judged on the model as it runs
after loading (tied weights as one storage) — and, where it loads here (RAM budgets), its outputs equal the model's
in RAM. GPU budgets cannot load on this machine: their maps are captured at transformers' ``_get_device_map``."""

from __future__ import annotations

import tempfile

import pytest
import torch
import transformers
import transformers.modeling_utils as modeling_utils

import allocator
from allocator.budgets import normalize_map
from allocator.evaluate.cost import estimate
from allocator.evaluate.memory import main_device
from allocator.evaluate.validate import check
from models import assert_same_output

pytestmark = pytest.mark.slow

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=3000)


def configs() -> dict:
    t = transformers
    return {
        "llama": (t.AutoModelForCausalLM, t.LlamaConfig(**SMALL, num_key_value_heads=2)),
        "qwen3-tied": (t.AutoModelForCausalLM, t.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16,
                                                             tie_word_embeddings=True)),
        "gpt2": (t.AutoModelForCausalLM, t.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=3000,
                                                      n_positions=64)),
        "opt": (t.AutoModelForCausalLM, t.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=3,
                                                    num_attention_heads=4, vocab_size=3000, word_embed_proj_dim=64,
                                                    max_position_embeddings=64)),
        "bart": (t.AutoModelForSeq2SeqLM, t.BartConfig(d_model=64, vocab_size=3000, encoder_layers=2,
                                                       decoder_layers=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                                       encoder_attention_heads=4, decoder_attention_heads=4,
                                                       max_position_embeddings=64)),
        "t5": (t.AutoModelForSeq2SeqLM, t.T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
                                                   vocab_size=3000)),
        "bert": (t.AutoModelForMaskedLM, t.BertConfig(**SMALL, max_position_embeddings=64)),
        "vit": (t.AutoModelForImageClassification, t.ViTConfig(hidden_size=64, intermediate_size=128,
                                                               num_hidden_layers=3, num_attention_heads=4,
                                                               image_size=32, patch_size=8)),
    }


def saved(name: str) -> tuple[type, str]:
    auto, config = configs()[name]
    torch.manual_seed(0)
    model = auto.from_config(config)
    folder = tempfile.mkdtemp(prefix=f"floor-{name}-")
    model.save_pretrained(folder)
    return auto, folder


def captured_map(auto, folder: str, max_memory: dict, patched: bool) -> dict:
    """The device map ``from_pretrained`` computes, taken at ``_get_device_map`` (the load stops there)."""
    seen = {}

    class Captured(Exception):
        pass

    def run():
        current = modeling_utils._get_device_map

        def spy(*args, **kwargs):
            seen["map"] = dict(current(*args, **kwargs))
            raise Captured

        modeling_utils._get_device_map = spy
        try:
            auto.from_pretrained(folder, device_map="auto", max_memory=max_memory)
        except Captured:
            pass
        finally:
            modeling_utils._get_device_map = current

    if patched:
        with allocator.patch():
            run()
    else:
        run()
    return seen["map"]


def judged(model, max_memory: dict, device_map: dict):
    """The estimate and validity of a map on the model as it runs (tied weights shared), for these budgets."""
    problem = allocator.build_problem(model, max_memory)
    device_map = normalize_map(device_map)
    return estimate(problem, device_map), not check(problem, device_map)[0]


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    yield


@pytest.mark.parametrize("name", list(configs()))
def test_never_below_transformers_own_map(name):
    auto, folder = saved(name)
    model = auto.from_pretrained(folder)   # as it runs after loading: ties as one storage
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    compared = 0
    for budgets in [{"cpu": int(total * f)} for f in (0.5, 0.7, 0.9)] + \
                   [{0: int(total * f), "cpu": 4 * total} for f in (0.5, 0.7, 0.9)]:
        theirs = captured_map(auto, folder, budgets, patched=False)
        ours = captured_map(auto, folder, budgets, patched=True)
        their_cost, their_valid = judged(model, budgets, theirs)
        our_cost, our_valid = judged(model, budgets, ours)
        where = f"{name} {budgets}: ours {ours}, theirs {theirs}"
        if their_valid:
            compared += 1
            assert our_valid, where
            assert our_cost.resident_fast >= their_cost.resident_fast, where
            if main_device(normalize_map(theirs).values()) == main_device(normalize_map(ours).values()):
                # (where transformers runs on the CPU with a GPU offered, the GPU as main device comes first)
                assert our_cost.streamed_bytes <= their_cost.streamed_bytes, where
    assert compared, f"{name}: transformers' map was valid under none of the budgets"


@pytest.mark.parametrize("name", ["qwen3-tied", "bart", "vit"])
def test_outputs_equal_where_loaded(name, tmp_path):
    auto, folder = saved(name)
    reference = auto.from_pretrained(folder).eval()
    total = allocator.build_problem(reference, {"cpu": 0}).graph.total
    with allocator.patch():
        offloaded = auto.from_pretrained(folder, device_map="auto", max_memory={"cpu": int(total * 0.7)},
                                         offload_folder=str(tmp_path)).eval()
    if name == "vit":
        inputs = {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    else:
        inputs = {"input_ids": torch.tensor([[1, 5, 9, 42, 7]])}
        if name == "bart":
            inputs["decoder_input_ids"] = torch.tensor([[2, 5]])
    with torch.no_grad():
        assert_same_output(offloaded(**inputs).logits, reference(**inputs).logits)


def untied_as_from_pretrained_has_it(model):
    """The same model with its tied weights separate tensors and the ties only declared (``all_tied_weights_keys``),
    as ``from_pretrained`` has it when it plans: it ties them after loading."""
    for target in model.all_tied_weights_keys:
        owner, _, attribute = target.rpartition(".")
        module = model.get_submodule(owner)
        setattr(module, attribute, torch.nn.Parameter(torch.empty_like(getattr(module, attribute))))
    return model


@pytest.mark.parametrize("name", ["qwen3-tied", "gpt2", "bart", "t5", "bert", "opt"])
def test_declared_ties_plan_as_real_ties(name):
    auto, config = configs()[name]
    with torch.device("meta"):
        tied, untied = auto.from_config(config), untied_as_from_pretrained_has_it(auto.from_config(config))
    assert sum(1 for _ in untied.parameters()) > sum(1 for _ in tied.parameters()), "the ties were not undone"
    total = allocator.build_problem(tied, {"cpu": 0}).graph.total
    for budgets in ({"cpu": total // 2}, {0: total // 2, "cpu": 4 * total}, {0: int(total * 0.8), "cpu": 4 * total},
                    {0: total // 3, 1: total // 3, "cpu": 4 * total}):
        assert allocator.plan(tied, budgets).device_map == allocator.plan(untied, budgets).device_map, budgets
