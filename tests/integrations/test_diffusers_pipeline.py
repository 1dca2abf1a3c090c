"""``allocator.plan_pipeline`` on FLUX.1-dev's configs (no weights), and what ``DiffusionPipeline.from_pretrained(
device_map="balanced")`` does with it under ``allocator.patch()``, captured at diffusers' ``load_sub_model`` on the
meta device (no weights of that size exist here); where the patch falls back to diffusers' own placement; and a tiny
DiT pipeline really loaded under the patch, its components with their planned maps, its images compared to the
pipeline in RAM."""

from __future__ import annotations

import dataclasses
import json
import tempfile

import pytest
import torch

pytest.importorskip("diffusers")

import allocator  # noqa: E402
from diffusion_models import FLUX_DEV, write_configs  # noqa: E402

pytestmark = pytest.mark.slow
GIB = 2**30
BUDGET = {0: "16GiB", 1: "16GiB", "cpu": "64GiB"}


@pytest.fixture(scope="module")
def flux_dev():
    return write_configs(tempfile.mkdtemp())


@pytest.fixture(scope="module")
def flux_plan(flux_dev):
    return allocator.plan_pipeline(flux_dev, BUDGET, dtype=torch.bfloat16)


def test_flux_dev_on_two_16gib_gpus(flux_plan):
    p = flux_plan
    assert p.valid
    assert set(p.components) == {"transformer", "text_encoder", "text_encoder_2", "vae"}
    assert p.on("transformer") == {0, 1}                      # on the GPUs, split across them
    assert all("disk" not in p.on(n) for n in p.components) and "cpu" not in p.on("transformer")
    assert all(p.peak[d] <= 16 * GIB for d in (0, 1))
    assert p.sizes["transformer"] > 22 * GIB and p.runs["transformer"] == 28 and p.runs["vae"] == 1
    assert p.plans["transformer"].valid and p.plans["transformer"].device_map == p.components["transformer"]
    data = json.loads(json.dumps(p.to_dict()))
    assert data["valid"] and data["components"]["vae"] in {"0", "1"}
    assert "transformer" in p.explain() and "with a map of its own over ['0', '1']" in p.explain()
    assert p.execution["transformer"] == "split" and p.runs_on["transformer"] == 0
    assert all(p.runs_on[n] == p.components[n] for n in p.components if p.execution[n] == "resident")
    assert all(p.runs_on[n] in (0, 1) for n in p.components)   # every component computes on a GPU
    assert data["execution"] == p.execution and data["runs_on"]["transformer"] == "0"
    assert "transformer: split, computes on 0" in p.explain()


def test_diffusers_own_balanced_sends_the_transformer_to_the_cpu(flux_plan):
    """What the issue describes, through diffusers' own function: the 22 GiB denoiser goes to the CPU whole."""
    from diffusers.pipelines.pipeline_loading_utils import _assign_components_to_devices

    sizes = dict(sorted(flux_plan.sizes.items(), key=lambda kv: kv[1], reverse=True))
    theirs = _assign_components_to_devices(sizes, {0: 16 * GIB, 1: 16 * GIB})
    assert "transformer" in theirs["cpu"]


def test_frequency_decides_who_gets_the_gpu():
    """A Flux with a small transformer (2 + 2 blocks, about 1.9 GiB) beside T5-XXL (8.9 GiB) on one 10 GiB GPU: both do
    not fit whole together. At 28 steps and at one, every component computes on the GPU (moved in when it runs, or
    streaming what does not fit), none on the CPU; the denoiser's price per image follows its runs."""
    small = {**FLUX_DEV, "transformer/config.json": {**FLUX_DEV["transformer/config.json"], "num_layers": 2,
                                                     "num_single_layers": 2}}
    folder = write_configs(tempfile.mkdtemp(), small)
    budget = {0: "10GiB", "cpu": "64GiB"}
    many = allocator.plan_pipeline(folder, budget, dtype=torch.bfloat16, steps=28)
    assert many.valid and many.runs["transformer"] == 28 and set(many.runs_on.values()) == {0}, many.explain()
    assert "cpu" not in many.execution.values()
    one = allocator.plan_pipeline(folder, budget, dtype=torch.bfloat16, steps=1)
    assert one.valid and one.runs["transformer"] == 1 and set(one.runs_on.values()) == {0}
    assert one.seconds["transformer"] < many.seconds["transformer"]


def test_patched_pipeline_load_splits_the_transformer(flux_dev, flux_plan, monkeypatch):
    import diffusers
    import diffusers.models.modeling_utils as modeling_utils
    import diffusers.pipelines.pipeline_utils as pipeline_utils

    calls = {}

    def recorder(**kwargs):   # diffusers' load_sub_model, on the meta device: records the call, loads nothing
        calls[kwargs["name"]] = kwargs
        if kwargs["name"] == "transformer":   # what its from_pretrained would map it to, under the patch
            with torch.device("meta"):
                model = diffusers.FluxTransformer2DModel.from_config(
                    diffusers.FluxTransformer2DModel.load_config(f"{flux_dev}/transformer"))
            calls["transformer_map"] = modeling_utils._determine_device_map(
                model, kwargs["device_map"], kwargs["max_memory"], kwargs["dtype"])
        return None

    monkeypatch.setattr(pipeline_utils, "load_sub_model", recorder)
    with allocator.patch():
        diffusers.DiffusionPipeline.from_pretrained(flux_dev, device_map="balanced", max_memory=dict(BUDGET),
                                                    torch_dtype=torch.bfloat16)
    assert calls["transformer"]["device_map"] == "auto"
    assert calls["transformer_map"] == flux_plan.components["transformer"]
    for name in ("text_encoder", "text_encoder_2", "vae"):
        where = flux_plan.components[name]
        assert calls[name]["device_map"] == ("auto" if isinstance(where, dict) else {"": where})
    calls.clear()
    diffusers.DiffusionPipeline.from_pretrained(flux_dev, device_map="balanced", max_memory=dict(BUDGET),
                                                torch_dtype=torch.bfloat16)   # unpatched: diffusers' own
    assert calls["transformer"]["device_map"] == {"": "cpu"}


def test_a_component_transformers_cannot_read_is_one_sentence_and_keeps_its_error(tmp_path):
    from allocator.pipelines.components import read_components

    (tmp_path / "model_index.json").write_text(json.dumps({"text_encoder": ["transformers", "CLIPTextModel"]}))
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(allocator.InvalidModel) as raised:
        read_components(str(tmp_path))
    assert str(raised.value) == (f"cannot build CLIPTextModel from {tmp_path / 'text_encoder'}: ValueError: The "
                                 "checkpoint you are trying to load has model type `no-such-architecture` but "
                                 "Transformers does not recognize this architecture; fix the config's fields it "
                                 "names.")
    assert isinstance(raised.value.__cause__, ValueError) and "pip install" in str(raised.value.__cause__)


def test_a_peak_over_its_budget_makes_the_pipeline_plan_invalid(flux_plan):
    """``valid`` reads every device's peak against its budget: one byte over on any device, and the plan is invalid,
    whatever its components' own plans say; exactly at the budget, it stays valid."""
    assert flux_plan.valid
    for device in flux_plan.peak:
        at = dataclasses.replace(flux_plan, peak={**flux_plan.peak, device: flux_plan.budgets[device]})
        over = dataclasses.replace(flux_plan, peak={**flux_plan.peak, device: flux_plan.budgets[device] + 1})
        assert at.valid and not over.valid, device
        assert not over.to_dict()["valid"] and "INVALID" in over.explain()


def _component_maps(folder, monkeypatch, *, patched: bool, **kwargs) -> dict:
    """The ``device_map`` each component's ``load_sub_model`` gets from ``DiffusionPipeline.from_pretrained(folder,
    device_map="balanced", ...)``, patched or not (``load_sub_model`` recorded on the meta device, nothing loaded)."""
    import contextlib

    import diffusers
    import diffusers.pipelines.pipeline_utils as pipeline_utils

    calls = {}

    def recorder(**call):
        calls[call["name"]] = call["device_map"]

    monkeypatch.setattr(pipeline_utils, "load_sub_model", recorder)
    with allocator.patch() if patched else contextlib.nullcontext():
        diffusers.DiffusionPipeline.from_pretrained(folder, device_map="balanced", max_memory=dict(BUDGET), **kwargs)
    return calls


@pytest.mark.parametrize("case", ["dtype dict", "passed component"])
def test_patched_pipeline_load_falls_back_to_diffusers_own_placement(flux_dev, monkeypatch, case):
    """A ``torch_dtype`` per component, or a component passed in (loaded already): ``plan_pipeline`` does not model
    these, so the patched load places components exactly as diffusers does unpatched."""
    import diffusers

    if case == "dtype dict":
        kwargs = dict(torch_dtype={"transformer": torch.bfloat16, "default": torch.float32})
    else:
        with torch.device("meta"):
            vae = diffusers.AutoencoderKL.from_config(diffusers.AutoencoderKL.load_config(f"{flux_dev}/vae"))
        kwargs = dict(torch_dtype=torch.bfloat16, vae=vae)
    ours = _component_maps(flux_dev, monkeypatch, patched=True, **kwargs)
    theirs = _component_maps(flux_dev, monkeypatch, patched=False, **kwargs)
    assert ours == theirs, (ours, theirs)
    plain = _component_maps(flux_dev, monkeypatch, patched=True, torch_dtype=torch.bfloat16)
    assert plain["transformer"] == "auto" and ours["transformer"] != "auto"   # the patch's own plan, without them


def _tiny_dit(folder: str) -> None:
    """A DiT pipeline (transformer, VAE, scheduler; no tokenizer) with random weights, saved in ``folder``."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                                  out_channels=8, num_layers=4, sample_size=8, patch_size=2,
                                                  num_embeds_ada_norm=1000, norm_num_groups=8)
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                                  layers_per_block=1, sample_size=16)
    diffusers.DiTPipeline(transformer=transformer, vae=vae, scheduler=diffusers.DDIMScheduler()).save_pretrained(folder)


def _stand_in(where):
    """A planned placement as this machine loads it: the accelerator stood in by RAM, RAM by the disk. A whole
    component is loaded in RAM as a map of its own (``{"": "cpu"}``): diffusers' pipeline loading dispatches a
    component it places on ``"cpu"`` with GPU 0 as its main device, which this machine does not have."""
    if isinstance(where, dict):
        return {k: "disk" if d in ("cpu", "disk") else "cpu" for k, d in where.items()}
    return {"": "cpu"}


def test_patched_pipeline_load_gives_components_their_planned_maps_and_the_same_images(monkeypatch, tmp_path):
    """``DiffusionPipeline.from_pretrained(device_map="balanced")`` under ``allocator.patch()``, really loaded: each
    component with a map of its own (the transformer, the GPU budget being 0.6 of it) is loaded by diffusers
    with exactly its planned map, and the images equal the pipeline loaded in RAM (``assert_close``, float32). No
    GPU here: ``plan_pipeline`` runs as the patch calls it, and its placements are loaded with the accelerator stood
    in by RAM and RAM by the disk (:func:`_stand_in`), so every offloaded part runs from ``offload_folder``."""
    import diffusers

    from allocator.integrations import diffusers as integration

    folder = str(tmp_path / "dit")
    _tiny_dit(folder)
    ram = diffusers.DiTPipeline.from_pretrained(folder)
    sizes = {n: sum(p.numel() * p.element_size() for p in m.parameters()) for n, m in ram.components.items()
             if isinstance(m, torch.nn.Module)}
    budget = {0: int(sizes["transformer"] * 0.6), "cpu": 10 * sum(sizes.values())}
    planned = allocator.plan_pipeline(folder, budget)
    assert planned.valid and set(planned.components) == {"transformer", "vae"}
    assert isinstance(planned.components["transformer"], dict)
    assert {0, "cpu"} <= set(planned.components["transformer"].values())
    real = integration.plan_pipeline

    def stood_in(*args, **kwargs):
        result = real(*args, **kwargs)
        whole = {n: {"cpu": 1 << 40} for n, w in result.components.items() if not isinstance(w, dict)}
        return dataclasses.replace(result, components={n: _stand_in(w) for n, w in result.components.items()},
                                   given={**result.given, **whole})

    monkeypatch.setattr(integration, "plan_pipeline", stood_in)
    with allocator.patch():
        pipe = diffusers.DiTPipeline.from_pretrained(folder, device_map="balanced", max_memory=dict(budget),
                                                     offload_folder=str(tmp_path / "offload"))
    for name, where in planned.components.items():
        assert getattr(pipe, name).hf_device_map == _stand_in(where), name
    run = dict(class_labels=[1], num_inference_steps=2, output_type="pt")
    with torch.no_grad():
        want = ram(generator=torch.Generator().manual_seed(3), **run).images
        got = pipe(generator=torch.Generator().manual_seed(3), **run).images
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
