"""The runtime that moves only what the router picks (issue #33 stage 3): allocator.offload.experts, attach on MoE
models loaded by from_pretrained; equality with transformers' eager experts (logits within float tolerance,
greedy tokens exact); the expert profile."""

from __future__ import annotations

import pytest
import torch

import allocator
from allocator.model.cache_kwarg import cache_keyword, output_cache
from allocator.model.experts import find_experts
from allocator.offload import attach, detach
from allocator.offload.experts import NAME, eager_forward, experts_forward, register

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

from models import assert_same_output  # noqa: E402
from moe_models import SMALL, small_model  # noqa: E402

FAMILIES = sorted(SMALL)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (folder, the model in RAM with eager experts)."""
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        small_model(family, layers=12).save_pretrained(folder)
        out[family] = (folder, AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval())
    return out


def _offloaded(folder, ref, fraction=0.6, **options):
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(ref.config)
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    plan = allocator.plan(meta, {"cpu": int(total * fraction)}, runtime="allocator", **options)
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=plan.device_map, offload_folder=folder / "off",
                                                 experts_implementation="eager").eval()
    return plan, model


def _same(ref, model):
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert_same_output(model(ids).logits, ref(ids).logits)                                # prefill
    assert torch.equal(ref.generate(ids, max_new_tokens=6, do_sample=False),                   # decode
                       model.generate(ids, max_new_tokens=6, do_sample=False))
    batch = torch.randint(1, 128, (2, 10))
    mask = torch.ones_like(batch)
    mask[1, :4] = 0                                                                            # left padding
    with torch.no_grad():
        assert_same_output(model(batch, attention_mask=mask).logits, ref(batch, attention_mask=mask).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_equal_to_eager_on_a_cpu_main_device(saved, family):
    folder, ref = saved[family]
    plan, model = _offloaded(folder, ref)
    assert plan.valid and plan.experts, plan
    resident = sum(row.count("cpu") for row in plan.experts.values())
    assert 0 < resident < sum(len(row) for row in plan.experts.values())
    runtime = attach(model, plan)
    try:
        assert len(runtime.experts) == len(find_experts(model)) and model.config._experts_implementation == NAME
        assert not {u.name for u in runtime.units} & {r.layer.experts for r in runtime.experts.values()}
        _same(ref, model)
        t = runtime.traffic
        assert t.routed == t.resident + t.fetched + t.computed and t.resident > 0 and t.fetched > 0
        assert t.copied == 0 and t.computed == 0                   # CPU main device: slices used in place
    finally:
        detach(model)
    assert model.config._experts_implementation == "eager"
    assert not any(hasattr(m, "_allocator_experts") for m in model.modules())


def test_without_expert_awareness_streams_whole_modules(saved):
    folder, ref = saved["qwen3_moe"]
    plan, model = _offloaded(folder, ref)
    runtime = attach(model, plan, experts=False)
    try:
        assert runtime.experts == {} and any(u.name.endswith("mlp.experts") for u in runtime.units)
        _same(ref, model)
    finally:
        detach(model)


def _expert_bytes(runtime):
    routed = next(iter(runtime.experts.values()))
    return sum(m[0].numel() * m.element_size() for m in routed.metas.values())


@pytest.mark.parametrize("mode", ["fetch", "compute", "auto"])
def test_stand_in_accelerator_moves_only_routed_non_resident_experts(saved, mode):
    folder, ref = saved["qwen3_moe"]
    plan, model = _offloaded(folder, ref)
    layers = find_experts(model)
    where = {m.experts: ("main",) * 2 + ("cpu",) * (m.num_experts - 2) for m in layers}
    runtime = attach(model, None, device="stand-in", experts=where, expert_mode=mode)
    try:
        _same(ref, model)
        t, size = runtime.traffic, _expert_bytes(runtime)
        copies = [n for kind, *rest in runtime.device.log if kind == "copy" for n in rest]
        assert sum(copies) == t.copied == t.fetched * size          # exactly the fetched experts' slices
        assert t.routed == t.resident + t.fetched + t.computed and t.resident > 0
        if mode == "fetch":
            assert t.computed == 0 and t.activations == 0 and t.fetched > 0
        if mode == "compute":
            assert t.copied == 0 and t.computed > 0 and t.activations > 0
    finally:
        detach(model)


def test_decode_token_copies_at_most_the_routed_non_resident_experts(saved):
    folder, ref = saved["mixtral"]
    plan, model = _offloaded(folder, ref)
    layers = find_experts(model)
    where = {m.experts: ("main",) + ("cpu",) * (m.num_experts - 1) for m in layers}
    runtime = attach(model, None, device="stand-in", experts=where, expert_mode="fetch")
    try:
        ids = torch.randint(0, 128, (1, 5))
        with torch.no_grad():
            out = model(ids, use_cache=True)
            before = runtime.traffic.copied
            routed: list = []
            hooks = [model.get_submodule(m.experts).register_forward_pre_hook(
                lambda mod, args: routed.append(set(args[1].flatten().tolist()) - {0})) for m in layers]
            model(ids[:, -1:], **{cache_keyword(model): output_cache(out)}, use_cache=True)
            for h in hooks:
                h.remove()
        size = _expert_bytes(runtime)
        assert runtime.traffic.copied - before == sum(len(r) for r in routed) * size <= 2 * len(layers) * size
    finally:
        detach(model)


def test_profile_round_trip_and_counts(saved, tmp_path):
    _, ref = saved["olmoe"]
    batches = [torch.randint(0, 128, (2, 7)), {"input_ids": torch.randint(0, 128, (1, 5))}]
    profile = allocator.profile_experts(ref, batches)
    layers = find_experts(ref)
    assert set(profile.counts) == {m.experts for m in layers}
    assert profile.tokens == 2 * 7 + 5
    assert all(sum(row) == profile.tokens * 2 for row in profile.counts.values())    # top-2
    profile.save(tmp_path / "profile.json")
    assert allocator.ExpertProfile.load(tmp_path / "profile.json") == profile
    assert not any(m._forward_pre_hooks for m in ref.modules())                      # hooks removed
    with pytest.raises(allocator.InvalidModel):
        allocator.profile_experts(torch.nn.Linear(2, 2), [torch.zeros(1, 2)])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(allocator.InvalidOption):
        allocator.ExpertProfile.load(tmp_path / "bad.json")


def test_registered_implementation_falls_back_to_eager(saved):
    register()
    register()
    assert ALL_EXPERTS_FUNCTIONS[NAME] is experts_forward
    _, ref = saved["gpt_oss"]
    module = ref.get_submodule(find_experts(ref)[0].experts)
    h = torch.randn(3, ref.config.hidden_size)
    idx = torch.tensor([[0, 1], [2, 3], [1, 0]])
    w = torch.rand(3, 2)
    with torch.no_grad():
        assert_same_output(experts_forward(module, h, idx, w), eager_forward(module)(module, h, idx, w))


@pytest.mark.parametrize("mode", ["fetch", "compute", "auto"])
def test_experts_over_two_stand_in_accelerators_equal_eager(saved, mode):
    """Issue #39: a plan's experts over two accelerators, RAM and disk, and layers on either accelerator
    (``Runtime.runs_on``), run on the stand-in: an expert resident on the other accelerator is computed there or
    fetched from there per call; the offloaded ones are fetched in turns of ``fetch_chunk``; equal to eager."""
    from allocator.report.runtime import Runtime

    folder, ref = saved["qwen3_moe"]
    _, model = _offloaded(folder, ref)
    layers = find_experts(model)
    rows = {m.experts: (0, 1, "cpu") + ("disk",) * (m.num_experts - 3) for m in layers}
    homes = {m.experts: i % 2 for i, m in enumerate(layers)}
    spec = Runtime(name="allocator", main_device=0, experts=rows, expert_mode={k: mode for k in rows},
                   runs_on=homes, fetch_chunk={k: 2 for k in rows})
    runtime = attach(model, spec, device="stand-in")
    try:
        assert {r.home for r in runtime.experts.values()} == {0, 1}
        _same(ref, model)
        t = runtime.traffic
        assert t.routed == t.resident + t.fetched + t.computed + t.remote and t.resident > 0
        copies = [n for kind, *rest in runtime.device.log if kind == "copy" for n in rest]
        widest = max(m[0].numel() * m.element_size() for r in runtime.experts.values() for m in r.metas.values())
        assert t.fetched == 0 or max(copies) <= 2 * widest           # fetched in turns of fetch_chunk=2 experts
        if mode == "fetch":
            assert t.remote == 0 and t.peer > 0 and t.computed == 0
        if mode == "compute":
            assert t.remote > 0 and t.peer == 0 and t.computed > 0
    finally:
        detach(model)


def test_hooks_that_do_nothing_on_a_cpu_main_device_are_off_while_attached_and_put_back(saved):
    """On a CPU main device accelerate hooks every module not offloaded with an ``AlignDevicesHook`` that only sends
    CPU tensors to the CPU; the runtime takes those off while it runs (outputs unchanged) and detach puts back the
    very same hooks and forwards."""
    from accelerate.hooks import AlignDevicesHook

    folder, ref = saved["qwen3_moe"]
    plan, model = _offloaded(folder, ref)
    before = {name: (m.__dict__.get("_hf_hook"), m.__dict__.get("forward"), m.__dict__.get("_old_forward"))
              for name, m in model.named_modules()}
    idle = [name for name, m in model.named_modules() if type(m.__dict__.get("_hf_hook")) is AlignDevicesHook
            and not m._hf_hook.offload and not m._hf_hook.io_same_device]
    assert len(idle) > 10
    runtime = attach(model, plan)
    try:
        assert sorted(name for name, m in model.named_modules()
                      if any(t.module is m for t in runtime.passthrough)) == sorted(idle)
        assert all("_hf_hook" not in model.get_submodule(name).__dict__ for name in idle)
        assert model._hf_hook.io_same_device                       # the top module's hook stays
        _same(ref, model)
    finally:
        detach(model)
    after = {name: (m.__dict__.get("_hf_hook"), m.__dict__.get("forward"), m.__dict__.get("_old_forward"))
             for name, m in model.named_modules()}
    assert all(after[n][0] is before[n][0] and after[n][1] is before[n][1] and after[n][2] is before[n][2]
               for n in before)
    _same(ref, model)
