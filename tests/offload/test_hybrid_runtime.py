"""Issue #40, the runtime's side: a plan made for an accelerator main device, run here with the stand-in as the
accelerator; each offloaded unit computes where the plan's compute map says for the phase of the call. Outputs equal
the model in RAM (``assert_close``), greedy tokens are identical, and CPU-computed calls copy no weights."""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest
import torch

import allocator
from allocator import offload
from allocator.model.cache_kwarg import cache_keyword, forward_cache, output_cache
from allocator.offload.devices import on_stand_in
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
    # an embedding's token ids (batch, sequence): a 12-token prompt is a prefill call, one new token a decode call
    assert call_tokens((torch.zeros(1, 12, dtype=torch.long),), {}) == 12
    assert call_tokens((torch.zeros(2, 1, dtype=torch.long),), {}) == 2 and call_tokens((), {}) == 0
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


def _where(tensor) -> str:
    """``"main"`` for a tensor on the stand-in accelerator, ``"cpu"`` for one in RAM."""
    return "main" if on_stand_in(tensor) else "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["layers whole", "from_pretrained"])
def test_hybrid_hooks_move_inputs_outputs_and_kv_cache_between_cpu_and_accelerator(saved, tmp_path, loader):
    """On the stand-in a tensor on the accelerator is tagged (``on_stand_in``), so this sees where things are. A
    prefill streamed to the main device, a decode call on the CPU, then a 3-token call streamed again: in the CPU call
    each hybrid unit's attention gets its hidden states and its KV cache layer in RAM (the hook moved them there) and
    its output goes back to the accelerator; in the streamed call after it, the cache layer is back on the accelerator
    before the attention reads it. Logits equal the model in RAM at every call.

    ``"layers whole"``: the decoder layers loaded whole (accelerate's ``preload_module_classes``), so their offload
    hook is the layer's, which gets the KV cache. ``"from_pretrained"`` puts the offload hooks on the leaf modules,
    which never see the cache: the runtime's ``LayerHook`` on the layer moves its inputs and cache once."""
    accelerate = pytest.importorskip("accelerate")
    folder, auto, prompt, ram, _ = saved["llama"]
    plan = _plan("llama", ram)
    loaded = {k: ("disk" if v in ("cpu", "disk") else "cpu") for k, v in plan.device_map.items()}
    forced = dataclasses.replace(plan.hybrid, devices={u: {"prefill": 0, "decode": "cpu"} for u in plan.compute})
    if loader == "from_pretrained":
        model = getattr(transformers, auto).from_pretrained(folder, device_map=loaded, offload_folder=tmp_path,
                                                            dtype=torch.float32).eval()
    else:
        with accelerate.init_empty_weights():
            model = getattr(transformers, auto).from_config(ram.config).eval()
        model = accelerate.load_checkpoint_and_dispatch(model, str(folder), device_map=loaded, offload_folder=tmp_path,
                                                        preload_module_classes=["LlamaDecoderLayer"],
                                                        dtype=torch.float32)
    runtime = offload.attach(model, dataclasses.replace(plan, device_map=loaded, hybrid=forced), device="stand-in",
                             prefetch=0)
    device = runtime.device
    units = {key: model.get_submodule(key) for key in plan.compute}   # the units the plan computes per phase
    units = {key: m for key, m in units.items() if hasattr(m, "self_attn")}
    assert units, plan.compute
    seen, handles = [], []
    for name, module in units.items():
        index = module.self_attn.layer_idx

        def attention_in(mod, args, kwargs, name=name, index=index):
            layer = forward_cache(kwargs).layers[index]
            keys = [] if getattr(layer, "keys", None) is None or not layer.keys.numel() else [layer.keys, layer.values]
            seen.append((name, "in", _where(kwargs["hidden_states"]), {_where(t) for t in keys}))

        def unit_out(mod, args, output, name=name):
            seen.append((name, "out", _where(output[0] if isinstance(output, tuple) else output), set()))

        handles += [module.self_attn.register_forward_pre_hook(attention_in, with_kwargs=True),
                    module.register_forward_hook(unit_out)]
    steps = [prompt, torch.tensor([[7]]), torch.tensor([[9, 10, 11]])]   # prefill, decode (CPU), prefill again
    ram_cache, cache = transformers.DynamicCache(config=ram.config), transformers.DynamicCache(config=model.config)
    kw = cache_keyword(model)
    try:
        for step, ids in enumerate(steps):
            seen.clear()
            with torch.no_grad():
                want = ram(input_ids=ids, **{kw: ram_cache}, use_cache=True).logits
                got = model(input_ids=device.put(ids), **{kw: cache}, use_cache=True).logits
            torch.testing.assert_close(got.as_subclass(torch.Tensor), want, atol=1e-4, rtol=1e-4)
            ins = {name: (hidden, keys) for name, kind, hidden, keys in seen if kind == "in"}
            outs = {name: where for name, kind, where, _ in seen if kind == "out"}
            assert set(ins) == set(outs) == set(units), seen
            if step == 1:   # decode on the CPU: inputs and KV cache in RAM, outputs back on the accelerator
                assert all(v == ("cpu", {"cpu"}) for v in ins.values()), ins
                assert all(where == "main" for where in outs.values()), outs
                assert {_where(cache.layers[m.self_attn.layer_idx].keys) for m in units.values()} == {"cpu"}
            else:           # streamed: everything on the accelerator, the cache back there after the CPU call
                assert all(v[0] == "main" and v[1] <= {"main"} for v in ins.values()), ins
                assert step == 0 or all(v[1] == {"main"} for v in ins.values()), ins
                assert all(where == "main" for where in outs.values()), outs
        hooks = [m._hf_hook for m in units.values()]
        assert all(isinstance(h, offload.HybridHook) and h.calls == {"decode": 1} and h.streamed == 2 for h in hooks)
    finally:
        for h in handles:
            h.remove()
        offload.detach(model)


class _Pair(torch.nn.Module):
    """Two same-shaped outputs from one unit's own weights (a tuple output, like attention's ``(out, weights)``)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(8, 8))
        self.b = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.a, x @ self.b


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(8, 8)
        self.pair = _Pair()

    def forward(self, x):
        return self.pair(self.pre(x))


def test_a_tuple_of_same_shaped_outputs_comes_back_unaliased(tmp_path):
    """The hybrid hook stages a CPU call's outputs in buffers the accelerator copies from (the stand-in stages like a
    GPU): two same-shaped tensors of one tuple output each come back with their own values, on the accelerator, and
    a second call does not overwrite the first call's outputs."""
    accelerate = pytest.importorskip("accelerate")
    from allocator.evaluate.compute import ComputePlan

    torch.manual_seed(0)
    ram = _Outer().eval()
    model = _Outer().eval()
    model.load_state_dict(ram.state_dict())
    device_map = {"pre": "cpu", "pair": "disk"}
    model = accelerate.dispatch_model(model, device_map, offload_dir=tmp_path)
    compute = ComputePlan(devices={"pair": {"prefill": "cpu", "decode": "cpu"}}, tokens={"prefill": 4, "decode": 1},
                          threshold=1, choices=())
    device = offload.StandInDevice()
    runtime = offload.attach(model, types.SimpleNamespace(device_map=device_map, hybrid=compute), device=device,
                             prefetch=0)
    try:
        assert isinstance(model.pair._hf_hook, offload.HybridHook)
        x, y = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
        with torch.no_grad():
            first, second = model(device.put(x)), model(device.put(y))
            want_first, want_second = ram(x), ram(y)
        assert model.pair._hf_hook.calls == {"decode": 2} and runtime.device.staged == 0
        for got, want in ((first, want_first), (second, want_second)):
            assert [_where(t) for t in got] == ["main", "main"]
            assert got[0].data_ptr() != got[1].data_ptr()
            for g, w in zip(got, want):
                torch.testing.assert_close(g.as_subclass(torch.Tensor), w, atol=1e-6, rtol=1e-6)
    finally:
        offload.detach(model)
