"""Model families (issue #46, "a model family is one place"): each family is one :class:`Family` behind one small
interface, registered in ``FAMILIES``; the reader, the problem's builder and the generation budget call its hooks.

The scratch family here (``timm_like``, classes of a made-up library) is registered for one test with its own
no-split rule, shown honoured by ``plan()``, and unregistered: no file of the package is touched to add it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import allocator
from allocator.errors import InvalidOption
from allocator.model import build_graph
from allocator.model.families import FAMILIES, Family, family_of
from allocator.model.families.diffusers import DIFFUSERS
from allocator.model.families.plain import TORCH
from allocator.model.families.transformers import TRANSFORMERS
from allocator.problem import build_problem


class Stage(nn.Module):
    """A stage of a made-up vision library: its stages differ in width, so none repeats and none is inferred."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width_in, width_out), nn.Linear(width_out, width_out)

    def forward(self, x):
        return self.fc2(self.fc1(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.stages = nn.Sequential(Stage(32, 64), Stage(64, 128), Stage(128, 64))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))


Stage.__module__ = Net.__module__ = "timm_like.models"   # as if imported from the made-up library

NET_BUDGET = {0: 80_000, "cpu": 10_000_000}
"""GPU 0 holds the stem, the head and half of the first stage (measured: 178,856 bytes in all, 25,088 in stage 0)."""


def is_timm_like(model) -> bool:
    return type(model).__module__.startswith("timm_like.")


def stage_rule(model, walked) -> set[str]:
    """The made-up library's no-split rule: its stages stay whole."""
    return {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Stage")}


def split_stages(device_map) -> list[str]:
    """The keys of ``device_map`` inside a stage (a stage split across devices)."""
    return sorted(k for k in device_map if k.startswith("stages.") and k.count(".") > 1)


def tiny_llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=64, **extra)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_each_library_model_has_its_family():
    from diffusion_models import flux

    assert family_of(tiny_llama()) is TRANSFORMERS
    assert family_of(flux()) is DIFFUSERS
    assert family_of(Net()) is TORCH
    assert family_of(nn.Sequential(nn.Linear(2, 2))) is TORCH
    assert (TRANSFORMERS.loader, DIFFUSERS.loader, TORCH.loader) == ("transformers", "accelerate", None)


def test_a_new_family_no_split_rule_is_honoured_by_plan():
    model = Net()
    before = allocator.plan(model, NET_BUDGET)
    assert split_stages(before.device_map), "the control: without the family, the first stage is split"
    FAMILIES["timm_like"] = Family("timm_like", matches=is_timm_like, no_split=stage_rule)
    try:
        assert family_of(model).name == "timm_like"
        assert build_graph(model).no_split == {"Stage"}
        after = allocator.plan(model, NET_BUDGET)
    finally:
        del FAMILIES["timm_like"]
    assert after.valid and not split_stages(after.device_map), after.device_map
    assert after.device_map != before.device_map
    assert family_of(model) is TORCH
    assert allocator.plan(model, NET_BUDGET).device_map == before.device_map


def test_a_family_infers_its_own_blocks_where_nothing_is_declared():
    family = Family("stages", matches=is_timm_like, infer_no_split=lambda model: {"Stage"})
    assert build_graph(Net()).no_split == frozenset()
    assert build_graph(Net(), family=family).no_split == {"Stage"}
    assert build_graph(Net(), family=family, infer_no_split=False).no_split == frozenset()


def test_the_newest_family_is_asked_first():
    model = tiny_llama()
    FAMILIES["llama"] = Family("llama", matches=lambda m: type(m).__name__.startswith("Llama"), loader="accelerate")
    try:
        assert family_of(model).name == "llama"
        assert family_of(Net()) is TORCH
    finally:
        del FAMILIES["llama"]
    assert family_of(model) is TRANSFORMERS


def test_the_problem_reads_experts_through_the_family():
    from moe_models import small_model

    model = small_model("mixtral")
    found = build_problem(model, {0: "1GB", "cpu": "1GB"}, runtime="allocator").moe
    assert len(found) == 2
    FAMILIES["no_experts"] = Family("no_experts", matches=lambda m: m is model, experts=lambda m: ())
    try:
        assert build_problem(model, {0: "1GB", "cpu": "1GB"}, runtime="allocator").moe == ()
    finally:
        del FAMILIES["no_experts"]


def test_the_generation_cache_is_built_by_the_family():
    from allocator.model.generation import generation_needs

    model = tiny_llama()
    budget = allocator.GenerationBudget(1, 16)
    graph = build_graph(model)
    assert generation_needs(model, graph, budget).cache_bytes > 0
    shared = Family("shared", matches=bool, cache_layers=lambda config, count: [("shared", None)] * count)
    assert generation_needs(model, graph, budget, family=shared).cache_bytes == 0


def test_a_family_that_does_not_generate_refuses_a_generation_budget():
    from diffusion_models import flux

    with pytest.raises(InvalidOption, match="is a diffusers model, which does not generate tokens"):
        allocator.plan(flux(), {"cpu": "1GB"}, generation=allocator.GenerationBudget(1, 16))


def test_declared_ties_are_read_through_the_family():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.all_tied_weights_keys = {"1.weight": "0.weight"}
    assert build_graph(model).declared_ties == (("0.weight", "1.weight"),)
    untied = Family("untied", matches=bool, tied_keys=lambda m: None)
    assert build_graph(model, family=untied).declared_ties == ()


def test_the_pipeline_components_follow_their_family_loader():
    from transformers import CLIPTextConfig, CLIPTextModel

    from allocator.pipelines.components import Component
    from diffusion_models import flux

    with torch.device("meta"):
        encoder = CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, vocab_size=64))
    for component in (Component("transformer", flux(), "diffusers"), Component("text_encoder", encoder,
                                                                               "transformers")):
        assert family_of(component.model).loader == component.loader


@pytest.mark.parametrize("fields, words", [
    (dict(name=""), "non-empty str"),
    (dict(no_split=3), "no_split must be callable"),
    (dict(loader="disk"), "loader must be one of"),
])
def test_a_family_is_checked_when_made(fields, words):
    with pytest.raises(InvalidOption, match=words):
        Family(**{"name": "x", "matches": bool, **fields})
