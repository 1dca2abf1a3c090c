"""Cache layers as transformers builds them: every class of the installed ``cache_utils`` modelled or refused by name,
KV-shared layers (Gemma-4 E-series) at 0 bytes, and a tiny Gemma-4 E-style model generating the same tokens offloaded
under ``patch()`` as in RAM.
"""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import allocator  # noqa: E402
from allocator import GenerationBudget, InvalidOption  # noqa: E402
from allocator.integrations import transformers as hf  # noqa: E402
from allocator.model import zoo  # noqa: E402
from allocator.model.cache_kwarg import output_cache  # noqa: E402
from allocator.model.cache_layers import MODELLED, REFUSED, cache_layer_kinds  # noqa: E402
from models import quiet_hf  # noqa: E402

cache_utils = pytest.importorskip("transformers.cache_utils")


def _layer_classes() -> list[type]:
    """Every cache-layer class ``cache_utils`` defines: what a ``Cache`` holds in ``layers`` (the two layer mixins,
    their subclasses, and ``DummyLayer`` and any other ``...Layer`` class, which subclass neither)."""
    mixins = tuple(c for c in (getattr(cache_utils, "CacheLayerMixin", None),
                               getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)) if c is not None)
    return [cls for name, cls in vars(cache_utils).items()
            if inspect.isclass(cls) and cls.__module__ == cache_utils.__name__
            and (issubclass(cls, mixins) or name.endswith("Layer") or name.endswith("LayerMixin"))]


def test_every_cache_layer_class_of_the_installed_transformers_is_modelled_or_refused_by_name():
    classes = _layer_classes()
    assert {"DynamicLayer", "DynamicSlidingWindowLayer", "StaticLayer", "DummyLayer"} <= {c.__name__ for c in classes}
    unknown = sorted(c.__name__ for c in classes if c.__name__ not in MODELLED and c.__name__ not in REFUSED)
    assert not unknown, (f"transformers {transformers.__version__} defines cache layers allocator neither models nor "
                         f"refuses by name: {unknown}; add them to allocator/model/cache_layers.py")
    assert not set(MODELLED) & set(REFUSED)
    assert all("generation=" in why or "DynamicCache" in why for why in REFUSED.values())  # each says what to do


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_cache_layer_raises_a_typed_error_naming_it(monkeypatch, name):
    from transformers import LlamaConfig

    layer = type(name, (), {"__module__": cache_utils.__name__})()  # only its class's name and module are read

    class Cache:
        def __init__(self, config):
            self.layers = [object.__new__(cache_utils.DynamicLayer), layer]

    monkeypatch.setattr(cache_utils, "DynamicCache", Cache)
    with pytest.raises(InvalidOption, match=f"cache layer 1 of LlamaConfig is a {name}: .*generation="):
        cache_layer_kinds(LlamaConfig(num_hidden_layers=2), 2)


def test_an_unknown_cache_layer_class_is_refused(monkeypatch):
    from transformers import LlamaConfig

    class DynamicLayer:  # a model's own class, named like transformers' one
        pass

    class Cache:
        def __init__(self, config):
            self.layers = [DynamicLayer()]

    monkeypatch.setattr(cache_utils, "DynamicCache", Cache)
    with pytest.raises(InvalidOption, match="is a DynamicLayer: a class allocator does not know"):
        cache_layer_kinds(LlamaConfig(num_hidden_layers=1), 1)


# -- Gemma-4 E-series: the last num_kv_shared_layers reuse earlier layers' keys and values ------------------------

def _expected_cache_bytes(config, batch: int, max_length: int, prefill: int, ebytes: int) -> int:
    """The KV cache summed over the layers that keep one, from the config alone: each non-reusing layer holds
    ``batch x tokens x 2 x kv heads x head dim`` (its own heads and head dim: full layers have wider ones)."""
    total = 0
    for i, (kind, mode) in enumerate(zip(config.layer_types, config.kv_sharing_modes)):
        if mode == "reuse":
            continue
        layer = config.per_layer_config[i]
        tokens = max_length - 1 if kind == "full_attention" else max(prefill, min(max_length - 1,
                                                                                  config.sliding_window))
        total += batch * tokens * 2 * layer.num_key_value_heads * layer.head_dim * ebytes
    return total


def test_gemma4_e4b_plans_with_generation_and_its_shared_layers_hold_no_cache():
    model = zoo.build("gemma4-e4b")
    config = model.config
    assert config.kv_sharing_modes.count("reuse") == 18
    budget = GenerationBudget(1, 8704)
    plan = allocator.plan(model, {0: "16GiB"}, dtype="bfloat16", generation=budget, strict=True)
    assert plan.valid, plan.explain()
    needs = allocator.build_problem(model, {0: "16GiB"}, dtype="bfloat16", generation=budget).generation
    assert needs.cache_bytes == _expected_cache_bytes(config, 1, 8704, 8703, 2)
    assert {layer.index for layer in needs.layers} == {i for i, m in enumerate(config.kv_sharing_modes)
                                                       if m != "reuse"}
    kinds = cache_layer_kinds(config, config.num_hidden_layers)
    assert [k for k, _ in kinds].count("shared") == 18
    assert all(kind == "shared" for (kind, _), mode in zip(kinds, config.kv_sharing_modes) if mode == "reuse")


def _tiny_gemma4_config(**extra):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, vocab_size=1000, vocab_size_per_layer_input=1000,
        hidden_size_per_layer_input=8, sliding_window=4, num_kv_shared_layers=3, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                     "sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=None, bos_token_id=2,
        **extra)


@pytest.mark.parametrize("k_eq_v", [False, True])
def test_tiny_gemma4_cache_bytes_equal_what_generate_fills(k_eq_v):
    """The predicted bytes per layer equal the storage ``generate`` leaves in its ``DynamicCache``, shared layers 0."""
    from transformers import Gemma4ForCausalLM

    config = _tiny_gemma4_config(attention_k_eq_v=k_eq_v, num_global_key_value_heads=1 if k_eq_v else None)
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(config).eval()
    prompt, new = 3, 10  # a prompt shorter than the window: what the sliding layers keep at the end is their largest
    budget = GenerationBudget(2, prompt + new, prompt_length=prompt)
    needs = allocator.build_problem(model, {"cpu": 10**9}, generation=budget).generation
    ids = torch.randint(3, 1000, (2, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True)
    cache = output_cache(out)
    measured = {}
    for i, layer in enumerate(cache.layers):
        tensors = [t for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]
        measured[i] = sum(t.untyped_storage().nbytes() for t in tensors)  # a sliding layer's view: count storage
    predicted = {layer.index: layer.nbytes for layer in needs.layers}
    assert {i: n for i, n in measured.items() if n} == predicted
    assert sum(measured.values()) == needs.cache_bytes == _expected_cache_bytes(config, 2, prompt + new, prompt, 4)
    assert all(measured[i] == 0 for i, m in enumerate(config.kv_sharing_modes) if m == "reuse")


@pytest.mark.slow
def test_tiny_gemma4_offloaded_under_patch_generates_the_tokens_of_the_model_in_ram(tmp_path):
    from transformers import Gemma4ForCausalLM

    config = _tiny_gemma4_config()
    torch.manual_seed(0)
    Gemma4ForCausalLM(config).eval().save_pretrained(tmp_path / "gemma4")
    with torch.device("meta"):
        meta = Gemma4ForCausalLM(config)
    budget = GenerationBudget(2, 20, prompt_length=8)
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    max_memory = {"cpu": int(0.8 * total)}
    ids = torch.randint(3, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with quiet_hf(), torch.no_grad():
        expected = Gemma4ForCausalLM.from_pretrained(tmp_path / "gemma4", dtype=torch.float32).eval().generate(
            ids, **kwargs)
        with hf.patch(generation=budget):
            model = Gemma4ForCausalLM.from_pretrained(
                tmp_path / "gemma4", dtype=torch.float32, device_map="auto", max_memory=dict(max_memory),
                offload_folder=str(tmp_path / "offload"))
        got = model.eval().generate(ids, **kwargs)
    where = {int(name.split(".")[2]): device for name, device in model.hf_device_map.items()
             if name.startswith("model.layers.")}
    modes = model.config.kv_sharing_modes
    # part of it offloaded: layers that reuse keys and values on disk, a layer that stores them for them in RAM
    assert {where[i] for i, m in enumerate(modes) if m == "reuse"} == {"disk"}, model.hf_device_map
    assert "cpu" in {where[i] for i, m in enumerate(modes) if m == "store"}, model.hf_device_map
    assert got.shape[1] == 20
    assert torch.equal(got, expected)
