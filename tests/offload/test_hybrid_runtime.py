"""Issue #40, the runtime's side: a plan made for an accelerator main device, run here with the stand-in as the
accelerator; each offloaded unit computes where the plan's compute map says for the phase of the call. Outputs equal
the model in RAM (``assert_close``), greedy tokens are identical, and CPU-computed calls copy no weights."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import allocator
from allocator import offload
from allocator.model.cache_kwarg import cache_keyword, forward_cache, output_cache
from allocator.offload.hybrid import call_tokens, phase_of, unit_phases

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128)
ARCHS = {
    "llama": ("LlamaConfig", "AutoModelForCausalLM", TINY),
    "qwen3": ("Qwen3Config", "AutoModelForCausalLM", {**TINY, "head_dim": 16}),
    "mistral": ("MistralConfig", "AutoModelForCausalLM", {**TINY, "sliding_window": 32}),
    "t5": ("T5Config", "AutoModelForSeq2SeqLM", dict(d_model=64, d_ff=128, d_kv=16, num_layers=3, num_heads=4,
                                                     vocab_size=256, decoder_start_token_id=0)),
}


def _build(arch, device="cpu"):
    config_cls, auto, kwargs = ARCHS[arch]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(transformers, auto).from_config(config).eval(), auto


def _generate(model, prompt):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, min_new_tokens=4)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    out = {}
    for arch in ARCHS:
        model, auto = _build(arch)
        model.save_pretrained(root / arch)
        prompt = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
        out[arch] = (root / arch, auto, prompt, model, _generate(model, prompt))
    return out


def _plan(arch, model):
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    meta, _ = _build(arch, "meta")
    return allocator.plan(meta, {0: int(total * 0.45), "cpu": 4 * total}, runtime="allocator",
                          generation=allocator.GenerationBudget(1, 32, prompt_length=12))


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_hybrid_outputs_equal_the_model_in_ram(saved, arch, tmp_path):
    folder, auto, prompt, ram, (want_ids, want_logits) = saved[arch]
    plan = _plan(arch, ram)
    assert plan.main_device == 0 and plan.compute, plan.device_map
    loaded = {k: ("disk" if v in ("cpu", "disk") else "cpu") for k, v in plan.device_map.items()}
    # prefill streamed to the (stand-in) accelerator, decode on the CPU: both paths and the switch between them
    forced = dataclasses.replace(plan.hybrid, devices={u: {"prefill": 0, "decode": "cpu"} for u in plan.compute})
    model = getattr(transformers, auto).from_pretrained(folder, device_map=loaded, offload_folder=tmp_path,
                                                        dtype=torch.float32).eval()
    runtime = offload.attach(model, dataclasses.replace(plan, device_map=loaded, hybrid=forced), device="stand-in",
                             prefetch=0)
    try:
        hooks = [u.module._hf_hook for u in runtime.units]
        assert hooks and all(isinstance(h, offload.HybridHook) for h in hooks)
        got_ids, got_logits = _generate(model, prompt)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
        staged = runtime.device.staged
        assert sum(h.calls.get("decode", 0) for h in hooks) > 0 and not any(h.calls.get("prefill") for h in hooks)
        # weights copied only for the calls streamed (prefill calls: more tokens than the threshold), once each
        assert staged == sum(s.nbytes * h.streamed for h in hooks for s in h.unit.slots)
        assert all(h.streamed <= 1 for h in hooks) and any(h.streamed for h in hooks)
    finally:
        offload.detach(model)
    assert not any(isinstance(getattr(m, "_hf_hook", None), offload.HybridHook) for m in model.modules())


def test_phase_of_a_call():
    states = torch.zeros(2, 7, 8)
    assert call_tokens((states,), {}) == 14 and call_tokens((torch.zeros(1, 1, 4, 16),), {}) == 1
    assert call_tokens((), {"hidden_states": torch.zeros(1, 1, 8)}) == 1
    assert phase_of(1, 1) == "decode" and phase_of(2, 1) == "prefill"
    compute = {"model.layers.1": {"prefill": 0, "decode": "cpu"}, "model.layers.2": {"prefill": 0, "decode": 0}}
    assert unit_phases(compute, "model.layers.1.self_attn.q_proj") == compute["model.layers.1"]
    assert unit_phases(compute, "model.layers.2") is None and unit_phases(compute, "lm_head") is None


def test_the_kv_cache_reaches_the_units_under_the_installed_name():
    """transformers 5.25 passes a layer's KV cache as ``cache=`` (``past_key_values=`` is deprecated, removed in
    5.40): the hybrid hook finds it under either name (``forward_cache``), and our code passes it without a
    ``FutureWarning`` (``cache_keyword``)."""
    model, _ = _build("llama")
    seen = []
    layer = model.model.layers[1]
    hooks = [m.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(forward_cache(kwargs)),
                                         with_kwargs=True) for m in (layer, layer.self_attn)]
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:   # conftest ignores warnings: record them
        warnings.simplefilter("always")
        out = model(input_ids=torch.tensor([[5, 6, 7]]), **{cache_keyword(model): cache}, use_cache=True)
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    for h in hooks:
        h.remove()
    assert len(seen) == 2 and all(found is cache for found in seen)
    assert output_cache(out) is cache and cache.get_seq_length() == 3
