"""Expert discovery (allocator.model.experts, issue #33): every MoE family transformers ships, found from structure."""

from __future__ import annotations

import logging
import pathlib
import warnings

import pytest
import torch
import torch.nn as nn

from allocator.model.experts import MoELayer, find_experts

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

from moe_models import SMALL, small_model  # noqa: E402


def _families() -> dict[str, str]:
    """Model type of every family whose modeling file uses ``use_experts_implementation``, by family folder."""
    base = pathlib.Path(transformers.__file__).parent / "models"
    folders = {d.name for d in base.iterdir()
               if any("use_experts_implementation" in f.read_text() for f in d.glob("modeling_*.py"))}
    out = {}
    for model_type, cls in CONFIG_MAPPING.items():
        folder = cls.__module__.split(".")[-2]
        if folder in folders and folder not in out:
            out[folder] = model_type
    return out


FAMILIES = _families()
# Default configs that do not build a model at all in transformers 5.25 (nothing to discover); strict xfail, so a
# family that starts building is tested from then on.
DO_NOT_BUILD = {"deepseek_ocr2", "diffusion_gemma", "dots1", "hunyuan_v1_moe", "inkling", "lfm2_moe",
                "qwen3_omni_moe", "step3p7"}


def _meta_model(model_type: str):
    """The family's default config on the meta device with 6 layers, else 2, else all of them (some configs tie
    other fields to the layer count)."""
    error = None
    for layers in (6, 2, None):
        cfg = AutoConfig.for_model(model_type)
        for c in {id(cfg): cfg, id(cfg.get_text_config()): cfg.get_text_config()}.values():
            for f in ("num_hidden_layers", "num_layers"):
                if isinstance(getattr(c, f, None), int) and layers is not None:
                    setattr(c, f, min(getattr(c, f), layers))
        try:
            return _build(cfg)
        except Exception as err:   # noqa: BLE001 - try the next layer count
            error = err
    raise error


def _build(cfg):
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            try:
                return AutoModelForCausalLM.from_config(cfg)
            except ValueError:
                return AutoModel.from_config(cfg)
        finally:
            logging.disable(logging.NOTSET)


def _decorated(module) -> bool:
    """transformers' own mark of a fused experts module: a ``forward`` made by ``use_experts_implementation`` on its
    class or a base class."""
    forwards = [c.__dict__["forward"] for c in type(module).__mro__ if "forward" in c.__dict__]
    return any(hasattr(f, "__wrapped__") and "use_experts_implementation" in f.__code__.co_qualname for f in forwards)


def test_every_family_is_listed():
    assert len(FAMILIES) >= 60, sorted(FAMILIES)
    assert {"qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen2_moe", "deepseek_v3"} <= set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_discovery_matches_transformers_experts(family):
    if family in DO_NOT_BUILD:
        with pytest.raises(Exception):  # noqa: B017 - any error: the family's default config builds no model
            _meta_model(FAMILIES[family])
        pytest.xfail(f"{family}: its default config does not build a model in transformers 5.25")
    model = _meta_model(FAMILIES[family])
    layers = find_experts(model)
    expected = [name for name, m in model.named_modules() if _decorated(m)]
    assert [layer.experts for layer in layers] == expected
    for layer in layers:
        experts = model.get_submodule(layer.experts)
        assert layer.kind == "fused"
        assert {p.shape[0] for p in experts.parameters(recurse=False)} == {layer.num_experts}
        assert layer.expert_bytes * layer.num_experts == sum(
            p.numel() * p.element_size() for p in experts.parameters(recurse=False))
        router = model.get_submodule(layer.router)
        rows = {p.shape[0] for p in router.parameters() if p.dim() == 2}
        assert any(layer.num_experts <= r <= 2 * layer.num_experts for r in rows), (layer.router, rows)
        assert layer.experts not in layer.shared and layer.router not in layer.shared
        assert all(s.startswith(layer.block + ".") for s in layer.shared)
        config = model.config.get_text_config()
        declared = getattr(config, "num_experts_per_tok", None)
        if isinstance(declared, int):
            assert layer.top_k == declared


@pytest.mark.parametrize("family", sorted(SMALL))
def test_small_models_on_cpu(family):
    model = small_model(family, layers=3 if family == "deepseek_v3" else 2)
    layers = find_experts(model)
    assert layers and all(isinstance(layer, MoELayer) for layer in layers)
    assert all(layer.top_k == 2 for layer in layers)
    assert {layer.num_experts for layer in layers} == {4 if family in ("mixtral", "gpt_oss") else 8}
    if family in ("qwen2_moe", "deepseek_v3"):
        assert all(layer.shared for layer in layers)
    else:
        assert not any(layer.shared for layer in layers)
    if family == "deepseek_v3":
        assert [layer.block for layer in layers] == ["model.layers.1.mlp", "model.layers.2.mlp"]   # layer 0 is dense
    for layer in layers:   # nothing in the model is unchanged by discovery
        assert model.get_submodule(layer.experts).training is False


class ListMoE(nn.Module):
    """Experts as a ModuleList of identical MLPs (the layout before transformers 5), and a shared expert."""

    def __init__(self, experts=4, hidden=8):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 16), nn.ReLU(), nn.Linear(16, hidden))
                                     for _ in range(experts))
        self.shared = nn.Linear(hidden, hidden)


def test_list_experts():
    model = nn.Sequential(nn.Linear(8, 8), ListMoE(), ListMoE(experts=6))
    layers = find_experts(model)
    assert [(m.block, m.experts, m.router, m.shared, m.kind, m.num_experts) for m in layers] == [
        ("1", "1.experts", "1.router", ("1.shared",), "list", 4), ("2", "2.experts", "2.router", ("2.shared",),
                                                                    "list", 6)]
    assert layers[0].expert_bytes == (8 * 16 + 16 + 16 * 8 + 8) * 4
    assert layers[0].tensor_names(3) == ("1.experts.3.0.weight", "1.experts.3.0.bias", "1.experts.3.2.weight",
                                         "1.experts.3.2.bias")


def test_not_a_mixture():
    """A stack of identical layers without a router, a convolution's 3D weight: no experts."""
    stack = nn.Sequential(nn.ModuleList(nn.Linear(8, 8) for _ in range(4)), nn.Conv1d(8, 8, 3, groups=8, bias=False),
                          nn.Linear(8, 3))
    assert find_experts(stack) == ()
