"""``allocator.plan_of(model)`` (issue #46): the :class:`allocator.Plan` behind a load under ``patch()``, with either
runtime, from ``from_pretrained`` and ``load_checkpoint_and_dispatch``; a typed error that says why where there is
none."""

from __future__ import annotations

import pytest
import torch

import allocator
from allocator import offload

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, RAM budget of half the model)."""
    folder = tmp_path_factory.mktemp("plan_of")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    model.save_pretrained(folder)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return folder, {"cpu": total // 2}


@pytest.mark.parametrize("runtime", ["accelerate", "allocator"])
def test_the_plan_of_a_patched_load(saved, runtime, tmp_path):
    folder, budgets = saved
    with allocator.patch(runtime=runtime):
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory=dict(budgets),
                                                     offload_folder=tmp_path / "offload")
    try:
        plan = allocator.plan_of(model)
        assert isinstance(plan, allocator.Plan) and plan.device_map == model.hf_device_map
        assert set(plan.device_map.values()) == {"cpu", "disk"}                # something was offloaded
        assert plan.explain().startswith(f"strategy {plan.strategy} for LlamaForCausalLM")
        assert plan.runtime.name == runtime
        attached = offload.runtime_of(model)
        assert (attached is not None) == (runtime == "allocator")
        if attached is not None:
            assert attached.plan == plan.runtime                              # the plan the runtime runs
    finally:
        if offload.runtime_of(model) is not None:
            offload.detach(model)


def test_the_plan_of_load_checkpoint_and_dispatch(saved, tmp_path):
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    folder, budgets = saved
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    with allocator.patch():
        model = load_checkpoint_and_dispatch(model, str(folder), device_map="auto", max_memory=dict(budgets),
                                             no_split_module_classes=["LlamaDecoderLayer"],
                                             offload_folder=str(tmp_path / "offload"))
    assert allocator.plan_of(model).device_map == model.hf_device_map


def test_no_plan_says_why(saved, tmp_path):
    folder, budgets = saved
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory=dict(budgets),
                                                 offload_folder=tmp_path / "offload")          # no patch
    with pytest.raises(allocator.NoPlan, match="not loaded under allocator.patch"):
        allocator.plan_of(model)
    with allocator.patch():   # a dict map is the caller's: nothing was planned
        model = AutoModelForCausalLM.from_pretrained(folder, device_map={"": "cpu"})
    with pytest.raises(allocator.NoPlan, match=r"allocator.plan\(model, max_memory\)"):
        allocator.plan_of(model)
