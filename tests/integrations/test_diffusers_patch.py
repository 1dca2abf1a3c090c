"""diffusers' ``ModelMixin.from_pretrained(device_map=...)`` under ``allocator.patch()``: real loads of small random
Flux and SD3 transformers saved with ``save_pretrained`` (one safetensors file, and sharded), a RAM budget of half
the model and the rest on disk (``offload_folder``). The patched load gets allocator's map, keeps at least the bytes
in RAM that diffusers' own map keeps, and computes what the model in RAM computes."""

from __future__ import annotations

import functools
import importlib
import tempfile

import pytest
import torch

pytest.importorskip("diffusers")

import allocator  # noqa: E402
from diffusion_models import bytes_on, flux, flux_inputs, model_bytes, sd3, sd3_inputs  # noqa: E402

pytestmark = pytest.mark.slow
TOL = dict(rtol=1e-4, atol=1e-5)
MODELS = {"flux": (flux, flux_inputs), "sd3": (sd3, sd3_inputs)}


@functools.cache
def _built(name: str, shard: str | None = None):
    """The model ``name`` (never changed by the tests) and a folder it is saved in, once per test process."""
    model = MODELS[name][0]()
    return model, _saved(model, **({"max_shard_size": shard} if shard else {}))


def _saved(model, **kwargs) -> str:
    folder = tempfile.mkdtemp()
    model.save_pretrained(folder, **kwargs)
    return folder


def _load(model, folder, budget, **kwargs):
    return type(model).from_pretrained(folder, device_map="auto", max_memory=dict(budget),
                                       offload_folder=tempfile.mkdtemp(), **kwargs)


@pytest.mark.parametrize("name,shard", [("flux", None), ("sd3", None), ("flux", "40KB")])
def test_patched_load_gets_allocators_map_and_same_outputs(name, shard):
    inputs = MODELS[name][1]
    model, folder = _built(name, shard)
    budget = {"cpu": f"{model_bytes(model) / 2048:.1f}KiB"}
    with torch.no_grad():
        reference = model(**inputs())[0]
        theirs = _load(model, folder, budget)
        with allocator.patch():
            ours = _load(model, folder, budget)
        expected = allocator.plan(model, budget, loader="accelerate", baseline=theirs.hf_device_map).device_map
        assert ours.hf_device_map == expected
        assert ours.hf_device_map != theirs.hf_device_map
        assert "disk" in ours.hf_device_map.values()
        assert bytes_on(model, ours.hf_device_map, "cpu") >= bytes_on(model, theirs.hf_device_map, "cpu")
        torch.testing.assert_close(theirs(**inputs())[0], reference, **TOL)
        torch.testing.assert_close(ours(**inputs())[0], reference, **TOL)


def test_flux_at_half_ram_keeps_blocks_in_ram_where_diffusers_sends_all_to_disk():
    model, folder = _built("flux")
    budget = {"cpu": f"{model_bytes(model) / 2048:.1f}KiB"}
    theirs = _load(model, folder, budget)
    with allocator.patch():
        ours = _load(model, folder, budget)
    blocks = [k for k in model.state_dict() if "transformer_blocks" in k]
    on_disk = lambda m: {bytes_on(model, m.hf_device_map, "disk")}   # noqa: E731
    assert all(theirs.hf_device_map.get(k.split(".")[0]) == "disk" for k in blocks)   # what the issue measured
    assert bytes_on(model, ours.hf_device_map, "cpu") > 2 * bytes_on(model, theirs.hf_device_map, "cpu")
    assert on_disk(ours) != on_disk(theirs)


def test_plan_keeps_declared_blocks_whole():
    model = flux()
    assert set(model._no_split_modules) == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    result = allocator.plan(model, {"cpu": f"{model_bytes(model) / 2048:.1f}KiB"})
    assert result.valid
    for key in result.device_map:
        parts = key.split(".")
        assert not (parts[0].endswith("transformer_blocks") and len(parts) > 2), key


def test_runtime_allocator_attaches_to_a_diffusers_load_with_its_plan():
    """``patch(runtime="allocator")`` on a diffusers load ends as ``plan()`` + ``attach(model, plan)`` would: the map
    of the plan made for the runtime (diffusers' own map the baseline), the runtime that plan decided (its prefetch
    depth: 0 here, where the runtime's default without a plan is 1), and outputs equal to the model in RAM."""
    model, folder = _built("flux")
    budget = {"cpu": f"{model_bytes(model) / 2048:.1f}KiB"}
    theirs = _load(model, folder, budget)
    expected = allocator.plan(model, budget, runtime="allocator", loader="accelerate", baseline=theirs.hf_device_map)
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
        with allocator.patch(runtime="allocator") as handle:
            assert "diffusers.models.modeling_utils.dispatch_model" in handle.patched
            ours = _load(model, folder, budget)
        runtime = ours._allocator_runtime
        assert ours.hf_device_map == expected.device_map
        assert runtime.plan == expected.runtime and runtime.prefetch == expected.runtime.prefetch == 0
        torch.testing.assert_close(ours(**flux_inputs())[0], reference, **TOL)


def test_unpatch_restores_diffusers():
    modeling_utils = importlib.import_module("diffusers.models.modeling_utils")
    original = modeling_utils._determine_device_map, modeling_utils.dispatch_model
    with allocator.patch(runtime="allocator"):
        assert modeling_utils._determine_device_map is not original[0]
    assert (modeling_utils._determine_device_map, modeling_utils.dispatch_model) == original


def test_string_and_dict_maps_pass_through():
    """A dict map and a device name are diffusers' own business: the replacement hands them on unchanged."""
    model, folder = _built("flux")
    with allocator.patch():
        loaded = type(model).from_pretrained(folder, device_map={"": "cpu"})
    assert loaded.hf_device_map == {"": "cpu"}
