"""The plan is the program (issue #39): what the runtime does is decided in the plan (``Plan.runtime``), carried by its
data, and read by :func:`allocator.offload.attach`; ``patch(runtime="allocator")`` + ``from_pretrained`` ends with
the same runtime state and traffic as ``plan`` + ``from_pretrained(device_map=plan.device_map)`` + ``attach``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import allocator
from allocator import offload
from allocator.integrations import transformers as hf
from allocator.report.runtime import Runtime

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=128, head_dim=16)
CONFIGS = {
    "llama": dict(),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (folder, the model in RAM)."""
    out = {}
    for family, extra in CONFIGS.items():
        folder = tmp_path_factory.mktemp(family)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **BASE, **extra)).eval().save_pretrained(folder)
        out[family] = (folder, AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval())
    return out


def _budget(ref, fraction=0.6):
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(ref.config)
    return meta, {"cpu": int(allocator.build_problem(meta, {"cpu": 0}).graph.total * fraction)}


def _tokens(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (1, 10))
    return model.generate(ids, max_new_tokens=6, do_sample=False)


def _explicit(folder, ref, budgets, meta, tmp, device=None, **options):
    plan = allocator.plan(meta, dict(budgets), runtime="allocator", **options)
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=plan.device_map, offload_folder=tmp / "a",
                                                 experts_implementation="eager").eval()
    return plan, model, offload.attach(model, plan, device=device)


def _patched(folder, budgets, tmp, device=None, **options):
    with hf.patch(runtime="allocator", offload_device=device, **options):
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory=dict(budgets),
                                                     offload_folder=tmp / "b", experts_implementation="eager").eval()
    return model, offload.runtime_of(model)


@pytest.mark.slow
@pytest.mark.parametrize("device", [None, "stand-in"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_patch_runs_what_plan_and_attach_run(saved, family, device, tmp_path):
    folder, ref = saved[family]
    meta, budgets = _budget(ref)
    plan, explicit, ours = _explicit(folder, ref, budgets, meta, tmp_path, device)
    model, theirs = _patched(folder, budgets, tmp_path, device)
    try:
        assert theirs is not None and model.hf_device_map == plan.device_map
        assert theirs.plan == ours.plan == plan.runtime
        assert theirs.state == ours.state
        expected = _tokens(ref)
        assert torch.equal(_tokens(explicit), expected) and torch.equal(_tokens(model), expected)
        assert theirs.traffic == ours.traffic and theirs.fetches == ours.fetches
        if family != "llama":
            assert ours.experts and ours.traffic.resident > 0          # the plan's resident experts are kept
            assert sum(len(r.rows) for r in ours.experts.values()) == sum(
                row.count(plan.main_device) for row in plan.experts.values())
    finally:
        offload.detach(explicit)
        offload.detach(model)


@pytest.mark.slow
def test_expert_profile_reaches_the_runtime_through_patch(saved, tmp_path):
    folder, ref = saved["qwen3_moe"]
    meta, budgets = _budget(ref)
    torch.manual_seed(2)
    profile = allocator.profile_experts(ref, [torch.randint(0, 128, (1, 16))])
    uniform = allocator.plan(meta, dict(budgets), runtime="allocator")
    plan = allocator.plan(meta, dict(budgets), runtime="allocator", expert_profile=profile)
    assert plan.runtime.experts != uniform.runtime.experts     # else this test could not tell them apart
    model, runtime = _patched(folder, budgets, tmp_path, expert_profile=profile)
    try:
        assert runtime.plan == plan.runtime
        assert {r.layer.experts: tuple(sorted(r.rows)) for r in runtime.experts.values()} == {
            k: v for k, v in plan.runtime.resident.items() if v}
    finally:
        offload.detach(model)


def test_runtime_section_round_trips_and_a_saved_plan_attaches_the_same(saved, tmp_path):
    folder, ref = saved["qwen3_moe"]
    meta, budgets = _budget(ref)
    plan = allocator.plan(meta, dict(budgets), runtime="allocator")
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["runtime"]["name"] == "allocator" and data["runtime"]["experts"]
    saved_plan = allocator.Plan.from_dict(data)
    assert saved_plan.runtime == plan.runtime == Runtime.from_dict(data["runtime"])
    assert plan.runtime.buffers["experts"] > 0 and plan.runtime.buffers["streamed"] == plan.streamed
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=plan.device_map, offload_folder=tmp_path / "c",
                                                 experts_implementation="eager").eval()
    runtime = offload.attach(model, saved_plan)
    try:
        assert runtime.plan == plan.runtime and runtime.prefetch == plan.runtime.prefetch
        assert {r.layer.experts: tuple(sorted(r.rows)) for r in runtime.experts.values()} == {
            k: v for k, v in plan.runtime.resident.items() if v}
    finally:
        offload.detach(model)
    assert offload.runtime_of(model) is None


def test_accelerates_plan_decides_accelerates_runtime(saved):
    _, ref = saved["llama"]
    meta, budgets = _budget(ref)
    runtime = allocator.plan(meta, dict(budgets)).runtime
    assert runtime == Runtime(name="accelerate", main_device="cpu") and not runtime.streams


@pytest.mark.slow
def test_fetch_buffers_on_an_accelerator_main_device_stay_within_the_plans_reserve(saved, tmp_path):
    """Issue #39: on an accelerator main device (the stand-in) the buffers fetched experts are copied into are held
    only while their experts module runs, shared by the layers, so what the runtime holds at once (streamed modules
    and fetch buffers, ``peak_held``) stays within the plan's streaming reserve; a buffer kept per layer held up to
    ``layers x routed experts``, above it."""
    folder, ref = saved["qwen3_moe"]
    meta, _ = _budget(ref)
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (1, 48))   # a prefill that routes most experts of every layer
    with torch.no_grad():
        want = ref(ids).logits
    for fraction in (0.3, 0.6):
        plan = allocator.plan(meta, {0: int(total * fraction), "cpu": 4 * total}, runtime="allocator", prefetch=0)
        assert plan.main_device == 0
        reserve = plan.runtime.buffers["streamed"] + plan.runtime.buffers["prefetch"]
        loaded = {k: ("disk" if v in ("cpu", "disk") else "cpu") for k, v in plan.device_map.items()}
        model = AutoModelForCausalLM.from_pretrained(folder, device_map=loaded, offload_folder=tmp_path / str(fraction),
                                                     experts_implementation="eager").eval()
        runtime = offload.attach(model, dataclasses.replace(plan, device_map=loaded), device="stand-in", prefetch=0)
        try:
            with torch.no_grad():
                got = model(ids).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert runtime.traffic.fetched > 0 and runtime.traffic.copied > 0
            layers = len(runtime.experts)
            assert layers > 1 and runtime.peak_held <= reserve, (fraction, runtime.peak_held, reserve)
            assert runtime.fetch_buffers.nbytes() == 0 and runtime.held == 0   # released after each forward
        finally:
            offload.detach(model)
