"""``allocator.plan_pipeline`` on the configs of real 2025-26 pipelines (meta device, bfloat16, no weights): each
device's joint peak (what every component keeps there + the most one needs while it runs, activations at the
``DiffusionBudget``'s sizes included) within its budget, and each component run where the issue (#47) asks.

All sizes and peaks here are estimates from the configs; nothing is loaded or timed."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch

pytest.importorskip("diffusers")

import allocator  # noqa: E402
from diffusion_models import FLUX_DEV, QWEN_IMAGE, WAN_T2V_14B, Z_IMAGE_TURBO, write_configs  # noqa: E402

GIB = 2**30


def planned(files, budget, size, **kwargs):
    return allocator.plan_pipeline(write_configs(tempfile.mkdtemp(), files), budget, budget=size,
                                   dtype=torch.bfloat16, **kwargs)


def holds(p, device) -> int:
    """Bytes the plan keeps on ``device`` plus the most one component needs there while it runs, recounted from the
    components' own sizes, activations and plans (not from ``p.peak``)."""
    kept, running = 0, 0
    for name, how in p.execution.items():
        if how == "split":
            own = p.plans[name]
            kept += sum(own.parts.get(device, {}).get(k, 0) for k in ("weights", "experts", "expert_cache", "cache"))
            run = sum(v for k, v in own.parts.get(device, {}).items()
                      if k not in ("weights", "experts", "expert_cache", "cache"))
            running = max(running, run + (p.activations[name] if own.main_device == device else 0))
        elif how == "moved":
            kept += p.sizes[name] if device == "cpu" else 0
            running = max(running, p.sizes[name] + p.activations[name] if p.runs_on[name] == device else 0)
        else:
            kept += p.sizes[name] if p.components[name] == device else 0
            running = max(running, p.activations[name] if p.runs_on[name] == device else 0)
    return kept + running


def check_joint_peaks(p):
    assert p.valid, p.explain()
    for device, limit in p.budgets.items():
        assert holds(p, device) == p.peak.get(device, 0) <= limit, (device, p.explain())
    assert all("disk" not in p.on(n) for n in p.components)
    data = json.loads(json.dumps(p.to_dict()))
    assert data["execution"] == p.execution and data["valid"]


@pytest.fixture(scope="module")
def flux():
    return planned(FLUX_DEV, {0: "16GiB", 1: "16GiB", "cpu": "64GiB"}, allocator.DiffusionBudget(1024, 1024))


def test_flux_dev_on_two_16gib_gpus_at_1024(flux):
    p = flux
    check_joint_peaks(p)
    assert p.on("transformer") == {0, 1} and p.runs_on["transformer"] == 0     # on the GPUs only
    vae = p.runs_on["vae"]
    assert vae in (0, 1) and p.activations["vae"] > GIB                        # the decode at 1024² counted ...
    assert p.peak[vae] - p.activations["vae"] >= sum(                          # ... on top of what stays there
        p.sizes[n] for n in p.components if p.components[n] == vae)
    assert "estimate" in p.explain() and "joint peak" in p.explain()


def test_qwen_image_balanced_on_two_40gib_gpus_at_1328():
    p = planned(QWEN_IMAGE, {0: "40GiB", 1: "40GiB", "cpu": "64GiB"},
                allocator.DiffusionBudget(1328, 1328, steps=50), balanced=True)
    check_joint_peaks(p)
    assert all(p.peak[d] <= 0.9 * 40 * GIB for d in (0, 1)), p.explain()
    vae = p.runs_on["vae"]
    assert vae in (0, 1) and p.execution["vae"] in ("resident", "moved")
    assert p.activations["vae"] > 4 * GIB and p.peak[vae] >= p.activations["vae"] + p.sizes["vae"]
    # diffusers' own balanced puts the 38 GiB transformer whole on one GPU, over 90 % with its activations
    from diffusers.pipelines.pipeline_loading_utils import _assign_components_to_devices

    sizes = dict(sorted(p.sizes.items(), key=lambda kv: kv[1], reverse=True))
    theirs = _assign_components_to_devices(sizes, {0: 40 * GIB, 1: 40 * GIB})
    fullest = max(sum(p.sizes[n] for n in names) for d, names in theirs.items() if d != "cpu")
    assert fullest > 0.9 * 40 * GIB > max(p.peak[0], p.peak[1])


def test_z_image_turbo_on_one_12gib_gpu_moves_every_component_onto_it():
    """A 12 GiB card (the transformer alone is 11.5 GiB in bfloat16): every component lives in RAM and is moved
    onto GPU 0 when it runs, so GPU 0 holds one component and its activations at a time."""
    p = planned(Z_IMAGE_TURBO, {0: "12GiB", "cpu": "32GiB"}, allocator.DiffusionBudget(1024, 1024, steps=8,
                                                                                        guidance=0.0))
    check_joint_peaks(p)
    assert set(p.runs_on.values()) == {0}, p.explain()
    assert p.execution["transformer"] == p.execution["text_encoder"] == "moved"
    assert p.peak[0] >= p.sizes["vae"] + p.activations["vae"]
    assert any("moved whole onto 0" in d.text and "computed on the CPU it would take" in d.text
               for d in p.decisions)


def test_wan_t2v_14b_on_24gib_and_42gib_ram_at_480p_81_frames():
    p = planned(WAN_T2V_14B, {0: "24GiB", "cpu": "42GiB"},
                allocator.DiffusionBudget(480, 832, frames=81, steps=50))
    check_joint_peaks(p)
    assert p.runs_on["transformer"] == 0 and p.runs_on["vae"] == 0
    assert p.activations["transformer"] > 2 * GIB and p.activations["vae"] > 2 * GIB   # 21 latent frames, 4 per chunk
    assert p.peak["cpu"] <= 42 * GIB


def test_a_rarely_run_component_is_moved_or_computed_where_it_lives_by_the_estimate(flux):
    """The text encoder of a 12 GiB-card pipeline: moving 7.5 GiB over the host link once per image is priced
    against computing it on the CPU; with a host link 100x slower, the CPU wins and the plan says so."""
    size = allocator.DiffusionBudget(1024, 1024, steps=8, guidance=0.0)
    budget = {0: "12GiB", "cpu": "32GiB"}
    fast = planned(Z_IMAGE_TURBO, budget, size)
    slow = planned(Z_IMAGE_TURBO, budget, size, profile=allocator.Profile(host_to_device=0.25e9))
    assert fast.execution["text_encoder"] == "moved" and slow.execution["text_encoder"] == "cpu"
    assert slow.valid and slow.price > fast.price
    said = next(d.text for d in slow.decisions if d.units == ("text_encoder",))
    assert "computed on the CPU" in said and "moved onto 0 it would take" in said


def test_without_a_budget_the_pipelines_default_size_is_counted_and_said():
    """FLUX.1-dev's transformer config has no ``sample_size``: 1024², which is also FluxPipeline's default
    (``default_sample_size`` 128 latents x the VAE's 8)."""
    folder = write_configs(tempfile.mkdtemp())
    p = allocator.plan_pipeline(folder, {0: "16GiB", 1: "16GiB", "cpu": "64GiB"}, dtype=torch.bfloat16, steps=4)
    assert (p.budget.height, p.budget.width, p.budget.steps) == (1024, 1024, 4) and p.runs["transformer"] == 4
    assert any("no DiffusionBudget given: activations counted at 1024x1024" in d.text for d in p.decisions)
    assert p.activations["vae"] == planned(FLUX_DEV, {0: "16GiB", 1: "16GiB", "cpu": "64GiB"},
                                           allocator.DiffusionBudget(1024, 1024)).activations["vae"]


@pytest.mark.parametrize("budget", [{0: "8GiB", "cpu": "32GiB"}, {0: "24GiB", "cpu": "16GiB"},
                                    {0: "10GiB", 1: "10GiB", "cpu": "24GiB"}, {0: "6GiB", "cpu": "8GiB"}])
def test_every_plan_keeps_the_joint_rule_or_says_what_is_over(budget):
    """Z-Image-Turbo over budgets from a small card to more than enough, and one too small for it: a valid plan's
    joint peaks recount from its components and stay within every budget; an invalid one names what is over."""
    given = dict(budget)
    p = planned(Z_IMAGE_TURBO, budget, allocator.DiffusionBudget(1024, 1024, steps=8, guidance=0.0))
    assert budget == given   # the caller's dict is never modified
    if p.valid:
        check_joint_peaks(p)
        assert p.runs_on["transformer"] == 0   # the denoiser computes on the GPU whenever a plan exists
    else:
        assert p.unplaced or any(p.peak.get(d, 0) > b for d, b in p.budgets.items())
        assert "INVALID" in p.explain() and any("no choice keeps every device" in d.text for d in p.decisions)
    assert json.loads(json.dumps(p.to_dict()))["budget"]["steps"] == 8


def test_steps_given_twice_and_different_is_refused():
    folder = write_configs(tempfile.mkdtemp())
    with pytest.raises(allocator.InvalidOption, match="give the steps once"):
        allocator.plan_pipeline(folder, {0: "16GiB"}, budget=allocator.DiffusionBudget(1024, 1024, steps=28),
                                steps=4)
