"""A target and its draft model placed together (issue #47, :func:`allocator.plan_together`): both KV caches and both
models' weights kept, the larger of what one needs while it runs, both orders tried; real loads of the joint maps
generate the same tokens with ``assistant_model=`` as the two models in RAM."""

from __future__ import annotations

import warnings

import pytest
import torch

import allocator
from allocator.model import zoo
from allocator.pipelines.together import PERSISTENT

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

GEN = allocator.GenerationBudget(1, 8192)


def _together(budget, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return allocator.plan_together({"model": zoo.build("llama-8b"), "assistant_model": zoo.build("llama-3.2-1b")},
                                       budget, generation=GEN, dtype=torch.bfloat16, **options)


def _joint_peak(joint, device) -> int:
    """What every model keeps on ``device`` plus the most one of them needs there while it runs, from their plans."""
    kept = sum(p.parts.get(device, {}).get(k, 0) for p in joint.plans.values() for k in PERSISTENT)
    running = max(sum(v for k, v in p.parts.get(device, {}).items() if k not in PERSISTENT)
                  for p in joint.plans.values())
    return kept + running


@pytest.mark.slow
def test_llama_8b_and_its_1b_draft_both_whole_on_one_24gib_gpu_with_both_caches():
    joint = _together({0: "24GiB", "cpu": "64GiB"})
    assert joint.valid
    for name, p in joint.plans.items():
        assert p.resident("cpu") == p.resident("disk") == 0, name          # whole on GPU 0
        assert p.parts[0]["cache"] > 0, name                                 # its KV cache there too
    limit = 24 * 2 ** 30
    assert joint.peak[0] == _joint_peak(joint, 0) <= limit
    assert joint.step_seconds == pytest.approx(joint.plans["model"].costs["decode"].seconds
                                               + 5 * joint.plans["assistant_model"].costs["decode"].seconds)


@pytest.mark.slow
def test_on_16gib_the_plan_says_what_is_offloaded_and_prices_an_assisted_step():
    joint = _together({0: "16GiB", "cpu": "64GiB"})
    assert joint.valid and joint.peak[0] <= 16 * 2 ** 30 and joint.peak[0] == _joint_peak(joint, 0)
    target, draft = joint.plans["model"], joint.plans["assistant_model"]
    assert target.resident("cpu") > 0                        # the target streams part of itself
    assert draft.main_device == 0 and draft.resident(0) > 0  # the draft, run 5 times a step, not left on the CPU
    text = joint.explain()
    assert "model: LlamaForCausalLM, main device 0" in text and "cpu: " in text and "per assisted step" in text
    # planned alone, each takes the whole GPU: together they would need more than it has
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = [allocator.plan(zoo.build(n), {0: "16GiB", "cpu": "64GiB"}, generation=GEN, dtype=torch.bfloat16)
                 for n in ("llama-8b", "llama-3.2-1b")]
    assert sum(p.peak[0] for p in alone) > 16 * 2 ** 30


def test_a_joint_plan_of_two_tiny_models_keeps_the_joint_peak_within_the_budget():
    """Where the GPU holds the target but not both, the joint peak (both kept, the larger of their runs) stays within
    it, whichever order is kept; the assisted step is priced."""
    config = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256, max_position_embeddings=128)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=4, **config))
        draft = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=1, **config))
    gen = allocator.GenerationBudget(1, 64)
    sizes = {n: allocator.build_problem(m, {"cpu": 10 ** 9}).graph.total for n, m in
             (("model", target), ("assistant_model", draft))}
    budget = {0: sizes["model"] + sizes["assistant_model"] // 2, "cpu": 10 * sum(sizes.values())}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        joint = allocator.plan_together({"model": target, "assistant_model": draft}, budget, generation=gen)
    assert joint.valid and joint.peak[0] <= budget[0]
    orders = {tuple(order) for order in (("model", "assistant_model"), ("assistant_model", "model"))}
    assert joint.order in orders and joint.step_seconds is not None
    assert joint.peak[0] == _joint_peak(joint, 0)
    assert sum(p.resident(0) for p in joint.plans.values()) <= budget[0]


def test_a_generation_budget_for_a_model_not_given_is_a_typed_error():
    with pytest.raises(allocator.InvalidOption, match="not among the models"):
        allocator.plan_together({"model": torch.nn.Linear(4, 4)}, {"cpu": 10 ** 6}, generation={"draft": GEN})
    with pytest.raises(allocator.InvalidOption, match="at least one model"):
        allocator.plan_together({}, {"cpu": 10 ** 6})


@pytest.mark.slow
def test_real_loads_of_the_joint_maps_generate_what_the_pair_in_ram_generates(tmp_path):
    """A tiny target and draft saved, planned together over a GPU-less budget that offloads part of the target, loaded
    with their maps by ``from_pretrained``: ``generate(assistant_model=...)`` gives the same greedy tokens as the two
    models in RAM."""
    config = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    folders = {}
    for name, layers in (("model", 4), ("assistant_model", 1)):
        model = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=layers, **config)).eval()
        model.save_pretrained(tmp_path / name)
        folders[name] = tmp_path / name
    ram = {n: AutoModelForCausalLM.from_pretrained(f).eval() for n, f in folders.items()}
    sizes = {n: sum(p.numel() * p.element_size() for p in m.parameters()) for n, m in ram.items()}
    with torch.device("meta"):
        metas = {n: AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=4 if n == "model" else 1, **config))
                 for n in folders}
    budget = {"cpu": sizes["assistant_model"] + sizes["model"] // 2 + 200_000, "disk": "1GiB"}
    gen = allocator.GenerationBudget(1, 32)
    joint = allocator.plan_together(metas, budget, generation=gen)
    assert joint.valid and "disk" in set(joint.plans["model"].device_map.values())
    loaded = {n: AutoModelForCausalLM.from_pretrained(folders[n], device_map=joint.plans[n].device_map,
                                                       offload_folder=tmp_path / f"offload-{n}").eval()
              for n in folders}
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = ram["model"].generate(prompt, assistant_model=ram["assistant_model"], **kwargs)
    got = loaded["model"].generate(prompt, assistant_model=loaded["assistant_model"], **kwargs)
    assert torch.equal(got, want)
    assert torch.equal(want, ram["model"].generate(prompt, **kwargs))   # assisted decoding keeps greedy's tokens
